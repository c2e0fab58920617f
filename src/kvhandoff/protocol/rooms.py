"""Rooms: the per-request state the transfer session keeps. Pure data (no threads, no clock).

Rules:
- A room on one agent is a `Group` of legs; a `Leg` is the transfer with ONE peer. A decode
  rank gathering heads from several prefill ranks has several legs; a prefill rank serving
  several decode ranks (decode TP > prefill TP) has one leg per decode rank. The group is
  Success when all its expected legs are, and Failed as soon as one leg fails (the others are
  then failed too, with the reason).
- Only the session (`session.TransferSession`) and its parts touch these, on the control
  thread. Everything that decides where a leg stands lives on the leg: its room state is its
  `RoomMachine` (`kvhandoff.state_machine`); how far its own exchange got is its `LegPhase`,
  moved only by `Leg.advance` along `LEG_PHASES`, never by an ad-hoc flag; what the release
  of its pages still waits for (ops in flight, cancels unanswered, a failed cancel, a
  one-sided writer not yet stopped) is its `Fence`, and `Leg.advance(RELEASED)` refuses while
  the fence holds. The room's own state is its `RoomPhase` (OPEN -> DONE -> RELEASED), moved
  only by `Group.advance`, which refuses RELEASED until every leg is released.
- A chunk of a layer is a `Unit` (layer, chunk): posted, checksummed and verified on its own;
  the layer lands once its unit of every chunk did.
- A room's pages are released exactly once: when it is terminal AND no transport op of it is
  still in flight (cancelled ops count until they completed). The engine handles
  (`handles.Sender` / `handles.Receiver`) see a room through its published view, which
  `lifecycle.RoomTable.publish` derives from the group (a copy, never a second owner).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvhandoff.errors import Failure, InvalidTransition
from kvhandoff.kv_layout import SpanPlan
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll, Role, RoomMachine


class Unit(NamedTuple):
    """What one post moves: `layer` of one chunk of the room (chunk 0: the first, or only,
    one). On the wire it is the (layer, chunk) of a `LayerInfo` / `LayerNack`."""

    layer: int
    chunk: int = 0


class LegPhase(enum.Enum):
    """How far a leg's exchange with its peer got (its room state is its `RoomMachine`)."""

    NEW = "new"  # decode: the engine has not given its pages yet
    READY = "ready"  # pages known (prefill: the request came); decode: not requested yet
    REQUESTED = "requested"  # decode: its TransferRequest is sent
    ACCEPTED = "accepted"  # the transfer is accepted on this side: data moves
    ACKED = "acked"  # prefill: the decode's RoomAck came (it may overtake send completions)
    RELEASED = "released"  # terminal and nothing of it in flight: its pages may go back


#: the phase transitions a leg may take (RELEASED: from any phase, once it is terminal and
#: its `Fence` holds nothing)
LEG_PHASES: dict[LegPhase, frozenset[LegPhase]] = {
    LegPhase.NEW: frozenset({LegPhase.READY}),
    # decode sends its request; a prefill leg is created READY and accepts
    LegPhase.READY: frozenset({LegPhase.REQUESTED, LegPhase.ACCEPTED}),
    # the prefill accepted; or it dropped our handshake before it did: request again
    LegPhase.REQUESTED: frozenset({LegPhase.ACCEPTED, LegPhase.READY}),
    LegPhase.ACCEPTED: frozenset({LegPhase.ACKED}),
    LegPhase.ACKED: frozenset(),
    LegPhase.RELEASED: frozenset(),
}


class RoomPhase(enum.Enum):
    """How far a room (`Group`) on this agent got: the engine sees DONE as its view's `done`
    and RELEASED as its pages going back (`effects.Release`, exactly once)."""

    OPEN = "open"
    DONE = "done"  # terminal: every leg is, or one failed (the others are failed with it)
    RELEASED = "released"  # done and every leg released: its pages may go back


#: the phase transitions a room may take, each once
ROOM_PHASES: dict[RoomPhase, frozenset[RoomPhase]] = {
    RoomPhase.OPEN: frozenset({RoomPhase.DONE}),
    RoomPhase.DONE: frozenset({RoomPhase.RELEASED}),
    RoomPhase.RELEASED: frozenset(),
}


@dataclass(eq=False, slots=True)
class Fence:
    """What the release of one leg's pages still waits for, besides the leg being terminal:
    anything that may still write into them. `holds` is the one rule (`Leg.advance`)."""

    #: this side's ops in flight per data tag (tag -> ops not yet completed)
    tags: dict[int, int] = field(default_factory=dict)
    #: this side's cancels of the leg's ops not yet answered (tags)
    cancelling: set[int] = field(default_factory=set)
    #: a cancel or disconnect failed (a copy that did not stop): held until
    #: write_quarantine_s
    stop_failed: bool = False
    #: decode, one-sided: the prefill may still write into this leg's pages (until every
    #: layer landed, or the prefill confirmed it stopped, or the write quarantine after a
    #: failure)
    remote_writes: bool = False
    #: prefill: an AbortAck is owed to the peer once this side's writes are known stopped
    #: (an obligation, not a hold)
    ack_when_stopped: bool = False

    @property
    def own_writes(self) -> bool:
        """This side's ops may still move bytes (in flight, a cancel unanswered, or one that
        failed)."""
        return bool(self.tags or self.cancelling or self.stop_failed)

    @property
    def holds(self) -> bool:
        """The leg's pages may still be written into (by this side or by the peer)."""
        return self.own_writes or self.remote_writes


@dataclass(eq=False, kw_only=True)
class Group:
    """One room on one agent: its legs and what the engine gave."""

    room: int
    role: Role
    layers: tuple[int, ...]
    expected: int | None  # legs this room needs (None: not known yet, decode before routing)
    token: object = None  # the engine handle's identity of this room
    legs: list[Leg] = field(default_factory=list)
    seq_len: int = 0
    pages: Any = None  # prefill: per-region table; decode: (table, page-aligned prefix)
    ready: list[int] = field(default_factory=list)  # prefill: layers marked ready, in order
    landed: set[int] = field(default_factory=set)  # decode: layers landed on every leg
    failure: Failure | None = None
    phase: RoomPhase = RoomPhase.OPEN
    published: tuple[Any, ...] = ()  # the last view sent to the engine side
    t_created: float = 0.0
    t_last_ready: float | None = None
    t_done: float | None = None
    # issue 17 (admission, prefix agreement): prefill: the prompt token ids; decode: the
    # digests of its prompt and cached prefix, and its free pages (prefill_complete)
    prompt_tokens: Any = None
    prompt: Any = None
    cached_prefix: Any = None
    free_pages: int | None = None
    chunk_end: int = 0  # prefill: the tokens whose pages the engine gave so far (chunked)
    # decode: the readers its TransferRequests announce; prefill: True when `expected` came
    # from the first reader (the engine opened the room without a count)
    readers: int = 0
    readers_told: bool = False
    # decode: aborted before its prefill ranks were known; they are told once found (the
    # prefill's room then fails at once instead of holding its pages until a deadline)
    tell_abort: str | None = None

    def advance(self, to: RoomPhase) -> None:
        """Moves the room to phase `to` (`ROOM_PHASES`; RELEASED only once every leg is).

        Raises:
            InvalidTransition: `to` is not reachable from the room's phase.
        """
        ok = to in ROOM_PHASES[self.phase] and (
            to is not RoomPhase.RELEASED or all(leg.released for leg in self.legs))
        if not ok:
            raise InvalidTransition(f"room {self.room}: phase {self.phase.value} -> "
                                    f"{to.value} is not allowed")
        self.phase = to

    @property
    def done(self) -> bool:
        """Terminal as the engine sees it (the phase moved on from OPEN)."""
        return self.phase is not RoomPhase.OPEN

    @property
    def released(self) -> bool:
        return self.phase is RoomPhase.RELEASED

    @property
    def state(self) -> KVPoll:
        if self.failure is not None:
            return KVPoll.Failed
        if self.expected is not None and len(self.legs) >= self.expected:
            if not self.legs:
                return KVPoll.Success
            return min(leg.machine.state for leg in self.legs)
        return min([KVPoll.Bootstrapping] + [leg.machine.state for leg in self.legs])


@dataclass(eq=False, kw_only=True)
class Leg:
    """The transfer of one room with one peer."""

    room: int
    role: Role
    machine: RoomMachine
    layers: tuple[int, ...]  # layer ids that move, in order
    group: Group
    peer: str  # control address of the other side
    planes: dict[str, list[str]] | None = None  # decode: the planes this leg brings per region
    peer_gen: int = 0
    xfer: int = 0
    seq_len: int = 0
    prefix_len: int = 0  # page-aligned decode prefix
    page_size: int = 0  # this side's page size
    pages: dict[str, np.ndarray] = field(default_factory=dict)  # this side, per region
    plans: dict[str, SpanPlan] = field(default_factory=dict)  # per region (same every layer)
    phase: LegPhase = LegPhase.NEW
    verifying: set[tuple[Unit, int]] = field(default_factory=set)  # (unit, attempt) hashing
    posted: dict[Unit, int] = field(default_factory=dict)  # unit -> attempt posted
    outstanding: dict[tuple[Unit, int], int] = field(default_factory=dict)  # -> ops left
    sums: dict[tuple[Unit, int], dict[str, int | None]] = field(default_factory=dict)
    recv_done: dict[tuple[Unit, int], set[str]] = field(default_factory=dict)
    failure: Failure | None = None
    one_sided: bool = False  # the prefill writes into the decode's pages (no receives)
    fence: Fence = field(default_factory=Fence)  # what the release of its pages waits for
    # decode, one-sided writes the writer read back (`receive`: the writer's verification), per
    # unit and attempt, from the LayerDone: region -> (the landed sum, the digest of the plan
    # the writer wrote by)
    landed: dict[tuple[Unit, int], dict[str, tuple[int, int]]] = field(default_factory=dict)
    bytes_moved: int = 0
    retransmits: int = 0
    checksums_verified: int = 0
    # Chunked prefill: the leg's chunk c moves tokens up to chunk_ends[c] (chunk 0: what the
    # TransferAccepted covers); its plans and transfer id (prefill: None until the decode's
    # ChunkAccepted). posted/outstanding/sums/... are keyed by `Unit` (layer, chunk).
    chunk_ends: list[int] = field(default_factory=list)
    chunk_plans: list[dict[str, SpanPlan]] = field(default_factory=list)
    chunk_xfers: list[int | None] = field(default_factory=list)
    covered: dict[str, int] = field(default_factory=dict)  # per region: tokens planned so far
    src_table: dict[str, np.ndarray] = field(default_factory=dict)  # decode: prefill's pages
    dst_table: dict[str, np.ndarray] = field(default_factory=dict)  # prefill: decode's pages
    dst_page_size: int = 0  # prefill: the decode's page size
    units_done: set[Unit] = field(default_factory=set)  # sent (prefill) / landed (decode)

    # ------------------------------------------------------------------ phase

    def advance(self, to: LegPhase) -> None:
        """Moves the leg to phase `to` (`LEG_PHASES`; RELEASED only once it is terminal and
        nothing can write its pages any more: its `fence` holds nothing).

        Raises:
            InvalidTransition: `to` is not reachable from the leg's phase.
        """
        ok = (self.machine.is_terminal and self.phase is not LegPhase.RELEASED
              and not self.fence.holds
              if to is LegPhase.RELEASED else to in LEG_PHASES[self.phase])
        if not ok:
            raise InvalidTransition(f"room {self.room}, leg with {self.peer}: phase "
                                    f"{self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    @property
    def requested(self) -> bool:
        """Decode: its TransferRequest went out (and has not been withdrawn)."""
        return self.phase in (LegPhase.REQUESTED, LegPhase.ACCEPTED, LegPhase.ACKED)

    @property
    def accepted(self) -> bool:
        """The transfer is accepted on this side: data moves (or moved)."""
        return self.phase in (LegPhase.ACCEPTED, LegPhase.ACKED)

    @property
    def released(self) -> bool:
        return self.phase is LegPhase.RELEASED

    # ------------------------------------------------------------------ chunks

    def first_chunk(self, end: int, xfer: int) -> None:
        """The plans just made cover chunk 0, up to `end` tokens, under transfer id `xfer`."""
        self.chunk_ends, self.chunk_plans, self.chunk_xfers = [end], [self.plans], [xfer]

    def plans_of(self, unit: Unit) -> dict[str, SpanPlan]:
        """The span plans of `unit`'s chunk."""
        return self.chunk_plans[unit.chunk] if self.chunk_plans else self.plans

    def tag(self, unit: Unit, region: int, attempt: int) -> int:
        """The data tag of (`unit`, region index, attempt): each chunk has its own transfer
        id, so the tag names the layer alone."""
        xfer = self.chunk_xfers[unit.chunk] if self.chunk_xfers else self.xfer
        assert xfer is not None  # units of a chunk are posted once its transfer id is known
        return P.data_tag(xfer, unit.layer, region, attempt)

    def unit_done(self, unit: Unit) -> int | None:
        """Records `unit` as sent / landed; its layer when every chunk of it is (the last
        chunk is known), else None."""
        self.units_done.add(unit)
        ends = self.chunk_ends
        if ends and ends[-1] < self.seq_len:
            return None
        if len(ends) > 1 and any(Unit(unit.layer, c) not in self.units_done
                                 for c in range(len(ends))):
            return None
        return unit.layer
