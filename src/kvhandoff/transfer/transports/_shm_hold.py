# Held completions of the shm transport (shm.py's module comment has the contract): the outcome
# of an ended op is recorded at once, its on_done goes to the callback thread only once nothing
# of it writes into memory any more. Receives waiting for their writer are held in `_awaiting`
# (by writer ident and tag) until its b"F" / b"A", its exit, or the bound; a disconnected
# peer's socket and pidfd are kept open (a "drain") while receives of it are held. Mixed into
# ShmTransport; everything here runs under its `_lock` rules.
from __future__ import annotations

import functools
import logging
import operator
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ._shm_wire import FINAL, TAGMSG, ShmOp, ShmPeer
from ._threaded import IoCommand

if TYPE_CHECKING:
    import threading

    from .base import OnDone

log = logging.getLogger("kvhandoff.transfer.transports.shm")


class HeldCompletions:
    """_deliver / _settle / _release and the drains of ShmTransport."""

    if TYPE_CHECKING:  # provided by ShmTransport / ThreadedTransport
        _lock: threading.Lock
        _ops: dict[tuple[str, int, bool], Any]
        _callbacks: Any
        _bound_s: float
        _bytes_received: int
        _awaiting: dict[tuple[bytes, int], ShmOp]
        _drains: list[tuple[ShmPeer, zmq.Socket[bytes]]]

        def _command(self, cmd: IoCommand, *args: Any) -> None: ...
        def _finish(self, op: Any, reason: str | None) -> bool: ...

    def _deliver(self, done: list[tuple[ShmOp, BaseException | None]]) -> None:
        """Records each op's outcome; hands on_done to the callback thread now if nothing of
        the op writes into memory any more, else holds it (see the module comment)."""
        ready: list[ShmOp] = []
        held = False
        reused: list[ShmOp] = []
        with self._lock:
            for op, exc in done:
                op.result = exc
                if self._ready_locked(op):
                    ready.append(op)
                elif not op.is_send and op.exposed and not op.acked:
                    op.hold_until = time.monotonic() + self._bound_s
                    old = self._awaiting.get((op.ident, op.tag))
                    if old is not None:  # a tag reused while held: the writer's answers
                        reused.append(old)  # cannot tell them apart (warned below)
                    self._awaiting[(op.ident, op.tag)] = op
                    held = True
            for old in reused:
                old.acked = True
                if self._ready_locked(old):
                    ready.append(old)
        if reused:
            log.warning("shm: tag(s) %s reused while an ended receive of it was held; the "
                        "older one is released unconfirmed", [op.tag for op in reused])
        for op in ready:
            self._callbacks.submit(_call(op.on_done, op.result))
        if held:
            self._command(IoCommand.HOLD)

    def _ready_locked(self, op: ShmOp) -> bool:
        """(lock held) Whether finished `op`'s on_done may go now; marks it delivered if so."""
        if op.delivered or not op.finished:
            return False
        if op.job is not None and not op.job.ended_event.is_set():
            return False
        if not op.is_send and op.exposed and not op.acked:
            if op.info is None or op.info.dead is None:
                return False
        op.delivered = True
        return True

    def _settle(self, ops: list[ShmOp]) -> None:
        """Hands on the on_done of those of `ops` that finished and may go now."""
        with self._lock:
            ready = [op for op in ops if self._ready_locked(op)]
        for op in ready:
            self._callbacks.submit(_call(op.on_done, op.result))

    def _release(self, keep: Callable[[ShmOp], bool], why: str | None) -> None:
        """Stops holding the receives `keep` selects (their writer confirmed, is gone, or the
        bound passed: `why` then says so in a warning) and hands on their on_done."""
        with self._lock:
            ops = [op for op in self._awaiting.values() if keep(op)]
            for op in ops:
                del self._awaiting[(op.ident, op.tag)]
                op.acked = True
        if ops and why is not None:
            log.warning("shm: %d ended receive(s) released although their writer did not "
                        "confirm it stopped writing into them (%s): %s", len(ops), why,
                        ", ".join(repr(op) for op in ops[:8]))
        self._settle(ops)

    def _hold_timeout_ms(self) -> int | None:
        """How long the I/O thread may sleep before a held receive's bound passes."""
        with self._lock:
            if not self._awaiting:
                return None
            first = min(op.hold_until for op in self._awaiting.values())
        return max(0, int((first - time.monotonic()) * 1000) + 1)

    def _end_drains(self, poller: zmq.Poller | None, pidfds: dict[int, ShmPeer],
                    closing: bool) -> None:
        """Closes the socket and pidfd of disconnected peers none of whose receives is held
        any more (all of them when `closing`)."""
        with self._lock:
            held = {op.ident for op in self._awaiting.values()}
        still = []
        for info, sock in self._drains:
            if not closing and info.ident in held:
                still.append((info, sock))
                continue
            if poller is not None:
                poller.unregister(sock)
            sock.close(linger=0)
            if pidfds.pop(info.pidfd, None) is not None and poller is not None:
                poller.unregister(info.pidfd)
            try:
                os.close(info.pidfd)
            except OSError:
                pass
        self._drains = still

    def _drain_dealer(self, info: ShmPeer, sock: zmq.Socket[bytes], live: bool) -> None:
        """Messages of writers (to us as receiver): F (landed / failed), A (stopped). A
        socket kept after disconnect (not `live`) only releases held receives."""
        peer = info.name
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            head = frames[0]
            if head[:1] in (b"F", b"A") and len(head) in (FINAL.size, TAGMSG.size):
                tag = (FINAL.unpack(head)[1] if head[:1] == b"F" and len(head) == FINAL.size
                       else TAGMSG.unpack(head)[1] if len(head) == TAGMSG.size else None)
                if tag is None:
                    log.warning("shm: dropping a malformed frame from peer %r", peer)
                    continue
                # the writer is done with that tag either way: a held receive of it (one that
                # ended before) is released first; the F is then not for a live receive
                with self._lock:
                    held = self._awaiting.get((info.ident, tag))
                if held is not None:
                    self._release(functools.partial(operator.is_, held), None)
                    continue
                if head[:1] != b"F" or not live:
                    continue
                ok = FINAL.unpack(head)[2]
                with self._lock:
                    op = self._ops.get((peer, tag, False))
                    if op is not None:
                        op.acked = True
                        if ok:
                            self._bytes_received += op.plan.total
                if op is not None:
                    reason = None if ok else (frames[1].decode("utf-8", "replace")
                                              if len(frames) > 1 and frames[1] else
                                              "writer failed")
                    self._finish(op, reason)
            else:
                log.warning("shm: dropping a malformed frame from peer %r", peer)


def due(now: float, op: ShmOp) -> bool:
    return op.hold_until <= now


def _call(fn: OnDone, exc: BaseException | None) -> Callable[[], None]:
    return lambda: fn(exc)
