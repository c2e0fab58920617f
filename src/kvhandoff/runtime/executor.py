"""`Executor`: carries out a `TransferSession`'s effects. One code for production and for the
simulator: it is handed its parts, and production and the simulator hand it different ones.

The parts (`Parts`):
- `clock`: the time each event is fed at (production: `time.monotonic`; the simulator's clock);
- `transport`: the data plane (`transports.base.Transport`; the simulator's `SimTransport`);
- `outbox`: where control messages go (`Outbox`: production's ZMQ / same-host lane sockets,
  `runtime.outbox`; the simulator's channels);
- `calls`: the peer-call workers (`PeerCalls`): a transport call that may wait on its peer
  (connect, register_remote, cancel, disconnect) runs there, each peer's calls in order, and
  its outcome comes back as events (production: a thread pool, `runtime.calls`; the simulator:
  calls its seed runs, or holds while a cancel waits for a copy to stop);
- `hashing`: the checksums (`runtime.hashing.Hasher`, itself handed a worker pool: a thread
  pool, or the simulator's queue of jobs it runs when its seed says);
- `views`: the engine's view of each room (`Views`: `runtime.handles.RoomView` in production);
- `post`: hands an event back to whoever feeds this executor (any thread: a completion);
  `post_now`: an event fed later in the same pass (a small hashing job hashed inline);
- `log`: what a `Log` effect becomes.

What the executor itself holds is what both worlds must share: the `PassBatch` of the pass
(one-sided writes held until the pass ends, flushed before a cancel or a dropped peer so that
the cancel finds them posted), the order of effects, and the outcome of each peer call turned
into the event the session expects. A driver calls `feed` for each event and `end_pass` once
per pass (the writes of the pass, then its messages).

Rules: the control thread (or the simulator's one step) only; `post` is the one way back in.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvhandoff.errors import KVHandoffError, TransportError
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
from kvhandoff.runtime.batching import PassBatch
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.runtime.seam import Stepper
from kvhandoff.transports.base import OneSidedTransport, Transport

#: A peer call: runs on a peer-call worker, returns the events that say how it went.
Call = Callable[[], list[ev.Event]]


class Outbox(Protocol):
    """Where the session's control messages go."""

    def send(self, addr: str, msg: P.Message) -> None:
        """Queues `msg` for `addr` (it leaves at `flush`)."""

    def forget(self, peer: str) -> None:
        """`peer` was dropped: its connection closes once what is queued for it left."""

    def flush(self) -> None:
        """Sends what is queued, in order."""


class PeerCalls(Protocol):
    """Where transport calls that may wait on a peer run: each peer's one at a time, in the
    order asked; each call's events are posted once it returned."""

    def run(self, peer: str, call: Call) -> None: ...


class Views(Protocol):
    """The engine's view of its rooms."""

    def update(self, eff: RoomUpdate) -> None: ...

    def release(self, eff: Release) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What an `Executor` is handed (see the module doc)."""

    clock: Callable[[], float]
    transport: Transport
    outbox: Outbox
    calls: PeerCalls
    hashing: Hasher
    views: Views
    post: Callable[[ev.Event], None]
    post_now: Callable[[ev.Event], None]
    log: Callable[[Log], None]


class Executor:
    """Feeds events to a `Stepper` and carries out the effects it returns (module doc).
    `on_error`: an error of the stepper goes there (production: counted and logged, the
    control thread serves every room) instead of being raised (the simulator); `observe` sees
    every event with its effects, `settle` runs after them (production's room timelines);
    `stale_s`: a pass's writes held longer are never posted (`PassBatch`)."""

    def __init__(self, parts: Parts, step: Stepper, *,
                 observe: Callable[[ev.Event, list[Effect]], list[Effect]] | None = None,
                 settle: Callable[[], None] | None = None,
                 on_error: Callable[[ev.Event, float], None] | None = None,
                 stale_s: float = float("inf")) -> None:
        self.parts = parts
        self.step = step
        self._observe = observe  # a driver's observer of every event and its effects
        self._settle = settle
        self._on_error = on_error
        self.batch = PassBatch(transport=parts.transport, hashing=parts.hashing,
                               post=parts.post, clock=parts.clock, stale_s=stale_s)

    # ------------------------------------------------------------------ the driver's calls

    def feed(self, event: ev.Event) -> None:
        """Feeds `event` at the clock's time and executes its effects, in order."""
        now = self.parts.clock()
        try:
            effects = self.step.handle(event, now)
        except Exception:
            if self._on_error is None:
                raise
            self._on_error(event, now)
            return
        if self._observe is not None:
            effects = self._observe(event, effects)
        for eff in effects:
            self.execute(eff)
        if self._settle is not None:
            self._settle()

    def end_pass(self) -> None:
        """The pass ends: its held writes leave, then its messages."""
        self.batch.flush()
        self.parts.outbox.flush()

    # ------------------------------------------------------------------ effects

    def execute(self, eff: Effect) -> None:
        p = self.parts
        if isinstance(eff, Send):
            p.outbox.send(eff.addr, eff.msg)
        elif isinstance(eff, PostWrite):
            self.batch.hold(eff)  # with the room's others of this pass
        elif isinstance(eff, PostSend | PostRecv):
            done = functools.partial(self._op_done, eff.op)
            tr = p.transport
            post = tr.post_send if isinstance(eff, PostSend) else tr.post_recv
            try:
                post(eff.peer, eff.tag, eff.buffer, eff.offsets, eff.nbytes, done)
            except KVHandoffError as e:
                p.post(ev.OpDone(eff.op, str(e)))
        elif isinstance(eff, RoomUpdate):
            p.views.update(eff)
        elif isinstance(eff, Release):
            p.views.release(eff)
        elif isinstance(eff, HashSpans):
            if p.hashing.inline(eff):
                p.post_now(p.hashing.hashed(eff))  # fed in this pass
            else:
                p.hashing.submit(eff)
        elif isinstance(eff, Cancel):
            self.batch.flush()  # the cancel finds the writes it cancels posted
            p.calls.run(eff.peer, functools.partial(self._cancel, eff))
        elif isinstance(eff, DropPeer):
            self.batch.flush()
            p.calls.run(eff.peer, functools.partial(self._drop, eff))
            p.outbox.forget(eff.peer)
        elif isinstance(eff, Connect):
            p.calls.run(eff.peer, functools.partial(self._connect, eff))
        elif isinstance(eff, RegisterRemote):
            p.calls.run(eff.peer, functools.partial(self._register_remote, eff))
        elif isinstance(eff, Log):
            p.log(eff)
        else:
            raise TypeError(f"unknown effect {eff!r}")

    def _op_done(self, op: int, exc: BaseException | None) -> None:
        """(transport thread) A posted send or receive completed."""
        self.parts.post(ev.OpDone(op, None if exc is None else str(exc)))

    # ------------------------------------------------------------------ peer calls
    # (peer-call worker) each may wait on its peer up to the transport's bound

    def _connect(self, eff: Connect) -> list[ev.Event]:
        def connect() -> None:
            tr = self.parts.transport
            tr.bind_session(eff.peer, eff.key)  # the data plane's session too
            tr.connect(eff.peer, eff.address)

        return [ev.Connected(eff.peer, outcome(connect), eff.gen)]

    def _register_remote(self, eff: RegisterRemote) -> list[ev.Event]:
        """A refusal: the session sends to that peer two-sided."""
        def register() -> None:
            tr = self.parts.transport
            if not isinstance(tr, OneSidedTransport) or not tr.can_write(eff.peer):
                raise TransportError(f"register_remote: the {tr.kind} transport's lane to peer "
                                     f"{eff.peer!r} has no one-sided writes (can_write)")
            for name, descriptor in eff.descriptors:
                tr.register_remote(eff.peer, name, descriptor)

        return [ev.RemoteRegistered(eff.peer, outcome(register))]

    def _cancel(self, eff: Cancel) -> list[ev.Event]:
        """shm waits here (bounded) for a local copy to stop; a failure keeps the room's
        pages held (the session counts and logs it)."""
        error = outcome(lambda: self.parts.transport.cancel(eff.peer, eff.tag))
        return [ev.Cancelled(eff.peer, eff.tag, error)]

    def _drop(self, eff: DropPeer) -> list[ev.Event]:
        """A failed disconnect is answered like a failed cancel."""
        out: list[ev.Event] = []

        def drop() -> None:
            tr = self.parts.transport
            if tr.peer_exited(eff.peer):
                out.append(ev.PeerExited(eff.peer, eff.gen))
            tr.disconnect(eff.peer)

        error = outcome(drop)
        return [*out, ev.Cancelled(eff.peer, None, error)]


def outcome(call: Callable[[], None]) -> str | None:
    """Runs a transport call for the session: None, or why it failed (any exception: the
    session must hear of it, never the worker's log alone)."""
    try:
        call()
    except KVHandoffError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported to the session as the call's outcome
        return repr(e)
    return None


def log_effect(logger: logging.Logger) -> Callable[[Log], None]:
    """The production `log` part: a `Log` effect to `logger`."""
    def log(eff: Log) -> None:
        logger.log(eff.level, "%s", eff.message, exc_info=eff.exc)
    return log
