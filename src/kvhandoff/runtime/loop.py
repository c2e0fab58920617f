"""`ControlLoop`: the one thread that drives a `TransferSession` and does its I/O.

It owns the control sockets (a ROUTER bound on the agent's control address; the outbox's
DEALERs, `runtime.outbox`), the same-host lane's Unix sockets (`runtime.locallane`: peers of
this host are sent to there, not over ZMQ), the wake pipe and the event queue. Engine threads,
transport callbacks, hasher workers, peer-call workers and the route-lookup threads never touch
the session: they `post` an event (a deque append plus one byte on the wake pipe) and, when
they must wait, wait on a room's view. The loop feeds the session one event at a time and its
`runtime.executor.Executor` carries out the effects, with production's parts: the real clock,
the transport, the ZMQ outbox, the peer-call threads (`runtime.calls`), the hasher's pool and
the room views. The simulator (`kvhandoff.testing.simulator`) runs the same executor with
simulated parts. The loop drives a `Stepper`: the session itself, or what a test installed in
front of it (`runtime.seam`); it has no test branches.

Each pass: read the wake pipe, start the peer calls due, feed the queued events, read control
messages (at most a quarter heartbeat's worth, so a burst cannot hold back heartbeats), feed a
`Tick`, then end the pass (`Executor.end_pass`: the writes the pass held, then the outbox).
Liveness is measured by time: the `Tick` says when the loop last read its control sockets
(`read_at`), whatever it found there, and a peer is silent when nothing authenticated came from
it since (a flood of junk or of strangers' messages neither hides a dead peer nor makes a live
one look dead: ZMQ reads its connections in turn, so a peer's messages are never far behind).
The same-host lane's inbox is one queue of this agent's own for every local peer (all of its
uid): there `read_at` is no later than when that queue was last found empty.
Nothing a sender puts in a frame ends the thread: every error of a message or a pass is caught,
counted and logged at a bounded rate (`RateLog`), and a stranger's socket is closed once idle.
Nothing here takes a lock another kind of thread holds, so heartbeats leave on time however
busy the engine threads are.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from kvhandoff.buffers.bufferset import view_memory
from kvhandoff.errors import ConfigError, ProtocolError
from kvhandoff.netaddr import join_host_port, zmq_endpoint, zmq_ipv6
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Release, RoomUpdate
from kvhandoff.protocol.peers import BAD_HMAC
from kvhandoff.protocol.session import TransferSession
from kvhandoff.runtime.calls import ThreadPeerCalls
from kvhandoff.runtime.executor import Executor, Parts, log_effect
from kvhandoff.runtime.handles import RoomView
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.runtime.locallane import LocalLane, available
from kvhandoff.runtime.outbox import ControlOutbox
from kvhandoff.runtime.seam import Stepper
from kvhandoff.runtime.tracing import RoomTimelines
from kvhandoff.settings import Settings
from kvhandoff.transports.base import Transport

log = logging.getLogger("kvhandoff.agent")

_Query = Callable[[TransferSession], Any]
# Bytes one connection may have queued for this agent before ZMQ stops reading it (TCP flow
# control then holds the sender back; nothing is dropped). ZMQ bounds a connection's queue in
# messages (RCVHWM), each at most MAXMSGSIZE (the largest honest message, max_message_bytes,
# plus its seal or envelope: wire.frame_limit): the queue is held to this budget by
# `control_rcvhwm`, at least
# MIN_CONTROL_RCVHWM messages (a burst of small ones is read in batches of at least that)
CONTROL_CONN_BYTES = 256 << 20
MIN_CONTROL_RCVHWM = 16


def control_rcvhwm(max_message_bytes: int) -> int:
    """The control ROUTER's RCVHWM: CONTROL_CONN_BYTES worth of the largest messages."""
    return max(MIN_CONTROL_RCVHWM, CONTROL_CONN_BYTES // P.frame_limit(max_message_bytes))


class RoomViews:
    """Production's `views` part: a room's `RoomView` (its engine handle) takes each update."""

    def update(self, eff: RoomUpdate) -> None:
        assert isinstance(eff.token, RoomView)
        eff.token.update(eff.state, eff.failure, eff.landed, eff.done)

    def release(self, eff: Release) -> None:
        assert isinstance(eff.token, RoomView)
        eff.token.release()


class ControlLoop:
    """Drives `session` on its own thread (see the module doc). Keyword-only arguments."""

    def __init__(self, *, transport: Transport, buffers: dict[str, np.ndarray],
                 settings: Settings, timelines: RoomTimelines | None = None) -> None:
        self.session: TransferSession | None = None  # given to start()
        self._timelines = timelines  # sees every handled event and its effects
        self.transport = transport
        self.settings = settings
        self._buffers = buffers  # transport buffer name -> bytes
        self._queue: deque[tuple[ev.Event | None, _Query | None, Future[Any] | None]] = deque()
        self._ahead: deque[ev.Event] = deque()
        self._hashing = Hasher(buffers=buffers, transport=transport, post=self.post)
        self._calls = ThreadPeerCalls(post=self.post, wake=self._wake_if_asleep)
        self.counters = {"messages_out": 0, "messages_out_local": 0, "rejected_messages": 0,
                         "loop_errors": 0, "loop_stalls": 0}
        secret = settings.hmac_secret
        #: with a shared secret, the key handshake messages are sealed under (`wire.seal_hello`)
        self._hello_key = (P.hello_key(secret.get_secret_value().encode())
                           if secret else None)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, P.frame_limit(settings.max_message_bytes))
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
        # same-host peers: control messages over a Unix socket (runtime.locallane)
        # a sealed message's body carries its seal or envelope beyond the limit (wire.frame_limit)
        self._lane = LocalLane(self.address,
                               max_message_bytes=P.frame_limit(settings.max_message_bytes),
                               counters=self.counters) \
            if settings.local_control_lane and available() else None
        self.outbox = ControlOutbox(ctx=self._ctx, lane=self._lane, frames=self._frames,
                                    known=self._known, counters=self.counters)
        self._collected = time.monotonic()  # when stranger sockets were last collected
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._read_at = time.monotonic()  # when the control sockets were last read
        self._lane_read_at = self._read_at  # when the lane's inbox was last found empty
        self._rejects_log = RateLog(log, logging.WARNING)
        self._errors_log = RateLog(log, logging.ERROR)
        self._stalls_log = RateLog(log, logging.WARNING)
        self._closing = False
        self._asleep = True  # the loop may be in (or about to enter) poll
        self._thread: threading.Thread | None = None
        self._exec: Executor | None = None  # made by start()

    def start(self, session: TransferSession, name: str, *, step: Stepper | None = None
              ) -> None:
        """Starts the thread that drives `session` (built with this loop's `address`): the
        events go to `step` (a test's seam in front of the session, `runtime.seam`) when given,
        else to the session itself."""
        self.session = session
        parts = Parts(clock=time.monotonic, transport=self.transport, outbox=self.outbox,
                      calls=self._calls, hashing=self._hashing, views=RoomViews(),
                      post=self.post, post_now=self._post_now, log=log_effect(log))
        tl = self._timelines
        self._exec = Executor(parts, session if step is None else step,
                              observe=None if tl is None else tl.observe,
                              settle=None if tl is None else tl.settle,  # a room's trace
                              on_error=self._step_failed,
                              # as long as the session's own silence rule (`_woke`)
                              stale_s=2 * self.settings.heartbeat_interval_s)
        # the Hello says where the buffers live; it decides the rooms' checksum algorithm
        kinds = {view_memory(v)[0] for v in self._buffers.values()}
        session.set_memory("cuda" if "cuda" in kinds else "host")
        self._thread = threading.Thread(target=self._run, name=f"kvh-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    @property
    def stepper(self) -> Stepper | None:
        """What the loop feeds events to: the session, or a test's seam in front of it."""
        return None if self._exec is None else self._exec.step

    def install(self, wrap: Callable[[Stepper], Stepper]) -> None:
        """Puts `wrap(stepper)` in front of what the loop drives now (a test's seam,
        `runtime.seam.Filtered`), on the control thread between two events."""
        def swap(_: TransferSession) -> None:
            assert self._exec is not None
            self._exec.step = wrap(self._exec.step)

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

    def _wake_if_asleep(self) -> None:
        if self._asleep:
            self._wake()

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
        self._calls.close()
        self.outbox.close()
        self._router.close(0)
        if self._lane is not None:
            self._lane.close()
        w, self._wake_w = self._wake_w, -1  # late posts (transport callbacks) write nothing
        os.close(w)
        os.close(self._wake_r)

    # ------------------------------------------------------------------ control thread

    def _post_now(self, event: ev.Event) -> None:
        """An event the executor made to be fed in this pass (a hashing job done inline)."""
        self._queue.append((event, None, None))

    def _frames(self, addr: str, msg: P.Message) -> list[bytes]:
        assert self.session is not None
        if (self._hello_key is not None and isinstance(msg, P.Hello | P.HelloReject)
                and not (isinstance(msg, P.HelloReject) and msg.reason == BAD_HMAC)):
            # a handshake message sealed over its bytes for `addr` (the refusal of one that
            # did not authenticate goes as it is: its sender may hold no key, or another)
            return P.seal_hello(msg, key=self._hello_key, recipient=addr, iv=os.urandom(12))
        return self.session.peers.frames(addr, msg)

    def _known(self, addr: str) -> bool:
        assert self.session is not None
        return self.session.peers.get(addr) is not None

    def _step_failed(self, event: ev.Event, now: float) -> None:
        """The session fails the room of a room's event itself (both sides told); this is an
        event of no room (a tick, a peer's message): counted and logged."""
        self.counters["loop_errors"] += 1
        self._errors_log.log(now, "agent: error handling %s", type(event).__name__,
                             exc_info=True)

    def _feed(self, event: ev.Event) -> None:
        assert self._exec is not None
        self._exec.feed(event)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        lane = self._lane
        if lane is not None:
            lane.attach(poller)
        hb = self.settings.heartbeat_interval_s
        faults, faults_at = _major_faults(), time.monotonic()
        while True:
            closing = self._closing
            self._asleep = True  # before _timeout_ms looks at the queue (see post)
            timeout_ms = self._timeout_ms(hb)
            t_poll = time.monotonic()
            if t_poll - faults_at > hb / 2:  # (a syscall: not on every pass)
                faults, faults_at = _major_faults(), t_poll
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            self._asleep = False
            t_woke = time.monotonic()
            try:
                self._pass(events, lane, hb)
                self._stalled(t_woke - t_poll - timeout_ms / 1e3 if not events else 0.0,
                              time.monotonic() - t_woke, hb, faults)
            except Exception as e:  # noqa: BLE001 - the thread serves every room: never dies
                self.counters["loop_errors"] += 1
                self._errors_log.log(time.monotonic(), "agent: error in the control loop: %r",
                                     e, exc_info=True)
            if closing and not self._queue and not self._ahead:
                break

    def _stalled(self, late: float, took: float, hb: float, faults: int) -> None:
        """Counts and logs a pass of this loop that came over a heartbeat late (`late`: after
        its poll's timeout; the process was not scheduled, or another thread held the GIL) or
        that ran over a heartbeat (`took`): two of them without a heartbeat sent and the
        peers give this agent's rooms up. `faults`: the process's major page faults at most
        half a heartbeat before the poll; the log says how many came since (its code's or
        files' pages read back from disk: memory pressure, or a host that pages out what sat
        unused)."""
        if late > hb or took > hb:
            self.counters["loop_stalls"] += 1
            faults = _major_faults() - faults
            self._stalls_log.log(time.monotonic(), "agent: control loop stalled: woke %.2fs after "
                                 "its poll's timeout, its pass took %.2fs (heartbeat %gs), %d "
                                 "major page faults in the process about then: the host's CPU is "
                                 "oversubscribed, another thread of this process held the GIL, "
                                 "or (page faults) its pages were read back from disk",
                                 max(late, 0.0), took, hb, faults)

    def _pass(self, events: dict[Any, int], lane: LocalLane | None, hb: float) -> None:
        """One pass of the loop (see the module doc), once `poll` returned `events`."""
        assert self._exec is not None
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._calls.next_calls()
        self._drain_ahead()
        self._drain_queue(time.monotonic() + hb / 4)
        # the control sockets are read now (polled, then read for up to a quarter heartbeat
        # whatever comes): a peer's silence is measured up to here, by time alone
        self._read_at = time.monotonic()
        if self._router in events:
            self._read(hb)
        read_at = self._read_at
        if lane is not None:
            if not lane.inbox:  # what the lane brought before now was all fed
                self._lane_read_at = read_at
            lane.service(events)
            if lane.inbox:
                self._read_lane(lane, hb)
            # the lane's inbox is this agent's own backlog (one queue for every same-host
            # peer, all of this uid): a peer's message may wait behind another's there
            read_at = min(read_at, self._lane_read_at)
        self._feed(ev.Tick(read_at=read_at))
        self._exec.end_pass()  # the writes of the whole pass, then its messages
        now = time.monotonic()
        if now - self._collected > hb:
            self._collected = now
            self.outbox.collect(now)

    def _drain_ahead(self) -> None:
        while self._ahead:
            self._feed(self._ahead.popleft())

    def _drain_queue(self, until: float) -> None:
        """Feeds queued events until the queue is empty or the clock passes `until` (a burst
        of engine calls must not hold back heartbeats: the rest waits for the next pass). A
        room's layers ready one after the other are fed as one `Batch` (`PassBatch`)."""
        assert self._exec is not None
        batch = self._exec.batch
        left = len(self._queue)
        for i in itertools.count():
            if left <= 0 or (i % 64 == 63 and time.monotonic() > until):
                return
            event, fn, fut = self._queue.popleft()
            left -= 1
            event, taken = batch.take_ready(event, self._queue, left)
            left -= taken
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
        back heartbeats and answers: after a quarter heartbeat, tick, then read on in the
        next pass. ZMQ's ROUTER reads its connections in turn, so however much one sender
        sends, every peer's next message is read within a few passes."""
        batch_end = time.monotonic() + hb / 4
        for _ in range(1000):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._message(frames[1:], batch_end)
            if time.monotonic() > batch_end:
                return

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
        refused: ev.HelloRefused | None = None
        try:
            # header, size and seal first; with a secret the seal is checked over the raw
            # bytes before anything is decoded (a stranger's frame costs a MAC or GCM pass at
            # most, never a decode)
            opened = P.open_frames(frames, max_bytes=self.settings.max_message_bytes)
            env, key = opened.hello, self._hello_key
            if env is not None:  # a sealed handshake message
                body = (None if key is None else
                        P.open_hello(opened, key=key, recipient=self.session.me.address))
                if body is None:
                    refused = ev.HelloRefused(opened.kind, opened.src, env.nonce, env.echo)
                else:
                    msg, seal = P.decode_body(body), None
                    if not P.envelope_matches(msg, env):
                        raise ProtocolError(f"{opened.kind}: its nonces differ from its "
                                            "envelope's")
            elif (key is not None and opened.seal is None
                  and opened.kind in P.UNSEALED_KINDS and opened.kind != "hello_reject"):
                # a Hello or HelloAck that came unsealed: refused undecoded (only a refusal
                # of ours, a small HelloReject, comes unsealed: `screen`)
                refused = ev.HelloRefused(opened.kind, opened.src)
            elif key is not None and not self.session.peers.screen(opened):
                return  # counted by the session (unauthenticated_messages)
            else:
                msg, seal = P.decode_body(opened.body), opened.seal
        except Exception as e:  # noqa: BLE001 - ProtocolError, or anything a decoder bug raises
            self.counters["rejected_messages"] += 1
            self._rejects_log.log(time.monotonic(), "rejected a control message: %s", e)
            return
        self._feed(refused if refused is not None else ev.MessageReceived(msg, seal))
        self._drain_ahead()
        if self._queue:  # completions and engine events between messages
            self._drain_queue(batch_end)

    def _timeout_ms(self, hb: float) -> int:
        assert self._exec is not None
        if (self.outbox.pending or self._queue or self._ahead or self._closing
                or self._calls.ended or self._exec.batch.pending
                or (self._lane is not None and self._lane.inbox)):
            return 0
        now = time.monotonic()
        when = self._exec.step.next_wakeup()
        return max(0, min(int((when - now) * 1e3) + 1, int(hb * 1e3)))


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


def _major_faults() -> int:
    """The process's major page faults so far (`ControlLoop._stalled`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt
