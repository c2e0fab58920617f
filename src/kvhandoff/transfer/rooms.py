"""Rooms: the per-request state an agent keeps, and the handles engines hold.

Rules:
- A room on one agent is a `_Group` of legs; a leg (`_Room`) is the transfer with ONE peer.
  A decode rank gathering heads from several prefill ranks has several legs; a prefill rank
  serving several decode ranks (decode TP > prefill TP) has one leg per decode rank. The group
  is Success when all its expected legs are, and Failed as soon as one leg fails (the others
  are then failed too, with the reason).
- A `_Room` is mutated only under its agent's lock; its life cycle is its `RoomMachine`
  (`kvhandoff.state_machine`), never an ad-hoc flag.
- Handles (`Sender`, `Receiver`) are small: they forward to the agent, which owns the room.
  Names follow SGLang's KVSender/KVReceiver and vLLM's wait_for_layer_load / save_kv_layer.
- A room's pages are released exactly once: when it is terminal AND no transport op of it is
  still in flight (cancelled ops count until their callback ran). `released` is set then, and
  the `on_release` callback runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhandoff.errors import ConfigError, Failure, FailureKind, TransferTimeout
from kvhandoff.kv_layout import SpanPlan
from kvhandoff.state_machine import KVPoll, Role, RoomMachine

if TYPE_CHECKING:
    from kvhandoff.transfer.agent import TransferAgent


@dataclass(eq=False)
class _Group:
    """One room on one agent: its legs and what the engine gave."""

    room: int
    role: Role
    layers: tuple[int, ...]
    expected: int | None  # legs this room needs (None: not known yet, decode before routing)
    legs: list[_Room] = field(default_factory=list)
    seq_len: int = 0
    pages: Any = None  # the engine's page table (prefill: copied into each leg on request)
    ready: list[int] = field(default_factory=list)  # prefill: layers marked ready, in order
    failure: Failure | None = None
    layer_events: dict[int, threading.Event] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    on_release: Callable[[int], None] | None = None
    t_created: float = 0.0
    t_last_ready: float | None = None
    t_done: float | None = None

    @property
    def state(self) -> KVPoll:
        if self.failure is not None:
            return KVPoll.Failed
        if self.expected is not None and len(self.legs) >= self.expected:
            if not self.legs:
                return KVPoll.Success
            return min(leg.machine.state for leg in self.legs)
        return min([KVPoll.Bootstrapping] + [leg.machine.state for leg in self.legs])


@dataclass(eq=False)
class _Room:
    room: int
    role: Role
    machine: RoomMachine
    layers: tuple[int, ...]  # layer ids that move, in order
    group: _Group | None = None
    planes: dict[str, list[str]] | None = None  # decode: the planes this leg brings per region
    peer: str | None = None  # control address of the other side
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
    verifying: set[tuple[int, int]] = field(default_factory=set)  # (layer, attempt) in hasher
    acked: bool = False  # prefill: the RoomAck came (it may overtake our own send completions)
    posted: dict[int, int] = field(default_factory=dict)  # layer -> attempt posted
    outstanding: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, attempt) -> ops
    inflight_tags: dict[int, int] = field(default_factory=dict)  # tag -> ops not yet called back
    sums: dict[tuple[int, int], dict[str, int | None]] = field(default_factory=dict)
    recv_done: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    released: threading.Event = field(default_factory=threading.Event)  # nothing in flight
    failure: Failure | None = None  # set when the leg failed
    bytes_moved: int = 0
    retransmits: int = 0
    checksums_verified: int = 0


class _Handle:
    __slots__ = ("room", "_agent", "_g")

    def __init__(self, agent: TransferAgent, g: _Group) -> None:
        self.room = g.room
        self._agent = agent
        self._g = g

    def poll(self) -> KVPoll:
        """The room's state (KVPoll, the worst of its legs); Failed and Success are final."""
        return self._g.state

    @property
    def failure(self) -> str | None:
        """Why the room failed, in words (None unless `poll()` is Failed)."""
        f = self._g.failure
        return f.reason if f is not None else None

    @property
    def failure_kind(self) -> FailureKind | None:
        """What kind of failure ended the room (None unless `poll()` is Failed)."""
        f = self._g.failure
        return f.kind if f is not None else None

    @property
    def error(self) -> Failure | None:
        """The room's `Failure` (kind, reason, details), None unless it failed; `.error()` of
        it is the typed exception the blocking calls raise."""
        return self._g.failure

    def raise_for_failure(self) -> None:
        """Raises the room's typed `RoomFailed` subclass if it failed; else nothing."""
        f = self._g.failure
        if f is not None:
            raise f.error(self.room)

    @property
    def released(self) -> bool:
        """Whether the room's pages may be reused (terminal, nothing in flight)."""
        return self._g.released.is_set()

    def wait(self, timeout: float) -> KVPoll:
        """Blocks until the room is terminal or `timeout` seconds passed; returns the state."""
        self._g.done.wait(timeout)
        return self._g.state

    def wait_released(self, timeout: float) -> bool:
        """Blocks until the pages are released (bounded by `timeout`); whether they are."""
        return self._g.released.wait(timeout)

    def abort(self, reason: str = "aborted by the engine") -> None:
        """Fails the room on both sides with `reason`; safe to call twice or after the end."""
        self._agent._abort(self._g, reason)

    def stats(self) -> dict[str, Any]:
        """Byte and timing figures of the room (for demo/bench output)."""
        return self._agent._room_stats(self._g)

    def __repr__(self) -> str:
        cls = type(self).__name__
        failure = f", failure={self.failure!r}" if self.failure else ""
        return f"{cls}(room={self.room}, state={self._g.state.name}{failure})"

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._g.done.is_set():
            self.abort("handle closed before the room finished")


class Sender(_Handle):
    """Prefill side of a room (cf. SGLang KVSender, vLLM save_kv_layer)."""

    __slots__ = ()

    def layer_ready(self, layer_id: int, event: Any = None) -> None:
        """Layer `layer_id`'s KV is written: send it now. For CUDA, pass the layer's event; the
        agent waits on it before reading the pages."""
        if event is not None:
            event.synchronize()
        self._agent._layer_ready(self._g, layer_id)


class Receiver(_Handle):
    """Decode side of a room (cf. SGLang KVReceiver, vLLM wait_for_layer_load)."""

    __slots__ = ()

    def init(
        self,
        dst_pages: np.ndarray | list[int] | dict[str, np.ndarray | list[int]],
        seq_len: int,
        decode_prefix_len: int = 0,
    ) -> None:
        """Offers destination pages: one page table covering the whole sequence from token 0
        (suffix-only regions use its pages from the page-aligned prefix on), or a dict per
        region. `decode_prefix_len` tokens are already held (their indexer rows stay)."""
        self._agent._receiver_init(self._g, dst_pages, seq_len, decode_prefix_len)

    def wait_for_layer(self, layer_id: int, timeout: float) -> bool:
        """Blocks until `layer_id` landed and verified on every leg; returns True. The caller
        bounds the wait.

        Raises:
            RoomFailed: the room failed (before or while waiting): the subclass of its
                `FailureKind` (`ChecksumMismatch` naming layer and region, `LayoutMismatch`
                with the diff, `PeerLost`, `Aborted`, `DeadlineExpired`, ...).
            TransferTimeout: `timeout` seconds passed with the room still going.
            ConfigError: `layer_id` is not a layer of the layout.
        """
        ev = self._g.layer_events.get(layer_id)
        if ev is None:
            raise ConfigError(f"wait_for_layer({layer_id}): not a layer of this room's layout "
                              f"(layers {self._g.layers[0]}..{self._g.layers[-1]})")
        landed = ev.wait(timeout)
        self.raise_for_failure()
        if not landed:
            raise TransferTimeout(f"room {self.room}: layer {layer_id} not landed within "
                                  f"{timeout:g}s (state {self._g.state.name})")
        return True
