"""`ControlOutbox`: production's outbox (the `outbox` part of an `runtime.executor.Executor`):
the control messages of a pass, sent at its end over ZMQ (one DEALER per peer address) or over
the same-host lane (`runtime.locallane`) for peers of this host.

Each message leaves as the session's peer table frames it (sealed under the session with its
recipient when ``hmac_secret`` is set: `PeerTable.frames`). A dropped peer's socket closes once
the outbox went out, lingering a while so its last messages (the Failed of its rooms) still
leave; a stranger's socket is closed once idle (`collect`).

Rules: the control thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvhandoff.netaddr import split_host_port, zmq_endpoint, zmq_ipv6
from kvhandoff.protocol import wire as P
from kvhandoff.runtime.locallane import LocalLane

log = logging.getLogger("kvhandoff.agent")

LINGER_DROPPED_MS = 2000  # how long a dropped peer's last messages may take to leave
# Senders' connections that cost this agent nothing once idle: a ZMQ DEALER to an address the
# session has no peer record for (it only answered a stranger's Hello, or told a forgotten peer)
# is closed after DEALER_IDLE_S, and the least recently used go beyond MAX_STRANGER_DEALERS
DEALER_IDLE_S = 30.0
MAX_STRANGER_DEALERS = 256


class ControlOutbox:
    """The control messages out (see the module doc). `frames(addr, msg)`: the frames of a
    message as the session seals it; `known(addr)`: whether the session has a peer record
    for `addr` (a stranger's socket is collected)."""

    def __init__(self, *, ctx: zmq.Context[zmq.Socket[bytes]], lane: LocalLane | None,
                 frames: Callable[[str, P.Message], list[bytes]],
                 known: Callable[[str], bool], counters: dict[str, int]) -> None:
        self._ctx = ctx
        self._lane = lane
        self._frames = frames
        self._known = known
        self._counters = counters
        self._queue: deque[tuple[str, P.Message]] = deque()
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._dealer_used: dict[str, float] = {}  # address -> when last sent to
        self._to_close: list[zmq.Socket[bytes]] = []
        self._lane_drops: list[str] = []  # peers whose lane closes once the outbox went out

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def send(self, addr: str, msg: P.Message) -> None:
        self._queue.append((addr, msg))

    def forget(self, peer: str) -> None:
        sock = self._dealers.pop(peer, None)
        self._dealer_used.pop(peer, None)
        if sock is not None:
            self._to_close.append(sock)  # after the outbox went out
        if self._lane is not None:
            self._lane_drops.append(peer)

    def flush(self) -> None:
        while self._queue:
            addr, msg = self._queue.popleft()
            if not addr:
                continue
            try:
                frames = self._frames(addr, msg)  # sealed with a secret
                if self._lane is None or not self._lane.send(addr, frames):
                    self._dealer(addr).send_multipart(frames, zmq.NOBLOCK)
                    self._dealer_used[addr] = time.monotonic()
                self._counters["messages_out"] += 1
            except (zmq.ZMQError, ValueError) as e:
                log.warning("could not send %s to %s: %s", type(msg).__name__, addr, e)
        if self._lane_drops:
            assert self._lane is not None
            for peer in self._lane_drops:
                self._lane.drop(peer)  # what was written stays queued for the peer
            self._lane_drops.clear()
        for sock in self._to_close:
            # a dropped peer's last messages (the Failed of its rooms) still go out in the
            # background for a while: a peer that was only frozen reads them when it wakes,
            # instead of finishing rooms this side already failed (a split outcome)
            sock.close(linger=LINGER_DROPPED_MS)
        self._to_close.clear()

    def collect(self, now: float) -> None:
        """Closes the DEALERs of addresses the session has no peer record for once idle for
        DEALER_IDLE_S, and the least recently used beyond MAX_STRANGER_DEALERS: a stranger
        (whose Hello was refused, say) costs a socket for a while, not for good."""
        strangers = sorted((self._dealer_used.get(a, 0.0), a) for a in self._dealers
                           if not self._known(a))
        extra = len(strangers) - MAX_STRANGER_DEALERS
        for i, (used, addr) in enumerate(strangers):
            if i < extra or now - used > DEALER_IDLE_S:
                self._dealers.pop(addr).close(linger=0)
                self._dealer_used.pop(addr, None)

    def close(self) -> None:
        for s in [*self._dealers.values(), *self._to_close]:
            s.close(0)
        self._dealers.clear()
        self._to_close.clear()

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(addr)
        if sock is None:
            host, port = split_host_port(addr)  # ValueError: flush logs it, sends nothing
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.setsockopt(zmq.IPV6, zmq_ipv6(host))
            sock.connect(zmq_endpoint(host, port))
            self._dealers[addr] = sock
        return sock
