# In-process transport: the reference implementation and test double.
#
# How it works: every instance sits in a process-global registry keyed by its address. A send
# and a receive of the same (sender address, tag) meet in the *receiver's* tables; once both are
# posted the receiver's thread copies the bytes with numpy (piece by piece, the pieces cut at the
# union of both span lists' boundaries and the chunk grid), then completes both ops.
#
# Rules: one module lock (_LOCK) guards every table and every op state; the copy of each chunk
# happens under it after checking the job was not cancelled, so once cancel() returns nothing of
# that tag writes into memory. An op is finished exactly once (_Op.finish_locked under _LOCK);
# its callback runs on its owner's CallbackThread, outside the lock.
#
# Why it keeps its own op record instead of optable.OpTable (which tcp, ucx and shm share): an
# inproc op lives in two transports at once (its owner's table and, until matched, the peer's
# unmatched table), a job ends both halves (two transports' ops) together, and cancel of one
# side ends the other half, all under the one process-global lock; OpTable is one transport's
# table under that transport's own lock. And OpTable.post completes an empty span list at once,
# where inproc pairs it with the peer's op (a 0-byte send meeting a 10-byte receive fails both
# with a size mismatch): as the reference the conformance kit runs on, that must not change.
from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import cut_plan, pair_spans
from kvhandoff.transports.base import OnDone, Transport, TransportKind, TransportStatus
from kvhandoff.transports.callbacks import CallbackThread
from kvhandoff.transports.streams import check_buffer, check_tag, normalise_spans

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

_LOCK = threading.Lock()
_REGISTRY: dict[bytes, InprocTransport] = {}


class _Op:
    __slots__ = ("owner", "peer", "tag", "is_send", "buf", "off", "nb", "total", "on_done",
                 "finished", "home", "job")

    def __init__(self, owner: InprocTransport, peer: str, tag: int, is_send: bool,
                 buf: np.ndarray, off: np.ndarray, nb: np.ndarray, on_done: OnDone) -> None:
        self.owner = owner
        self.peer = peer
        self.tag = tag
        self.is_send = is_send
        self.buf = buf
        self.off = off
        self.nb = nb
        self.total = int(nb.sum()) if nb.size else 0
        self.on_done = on_done
        self.finished = False
        self.home: InprocTransport | None = None  # whose unmatched table holds it
        self.job: _Job | None = None

    def finish_locked(self, exc: BaseException | None) -> bool:
        """Marks the op finished (caller holds _LOCK); True if this call did it."""
        if self.finished:
            return False
        self.finished = True
        self.job = None
        owner = self.owner
        key = (self.peer, self.tag)
        ops = owner._ops.get(key)
        if ops is not None:
            if self in ops:
                ops.remove(self)
            if not ops:
                del owner._ops[key]
        if self.home is not None:
            table = self.home._unmatched_sends if self.is_send else self.home._unmatched_recvs
            for k, v in list(table.items()):
                if v is self:
                    del table[k]
            self.home = None
        return True

    def deliver(self, exc: BaseException | None) -> None:
        on_done = self.on_done
        self.owner._callbacks.submit(lambda: on_done(exc))

    def __repr__(self) -> str:
        kind = "send" if self.is_send else "recv"
        return f"<inproc {kind} peer={self.peer!r} tag={self.tag} bytes={self.total}>"


class _Job:
    __slots__ = ("send", "recv", "cancelled")

    def __init__(self, send: _Op, recv: _Op) -> None:
        self.send = send
        self.recv = recv
        self.cancelled = False


class InprocTransport(Transport):
    """Moves bytes between transports of one process with numpy copies."""

    kind: ClassVar[TransportKind] = TransportKind.INPROC

    def __init__(self, settings: Settings) -> None:
        self._chunk_bytes = int(settings.chunk_bytes)
        self._address = b"inproc:" + uuid.uuid4().hex.encode()
        self._buffers: dict[str, np.ndarray] = {}
        self._peers: dict[str, bytes] = {}
        self._ops: dict[tuple[str, int], list[_Op]] = {}
        # keyed by (sender address, tag); ops of the *other* side are stored here too
        self._unmatched_sends: dict[tuple[bytes, int], _Op] = {}
        self._unmatched_recvs: dict[tuple[bytes, int], _Op] = {}
        self._bytes_sent = 0
        self._bytes_received = 0
        self._closed = False
        self._callbacks = CallbackThread(f"kvhandoff-inproc-{self._address[7:15].decode()}")
        with _LOCK:
            _REGISTRY[self._address] = self

    @property
    def address(self) -> bytes:
        return self._address

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("inproc transport is closed")

    def register(self, name: str, buf: np.ndarray) -> None:
        self._check_open()
        arr = check_buffer(name, buf)
        with _LOCK:
            if name in self._buffers:
                raise TransportError(f"register: a buffer named {name!r} is already registered")
            self._buffers[name] = arr

    def connect(self, peer: str, address: bytes) -> None:
        self._check_open()
        if not isinstance(address, bytes) or not address.startswith(b"inproc:"):
            raise TransportError(f"connect {peer!r}: address {address!r} is not an inproc "
                                 "address; both agents must use the same transport")
        with _LOCK:
            known = self._peers.get(peer)
            if known is not None and known != address:
                raise TransportError(f"connect {peer!r}: already connected at another address; "
                                     "disconnect first")
            if address not in _REGISTRY:
                raise TransportError(f"connect {peer!r}: no inproc transport at {address!r} in "
                                     "this process")
            self._peers[peer] = address

    def _prepare(self, what: str, peer: str, tag: int, name: str, offsets: np.ndarray,
                 nbytes: np.ndarray, on_done: OnDone) -> tuple[bytes, _Op]:
        self._check_open()
        tag = check_tag(tag)
        if not callable(on_done):
            raise TransportError(f"{what}: on_done must be callable")
        buf = self._buffers.get(name)
        if buf is None:
            raise TransportError(f"{what}: no buffer registered as {name!r}")
        addr = self._peers.get(peer)
        if addr is None:
            raise TransportError(f"{what}: peer {peer!r} is not connected; call connect first")
        off, nb = normalise_spans(offsets, nbytes, buf.size, what=f"{what} {name!r}")
        return addr, _Op(self, peer, tag, what == "post_send", buf, off, nb, on_done)

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        addr, op = self._prepare("post_send", peer, tag, name, offsets, nbytes, on_done)
        with _LOCK:
            self._check_open()
            receiver = _REGISTRY.get(addr)
            if receiver is None:
                self._track(op)
                op.finish_locked(None)
                op.deliver(TransportError(f"post_send: peer {peer!r} is gone (closed)"))
                return
            key = (self._address, op.tag)
            if key in receiver._unmatched_sends:
                raise TransportError(f"post_send: tag {op.tag} to peer {peer!r} is already "
                                     "pending")
            self._track(op)
            recv = receiver._unmatched_recvs.pop(key, None)
            if recv is None:
                op.home = receiver
                receiver._unmatched_sends[key] = op
            else:
                recv.home = None
                receiver._start_locked(op, recv)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        addr, op = self._prepare("post_recv", peer, tag, name, offsets, nbytes, on_done)
        with _LOCK:
            self._check_open()
            key = (addr, op.tag)
            if key in self._unmatched_recvs:
                raise TransportError(f"post_recv: tag {op.tag} from peer {peer!r} is already "
                                     "pending")
            self._track(op)
            send = self._unmatched_sends.pop(key, None)
            if send is None:
                op.home = self
                self._unmatched_recvs[key] = op
            else:
                send.home = None
                self._start_locked(send, op)

    def _track(self, op: _Op) -> None:
        self._ops.setdefault((op.peer, op.tag), []).append(op)

    def _start_locked(self, send: _Op, recv: _Op) -> None:
        job = _Job(send, recv)
        send.job = recv.job = job
        self._callbacks.submit(lambda: self._run_job(job))

    def _run_job(self, job: _Job) -> None:
        send, recv = job.send, job.recv
        if send.total != recv.total:
            err = TransportError(f"size mismatch on tag {recv.tag}: sender has {send.total} bytes,"
                                 f" receiver expects {recv.total}")
            self._finish_pair(job, err, err)
            return
        plan, chunk = cut_plan(pair_spans(send.off, send.nb, recv.off, recv.nb),
                               self._chunk_bytes)
        so, do, lens = plan.src_offsets, plan.dst_offsets, plan.nbytes
        bounds = np.flatnonzero(np.diff(chunk)) + 1
        groups = np.split(np.arange(lens.size), bounds) if lens.size else []
        src, dst = send.buf, recv.buf
        for g in groups:
            with _LOCK:
                if job.cancelled:
                    return
                for s, d, n in zip(so[g].tolist(), do[g].tolist(), lens[g].tolist(),
                                   strict=True):
                    dst[d:d + n] = src[s:s + n]
        self._finish_pair(job, None, None)

    def _finish_pair(self, job: _Job, send_exc: BaseException | None,
                     recv_exc: BaseException | None) -> None:
        with _LOCK:
            if job.cancelled:
                return
            job.cancelled = True  # nothing more of this job may run
            send_fin = job.send.finish_locked(send_exc)
            recv_fin = job.recv.finish_locked(recv_exc)
            if send_exc is None and recv_exc is None:
                job.send.owner._bytes_sent += job.send.total
                job.recv.owner._bytes_received += job.recv.total
        if send_fin:
            job.send.deliver(send_exc)
        if recv_fin:
            job.recv.deliver(recv_exc)

    def _fail_locked(self, ops: list[_Op], exc_self: BaseException,
                     exc_peer: BaseException) -> list[tuple[_Op, BaseException]]:
        """Ends `ops` (this side) and the other halves of their started jobs."""
        out: list[tuple[_Op, BaseException]] = []
        for op in list(ops):
            job = op.job
            if op.finish_locked(exc_self):
                out.append((op, exc_self))
            if job is not None:
                job.cancelled = True
                other = job.recv if op.is_send else job.send
                if other.finish_locked(exc_peer):
                    out.append((other, exc_peer))
        return out

    def cancel(self, peer: str, tag: int) -> None:
        tag = check_tag(tag)
        with _LOCK:
            ops = self._ops.get((peer, tag), [])
            done = self._fail_locked(ops, TransportError(f"cancelled: tag {tag} peer {peer!r}"),
                                     TransportError(f"peer cancelled tag {tag}"))
        for op, exc in done:
            op.deliver(exc)

    def disconnect(self, peer: str) -> None:
        with _LOCK:
            ops = [op for (p, _), lst in self._ops.items() if p == peer for op in lst]
            done = self._fail_locked(ops, TransportError(f"disconnected from peer {peer!r}"),
                                     TransportError("peer disconnected"))
            self._peers.pop(peer, None)
        for op, exc in done:
            op.deliver(exc)

    def status(self) -> TransportStatus:
        return TransportStatus(kind=self.kind, lanes=("memcpy",), degraded=False,
                               reason="in-process memcpy", bytes_sent=self._bytes_sent,
                               bytes_received=self._bytes_received)

    def close(self) -> None:
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            _REGISTRY.pop(self._address, None)
            ops = [op for lst in self._ops.values() for op in lst]
            # the other side's ops waiting in this transport's tables
            ops_peer = [*self._unmatched_sends.values(), *self._unmatched_recvs.values()]
            err = TransportError("inproc transport closed")
            done = self._fail_locked(ops, err, TransportError("peer transport closed"))
            for op in ops_peer:
                if op.finish_locked(None):
                    done.append((op, TransportError("peer transport closed")))
        for op, exc in done:
            op.deliver(exc)
        self._callbacks.stop()

    def __repr__(self) -> str:
        return f"<InprocTransport {self._address.decode()} peers={len(self._peers)}>"
