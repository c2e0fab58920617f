# The writer side of the shm transport's two-sided path (transport.py has the design).
#
# How it works: a receiver exposes a posted receive with b"R" (tag, total, its buffer's
# descriptor, its span list) on our ROUTER; once a local send of the same (receiver, tag) is
# here too, the copy starts (the transport's `start_job`). b"X" asks us to stop writing a tag:
# answered with b"A" at once when no copy of it runs, else once that copy ended. Each copy's end
# is answered with b"F" (ok / reason), which completes the receive on the other side.
#
# Rules: `ExposedWriter` owns every table of this path (sends waiting for their R, exposed
# receives waiting for their send, copies running, stop requests that came during a copy) and
# runs on the transport's I/O thread only; the one exception is `cut()`, a counter any thread
# may read (disconnect() drops only what arrived before it). It does not open targets or start
# copies itself: `resolve` and `start_job` are the transport's.
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
import zmq

from kvhandoff.errors import TransportError
from kvhandoff.transports.shm.copy import CopyJob, Target
from kvhandoff.transports.shm.wire import EXPOSE, FINAL, TAGMSG, ShmOp, ShmPeer

log = logging.getLogger("kvhandoff.transports.shm.transport")

Key = tuple[bytes, int]  # (receiver ident, tag)


class ExposedWriter:
    """The two-sided writer's tables and its ROUTER messages (see module comment)."""

    __slots__ = ("_router", "_finish", "_resolve", "_start_job", "_sends", "_exposed", "_seq",
                 "_exposed_seq", "_jobs", "_ack_after")

    def __init__(self, *, router: zmq.Socket[bytes],
                 finish: Callable[[ShmOp, str | None], object],
                 resolve: Callable[[ShmOp, bytes], Target],
                 start_job: Callable[[ShmOp, Target, np.ndarray, np.ndarray, Key], None]
                 ) -> None:
        self._router = router
        self._finish = finish
        self._resolve = resolve  # the receive's descriptor -> an opened Target (or raises)
        self._start_job = start_job
        self._sends: dict[Key, ShmOp] = {}  # sends waiting for their receive's R
        self._exposed: dict[Key, tuple[bytes, np.ndarray, np.ndarray]] = {}  # R, no send yet
        # when each exposed receive arrived (a count shared with disconnect(), as in tcp.py)
        self._seq = itertools.count()
        self._exposed_seq: dict[Key, int] = {}
        self._jobs: dict[Key, CopyJob] = {}  # copies running
        self._ack_after: set[Key] = set()  # X arrived while copying

    def cut(self) -> int:
        """(any thread) A point in the order of arrivals: what arrived before it is older."""
        return next(self._seq)

    def add_send(self, op: ShmOp) -> None:
        """A local send: starts its copy if its receive was exposed already."""
        key = (op.ident, op.tag)
        self._sends[key] = op
        self._try_start(key)

    def forget_send(self, op: ShmOp) -> None:
        """A send that ended before its copy started."""
        if self._sends.get((op.ident, op.tag)) is op:
            del self._sends[(op.ident, op.tag)]

    def drop_peer(self, info: ShmPeer, cut: int) -> None:
        """`info` was disconnected at `cut`: its sends are forgotten, and its receives exposed
        before `cut` are confirmed as never written (b"A")."""
        for key in [k for k in self._exposed
                    if k[0] == info.ident and self._exposed_seq.get(k, -1) < cut]:
            del self._exposed[key]
            self._exposed_seq.pop(key, None)
            self._router.send_multipart([info.ident, TAGMSG.pack(b"A", key[1])])
        for key in [k for k, op in self._sends.items() if op.peer == info.name]:
            del self._sends[key]

    def started(self, key: Key, job: CopyJob) -> None:
        self._jobs[key] = job

    def refuse(self, key: Key, reason: str) -> None:
        """The receive of `key` gets nothing: b"F" not ok, with `reason`."""
        self._router.send_multipart([key[0], FINAL.pack(b"F", key[1], 0), reason.encode()])

    def ended(self, key: Key, job: CopyJob) -> None:
        """The copy of `key` ended: b"F" (and b"A" when a stop was asked meanwhile)."""
        self._jobs.pop(key, None)
        ok = job.error is None and not job.cancelled
        reason = b"" if ok else (job.error or "sender cancelled").encode()
        self._router.send_multipart([key[0], FINAL.pack(b"F", key[1], int(ok)), reason])
        if key in self._ack_after:
            self._ack_after.discard(key)
            self._router.send_multipart([key[0], TAGMSG.pack(b"A", key[1])])

    def confirm_all(self) -> None:
        """Closing: nothing writes the receives we were allowed to write any more."""
        for ident, tag in [*self._exposed, *self._jobs]:
            self._router.send_multipart([ident, TAGMSG.pack(b"A", tag)])

    def drain_router(self) -> None:
        """Messages of receivers (to us as writer): R (expose), X (stop writing)."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, head = frames[0], frames[1] if len(frames) > 1 else b""
            if head[:1] == b"R" and len(head) == EXPOSE.size and len(frames) == 5:
                _, tag, total = EXPOSE.unpack(head)
                off = np.frombuffer(frames[3], dtype="<i8").astype(np.int64)
                nb = np.frombuffer(frames[4], dtype="<i8").astype(np.int64)
                if off.size != nb.size or int(nb.sum()) != total:
                    log.warning("shm: dropping a malformed expose message")
                    continue
                self._exposed[(ident, tag)] = (frames[2], off, nb)
                self._exposed_seq[(ident, tag)] = next(self._seq)
                self._try_start((ident, tag))
            elif head[:1] == b"X" and len(head) == TAGMSG.size:
                _, tag = TAGMSG.unpack(head)
                key = (ident, tag)
                self._exposed.pop(key, None)
                self._exposed_seq.pop(key, None)
                job = self._jobs.get(key)
                if job is None:
                    self._router.send_multipart([ident, TAGMSG.pack(b"A", tag)])
                else:
                    job.cancel()
                    self._ack_after.add(key)
            else:
                log.warning("shm: dropping a malformed control message")

    def _try_start(self, key: Key) -> None:
        op = self._sends.get(key)
        exposed = self._exposed.get(key)
        if op is None or exposed is None:
            return
        del self._sends[key]
        del self._exposed[key]
        self._exposed_seq.pop(key, None)
        desc, doff, dnb = exposed
        total = int(dnb.sum()) if dnb.size else 0
        if total != op.total:
            reason = (f"size mismatch on tag {op.tag}: sender has {op.total} bytes, "
                      f"receiver expects {total}")
            self.refuse(key, reason)
            self._finish(op, reason)
            return
        try:
            target = self._resolve(op, desc)
            if (doff + dnb > target.nbytes).any():
                raise TransportError("the receive's spans exceed its buffer")
        except TransportError as e:
            self.refuse(key, str(e))
            self._finish(op, str(e))
            return
        self._start_job(op, target, doff, dnb, key)
