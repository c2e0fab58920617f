"""Rooms: the per-request state the transfer session keeps. Pure data (no threads, no clock).

Rules:
- A room on one agent is a `Room` of legs; a `Leg` is the transfer with ONE peer. A decode
  rank gathering heads from several prefill ranks has several legs; a prefill rank serving
  several decode ranks (decode TP > prefill TP) has one leg per decode rank. The room is
  Success when all its expected legs are, and Failed as soon as one leg fails (the others are
  then failed too, with the reason).
- Only the session (`session.TransferSession`) and its parts touch these, on the control
  thread. Where a room and its legs stand (machine, phase, fence, failure, the legs it
  expects) is not here: it is the room's `state` (`roomstate.RoomState`) and each leg's
  `state` (`roomstate.LegState`), moved only through their methods. What is here is what the
  data path works with, in small records each owned by one concern:
  - a room: what the engine gave (`EngineInput`: pages, token counts, layers ready, the
    prompt for admission), the layers landed on every leg and the view last published;
  - a leg: who the peer is and which request (`peer`, `peer_gen`, `xfer`, `one_sided`), what
    it moves (`LegPlan`: token range, both sides' pages, planes, the span plans and transfer
    id of each chunk, and the data tag of a unit), what its data path tracks per unit and
    attempt (`Progress`: posted, ops left, sums, receives, hashing, read-backs, units done)
    and its figures (`LegStats`).
- A chunk of a layer is a `Unit` (layer, chunk): posted, checksummed and verified on its own;
  the layer lands once its unit of every chunk did.
- A room's pages are released exactly once: when it is terminal AND no transport op of it is
  still in flight (cancelled ops count until they completed). The engine handles
  (`handles.Sender` / `handles.Receiver`) see a room through its published view, which
  `lifecycle.RoomTable.publish` derives from the room (a copy, never a second owner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvhandoff.kv_layout import RegionSpec, SendFrom, SpanPlan
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.roomstate import LegState, RoomState
from kvhandoff.state_machine import Role


class Unit(NamedTuple):
    """What one post moves: `layer` of one chunk of the room (chunk 0: the first, or only,
    one). On the wire it is the (layer, chunk) of a `LayerInfo` / `LayerNack`."""

    layer: int
    chunk: int = 0


@dataclass(eq=False, kw_only=True, slots=True)
class EngineInput:
    """What the engine gave for a room (its open, its init, its chunks and ready layers)."""

    seq_len: int = 0
    # prefill: per-region table; decode: (table, page-aligned prefix, per-region starts)
    pages: Any = None
    ready: list[int] = field(default_factory=list)  # prefill: layers marked ready, in order
    t_last_ready: float | None = None  # prefill: when the last of them was
    chunk_end: int = 0  # prefill: the tokens whose pages the engine gave so far (chunked)
    # issue 17 (admission, prefix agreement): prefill: the prompt token ids; decode: the
    # digests of its prompt and cached prefix, and its free pages (prefill_complete)
    prompt_tokens: Any = None
    prompt: Any = None
    cached_prefix: Any = None
    free_pages: int | None = None
    readers: int = 0  # decode: the readers its TransferRequests announce


@dataclass(eq=False, kw_only=True)
class Room:
    """One room on one agent: its state, its legs and what the engine gave."""

    room: int
    role: Role
    layers: tuple[int, ...]
    state: RoomState  # its phase, failure, the legs it expects, its legs' states
    token: object = None  # the engine handle's identity of this room
    legs: list[Leg] = field(default_factory=list)
    given: EngineInput = field(default_factory=EngineInput)
    landed: set[int] = field(default_factory=set)  # decode: layers landed on every leg
    published: tuple[Any, ...] = ()  # the last view sent to the engine side
    t_created: float = 0.0
    # decode: aborted before its prefill ranks were known; they are told once found (the
    # prefill's room then fails at once instead of holding its pages until a deadline)
    tell_abort: str | None = None

    def add_leg(self, leg: Leg) -> None:
        """A leg of this room (its state joins the room's)."""
        self.legs.append(leg)
        self.state.add(leg.state)


@dataclass(eq=False, kw_only=True, slots=True)
class LegPlan:
    """What one leg moves: its token range, both sides' pages and page sizes, the planes it
    brings, and the span plans of each chunk (`planning.span_plans` fills it).

    Chunked prefill: chunk c moves tokens up to `chunk_ends[c]` (chunk 0: what the
    TransferAccepted covers) by `chunk_plans[c]` under transfer id `chunk_xfers[c]` (prefill:
    None until the decode's ChunkAccepted); a leg that is not chunked has one chunk."""

    seq_len: int = 0
    prefix_len: int = 0  # page-aligned decode prefix
    # per region, a later token (page-aligned on the decode) the region starts at: a sliding-
    # window region whose decode holds no page before its window (absent: `prefix_len`)
    starts: dict[str, int] = field(default_factory=dict)
    page_size: int = 0  # this side's page size
    pages: dict[str, np.ndarray] = field(default_factory=dict)  # this side, per region
    src_table: dict[str, np.ndarray] = field(default_factory=dict)  # decode: prefill's pages
    dst_table: dict[str, np.ndarray] = field(default_factory=dict)  # prefill: decode's pages
    dst_page_size: int = 0  # prefill: the decode's page size
    planes: dict[str, list[str]] | None = None  # the planes this leg brings per region
    covered: dict[str, int] = field(default_factory=dict)  # per region: tokens planned so far
    chunk_ends: list[int] = field(default_factory=list)
    chunk_plans: list[dict[str, SpanPlan]] = field(default_factory=list)
    chunk_xfers: list[int | None] = field(default_factory=list)

    def first_token(self, region: RegionSpec) -> int:
        """The token `region`'s transfer starts at (not page-aligned): the decode prefix for a
        suffix-only region (0 for a whole-sequence one), or the region's later start."""
        base = self.prefix_len if region.send_from is SendFrom.DECODE_PREFIX else 0
        return max(base, self.starts.get(region.name, 0))

    def first_chunk(self, end: int, xfer: int, plans: dict[str, SpanPlan]) -> None:
        """`plans` cover chunk 0, up to `end` tokens, under transfer id `xfer`."""
        self.chunk_ends, self.chunk_plans, self.chunk_xfers = [end], [plans], [xfer]

    def add_chunk(self, end: int, xfer: int | None, plans: dict[str, SpanPlan]) -> int:
        """The next chunk, up to `end` tokens (`xfer`: None until the decode accepted it);
        its index."""
        self.chunk_ends.append(end)
        self.chunk_plans.append(plans)
        self.chunk_xfers.append(xfer)
        return len(self.chunk_ends) - 1

    def chunk_accepted(self, chunk: int, xfer: int) -> bool:
        """Prefill: the decode accepted later chunk `chunk` under transfer id `xfer`; False
        (nothing changes) when that chunk is not one offered and still unanswered."""
        if not 0 < chunk < len(self.chunk_xfers) or self.chunk_xfers[chunk] is not None:
            return False
        self.chunk_xfers[chunk] = xfer
        return True

    def plans_of(self, unit: Unit) -> dict[str, SpanPlan]:
        """The span plans of `unit`'s chunk (none before the transfer is accepted)."""
        return self.chunk_plans[unit.chunk] if self.chunk_plans else {}

    def tag(self, unit: Unit, region: int, attempt: int) -> int:
        """The data tag of (`unit`, region index, attempt): each chunk has its own transfer
        id, so the tag names the layer alone."""
        xfer = self.chunk_xfers[unit.chunk]
        assert xfer is not None  # units of a chunk are posted once its transfer id is known
        return P.data_tag(xfer, unit.layer, region, attempt)


@dataclass(eq=False, kw_only=True, slots=True)
class Progress:
    """What one leg's data path tracks, per unit (layer, chunk) and attempt: posted, ops
    left, sums, receives done, hashing, the writer's read-back, and the units done."""

    posted: dict[Unit, int] = field(default_factory=dict)  # unit -> attempt posted
    outstanding: dict[tuple[Unit, int], int] = field(default_factory=dict)  # -> ops left
    sums: dict[tuple[Unit, int], dict[str, int | None]] = field(default_factory=dict)
    recv_done: dict[tuple[Unit, int], set[str]] = field(default_factory=dict)
    verifying: set[tuple[Unit, int]] = field(default_factory=set)  # (unit, attempt) hashing
    # decode, one-sided writes the writer read back (`receive`: the writer's verification), per
    # unit and attempt, from the LayerDone: region -> (the landed sum, the digest of the plan
    # the writer wrote by)
    landed: dict[tuple[Unit, int], dict[str, tuple[int, int]]] = field(default_factory=dict)
    units_done: set[Unit] = field(default_factory=set)  # sent (prefill) / landed (decode)

    def unit_done(self, unit: Unit, plan: LegPlan) -> int | None:
        """Records `unit` as sent / landed; its layer when every chunk of it is (the last
        chunk of `plan` is known), else None."""
        self.units_done.add(unit)
        ends = plan.chunk_ends
        if ends and ends[-1] < plan.seq_len:
            return None
        if len(ends) > 1 and any(Unit(unit.layer, c) not in self.units_done
                                 for c in range(len(ends))):
            return None
        return unit.layer


@dataclass(eq=False, kw_only=True, slots=True)
class LegStats:
    """One leg's figures (`reports.room_stats`)."""

    bytes_moved: int = 0
    retransmits: int = 0
    checksums_verified: int = 0


@dataclass(eq=False, kw_only=True)
class Leg:
    """The transfer of one room with one peer."""

    room: int
    role: Role
    state: LegState  # its machine, phase, fence and failure
    layers: tuple[int, ...]  # layer ids that move, in order
    parent: Room  # the room this leg is one transfer of
    peer: str  # control address of the other side
    peer_gen: int = 0
    xfer: int = 0  # the transfer id of its request (every message about the leg names it)
    one_sided: bool = False  # the prefill writes into the decode's pages (no receives)
    plan: LegPlan = field(default_factory=LegPlan)
    progress: Progress = field(default_factory=Progress)
    stats: LegStats = field(default_factory=LegStats)
