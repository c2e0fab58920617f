"""`ControlLoop`: the one thread that drives a `TransferSession` and does its I/O.

It owns every ZMQ socket (a ROUTER bound on the agent's control address; one DEALER per peer),
the same-host lane's Unix sockets (`runtime.locallane`: peers of this host are sent to there,
not over ZMQ), the wake pipe and the event queue. Engine threads, transport callbacks, hasher
workers and the route-lookup threads never touch the session: they `post` an event (a deque
append plus one byte on the wake pipe) and, when they must wait, wait on a room's view. The
loop feeds the session one event at a time with the current time and executes the effects it
returns, in order: messages to the outbox, transfers to the transport (one-sided writes through
the pass's batch, `runtime.batching`), hashing jobs to the hasher pool (a small one of host
memory is hashed right here: see HASH_INLINE_BYTES), room updates to the views. It drives a
`Stepper`: the session itself, or what a test installed in front of it (`runtime.seam`); the
loop has no test branches.

Each pass: read the wake pipe, feed the queued events, read control messages (at most a quarter
heartbeat's worth, so a burst cannot hold back heartbeats), feed a `Tick`, post the writes the
pass held (`PassBatch.flush`, once per pass), and send the outbox (each message as the session's
peer table frames it: sealed under the session with its recipient when ``hmac_secret`` is set,
`PeerTable.frames`). Nothing a sender puts in a frame ends the thread: every error of a message
or a pass is caught, counted and logged at a bounded rate (`RateLog`), and a stranger's socket
is closed once idle (`_collect_dealers`).
Nothing here takes a lock another kind of thread holds, so heartbeats leave on time however
busy the engine threads are.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from kvhandoff.buffers.bufferset import view_memory
from kvhandoff.errors import ConfigError, KVHandoffError, TransportError
from kvhandoff.netaddr import join_host_port, split_host_port, zmq_endpoint, zmq_ipv6
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import (
    Cancel,
    Connect,
    DropPeer,
    Effect,
    HashSpans,
    Log,
    PostRecv,
    PostSend,
    PostWrite,
    RegisterRemote,
    Release,
    RoomUpdate,
    Send,
)
from kvhandoff.protocol.session import TransferSession
from kvhandoff.runtime.batching import PassBatch
from kvhandoff.runtime.handles import RoomView
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.runtime.locallane import LocalLane, available
from kvhandoff.runtime.seam import Stepper
from kvhandoff.runtime.tracing import RoomTimelines
from kvhandoff.settings import Settings
from kvhandoff.transports.base import OneSidedTransport, Transport

log = logging.getLogger("kvhandoff.agent")

_Query = Callable[[TransferSession], Any]
LINGER_DROPPED_MS = 2000  # how long a dropped peer's last messages may take to leave
PEER_CALL_WORKERS = 4  # peers whose blocking transport calls run at once
# A hashing job of host memory up to this size runs on the control thread, its `Hashed` fed in
# the same pass: xxh3 of 2 MiB takes about 0.2 ms here, and a hasher job costs two thread
# hand-offs (a worker's wake-up, then the control thread's through the wake pipe), which on a
# loaded 2-core host cost more than that. Small layers are the short prompts' case, where
# the hand-offs are most of a layer's verification; larger jobs keep the pool's parallelism.
HASH_INLINE_BYTES = 2 << 20
# A batch of this many messages read from the control socket of which the session took none
# (see _read) counts as having read every peer's messages
MIN_IDLE_BATCH = 64
# Senders' connections that cost this agent nothing once idle: a ZMQ DEALER to an address the
# session has no peer record for (it only answered a stranger's Hello, or told a forgotten peer)
# is closed after DEALER_IDLE_S, and the least recently used go beyond MAX_STRANGER_DEALERS
DEALER_IDLE_S = 30.0
MAX_STRANGER_DEALERS = 256
# Bytes one connection may have queued for this agent before ZMQ stops reading it (TCP flow
# control then holds the sender back; nothing is dropped). ZMQ bounds a connection's queue in
# messages (RCVHWM), each at most MAXMSGSIZE (the largest honest message, max_message_bytes,
# plus its seal): the queue is held to this budget by `control_rcvhwm`, at least
# MIN_CONTROL_RCVHWM messages (a burst of small ones is read in batches of at least that)
CONTROL_CONN_BYTES = 256 << 20
MIN_CONTROL_RCVHWM = 16


def control_rcvhwm(max_message_bytes: int) -> int:
    """The control ROUTER's RCVHWM: CONTROL_CONN_BYTES worth of the largest messages."""
    return max(MIN_CONTROL_RCVHWM, CONTROL_CONN_BYTES // (max_message_bytes + P.SEAL_BYTES))


class ControlLoop:
    """Drives `session` on its own thread (see the module doc). Keyword-only arguments."""

    def __init__(self, *, transport: Transport, buffers: dict[str, np.ndarray],
                 settings: Settings, timelines: RoomTimelines | None = None) -> None:
        self.session: TransferSession | None = None  # given to start()
        self._step: Stepper | None = None  # the session, or a test's seam in front of it
        self._timelines = timelines  # sees every handled event and its effects
        self.transport = transport
        self.settings = settings
        self._buffers = buffers  # transport buffer name -> bytes
        self._queue: deque[tuple[ev.Event | None, _Query | None, Future[Any] | None]] = deque()
        self._ahead: deque[ev.Event] = deque()
        self._outbox: deque[tuple[str, P.Message]] = deque()
        self._to_close: list[zmq.Socket[bytes]] = []
        self._hashing = Hasher(buffers=buffers, transport=transport, post=self.post)
        self._batch = PassBatch(transport=transport, hashing=self._hashing, post=self.post)
        self._calls = ThreadPoolExecutor(max_workers=PEER_CALL_WORKERS,
                                         thread_name_prefix="kvh-peer-call")
        self._calls_waiting: dict[str, deque[Callable[[], None]]] = {}  # control thread only
        self._calls_done: deque[str] = deque()  # peers whose call ended (workers append)
        self.counters = {"messages_out": 0, "messages_out_local": 0, "rejected_messages": 0,
                         "loop_errors": 0}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes + P.SEAL_BYTES)
        self._router.setsockopt(zmq.RCVHWM, control_rcvhwm(settings.max_message_bytes))
        host, port = settings.agent_host, settings.agent_port
        self._router.setsockopt(zmq.IPV6, zmq_ipv6(host))
        try:
            if port:
                self._router.bind(zmq_endpoint(host, port))
            else:
                port = self._router.bind_to_random_port(zmq_endpoint(host))
        except zmq.ZMQError as e:
            self._router.close(0)
            raise ConfigError(f"agent_host={host!r}, agent_port={port}: the control socket "
                              f"cannot bind there ({e}); give an address of this host (an "
                              f"IPv6 one bare or in brackets)") from e
        self.address = join_host_port(host, port)
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._dealer_used: dict[str, float] = {}  # address -> when last sent to
        self._dealers_collected = time.monotonic()
        # same-host peers: control messages over a Unix socket (runtime.locallane)
        # a sealed message's body carries its seal (wire.SEAL_BYTES) beyond the limit
        self._lane = LocalLane(self.address,
                               max_message_bytes=settings.max_message_bytes + P.SEAL_BYTES,
                               counters=self.counters) \
            if settings.local_control_lane and available() else None
        self._lane_drops: list[str] = []  # peers whose lane closes once the outbox went out
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._drained_at = time.monotonic()  # when the control socket was last read empty
        self._rejects_log = RateLog(log, logging.WARNING)
        self._errors_log = RateLog(log, logging.ERROR)
        self._closing = False
        self._asleep = True  # the loop may be in (or about to enter) poll
        self._thread: threading.Thread | None = None

    def start(self, session: TransferSession, name: str, *, step: Stepper | None = None
              ) -> None:
        """Starts the thread that drives `session` (built with this loop's `address`): the
        events go to `step` (a test's seam in front of the session, `runtime.seam`) when given,
        else to the session itself."""
        self.session = session
        self._step = session if step is None else step
        # the Hello says where the buffers live; it decides the rooms' checksum algorithm
        kinds = {view_memory(v)[0] for v in self._buffers.values()}
        session.set_memory("cuda" if "cuda" in kinds else "host")
        self._thread = threading.Thread(target=self._run, name=f"kvh-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    @property
    def stepper(self) -> Stepper | None:
        """What the loop feeds events to: the session, or a test's seam in front of it."""
        return self._step

    def install(self, wrap: Callable[[Stepper], Stepper]) -> None:
        """Puts `wrap(stepper)` in front of what the loop drives now (a test's seam,
        `runtime.seam.Filtered`), on the control thread between two events."""
        def swap(_: TransferSession) -> None:
            assert self._step is not None
            self._step = wrap(self._step)

        self.query(swap)

    def post_ahead(self, event: ev.Event) -> None:
        """Queues an event that goes before the queued ones (an engine's abort, which the
        engine waits for): fed at the start of the next pass or between two messages."""
        self._ahead.append(event)
        if self._asleep:
            self._wake()

    def post(self, event: ev.Event) -> None:
        """Queues an event for the session (any thread; never blocks). The wake pipe is
        written only while the loop may be asleep in `poll` (it sets `_asleep` before it
        looks at the queue for the last time, so an event is never left waiting)."""
        self._queue.append((event, None, None))
        if self._asleep:
            self._wake()

    def running_elsewhere(self) -> bool:
        """Whether the loop runs and the caller is not the loop's own thread (so it may wait
        for the loop without deadlocking it)."""
        t = self._thread
        return t is not None and t.is_alive() and threading.current_thread() is not t

    def query(self, fn: _Query, timeout: float = 10.0) -> Any:
        """Runs `fn(session)` on the control thread and returns its result (bounded)."""
        assert self.session is not None
        if self._thread is None or not self._thread.is_alive():
            return fn(self.session)  # closed: nothing else touches the session any more
        fut: Future[Any] = Future()
        self._queue.append((None, fn, fut))
        self._wake()
        return fut.result(timeout)

    def _wake(self) -> None:
        w = self._wake_w
        if w < 0:  # closed: never write into a file descriptor number reused since
            return
        try:
            os.write(w, b"x")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Stops the loop after it fed the queued events and sent the outbox; closes sockets
        and the hasher pool (the transport is the agent's to close)."""
        self._closing = True
        self._wake()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        self._hashing.close()
        # a call still waiting on its peer ends when the agent closes the transport
        self._calls.shutdown(wait=False, cancel_futures=True)
        for s in [*self._dealers.values(), *self._to_close]:
            s.close(0)
        self._router.close(0)
        if self._lane is not None:
            self._lane.close()
        w, self._wake_w = self._wake_w, -1  # late posts (transport callbacks) write nothing
        os.close(w)
        os.close(self._wake_r)

    # ------------------------------------------------------------------ control thread

    def _feed(self, event: ev.Event) -> None:
        assert self._step is not None
        try:
            now = time.monotonic()
            effects = self._step.handle(event, now)
        except Exception:  # noqa: BLE001 - the control loop must survive anything an event does
            # the session fails the room of a room's event itself (both sides told); this is
            # an event of no room (a tick, a peer's message): counted and logged
            self.counters["loop_errors"] += 1
            self._errors_log.log(now, "agent: error handling %s", type(event).__name__,
                                 exc_info=True)
            return
        if self._timelines is not None:
            effects = self._timelines.observe(event, effects)
        for eff in effects:
            self._execute(eff)
        if self._timelines is not None:
            self._timelines.settle()  # a room's trace once its engine was told it ended

    def _execute(self, eff: Effect) -> None:
        if isinstance(eff, Send):
            self._outbox.append((eff.addr, eff.msg))
        elif isinstance(eff, PostSend | PostRecv):
            done = functools.partial(self._op_done, eff.op)
            post = self.transport.post_send if isinstance(eff, PostSend) else \
                self.transport.post_recv
            try:
                post(eff.peer, eff.tag, eff.buffer, eff.offsets, eff.nbytes, done)
            except KVHandoffError as e:
                self.post(ev.OpDone(eff.op, str(e)))
        elif isinstance(eff, PostWrite):
            self._batch.hold(eff)  # with the room's others of this pass
        elif isinstance(eff, RegisterRemote):
            self._call(eff.peer, functools.partial(self._register_remote, eff))
        elif isinstance(eff, RoomUpdate):
            assert isinstance(eff.token, RoomView)
            eff.token.update(eff.state, eff.failure, eff.landed, eff.done)
        elif isinstance(eff, Release):
            assert isinstance(eff.token, RoomView)
            eff.token.release()
        elif isinstance(eff, HashSpans):
            if self._inline_hash(eff):
                self._queue.append((self._hashing.hashed(eff), None, None))  # this pass
            else:
                self._hashing.submit(eff)
        elif isinstance(eff, Cancel):
            self._batch.flush()  # the cancel finds the writes it cancels posted
            self._call(eff.peer, functools.partial(self._cancel, eff))
        elif isinstance(eff, Connect):
            self._call(eff.peer, functools.partial(self._connect, eff))
        elif isinstance(eff, DropPeer):
            self._batch.flush()
            self._call(eff.peer, functools.partial(self._drop, eff))
            sock = self._dealers.pop(eff.peer, None)
            self._dealer_used.pop(eff.peer, None)
            if sock is not None:
                self._to_close.append(sock)  # after the outbox went out
            if self._lane is not None:
                self._lane_drops.append(eff.peer)
        elif isinstance(eff, Log):
            log.log(eff.level, "%s", eff.message, exc_info=eff.exc)
        else:
            raise TypeError(f"unknown effect {eff!r}")

    # ------------------------------------------------------------------ peer calls
    # A transport call that may wait on its peer (connect, register_remote, cancel,
    # disconnect) never runs on the control thread: it goes to the peer-call pool and its
    # outcome comes back as an event. Each peer's calls run one at a time, in the order the
    # session asked for them (a cancel never overtakes its connect); the control thread alone
    # keeps the per-peer queues, the workers only hand back the peer whose call ended.

    def _call(self, peer: str, fn: Callable[[], None]) -> None:
        """(control thread) Runs `fn` on the peer-call pool after `peer`'s earlier calls."""
        waiting = self._calls_waiting.get(peer)
        if waiting is not None:
            waiting.append(fn)
            return
        self._calls_waiting[peer] = deque()
        self._start_call(peer, fn)

    def _start_call(self, peer: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            finally:
                self._calls_done.append(peer)
                if self._asleep:
                    self._wake()

        try:
            self._calls.submit(run)
        except RuntimeError:  # the pool shut down: the agent is closing
            self._calls_waiting.pop(peer, None)

    def _next_calls(self) -> None:
        """(control thread) Starts each peer's next call once its previous one ended."""
        while self._calls_done:
            peer = self._calls_done.popleft()
            waiting = self._calls_waiting.get(peer)
            if waiting:
                self._start_call(peer, waiting.popleft())
            else:
                self._calls_waiting.pop(peer, None)

    def _connect(self, eff: Connect) -> None:
        """(peer-call worker) May wait on the peer up to the transport's bound."""
        def connect() -> None:
            self.transport.bind_session(eff.peer, eff.key)  # the data plane's session too
            self.transport.connect(eff.peer, eff.address)

        error = _outcome(connect)
        self.post(ev.Connected(eff.peer, error, eff.gen))

    def _register_remote(self, eff: RegisterRemote) -> None:
        """(peer-call worker) A refusal: the session sends to that peer two-sided."""
        def register() -> None:
            tr = self.transport
            if not isinstance(tr, OneSidedTransport) or not tr.can_write(eff.peer):
                raise TransportError(f"register_remote: the {tr.kind} transport's lane to peer "
                                     f"{eff.peer!r} has no one-sided writes (can_write)")
            for name, descriptor in eff.descriptors:
                tr.register_remote(eff.peer, name, descriptor)

        self.post(ev.RemoteRegistered(eff.peer, _outcome(register)))

    def _cancel(self, eff: Cancel) -> None:
        """(peer-call worker) shm waits here (bounded) for a local copy to stop; a failure
        keeps the room's pages held (the session counts and logs it)."""
        error = _outcome(lambda: self.transport.cancel(eff.peer, eff.tag))
        self.post(ev.Cancelled(eff.peer, eff.tag, error))

    def _drop(self, eff: DropPeer) -> None:
        """(peer-call worker) A failed disconnect is answered like a failed cancel."""
        def drop() -> None:
            if self.transport.peer_exited(eff.peer):
                self.post(ev.PeerExited(eff.peer, eff.gen))
            self.transport.disconnect(eff.peer)

        self.post(ev.Cancelled(eff.peer, None, _outcome(drop)))

    # ------------------------------------------------------------------ completions

    def _op_done(self, op: int, exc: BaseException | None) -> None:
        """(transport thread) A posted op completed."""
        self.post(ev.OpDone(op, None if exc is None else str(exc)))

    def _inline_hash(self, job: HashSpans) -> bool:
        """Whether `job` is hashed on the control thread: at most HASH_INLINE_BYTES, all of it
        in host memory (a device sum may wait on the device)."""
        total = 0
        for name, _, nbytes in job.spans:
            buf = self._buffers.get(name)
            if buf is None or view_memory(buf)[0] != "host":
                return False
            total += int(nbytes.sum())
        return total <= HASH_INLINE_BYTES

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(addr)
        if sock is None:
            host, port = split_host_port(addr)  # ValueError: _flush logs it, sends nothing
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.setsockopt(zmq.IPV6, zmq_ipv6(host))
            sock.connect(zmq_endpoint(host, port))
            self._dealers[addr] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        lane = self._lane
        if lane is not None:
            lane.attach(poller)
        hb = self.settings.heartbeat_interval_s
        while True:
            closing = self._closing
            self._asleep = True  # before _timeout_ms looks at the queue (see post)
            try:
                events = dict(poller.poll(self._timeout_ms(hb)))
            except zmq.ZMQError:
                break
            self._asleep = False
            try:
                self._pass(events, lane, hb)
            except Exception as e:  # noqa: BLE001 - the thread serves every room: never dies
                self.counters["loop_errors"] += 1
                self._errors_log.log(time.monotonic(), "agent: error in the control loop: %r",
                                     e, exc_info=True)
            if closing and not self._queue and not self._ahead:
                break

    def _pass(self, events: dict[Any, int], lane: LocalLane | None, hb: float) -> None:
        """One pass of the loop (see the module doc), once `poll` returned `events`."""
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._next_calls()
        self._drain_ahead()
        self._drain_queue(time.monotonic() + hb / 4)
        # read empty (polled: nothing waiting) on both lanes: the session's peers'
        # silence is theirs, not a backlog of ours
        drained = self._router not in events or self._read(hb)
        if lane is not None:
            lane.service(events)
            if lane.inbox:
                self._read_lane(lane, hb)
            drained = drained and not lane.inbox
        if drained:
            self._drained_at = time.monotonic()
        self._feed(ev.Tick(drained_at=self._drained_at))
        self._batch.flush()  # the writes of the whole pass, before its messages
        self._flush()
        now = time.monotonic()
        if now - self._dealers_collected > hb:
            self._dealers_collected = now
            self._collect_dealers(now)

    def _collect_dealers(self, now: float) -> None:
        """Closes the DEALERs of addresses the session has no peer record for once idle for
        DEALER_IDLE_S, and the least recently used beyond MAX_STRANGER_DEALERS: a stranger
        (whose Hello was refused, say) costs a socket for a while, not for good."""
        assert self.session is not None
        peers = self.session.peers
        strangers = sorted((self._dealer_used.get(a, 0.0), a) for a in self._dealers
                           if peers.get(a) is None)
        extra = len(strangers) - MAX_STRANGER_DEALERS
        for i, (used, addr) in enumerate(strangers):
            if i < extra or now - used > DEALER_IDLE_S:
                self._dealers.pop(addr).close(linger=0)
                self._dealer_used.pop(addr, None)

    def _drain_ahead(self) -> None:
        while self._ahead:
            self._feed(self._ahead.popleft())

    def _drain_queue(self, until: float) -> None:
        """Feeds queued events until the queue is empty or the clock passes `until` (a burst
        of engine calls must not hold back heartbeats: the rest waits for the next pass). A
        room's layers ready one after the other are fed as one `Batch` (`PassBatch`)."""
        left = len(self._queue)
        for i in itertools.count():
            if left <= 0 or (i % 64 == 63 and time.monotonic() > until):
                return
            event, fn, fut = self._queue.popleft()
            left -= 1
            event, taken = self._batch.take_ready(event, self._queue, left)
            left -= taken
            if event is not None:
                self._feed(event)
            elif fn is not None and fut is not None:
                assert self.session is not None
                try:
                    fut.set_result(fn(self.session))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _read(self, hb: float) -> bool:
        """A batch of control messages: a burst (hundreds of rooms' requests) must not hold
        back heartbeats and answers: after a quarter heartbeat, tick, then read on. Whether
        it read every message a peer sent: the socket read empty, or a batch of messages none
        of which the session took (garbage, forgeries, strangers). ZMQ's ROUTER reads its
        connections in turn, so a batch of those has no peer's message waiting behind it: a
        flood from outside must not stop this agent from seeing a peer's silence."""
        batch_end = time.monotonic() + hb / 4
        assert self.session is not None
        c = self.session.counters
        taken0 = c["messages_in"] - c["stale_messages"]
        n = 0
        for n in range(1, 1001):  # noqa: B007 - n counts the batch
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._message(frames[1:], batch_end)
            if time.monotonic() > batch_end:
                break
        return n >= MIN_IDLE_BATCH and c["messages_in"] - c["stale_messages"] == taken0

    def _read_lane(self, lane: LocalLane, hb: float) -> None:
        """The same-host lane's messages read this pass, as `_read` (what a quarter heartbeat
        does not reach waits for the next pass)."""
        batch_end = time.monotonic() + hb / 4
        inbox = lane.inbox
        for _ in range(1000):
            if not inbox:
                break
            self._message(inbox.popleft(), batch_end)
            if time.monotonic() > batch_end:
                break

    def _message(self, frames: list[bytes], batch_end: float) -> None:
        """Feeds one control message (its frames), then what it made due. Nothing a sender
        puts in a frame ends the loop: a frame that does not decode is counted in
        ``rejected_messages`` and logged at a bounded rate (a flood must not fill the log)."""
        assert self.session is not None
        try:
            # header, size and seal first; with a secret the seal is checked over the raw
            # bytes before anything is decoded (a stranger's frame costs a MAC pass at most)
            opened = P.open_frames(frames, max_bytes=self.settings.max_message_bytes)
            if self.settings.hmac_secret and not self.session.peers.screen(opened):
                return  # counted by the session (unauthenticated_messages)
            msg, seal = P.decode_body(opened.body), opened.seal
        except Exception as e:  # noqa: BLE001 - ProtocolError, or anything a decoder bug raises
            self.counters["rejected_messages"] += 1
            self._rejects_log.log(time.monotonic(), "rejected a control message: %s", e)
            return
        self._feed(ev.MessageReceived(msg, seal))
        self._drain_ahead()
        if self._queue:  # completions and engine events between messages
            self._drain_queue(batch_end)

    def _timeout_ms(self, hb: float) -> int:
        if (self._outbox or self._queue or self._ahead or self._closing or self._calls_done
                or self._batch.pending or (self._lane is not None and self._lane.inbox)):
            return 0
        now = time.monotonic()
        assert self._step is not None
        when = self._step.next_wakeup()
        return max(0, min(int((when - now) * 1e3) + 1, int(hb * 1e3)))

    def _flush(self) -> None:
        while self._outbox:
            addr, msg = self._outbox.popleft()
            if not addr:
                continue
            try:
                assert self.session is not None
                frames = self.session.peers.frames(addr, msg)  # sealed with a secret
                if self._lane is None or not self._lane.send(addr, frames):
                    self._dealer(addr).send_multipart(frames, zmq.NOBLOCK)
                    self._dealer_used[addr] = time.monotonic()
                self.counters["messages_out"] += 1
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


class RateLog:
    """Logs at most `burst` records per `window_s` (what comes from outside can be a flood);
    the next record after a window says how many were left out."""

    def __init__(self, logger: logging.Logger, level: int, *, burst: int = 10,
                 window_s: float = 10.0) -> None:
        self._log, self._level = logger, level
        self._burst, self._window_s = burst, window_s
        self._start, self._count, self._left_out = -1e18, 0, 0

    def log(self, now: float, fmt: str, *args: Any, exc_info: bool = False) -> None:
        if now - self._start > self._window_s:
            if self._left_out:
                self._log.log(self._level, "... %d more like these in %.0f s left out",
                              self._left_out, self._window_s)
            self._start, self._count, self._left_out = now, 0, 0
        if self._count >= self._burst:
            self._left_out += 1
            return
        self._count += 1
        self._log.log(self._level, fmt, *args, exc_info=exc_info)


def _outcome(call: Callable[[], None]) -> str | None:
    """Runs a transport call for the session: None, or why it failed (any exception: the
    session must hear of it, never the worker's log alone)."""
    try:
        call()
    except KVHandoffError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported to the session as the call's outcome
        return repr(e)
    return None
