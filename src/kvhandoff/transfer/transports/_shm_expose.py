# The writer side of the shm transport's two-sided path (shm.py has the design): receivers'
# b"R" (a receive exposed to us: where to write) and b"X" (stop writing that tag) on the ROUTER,
# and the start of a copy once a send and its receive's R are both here. Mixed into
# ShmTransport; runs on its I/O thread only.
from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from kvhandoff.errors import TransportError

from ._shm_copy import Job, Target, open_target
from ._shm_wire import EXPOSE, FINAL, TAGMSG, ShmOp, ShmPeer, parse_descriptor

if TYPE_CHECKING:
    import threading

log = logging.getLogger("kvhandoff.transfer.transports.shm")


class ExposedWrites:
    """_drain_router / _try_start of ShmTransport."""

    if TYPE_CHECKING:  # provided by ShmTransport
        _lock: threading.Lock
        _router: zmq.Socket[bytes]
        _peer_info: dict[str, ShmPeer]
        _lanes: dict[str, set[str]]
        _allow_map: bool
        _sends: dict[tuple[bytes, int], ShmOp]
        _exposed: dict[tuple[bytes, int], tuple[bytes, np.ndarray, np.ndarray]]
        _exposed_seq: dict[tuple[bytes, int], int]
        _seq: itertools.count[int]
        _jobs: dict[tuple[bytes, int], Job]
        _ack_after: set[tuple[bytes, int]]

        def _finish(self, op: Any, reason: str | None) -> bool: ...
        def _start_job(self, op: ShmOp, target: Target, doff: np.ndarray, dnb: np.ndarray,
                       checksum: bool, key: tuple[bytes, int] | None) -> None: ...

    def _drain_router(self) -> None:
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

    def _try_start(self, key: tuple[bytes, int]) -> None:
        op = self._sends.get(key)
        exposed = self._exposed.get(key)
        if op is None or exposed is None:
            return
        del self._sends[key]
        del self._exposed[key]
        self._exposed_seq.pop(key, None)
        desc, doff, dnb = exposed
        total = int(dnb.sum()) if dnb.size else 0
        if total != op.plan.total:
            reason = (f"size mismatch on tag {op.tag}: sender has {op.plan.total} bytes, "
                      f"receiver expects {total}")
            self._router.send_multipart([key[0], FINAL.pack(b"F", key[1], 0), reason.encode()])
            self._finish(op, reason)
            return
        with self._lock:
            info = self._peer_info.get(op.peer)
        try:
            if info is None:
                raise TransportError(f"peer {op.peer!r} is not connected")
            target = info.targets.get(desc)
            if target is None:
                pid, fd, seg_n, off, addr, n = parse_descriptor(desc)
                if pid != info.pid:
                    raise TransportError(f"the receive's buffer is of process {pid}, peer "
                                         f"{op.peer!r} is process {info.pid}")
                target = info.targets[desc] = open_target(pid, fd, seg_n, off, addr, n,
                                                          self._allow_map, info.maps)
                with self._lock:
                    self._lanes.setdefault(op.peer, set()).add(target.lane)
            if (doff + dnb > target.nbytes).any():
                raise TransportError("the receive's spans exceed its buffer")
        except TransportError as e:
            self._router.send_multipart([key[0], FINAL.pack(b"F", key[1], 0), str(e).encode()])
            self._finish(op, str(e))
            return
        self._start_job(op, target, doff, dnb, False, key)
