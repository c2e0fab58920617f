"""Rooms: the per-request state the transfer session keeps. Pure data (no threads, no clock).

Rules:
- A room on one agent is a `Group` of legs; a `Leg` is the transfer with ONE peer. A decode
  rank gathering heads from several prefill ranks has several legs; a prefill rank serving
  several decode ranks (decode TP > prefill TP) has one leg per decode rank. The group is
  Success when all its expected legs are, and Failed as soon as one leg fails (the others are
  then failed too, with the reason).
- Only the session (`session.TransferSession`) and its parts touch these, on the control
  thread. Where a room and its legs stand (machine, phase, fence, failure, the legs it
  expects) is not here: it is the group's `state` (`roomstate.RoomState`) and each leg's
  `state` (`roomstate.LegState`), moved only through their methods. What is here is what the
  data path works with.
- A chunk of a layer is a `Unit` (layer, chunk): posted, checksummed and verified on its own;
  the layer lands once its unit of every chunk did.
- A room's pages are released exactly once: when it is terminal AND no transport op of it is
  still in flight (cancelled ops count until they completed). The engine handles
  (`handles.Sender` / `handles.Receiver`) see a room through its published view, which
  `lifecycle.RoomTable.publish` derives from the group (a copy, never a second owner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvhandoff.kv_layout import SpanPlan
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.roomstate import LegState, RoomState
from kvhandoff.state_machine import Role


class Unit(NamedTuple):
    """What one post moves: `layer` of one chunk of the room (chunk 0: the first, or only,
    one). On the wire it is the (layer, chunk) of a `LayerInfo` / `LayerNack`."""

    layer: int
    chunk: int = 0


@dataclass(eq=False, kw_only=True)
class Group:
    """One room on one agent: its legs and what the engine gave."""

    room: int
    role: Role
    layers: tuple[int, ...]
    state: RoomState  # its phase, failure, the legs it expects, its legs' states
    token: object = None  # the engine handle's identity of this room
    legs: list[Leg] = field(default_factory=list)
    seq_len: int = 0
    pages: Any = None  # prefill: per-region table; decode: (table, page-aligned prefix)
    ready: list[int] = field(default_factory=list)  # prefill: layers marked ready, in order
    landed: set[int] = field(default_factory=set)  # decode: layers landed on every leg
    published: tuple[Any, ...] = ()  # the last view sent to the engine side
    t_created: float = 0.0
    t_last_ready: float | None = None
    # issue 17 (admission, prefix agreement): prefill: the prompt token ids; decode: the
    # digests of its prompt and cached prefix, and its free pages (prefill_complete)
    prompt_tokens: Any = None
    prompt: Any = None
    cached_prefix: Any = None
    free_pages: int | None = None
    chunk_end: int = 0  # prefill: the tokens whose pages the engine gave so far (chunked)
    readers: int = 0  # decode: the readers its TransferRequests announce
    # decode: aborted before its prefill ranks were known; they are told once found (the
    # prefill's room then fails at once instead of holding its pages until a deadline)
    tell_abort: str | None = None

    def add_leg(self, leg: Leg) -> None:
        """A leg of this room (its state joins the room's)."""
        self.legs.append(leg)
        self.state.add(leg.state)


@dataclass(eq=False, kw_only=True)
class Leg:
    """The transfer of one room with one peer."""

    room: int
    role: Role
    state: LegState  # its machine, phase, fence and failure
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
    verifying: set[tuple[Unit, int]] = field(default_factory=set)  # (unit, attempt) hashing
    posted: dict[Unit, int] = field(default_factory=dict)  # unit -> attempt posted
    outstanding: dict[tuple[Unit, int], int] = field(default_factory=dict)  # -> ops left
    sums: dict[tuple[Unit, int], dict[str, int | None]] = field(default_factory=dict)
    recv_done: dict[tuple[Unit, int], set[str]] = field(default_factory=dict)
    one_sided: bool = False  # the prefill writes into the decode's pages (no receives)
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
