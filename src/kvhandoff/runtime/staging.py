"""Host staging: device KV pages moved by a transport that cannot reach device memory (tcp,
ucx, nixl on a host without GPUDirect RDMA), through pinned host buffers.

`staging_choice` decides at the agent's start (settings ``host_staging``: auto, on, off);
`StagedTransport` is the one owner of the staging: it wraps the agent's transport, keeps the
agent's device buffers to itself and gives the transport only host memory
(`buffers.staging.StagingPool`). It is two-sided (not a `OneSidedTransport`), so the session
moves every layer by sends and receives:

- prefill, `post_send` of a layer's span list of a device buffer: a lease of the staging
  arena is taken; the staging thread copies the device spans into it, in order, then posts
  the send of the lease on the wrapped transport; the lease is returned when the send
  completed.
- decode, `post_recv`: a lease is taken and its receive posted on the wrapped transport.
  Once the bytes landed in the lease, the staging thread copies them into the device spans,
  and only then does the receive complete (so the session hashes, with devsum, the bytes in
  the DEVICE pages before it reports the layer landed).
- Memory: an op that does not fit in the free part of the arena waits, in order (oldest
  first, none overtakes), and the staging thread starts it once earlier ones returned their
  memory (`staging_waits` counts them): a room larger than the arena passes through it
  layer by layer (the decode posts a room's every layer at once; the prefill marks layers
  faster than they move). An op larger than the whole arena is refused at once, naming
  host_staging_mib. Both sides waiting can stall: a prefill whose arena is full of one
  room's sends while the decode's is full of another room's receives (rooms ready in one
  order on the prefill, accepted in another on the decode); the session's stall_timeout_s
  then fails a room, whose cancels free its memory, and the others go on.

`cancel` ends an op whichever step it is at: before its send was posted it completes with the
cancel; a posted one is cancelled on the wrapped transport; a receive whose bytes landed and
whose copy is pending completes with the cancel once no copy of it runs (the contract: an op's
completion comes once nothing of it writes into memory any more).

Visible: `status().lanes` gains ``host-staging``, the status is degraded with the reason, the
counters ``staged_bytes_out`` / ``staged_bytes_in`` (exported as metrics) count the bytes
copied device -> host (prefill) and host -> device (decode); the agent's status says
``"staging": "host"`` and its start log says why.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.buffers.bufferset import BufferSet, DeviceBytes, view_memory
from kvhandoff.buffers.staging import (
    ARENA,
    Lease,
    StagingPool,
    check_spans,
    copy_in,
    copy_out,
)
from kvhandoff.errors import ConfigError, TransportError
from kvhandoff.settings import Settings
from kvhandoff.transports.base import OnDone, Transport, TransportKind, TransportStatus

log = logging.getLogger("kvhandoff.staging")

__all__ = ["StagedTransport", "staging_choice"]

#: transports that register CUDA memory themselves (shm: its CUDA IPC lane, same host; nixl:
#: VRAM registration, which needs GPUDirect RDMA to move it between hosts)
DIRECT_KINDS = (TransportKind.SHM, TransportKind.NIXL)


def staging_choice(settings: Settings, memory: str, kind: TransportKind | None = None
                   ) -> str | None:
    """Why this agent's buffers go through host staging (None: they do not).

    Args:
        settings: the agent's settings (transport, auto_cross_host, host_staging).
        memory: where the buffers live, "host" or "cuda".
        kind: the kind of the transport built (default: settings.transport).

    Raises:
        ConfigError: CUDA buffers, a transport that cannot reach device memory and
            ``host_staging=off``: neither direct nor staged; names both settings.
    """
    if memory != "cuda":
        return None
    kind = settings.transport if kind is None else kind
    cross = settings.auto_cross_host
    if kind is TransportKind.AUTO:
        direct = cross in DIRECT_KINDS
        lane = f"settings.transport=auto with settings.auto_cross_host={cross}"
    else:
        direct = kind in DIRECT_KINDS
        lane = f"settings.transport={kind}"
    mode = settings.host_staging
    if mode == "on":
        return f"settings.host_staging=on (transport {kind})"
    if direct:
        return None
    if mode == "off":
        raise ConfigError(
            f"settings.host_staging=off: the KV caches are CUDA memory and {lane} moves host "
            "memory only; set host_staging=auto (device pages copied through pinned host "
            "buffers) or a transport that reaches device memory (shm on this host, nixl)")
    return f"{lane} cannot reach device memory (host_staging=auto)"


@dataclass(eq=False)
class _Op:
    """One staged send or receive (shared by the callers, the wrapped transport's callbacks
    and the staging thread under the transport's lock)."""

    send: bool
    peer: str
    tag: int
    name: str
    offsets: np.ndarray
    nbytes: np.ndarray
    on_done: OnDone
    total: int
    lease: Lease | None = None
    posted: bool = False  # on the wrapped transport
    cancelled: str | None = None
    done: bool = False


class StagedTransport(Transport):
    """A transport that moves device buffers through host staging (see the module comment).

    Args:
        inner: the transport that moves the bytes (its one buffer: the staging arena).
        settings: host_staging_mib sizes the staging arena.
        reason: why this agent stages (for the status and the log).
        pinned: pin the arena (default: where torch has CUDA).
    """

    def __init__(self, inner: Transport, settings: Settings, *, reason: str,
                 pinned: bool | None = None) -> None:
        self.inner = inner
        self.kind = inner.kind  # type: ignore[misc]  # the wire's kind is the inner one's
        self.reason = reason
        self.pool = StagingPool(inner.register, limit_bytes=settings.host_staging_mib << 20,
                                pinned=pinned)
        self._device: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._ops: dict[tuple[str, int], _Op] = {}
        self._jobs: collections.deque[_Op] = collections.deque()  # copies to run
        self._waiting: collections.deque[_Op] = collections.deque()  # ops with no lease yet
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.staged_out = 0  # device -> host bytes copied and sent (prefill)
        self.staged_in = 0  # host -> device bytes copied (decode)
        self.waited = 0  # ops that waited for staging memory
        self._thread = threading.Thread(target=self._run, name="kvh-staging", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ Transport

    @property
    def address(self) -> bytes:
        return self.inner.address

    def register(self, name: str, buf: Any) -> None:
        """Keeps a device buffer (a 1-D uint8 torch tensor) for staging; host buffers go to
        the wrapped transport as they are."""
        if view_memory(buf)[0] == "host":
            self.inner.register(name, buf)
            return
        if isinstance(buf, DeviceBytes):  # `stage` refuses these before
            raise ConfigError(f"host staging: buffer {name} is CUDA memory torch cannot use")
        with self._lock:
            if name in self._device:
                raise TransportError(f"register: a buffer named {name!r} is already registered")
            self._device[name] = buf

    def connect(self, peer: str, address: bytes) -> None:
        self.inner.connect(peer, address)

    def bind_session(self, peer: str, key: bytes) -> None:
        self.inner.bind_session(peer, key)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            for op in self._ops.values():
                if op.peer == peer and op.cancelled is None:
                    op.cancelled = f"peer {peer} disconnected"
            self._wake.notify()
        self.inner.disconnect(peer)  # posted ops complete with its error

    def peer_exited(self, peer: str) -> bool:
        return self.inner.peer_exited(peer)

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        dev = self._device.get(name)
        if dev is None:
            self.inner.post_send(peer, tag, name, offsets, nbytes, on_done)
            return
        op = self._new_op(True, peer, tag, name, dev, offsets, nbytes, on_done)
        self._enqueue(op)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        dev = self._device.get(name)
        if dev is None:
            self.inner.post_recv(peer, tag, name, offsets, nbytes, on_done)
            return
        op = self._new_op(False, peer, tag, name, dev, offsets, nbytes, on_done)
        self._enqueue(op)

    def cancel(self, peer: str, tag: int) -> None:
        with self._lock:
            op = self._ops.get((peer, tag))
            if op is not None and op.cancelled is None:
                op.cancelled = "cancelled"
                self._wake.notify()
            posted = op is None or op.posted
        if posted:
            self.inner.cancel(peer, tag)
        # not posted (a send being copied, a receive waiting for memory) or landed and being
        # copied: the staging thread completes it

    def status(self) -> TransportStatus:
        st = self.inner.status()
        with self._lock:
            counters = {**st.counters, "staged_bytes_out": self.staged_out,
                        "staged_bytes_in": self.staged_in, "staging_waits": self.waited}
        why = f"device memory staged through host memory: {self.reason}"
        return TransportStatus(kind=st.kind, lanes=(*st.lanes, "host-staging"), degraded=True,
                               reason=f"{st.reason}; {why}" if st.reason else why,
                               bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                               counters=counters)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self.inner.close()  # completes every posted op (through _end / _received)
        self._thread.join(timeout=30)
        with self._lock:  # what the staging thread did not take (it ended, or timed out)
            left = [*self._jobs, *self._waiting]
            self._jobs.clear()
            self._waiting.clear()
        for op in left:
            self._end(op, TransportError(f"host staging: tag {op.tag}: transport closed"))

    # ------------------------------------------------------------------ staging

    def _new_op(self, send: bool, peer: str, tag: int, name: str, dev: Any, offsets: Any,
                nbytes: Any, on_done: OnDone) -> _Op:
        if not callable(on_done):
            raise TransportError("on_done must be callable")
        off, nb = check_spans(f"{'post_send' if send else 'post_recv'}({name})",
                              int(dev.shape[0]), offsets, nbytes)
        with self._lock:
            if self._closed:
                raise TransportError("host staging: transport closed")
            if (peer, tag) in self._ops:
                raise TransportError(f"tag {tag} already pending with peer {peer}")
        return _Op(send, peer, tag, name, off, nb, on_done, int(nb.sum()))

    def _enqueue(self, op: _Op) -> None:
        """Takes `op`'s lease and starts it (a send: its copy; a receive: its post), or, while
        the arena holds too little, queues it behind the ops waiting already (the staging
        thread starts it once memory is free)."""
        self.pool.check(op.total)  # one that can never fit is refused here
        with self._lock:
            queued = bool(self._waiting)
        lease = None if queued else self.pool.take(op.total)  # FIFO: none overtakes
        with self._lock:
            self._ops[(op.peer, op.tag)] = op
            if lease is None:
                self._waiting.append(op)
                self.waited += 1
                return
            op.lease = lease
            if op.send:
                self._jobs.append(op)
                self._wake.notify()
                return
            op.posted = True
        try:
            self._post_recv(op)
        except BaseException:  # refused at once: the caller gets the error, no completion
            with self._lock:
                op.done = True
                self._ops.pop((op.peer, op.tag), None)
                lease, op.lease = op.lease, None
            if lease is not None:
                self.pool.give(lease)
            raise

    def _post_recv(self, op: _Op) -> None:
        """Posts a receive that holds its lease on the wrapped transport (the caller's thread
        or the staging thread); its refusal is raised."""
        assert op.lease is not None
        self.inner.post_recv(op.peer, op.tag, ARENA, op.lease.offsets, op.lease.lengths,
                             lambda e: self._received(op, e))

    def _received(self, op: _Op, exc: BaseException | None) -> None:
        """(wrapped transport's thread) A staged receive's bytes landed in its lease, or it
        failed: the copy into the device pages goes to the staging thread."""
        with self._lock:
            if exc is None and not self._closed:
                self._jobs.append(op)
                self._wake.notify()
                return
        self._end(op, exc or TransportError("host staging: transport closed"))

    def _end(self, op: _Op, exc: BaseException | None) -> None:
        with self._lock:
            if op.done:
                return
            op.done = True
            if self._ops.get((op.peer, op.tag)) is op:
                del self._ops[(op.peer, op.tag)]
            if exc is None and not op.send:
                self.staged_in += op.total
            lease, op.lease = op.lease, None
            if lease is not None and self._waiting:
                self._wake.notify()  # memory for a waiting op
        if lease is not None:
            self.pool.give(lease)
        try:
            op.on_done(exc)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the staging
            log.exception("host staging: on_done of tag %d raised", op.tag)

    def _run(self) -> None:
        """(staging thread) Ends cancelled waiting ops, starts the waiting ones that now fit,
        copies each job's bytes, then posts the send or completes the receive."""
        while True:
            with self._lock:
                while not (self._jobs or self._closed or self._admissible()):
                    self._wake.wait()
                if self._closed and not self._jobs:
                    return
                ended = [w for w in self._waiting if w.cancelled is not None]
                for w in ended:
                    self._waiting.remove(w)
                job = self._jobs.popleft() if self._jobs else None
            for w in ended:
                self._end(w, TransportError(f"host staging: tag {w.tag} {w.cancelled}"))
            self._admit()
            if job is not None:
                self._copy(job)

    def _admissible(self) -> bool:
        """(lock held) Whether a waiting op was cancelled or may fit now."""
        return any(op.cancelled is not None for op in self._waiting) or (
            bool(self._waiting) and self.pool.fits(self._waiting[0].total))

    def _admit(self) -> None:
        """Starts waiting ops, oldest first, while staging memory holds them (a send: its
        copy is queued; a receive: posted)."""
        while True:
            with self._lock:
                if not self._waiting or self._closed:
                    return
                op = self._waiting[0]
            try:
                lease = self.pool.take(op.total)
            except TransportError as e:  # checked at post_recv: not expected
                with self._lock:
                    self._waiting.popleft()
                self._end(op, e)
                continue
            if lease is None:
                return
            with self._lock:
                self._waiting.popleft()
                op.lease = lease
                # a cancel that came while the lease was taken found the op unposted and
                # left it to this thread: a receive posted now would wait for bytes that
                # never come, so it ends here (a send's copy checks it in `_copy`)
                late = op.cancelled is not None and not op.send
                if op.send and not late:
                    self._jobs.append(op)
                    continue
                if not late:
                    op.posted = True
            if late:
                self._end(op, TransportError(f"host staging: tag {op.tag} {op.cancelled}"))
                continue
            try:
                self._post_recv(op)
            except Exception as e:  # noqa: BLE001 - the op fails with it (its peer gone ...)
                self._end(op, e)
                continue
            self._cancel_if_late(op)

    def _copy(self, op: _Op) -> None:
        with self._lock:
            why = op.cancelled or ("transport closed" if self._closed else None)
        if why is not None:
            self._end(op, TransportError(f"host staging: tag {op.tag} {why}"))
            return
        assert op.lease is not None
        dev = self._device[op.name]
        try:
            if op.send:
                copy_out(dev, op.offsets, op.nbytes, self.pool.arena, op.lease)
            else:
                copy_in(self.pool.arena, op.lease, dev, op.offsets, op.nbytes)
        except Exception as e:  # noqa: BLE001 - the op fails with it (a CUDA error ...)
            self._end(op, TransportError(f"host staging: copying {op.name} "
                                         f"{'out of' if op.send else 'into'} device "
                                         f"memory failed: {e!r}"))
            return
        if not op.send:
            with self._lock:
                why = op.cancelled
            self._end(op, None if why is None else
                      TransportError(f"host staging: tag {op.tag} {why}"))
            return
        self._post_send(op)

    def _post_send(self, op: _Op) -> None:
        assert op.lease is not None
        with self._lock:
            why = op.cancelled or ("transport closed" if self._closed else None)
            if why is None:
                op.posted = True
                self.staged_out += op.total
        if why is not None:
            self._end(op, TransportError(f"host staging: tag {op.tag} {why}"))
            return
        try:
            self.inner.post_send(op.peer, op.tag, ARENA, op.lease.offsets, op.lease.lengths,
                                 lambda e: self._end(op, e))
        except Exception as e:  # noqa: BLE001 - e.g. the peer was disconnected meanwhile
            self._end(op, e)
            return
        self._cancel_if_late(op)

    def _cancel_if_late(self, op: _Op) -> None:
        """(staging thread, after posting `op` on the wrapped transport) A cancel that came
        between marking it posted and the post itself cancelled nothing there: again now."""
        with self._lock:
            late = op.cancelled is not None and not op.done
        if late:
            self.inner.cancel(op.peer, op.tag)


def stage(transport: Transport, settings: Settings, buffers: BufferSet,
          log_line: Callable[[str], None] | None = None) -> Transport:
    """`transport` as the agent uses it for `buffers`: wrapped in a `StagedTransport` when
    `staging_choice` says so (the start log says why), else as it is.

    Raises:
        ConfigError: neither direct nor staged (`staging_choice`), or staging chosen for CUDA
            memory torch cannot copy here (a CUDA array interface without a CUDA torch).
            `transport` is closed first.
    """
    try:
        why = staging_choice(settings, buffers.memory or "host", transport.kind)
        if why is not None:
            for name, view in buffers.views():
                if isinstance(view, DeviceBytes):
                    raise ConfigError(
                        f"buffers: {name} is CUDA memory that torch cannot use here (a CUDA "
                        "array interface without a CUDA build of torch): the "
                        f"{transport.kind} transport moves host memory only and host staging "
                        "copies device pages with torch; install a CUDA build of torch, or "
                        "use a transport that reaches device memory (shm on this host, nixl)")
    except ConfigError:
        transport.close()
        raise
    if why is None:
        return transport
    (log_line or log.warning)(f"KV caches in CUDA memory move through host staging: {why}; "
                              "each layer's device pages are copied to pinned host buffers "
                              "(prefill) and from them (decode)")
    return StagedTransport(transport, settings, reason=why)
