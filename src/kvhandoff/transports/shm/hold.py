# Held completions of the shm transport (transport.py's module comment has the contract).
#
# How it works: the outcome of an ended op is recorded at once; its on_done goes to the callback
# thread only once nothing of it writes into memory any more. A receive whose writer may still
# write is held (by writer ident and tag) until the writer's b"F" / b"A", its exit, or the bound;
# a disconnected peer's socket and pidfd are kept open (a "drain") while receives of it are held,
# so its confirmation or exit still arrives.
#
# Rules: `HeldReceives` owns the held receives and the drains. It shares the transport's lock
# (given at construction), because that lock guards the completion fields of every op
# (`finished`, `result`, `delivered`, `exposed`, `acked`); the held table is guarded by it too.
# The drains belong to the I/O thread. Callbacks go through `submit` (the transport's callback
# thread), or run on the copy thread that ended a one-sided write (`here`), never under the
# lock.
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from kvhandoff.transports.base import OnDone
from kvhandoff.transports.shm.wire import ShmOp, ShmPeer

log = logging.getLogger("kvhandoff.transports.shm.transport")


class HeldReceives:
    """The completions the shm transport holds back (see module comment)."""

    __slots__ = ("_lock", "_submit", "_bound_s", "_wake", "_awaiting", "_drains")

    def __init__(self, *, lock: threading.Lock, submit: Callable[[Callable[[], None]], None],
                 bound_s: float, wake: Callable[[], None]) -> None:
        self._lock = lock
        self._submit = submit
        self._bound_s = bound_s
        self._wake = wake  # tells the I/O thread to re-read the time bound
        # receives that ended while their writer may still write into them
        self._awaiting: dict[tuple[bytes, int], ShmOp] = {}
        # (I/O thread) disconnected peers whose socket and pidfd stay open while held
        self._drains: list[tuple[ShmPeer, zmq.Socket[bytes]]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._awaiting)

    def deliver(self, done: list[tuple[ShmOp, BaseException | None]], *,
                here: bool = False) -> None:
        """Records each op's outcome; hands on_done to the callback thread now if nothing of
        the op writes into memory any more, else holds it. `here`: the ready ones run on the
        caller's thread (a copy thread that ended a write; never a caller of post_* or
        cancel, which may hold locks)."""
        ready: list[ShmOp] = []
        held = False
        reused: list[ShmOp] = []
        with self._lock:
            for op, exc in done:
                op.result = exc
                if _ready_locked(op):
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
                if _ready_locked(old):
                    ready.append(old)
        if reused:
            log.warning("shm: tag(s) %s reused while an ended receive of it was held; the "
                        "older one is released unconfirmed", [op.tag for op in reused])
        self._hand_on(ready, here)
        if held:
            self._wake()

    def settle(self, ops: list[ShmOp], *, here: bool = False) -> None:
        """Hands on the on_done of those of `ops` that finished and may go now (`here`: as
        in `deliver`)."""
        with self._lock:
            ready = [op for op in ops if _ready_locked(op)]
        self._hand_on(ready, here)

    def release_one(self, ident: bytes, tag: int) -> bool:
        """The writer `ident` confirmed it is done with `tag`: the receive of it held, if any,
        is released; whether there was one."""
        with self._lock:
            op = self._awaiting.pop((ident, tag), None)
            if op is not None:
                op.acked = True
        if op is not None:
            self.settle([op])
        return op is not None

    def release(self, keep: Callable[[ShmOp], bool], why: str | None) -> None:
        """Stops holding the receives `keep` selects (their writer is gone, or the bound
        passed: `why` then says so in a warning) and hands on their on_done."""
        with self._lock:
            ops = [op for op in self._awaiting.values() if keep(op)]
            for op in ops:
                del self._awaiting[(op.ident, op.tag)]
                op.acked = True
        if ops and why is not None:
            log.warning("shm: %d ended receive(s) released although their writer did not "
                        "confirm it stopped writing into them (%s): %s", len(ops), why,
                        ", ".join(repr(op) for op in ops[:8]))
        self.settle(ops)

    def release_due(self) -> None:
        """Releases the held receives whose bound passed."""
        now = time.monotonic()
        self.release(lambda op: op.hold_until <= now,
                     f"no confirmation within stall_timeout_s={self._bound_s} s")

    def timeout_ms(self) -> int | None:
        """How long the I/O thread may sleep before a held receive's bound passes."""
        with self._lock:
            if not self._awaiting:
                return None
            first = min(op.hold_until for op in self._awaiting.values())
        return max(0, int((first - time.monotonic()) * 1000) + 1)

    # ---- drains (I/O thread) --------------------------------------------------------------

    @property
    def drains(self) -> list[tuple[ShmPeer, zmq.Socket[bytes]]]:
        return self._drains

    def drain(self, info: ShmPeer, sock: zmq.Socket[bytes]) -> None:
        """Keeps a disconnected peer's socket (and pidfd) open while receives of it are held."""
        self._drains.append((info, sock))

    def end_drains(self, poller: zmq.Poller | None, pidfds: dict[int, ShmPeer],
                   closing: bool) -> None:
        """Closes the socket and pidfd of disconnected peers none of whose receives is held
        any more (all of them when `closing`)."""
        if not self._drains:
            return
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

    def _hand_on(self, ops: list[ShmOp], here: bool = False) -> None:
        for op in ops:
            if not here:
                self._submit(_call(op.on_done, op.result))
                continue
            try:
                op.on_done(op.result)
            except Exception:  # a caller's callback must not kill the copy thread
                log.exception("transport callback raised")


def _ready_locked(op: ShmOp) -> bool:
    """(the transport's lock held) Whether finished `op`'s on_done may go now; marks it
    delivered if so."""
    if op.delivered or not op.finished:
        return False
    if op.job is not None and not op.job.ended_event.is_set():
        return False
    if not op.is_send and op.exposed and not op.acked:
        if op.info is None or op.info.dead is None:
            return False
    op.delivered = True
    return True


def _call(fn: OnDone, exc: BaseException | None) -> Callable[[], None]:
    return lambda: fn(exc)
