"""`ControlOutbox`: production's outbox (the `outbox` part of an `runtime.executor.Executor`):
the control messages of a pass, sent at its end over ZMQ (one DEALER per peer address) or over
the same-host lane (`runtime.locallane`) for peers of this host.

Each message leaves as the session's peer table frames it (sealed under the session with its
recipient when ``hmac_secret`` is set: `PeerTable.frames`). A dropped peer's socket closes once
the outbox went out, lingering a while so its last messages (the Failed of its rooms) still
leave; a stranger's socket is closed once idle (`collect`).

Each DEALER's queue is bounded in messages (ZMQ's SNDHWM; sends never block: NOBLOCK, and a
message over the bound is dropped, counted in `control_out_dropped` and logged at most once
per DROP_LOG_S). Why messages, and these numbers: ZMQ bounds a send queue only in messages,
and what an agent sends an address is bounded by what it answers there:
- an address the session has no peer record for (a stranger: its Hello was refused, or a
  forgotten peer) only ever gets refusals, at most 64 per heartbeat (the session's rate
  limit), each a few hundred bytes: STRANGER_SNDHWM = 64 messages, so a stranger that names an
  address that accepts and never reads costs at most 64 small messages until its socket is
  collected (DEALER_IDLE_S), never a queue that grows with what it sends;
- a peer (a session record: with a secret, one that proved the secret) gets a few messages
  per room per pass and is declared silent, its socket closed, two heartbeats after it stops
  answering: PEER_SNDHWM = 16,384 messages (four per room for 4,096 rooms) is far above what
  one that reads has queued, and a bound where one that stopped reading would otherwise grow
  the queue until it is found silent.
A socket opened for a stranger that later becomes a peer (its next Hello is taken) is
replaced by one with the peer's bound; the old one's last messages still leave
(LINGER_DROPPED_MS).

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
STRANGER_SNDHWM = 64  # messages queued to an address with no peer record (module doc)
PEER_SNDHWM = 16384  # messages queued to a peer (module doc)
DROP_LOG_S = 10.0  # at most one log line per this many seconds for dropped messages


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
        self._strangers: set[str] = set()  # addresses whose DEALER has the stranger's bound
        self._dropped_logged = -DROP_LOG_S  # when a drop was last logged
        self._dropped_since = 0  # drops not logged since
        counters.setdefault("control_out_dropped", 0)

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def send(self, addr: str, msg: P.Message) -> None:
        self._queue.append((addr, msg))

    def forget(self, peer: str) -> None:
        sock = self._dealers.pop(peer, None)
        self._dealer_used.pop(peer, None)
        self._strangers.discard(peer)
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
            except zmq.Again:  # its queue is at its bound (SNDHWM): dropped, counted
                self._dropped(addr, msg)
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

    def _dropped(self, addr: str, msg: P.Message) -> None:
        self._counters["control_out_dropped"] += 1
        self._dropped_since += 1
        now = time.monotonic()
        if now - self._dropped_logged >= DROP_LOG_S:
            hwm = STRANGER_SNDHWM if addr in self._strangers else PEER_SNDHWM
            log.warning("control: dropped %d message(s) (last: %s to %s): its queue holds %d "
                        "messages not read yet (the address does not read)",
                        self._dropped_since, type(msg).__name__, addr, hwm)
            self._dropped_logged, self._dropped_since = now, 0

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
                self._strangers.discard(addr)

    def close(self) -> None:
        for s in [*self._dealers.values(), *self._to_close]:
            s.close(0)
        self._dealers.clear()
        self._to_close.clear()

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(addr)
        if sock is not None and addr in self._strangers and self._known(addr):
            # a stranger became a peer: a socket with the peer's bound (the old one's last
            # messages still leave in the background)
            del self._dealers[addr]
            self._strangers.discard(addr)
            sock.close(linger=LINGER_DROPPED_MS)
            sock = None
        if sock is None:
            host, port = split_host_port(addr)  # ValueError: flush logs it, sends nothing
            stranger = not self._known(addr)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, STRANGER_SNDHWM if stranger else PEER_SNDHWM)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.setsockopt(zmq.IPV6, zmq_ipv6(host))
            sock.connect(zmq_endpoint(host, port))
            self._dealers[addr] = sock
            if stranger:
                self._strangers.add(addr)
        return sock
