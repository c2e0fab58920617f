"""What every part of one `session.TransferSession` shares: the agent's identity and settings,
the time of the event being handled, the effects it produced so far, the session's timers and
counters. Sans-IO like the session.

Rules:
- The session owns one `Context` and hands it, at construction, to each part it holds (the room
  table, the peer table, the data path, chunked prefill); a part keeps its own state and reads
  the rest through the context or through the parts it was given, never through the session.
- `now` is set by the session at the start of every `handle()` call; nothing else moves it.
- Effects leave in the order they were emitted (`emit` / `send`); the session takes them at the
  end of the call (`take`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable

from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Effect, Log, Send
from kvhandoff.protocol.handshake import MEMORY_KINDS, Identity
from kvhandoff.settings import Settings
from kvhandoff.state_machine import Role

COUNTERS = ("messages_in", "stale_messages", "retransmits",
            "checksum_failures", "checksums_verified", "checksums_writer_verified",
            "bytes_sent", "bytes_received",
            "rooms_success", "rooms_failed", "peers_lost", "early_dropped", "rooms_one_sided",
            "write_quarantines", "cancel_failures", "internal_errors",
            "unauthenticated_messages", "replayed_messages", "holds_renewed", "holds_expired",
            "rechecks", "rechecks_passed")


class Context:
    """The shared part of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, identity: Identity, settings: Settings, now: float) -> None:
        self.me = identity
        self.settings = settings
        self.now = now
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._out: list[Effect] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._xfer = itertools.count(1)
        lay = identity.layout
        self.layers = tuple(sorted({lid for r in lay.regions for lid in r.layer_ids}))
        self.layer_order = {lid: i for i, lid in enumerate(self.layers)}
        self.region_index = {r.name: i for i, r in enumerate(lay.regions)}
        # the regions holding rows of each layer (the layout is fixed for the session's life;
        # looked up per layer of every room, so computed once here)
        self.layer_regions = {lid: tuple(r.name for r in lay.regions_of_layer(lid))
                              for lid in self.layers}

    # what the agent is: fixed for the session's life (its memory kind aside, `set_memory`)

    @property
    def role(self) -> Role:
        return self.me.role

    @property
    def layout(self) -> LayoutSpec:
        return self.me.layout

    @property
    def hb(self) -> float:
        """The heartbeat interval (s)."""
        return self.settings.heartbeat_interval_s

    def set_memory(self, kind: str) -> None:
        if kind not in MEMORY_KINDS:
            raise ValueError(f"memory: {kind!r} is not one of {', '.join(MEMORY_KINDS)}")
        self.me = dataclasses.replace(self.me, memory=kind)

    # output

    def emit(self, effect: Effect) -> None:
        self._out.append(effect)

    def send(self, addr: str, msg: P.Message) -> None:
        self._out.append(Send(addr, msg))

    def log(self, level: int, message: str, exc: BaseException | None = None) -> None:
        self._out.append(Log(level, message, exc=exc))

    def take(self) -> list[Effect]:
        """The effects emitted since the last call."""
        out, self._out = self._out, []
        return out

    # ids and time

    def next_xfer(self) -> int:
        """A fresh transfer id (data tags carry it, `wire.data_tag`)."""
        return next(self._xfer)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Calls `fn` at the first `Tick` `delay_s` seconds from now or later."""
        heapq.heappush(self._timers, (self.now + delay_s, next(self._timer_seq), fn))

    def next_timer(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def run_due_timers(self) -> None:
        while self._timers and self._timers[0][0] <= self.now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
