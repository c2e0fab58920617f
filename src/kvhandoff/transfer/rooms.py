"""Rooms: the per-request state the transfer session keeps. Pure data (no threads, no clock).

Rules:
- A room on one agent is a `Group` of legs; a `Leg` is the transfer with ONE peer. A decode
  rank gathering heads from several prefill ranks has several legs; a prefill rank serving
  several decode ranks (decode TP > prefill TP) has one leg per decode rank. The group is
  Success when all its expected legs are, and Failed as soon as one leg fails (the others are
  then failed too, with the reason).
- Only the session (`session.TransferSession`) touches these, on the control thread; a leg's
  life cycle is its `RoomMachine` (`kvhandoff.state_machine`), never an ad-hoc flag.
- A room's pages are released exactly once: when it is terminal AND no transport op of it is
  still in flight (cancelled ops count until they completed). The engine handles
  (`handles.Sender` / `handles.Receiver`) see a room through its published view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.errors import Failure
from kvhandoff.kv_layout import SpanPlan
from kvhandoff.state_machine import KVPoll, Role, RoomMachine


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
    done: bool = False
    released: bool = False
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
    accepted: bool = False
    request_sent: bool = False
    inited: bool = False
    acked: bool = False  # prefill: the RoomAck came (it may overtake our own send completions)
    verifying: set[tuple[int, int]] = field(default_factory=set)  # (layer, attempt) hashing
    posted: dict[int, int] = field(default_factory=dict)  # layer -> attempt posted
    outstanding: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, att) -> ops
    inflight_tags: dict[int, int] = field(default_factory=dict)  # tag -> ops not yet completed
    sums: dict[tuple[int, int], dict[str, int | None]] = field(default_factory=dict)
    recv_done: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    failure: Failure | None = None
    released: bool = False  # terminal and nothing in flight
    one_sided: bool = False  # the prefill writes into the decode's pages (no receives)
    # decode, one-sided: the prefill may still write into this leg's pages (until every layer
    # landed, or the prefill confirmed it stopped, or write_quarantine_s after a failure)
    remote_writes: bool = False
    write_sums: dict[tuple[int, int], dict[str, int | None]] = field(default_factory=dict)
    bytes_moved: int = 0
    retransmits: int = 0
    checksums_verified: int = 0
    # Chunked prefill: the leg's chunk c moves tokens up to chunk_ends[c] (chunk 0: what the
    # TransferAccepted covers); its plans and transfer id (prefill: None until the decode's
    # ChunkAccepted). The internal keys of posted/outstanding/sums/... are units
    # (`session_data.unit_of(chunk, layer)`, the layer itself for chunk 0).
    chunk_ends: list[int] = field(default_factory=list)
    chunk_plans: list[dict[str, SpanPlan]] = field(default_factory=list)
    chunk_xfers: list[int | None] = field(default_factory=list)
    covered: dict[str, int] = field(default_factory=dict)  # per region: tokens planned so far
    src_table: dict[str, np.ndarray] = field(default_factory=dict)  # decode: prefill's pages
    dst_table: dict[str, np.ndarray] = field(default_factory=dict)  # prefill: decode's pages
    dst_page_size: int = 0  # prefill: the decode's page size
    units_done: set[int] = field(default_factory=set)  # units sent (prefill) / landed (decode)
