# One-sided writes of the shm transport (Transport.supports_write): the public calls and their
# I/O-thread handlers, mixed into ShmTransport (shm.py has the design; this part only starts
# jobs on a target installed by register_remote, and completes fences).
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhandoff.errors import TransportError

from ._chunks import ChunkPlan, check_tag, write_spans
from ._shm_copy import Target, open_target
from ._shm_cuda import (
    LANE,
    DeviceJob,
    DeviceLane,
    DeviceTarget,
    encode_device_descriptor,
    is_device_descriptor,
    parse_device_descriptor,
)
from ._shm_wire import ShmOp, describe_buffer, parse_descriptor
from ._threaded import IoCommand
from .base import OnDone, OnWritten

if TYPE_CHECKING:
    import threading

    import zmq

    from ._shm_wire import ShmPeer


class OneSidedWrites:
    """describe / register_remote / post_write / fence of ShmTransport."""

    if TYPE_CHECKING:  # provided by ShmTransport / ThreadedTransport
        _lock: threading.Lock
        _buffers: dict[str, np.ndarray]
        _peers: dict[str, bytes]
        _ops: dict[tuple[str, int, bool], Any]
        _peer_info: dict[str, ShmPeer]
        _lanes: dict[str, set[str]]
        _allow_map: bool
        _writes: dict[str, list[ShmOp]]
        _fences: list[tuple[str, set[int], OnDone]]
        _callbacks: Any
        _dev: dict[str, tuple[Any, int]]
        _dev_lane: DeviceLane
        _running: set[Any]

        def _check_open(self) -> None: ...
        def _command(self, cmd: IoCommand, *args: Any) -> None: ...
        def _dead(self, op: ShmOp) -> bool: ...
        def _finish(self, op: ShmOp, reason: str | None) -> bool: ...
        def peer_exited(self, peer: str) -> bool: ...
        def _start_job(self, op: ShmOp, target: Target, doff: np.ndarray, dnb: np.ndarray,
                       checksum: bool, key: tuple[bytes, int] | None) -> None: ...

    def describe(self, name: str) -> bytes:
        dev = self._dev.get(name)
        if dev is not None:  # a CUDA buffer: its IPC export
            return encode_device_descriptor(os.getpid(), dev[1], self._dev_lane.export(dev[0]))
        buf = self._buffers.get(name)
        if buf is None:
            raise TransportError(f"describe: no buffer registered as {name!r}")
        return describe_buffer(buf)

    def write_digest_alg(self, name: str) -> str | None:
        """The algorithm of post_write(checksum=True)'s digest for local buffer `name`:
        "xxh3" (host buffers, hashed while copying), "devsum" (CUDA buffers); None when no
        such buffer is registered."""
        return "devsum" if name in self._dev else "xxh3" if name in self._buffers else None

    def _descriptor_peer(self, peer: str, name: str, pid: int) -> ShmPeer:
        """(lock held) The connected peer a descriptor of process `pid` must come from."""
        self._check_open()
        info = self._peer_info.get(peer)
        if info is None:
            raise TransportError(f"register_remote: peer {peer!r} is not connected")
        if pid != info.pid:
            raise TransportError(f"register_remote {name!r}: the descriptor is of process "
                                 f"{pid}, peer {peer!r} is process {info.pid}")
        return info

    def _register_device_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        pid, n, export = parse_device_descriptor(descriptor)
        with self._lock:
            info = self._descriptor_peer(peer, name, pid)
            host = next(iter(self._buffers), None)
        if host is not None or not self._dev:
            raise TransportError(f"register_remote {name!r}: peer {peer!r}'s buffer is CUDA "
                                 "memory and this side's buffers are host memory; shm writes "
                                 "host to host or device to device, not across")
        try:
            tensor = self._dev_lane.open(peer, export)
        except Exception as e:  # noqa: BLE001 - a CUDA or torch error opening the handle
            raise TransportError(f"register_remote {name!r}: opening peer {peer!r}'s CUDA IPC "
                                 f"handle failed: {e}") from e
        with self._lock:
            info.remotes[name] = DeviceTarget(pid, n, tensor)
            self._lanes.setdefault(peer, set()).add(LANE)

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        if is_device_descriptor(descriptor):
            self._register_device_remote(peer, name, descriptor)
            return
        if self._dev:
            raise TransportError(f"register_remote {name!r}: peer {peer!r}'s buffer is host "
                                 "memory and this side's buffers are CUDA memory; shm writes "
                                 "host to host or device to device, not across")
        pid, fd, seg_n, off, addr, n = parse_descriptor(descriptor)
        with self._lock:
            info = self._descriptor_peer(peer, name, pid)
        target = open_target(pid, fd, seg_n, off, addr, n, self._allow_map, info.maps)
        with self._lock:
            info.remotes[name] = target
            self._lanes.setdefault(peer, set()).add(target.lane)

    def post_write(self, peer: str, tag: int, name: str, offsets: np.ndarray,
                   nbytes: np.ndarray, remote: str, remote_offsets: np.ndarray,
                   remote_nbytes: np.ndarray, on_done: OnWritten, *,
                   checksum: bool = False) -> None:
        tag = check_tag(tag)
        if not callable(on_done):
            raise TransportError("post_write: on_done must be callable")
        dev = self._dev.get(name)
        buf: Any = self._buffers.get(name) if dev is None else dev[0]
        if buf is None:
            raise TransportError(f"post_write: no buffer registered as {name!r}")
        size = buf.size if dev is None else dev[1]
        with self._lock:
            info = self._peer_info.get(peer)
            target = info.remotes.get(remote) if info is not None else None
        off, nb, roff, rnb, total = write_spans(
            peer, name, offsets, nbytes, size, remote,
            None if target is None else target.nbytes, remote_offsets, remote_nbytes,
            connected=info is not None)
        assert info is not None and target is not None  # write_spans checked both
        if (dev is not None) != isinstance(target, DeviceTarget):
            kinds = ("CUDA", "host") if dev is not None else ("host", "CUDA")
            raise TransportError(f"post_write {name!r} -> {remote!r}: a write from {kinds[0]} "
                                 f"memory into {kinds[1]} memory; shm writes host to host or "
                                 "device to device, not across")
        plan = ChunkPlan(off, nb, max(total, 1))
        op = ShmOp(peer, info.ident, tag, True, buf, plan, _ignore)
        op.is_write = True
        op.remote = (target, roff, rnb)
        op.on_done = _written_adapter(op, on_done)
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise TransportError(f"post_write: peer {peer!r} is not connected")
            key = (peer, tag, True)
            if key in self._ops:
                raise TransportError(f"post_write: tag {tag} with peer {peer!r} is already "
                                     "pending")
            self._ops[key] = op
        self._command(IoCommand.WRITE, op, checksum)

    def fence(self, peer: str, on_done: OnDone) -> None:
        if not callable(on_done):
            raise TransportError("fence: on_done must be callable")
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise TransportError(f"fence: peer {peer!r} is not connected")
        self._command(IoCommand.FENCE, peer, on_done)

    # ---- I/O thread -----------------------------------------------------------------------

    def _on_write(self, poller: zmq.Poller, pidfds: dict[int, str], op: ShmOp,
                  checksum: bool) -> None:
        if op.finished or op.remote is None or self._dead(op):
            return
        target, roff, rnb = op.remote
        self._writes.setdefault(op.peer, []).append(op)
        if isinstance(target, DeviceTarget):
            self._start_device_job(op, target, roff, rnb, checksum)
        else:
            self._start_job(op, target, roff, rnb, checksum, None)

    def _start_device_job(self, op: ShmOp, target: DeviceTarget, roff: np.ndarray,
                          rnb: np.ndarray, checksum: bool) -> None:
        """(I/O thread) A write between CUDA buffers: to the lane's worker (_shm_cuda.py).
        The peer's pidfd is read first: a copy into the IPC memory of a process that exited
        is never launched (its pidfd event may not have been handled yet)."""
        if self.peer_exited(op.peer):
            self._finish(op, f"peer {op.peer!r}: its process exited; no copy into its "
                             "device memory")
            self._forget_write(op)
            return
        soff, snb = op.plan.spans()
        job = DeviceJob(op.buf, soff, snb, target.tensor, roff, rnb, checksum,
                        lambda j: self._command(IoCommand.WRITTEN, j), owner=(op, None))
        with self._lock:
            cancelled = op.finished
            if not cancelled:
                op.job = job
        if cancelled:  # cancelled meanwhile: nothing launched
            self._forget_write(op)
            return
        self._running.add(job)
        try:
            self._dev_lane.submit(job)
        except TransportError as e:
            job._end(str(e))

    def _forget_write(self, op: ShmOp) -> None:
        """(I/O thread) A write that ended without a copy: fences stop waiting for it."""
        running = self._writes.get(op.peer, [])
        if op in running:
            running.remove(op)
        self._check_fences()

    def _on_fence(self, poller: zmq.Poller, pidfds: dict[int, str], peer: str,
                  on_done: OnDone) -> None:
        ids = {id(op) for op in self._writes.get(peer, []) if not op.finished}
        self._fences.append((peer, ids, on_done))
        self._check_fences()

    def _check_fences(self) -> None:
        still = []
        for peer, ids, on_done in self._fences:
            running = {id(op) for op in self._writes.get(peer, [])}
            if ids & running:
                still.append((peer, ids, on_done))
            else:
                self._callbacks.submit(functools.partial(on_done, None))
        self._fences = still

def _ignore(exc: BaseException | None) -> None:
    pass


def _written_adapter(op: ShmOp, on_written: OnWritten) -> OnDone:
    def done(exc: BaseException | None) -> None:
        on_written(exc, op.digest if exc is None else None)
    return done
