"""`ControlLoop`: the one thread that drives a `TransferSession` and does its I/O.

It owns every ZMQ socket (a ROUTER bound on the agent's control address; one DEALER per peer),
the wake pipe, the event queue and the timers. Engine threads, transport callbacks, hasher
workers and the route-lookup threads never touch the session: they `post` an event (a deque
append plus one byte on the wake pipe) and, when they must wait, wait on a room's view. The
loop feeds the session one event at a time with the current time and executes the effects it
returns, in order: messages to the outbox (through the effect filter, when tests installed
one), transfers to the transport, hashing jobs to the hasher pool, room updates to the views.

Each pass: read the wake pipe, feed the queued events, read control messages (at most a quarter
heartbeat's worth, so a burst cannot hold back heartbeats), run due timers, feed a `Tick`, and
send the outbox. Nothing here takes a lock another kind of thread holds, so heartbeats leave on
time however busy the engine threads are.
"""

from __future__ import annotations

import functools
import heapq
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

from kvhandoff.errors import KVHandoffError, ProtocolError
from kvhandoff.settings import Settings
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.buffers import view_memory
from kvhandoff.transfer.devsum import room_checksum
from kvhandoff.transfer.effects import (
    Cancel,
    Connect,
    Delayed,
    DropPeer,
    Effect,
    EffectFilter,
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
from kvhandoff.transfer.handles import RoomView
from kvhandoff.transfer.session import TransferSession
from kvhandoff.transfer.transports.base import Transport

log = logging.getLogger("kvhandoff.agent")

_Query = Callable[[TransferSession], Any]
LINGER_DROPPED_MS = 2000  # how long a dropped peer's last messages may take to leave


class ControlLoop:
    """Drives `session` on its own thread (see the module doc). Keyword-only arguments."""

    def __init__(self, *, transport: Transport, buffers: dict[str, np.ndarray],
                 settings: Settings, effect_filter: EffectFilter | None = None) -> None:
        self.session: TransferSession | None = None  # given to start()
        self.transport = transport
        self.settings = settings
        self._buffers = buffers  # transport buffer name -> bytes
        self._filter = effect_filter
        self._queue: deque[tuple[ev.Event | None, _Query | None, Future[Any] | None]] = deque()
        self._ahead: deque[ev.Event] = deque()
        self._outbox: deque[tuple[str, P.Message]] = deque()
        self._timers: list[tuple[float, int, Effect]] = []
        self._timer_seq = itertools.count()
        self._to_close: list[zmq.Socket[bytes]] = []
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvh-hash")
        self.counters = {"messages_out": 0, "rejected_messages": 0}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes + 64)
        self._router.setsockopt(zmq.RCVHWM, 0)
        host, port = settings.agent_host, settings.agent_port
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._drained_at = time.monotonic()  # when the control socket was last read empty
        self._closing = False
        self._asleep = True  # the loop may be in (or about to enter) poll
        self._thread: threading.Thread | None = None

    def start(self, session: TransferSession, name: str) -> None:
        """Starts the thread that drives `session` (built with this loop's `address`)."""
        self.session = session
        # the Hello says where the buffers live; it decides the rooms' checksum algorithm
        kinds = {view_memory(v)[0] for v in self._buffers.values()}
        session.set_memory("cuda" if "cuda" in kinds else "host")
        self._thread = threading.Thread(target=self._run, name=f"kvh-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

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
        self._hasher.shutdown(wait=True, cancel_futures=True)
        for s in [*self._dealers.values(), *self._to_close]:
            s.close(0)
        self._router.close(0)
        w, self._wake_w = self._wake_w, -1  # late posts (transport callbacks) write nothing
        os.close(w)
        os.close(self._wake_r)

    # ------------------------------------------------------------------ control thread

    def _feed(self, event: ev.Event) -> None:
        assert self.session is not None
        try:
            effects = self.session.handle(event, time.monotonic())
        except Exception:  # the control loop must survive anything an event does
            log.exception("agent: error handling %s", type(event).__name__)
            return
        for eff in effects:
            if self._filter is None:
                self._execute(eff)
            else:
                for e in self._filter(eff):
                    self._execute(e)

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
            # the digest must be of the room's algorithm: the transport computes it while
            # copying when it computes that one for this buffer, else it is hashed here once
            # the write landed (the source does not change while its room is open)
            fused = eff.checksum and self._write_digest_alg(eff.buffer) == eff.alg
            written = (functools.partial(self._written, eff.op)
                       if fused or not eff.checksum else
                       functools.partial(self._written_then_hash, eff))
            try:
                self.transport.post_write(eff.peer, eff.tag, eff.buffer, eff.offsets,
                                          eff.nbytes, eff.buffer, eff.remote_offsets,
                                          eff.nbytes, written, checksum=fused)
            except KVHandoffError as e:
                self.post(ev.Written(eff.op, str(e)))
        elif isinstance(eff, RegisterRemote):
            error = None
            try:
                for name, descriptor in eff.descriptors:
                    self.transport.register_remote(eff.peer, name, descriptor)
            except KVHandoffError as e:
                error = str(e)
            self._feed(ev.RemoteRegistered(eff.peer, error))
        elif isinstance(eff, RoomUpdate):
            assert isinstance(eff.token, RoomView)
            eff.token.update(eff.state, eff.failure, eff.landed, eff.done)
        elif isinstance(eff, Release):
            assert isinstance(eff.token, RoomView)
            eff.token.release()
        elif isinstance(eff, HashSpans):
            self._hasher.submit(self._hash, eff)
        elif isinstance(eff, Cancel):
            try:
                self.transport.cancel(eff.peer, eff.tag)
            except KVHandoffError:
                pass
        elif isinstance(eff, Connect):
            try:
                self.transport.connect(eff.peer, eff.address)
                error = None
            except KVHandoffError as e:
                error = str(e)
            self._feed(ev.Connected(eff.peer, error))
        elif isinstance(eff, DropPeer):
            try:
                if self.transport.peer_exited(eff.peer):
                    self.post(ev.PeerExited(eff.peer, eff.gen))
                self.transport.disconnect(eff.peer)
            except KVHandoffError:
                pass
            sock = self._dealers.pop(eff.peer, None)
            if sock is not None:
                self._to_close.append(sock)  # after the outbox went out
        elif isinstance(eff, Log):
            log.log(eff.level, "%s", eff.message)
        elif isinstance(eff, Delayed):
            heapq.heappush(self._timers, (time.monotonic() + eff.after_s,
                                          next(self._timer_seq), eff.effect))
        else:
            raise TypeError(f"unknown effect {eff!r}")

    def _op_done(self, op: int, exc: BaseException | None) -> None:
        """(transport thread) A posted op completed."""
        self.post(ev.OpDone(op, None if exc is None else str(exc)))

    def _written(self, op: int, exc: BaseException | None, digest: int | None) -> None:
        """(transport thread) A one-sided write ended."""
        self.post(ev.Written(op, None if exc is None else str(exc), digest))

    def _write_digest_alg(self, name: str) -> str | None:
        """The algorithm of the digest `transport.post_write(checksum=True)` gives for buffer
        `name`: what the transport says (`write_digest_alg`, shm: xxh3 of host buffers,
        devsum of CUDA ones), else xxh3 for host buffers (every transport's fused hash) and
        None (none it can give) for device buffers."""
        said = getattr(self.transport, "write_digest_alg", None)
        if said is not None:
            alg: str | None = said(name)
            return alg
        buf = self._buffers.get(name)
        return "xxh3" if buf is not None and view_memory(buf)[0] == "host" else None

    def _written_then_hash(self, eff: PostWrite, exc: BaseException | None,
                           digest: int | None) -> None:
        """(transport thread) A write whose digest the transport could not compute in the
        room's algorithm ended: hash its source spans on the hasher pool, then post
        `Written`."""
        if exc is not None:
            self.post(ev.Written(eff.op, str(exc)))
            return

        def hash_source() -> None:
            try:
                d = room_checksum(self._buffers[eff.buffer], eff.offsets, eff.nbytes, eff.alg)
            except Exception as e:  # noqa: BLE001 - reported to the session (fails the room)
                self.post(ev.Written(eff.op, f"checksum ({eff.alg}) of the written source "
                                             f"failed: {e!r}"))
                return
            self.post(ev.Written(eff.op, None, d))

        try:
            self._hasher.submit(hash_source)
        except RuntimeError as e:  # the pool shut down: the agent is closing
            self.post(ev.Written(eff.op, f"closing: {e}"))

    def _hash(self, job: HashSpans) -> None:
        """(hasher thread) The sums of a hashing job (with the room's algorithm, on the
        buffer where it lives), posted back as `Hashed`."""
        try:
            sums = tuple(room_checksum(self._buffers[name], offsets, nbytes, job.alg)
                         for name, offsets, nbytes in job.spans)
            self.post(ev.Hashed(job.job, sums))
        except Exception as e:  # noqa: BLE001 - reported to the session, which fails the room
            self.post(ev.Hashed(job.job, (), error=repr(e)))

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.connect(f"tcp://{addr}")
            self._dealers[addr] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        hb = self.settings.heartbeat_interval_s
        while True:
            closing = self._closing
            self._asleep = True  # before _timeout_ms looks at the queue (see post)
            try:
                events = dict(poller.poll(self._timeout_ms(hb)))
            except zmq.ZMQError:
                break
            self._asleep = False
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            self._drain_ahead()
            self._drain_queue(time.monotonic() + hb / 4)
            if self._router not in events:
                self._drained_at = time.monotonic()  # polled: nothing waiting to be read
            else:
                self._read(hb)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._execute(heapq.heappop(self._timers)[2])
            self._feed(ev.Tick(drained_at=self._drained_at))
            self._flush()
            if closing and not self._queue and not self._ahead:
                break

    def _drain_ahead(self) -> None:
        while self._ahead:
            self._feed(self._ahead.popleft())

    def _drain_queue(self, until: float) -> None:
        """Feeds queued events until the queue is empty or the clock passes `until` (a burst
        of engine calls must not hold back heartbeats: the rest waits for the next pass)."""
        for i in range(len(self._queue)):
            if i % 64 == 63 and time.monotonic() > until:
                return
            event, fn, fut = self._queue.popleft()
            if event is not None:
                self._feed(event)
            elif fn is not None and fut is not None:
                assert self.session is not None
                try:
                    fut.set_result(fn(self.session))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _read(self, hb: float) -> None:
        """A batch of control messages: a burst (hundreds of rooms' requests) must not hold
        back heartbeats and answers: after a quarter heartbeat, tick, then read on."""
        batch_end = time.monotonic() + hb / 4
        for _ in range(1000):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self._drained_at = time.monotonic()
                break
            try:
                msg = P.decode(frames[1:], max_bytes=self.settings.max_message_bytes)
            except ProtocolError as e:
                self.counters["rejected_messages"] += 1
                log.warning("rejected a control message: %s", e)
                continue
            self._feed(ev.MessageReceived(msg))
            self._drain_ahead()
            if self._queue:  # completions and engine events between messages
                self._drain_queue(batch_end)
            if time.monotonic() > batch_end:
                break

    def _timeout_ms(self, hb: float) -> int:
        if self._outbox or self._queue or self._ahead or self._closing:
            return 0
        now = time.monotonic()
        assert self.session is not None
        when = self.session.next_wakeup()
        if self._timers:
            when = min(when, self._timers[0][0])
        return max(0, min(int((when - now) * 1e3) + 1, int(hb * 1e3)))

    def _flush(self) -> None:
        while self._outbox:
            addr, msg = self._outbox.popleft()
            if not addr:
                continue
            try:
                self._dealer(addr).send_multipart(P.encode(msg), zmq.NOBLOCK)
                self.counters["messages_out"] += 1
            except zmq.ZMQError as e:
                log.warning("could not send %s to %s: %s", type(msg).__name__, addr, e)
        for sock in self._to_close:
            # a dropped peer's last messages (the Failed of its rooms) still go out in the
            # background for a while: a peer that was only frozen reads them when it wakes,
            # instead of finishing rooms this side already failed (a split outcome)
            sock.close(linger=LINGER_DROPPED_MS)
        self._to_close.clear()
