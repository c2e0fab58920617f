# The one-sided writer of the shm transport: `post_writes` and the copy jobs it runs.
#
# How it works: a job of host writes is ONE copy job (copy.CopyJob: every write's pieces back to
# back, `bounds` between them), started on the poster's thread; its copy thread (or the
# poster, for a job of at most copy.INLINE_MAX bytes) completes the op and calls on_done
# itself. A job whose targets lie on both host lanes (map and cma) is posted as one job per
# write (base._split_writes) and completes once. A write of CUDA memory is a job of one on the
# device lane (cuda.py), started and ended on the I/O thread (`_on_write`, `_on_written`: the
# lane's worker reports back through it); several are split the same way. With `checksum`
# each write's source is hashed while it is copied (xxh3; devsum on the device lane), and on
# the map lane each destination piece is hashed right after its copy, read through the
# mapping at the addresses the peer reads: `WriteResult.landed`, the writer's verification,
# one sum per write (None for a write on the cma or device lane, whose bytes are not mapped
# here; () when no write of the job was read). So the result carries what landed wherever
# the writer can read it, a job split across lanes included; there is no second call.
# `read_back` hashes what a mapped target holds now (the transport's private `_landed_digest`:
# the fault wrapper recomputes a landed sum after it flipped a byte behind a write's back).
# `post_tampered` is the fault-injection seam (the transport's private `_post_writes_tampered`,
# which testing.faults calls): a host job with a destination byte flipped inside the copy,
# before its landed hash.
#
# Rules: the writer owns its jobs (`_running`, the one-sided copy and device jobs started and
# not yet ended), the address cache of the host buffers it copies from and `bytes_written`.
# It reads what the transport owns and never changes it: the op table (the registered host
# buffers, the connected peers; a write op is entered in and finished through it, under its
# lock, the one lock of an op's lifecycle), the peer table (`ShmPeer.remotes`: the installed
# targets, guarded by that lock), the CUDA buffers. Completions go through the transport's
# held-receives part (`HeldReceives.deliver` / `settle`), which hands on_done on once nothing
# of the op writes. After cancel of a write returns nothing of it writes (the transport waits
# for `op.job`, which is entered under the lock before the job starts).
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan
from kvhandoff.transports.base import (
    OnDone,
    OnWritten,
    WriteResult,
    WriteSpec,
    _split_writes,
)
from kvhandoff.transports.iothread import IoThread
from kvhandoff.transports.optable import OpTable
from kvhandoff.transports.shm.copy import CopyJob, CopyPool, Target, read_back
from kvhandoff.transports.shm.cuda import DeviceJob, DeviceLane, DeviceTarget
from kvhandoff.transports.shm.hold import HeldReceives
from kvhandoff.transports.shm.wire import ShmOp, ShmPeer
from kvhandoff.transports.streams import check_tag, write_plan, write_plans


class OneSidedWriter:
    """The shm transport's one-sided writes and their jobs (see module comment). Keyword-only
    arguments: what it reads of the transport (`table`, `peers`, `devices`), the parts it
    hands jobs and completions to (`held`, `io`, `copier`, `device_lane`), and two questions
    about a peer (`dead`: fails an op whose peer's process is gone, and says so; `exited`:
    whether the peer's process ended)."""

    __slots__ = ("_table", "_lock", "_peers", "_dev", "_held", "_io", "_copier", "_dev_lane",
                 "_dead", "_exited", "_running", "_addrs", "bytes_written")

    def __init__(self, *, table: OpTable, peers: dict[str, ShmPeer],
                 devices: dict[str, tuple[Any, int]], held: HeldReceives, io: IoThread,
                 copier: CopyPool, device_lane: DeviceLane, dead: Callable[[ShmOp], bool],
                 exited: Callable[[str], bool]) -> None:
        self._table = table
        self._lock = table.lock
        self._peers = peers  # the transport's: read under _lock
        self._dev = devices  # the transport's CUDA buffers: name -> (1-D uint8 view, bytes)
        self._held = held
        self._io = io
        self._copier = copier
        self._dev_lane = device_lane
        self._dead = dead
        self._exited = exited
        # jobs started, end not yet reported (guarded by _lock: host jobs start on the
        # poster's thread and end on their copy thread)
        self._running: set[CopyJob | DeviceJob] = set()
        # host buffer name -> (the array, its address): a write job looks up each of its
        # regions' addresses (64 for a short room), numpy's lookup costs ~1.5 us each
        self._addrs: dict[str, tuple[np.ndarray, int]] = {}
        self.bytes_written = 0  # guarded by _lock

    # ---- what the transport calls (any thread) --------------------------------------------

    def digest_alg(self, name: str) -> str | None:
        """The algorithm of post_writes(checksum=True)'s digest for local buffer `name`:
        "xxh3" (host buffers, hashed while copying), "devsum" (CUDA buffers); None when no
        such buffer is registered."""
        return "devsum" if name in self._dev else "xxh3" if name in self._table.buffers else None

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """Host memory: the writes' pieces as ONE copy job (one completion, on its copy
        thread, or on this one for a small job), each write's source hashed on its own (a
        digest per write). A CUDA write: a job on the device lane; several, or a job whose
        targets lie on both host lanes: one job per write (_split_writes)."""
        if not any(w[1] in self._dev for w in writes):
            self._post_host(writes, peer, on_done, checksum)
        elif len(writes) == 1:
            self._post_device(peer, *writes[0], on_done, checksum)
        else:
            _split_writes(self, peer, writes, on_done, checksum=checksum)

    def post_tampered(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten,
                      flips: dict[int, int], *, checksum: bool = False) -> bool:
        """`post_writes` of host memory as one copy job that flips the first destination byte
        of write i's piece `flips[i]` right after that piece was copied and before it is
        hashed as landed, so the byte the peer holds is not the source's and the landed sum
        is of what it holds. The job copies from Python (the fast path never sees this).
        False, and nothing posted, where the writes are not one host job (CUDA buffers, or
        targets on both host lanes): the caller corrupts otherwise."""
        if any(w[1] in self._dev for w in writes):
            return False
        with self._lock:
            info = self._peers.get(peer)
            lanes = {getattr(info.remotes.get(w[2]), "lane", None) if info is not None else None
                     for w in writes}
        if len(lanes) != 1:
            return False
        self._post_host(writes, peer, on_done, checksum, flips)
        return True

    def read_back(self, peer: str, remote: str, plan: SpanPlan) -> int | None:
        """xxh3-64 of the peer's host buffer `remote` at `plan`'s destination pieces as they
        are now, read through the mapping the writes go through (copy.read_back); None on the
        cma and CUDA lanes (their bytes are not mapped here: the decode verifies them)."""
        with self._lock:
            info = self._peers.get(peer)
            target = info.remotes.get(remote) if info is not None else None
        if not isinstance(target, Target):
            return None
        return read_back(target, plan.dst_offsets, plan.nbytes)

    def running(self) -> list[CopyJob | DeviceJob]:
        """The jobs started whose end was not reported yet (the transport's close)."""
        with self._lock:
            return list(self._running)

    # ---- host writes ----------------------------------------------------------------------

    def _post_host(self, writes: Sequence[WriteSpec], peer: str, on_done: OnWritten,
                   checksum: bool, flips: dict[int, int] | None = None) -> None:
        """(any thread) Host writes as one copy job under the first write's tag, started from
        here (no I/O-thread hop); its copy thread completes the op (this thread, for a job of
        at most copy.INLINE_MAX bytes)."""
        with self._lock:
            info = self._peers.get(peer)
            targets = [info.remotes.get(w[2]) if info is not None else None for w in writes]
        bufs = [self._table.buffers.get(w[1]) for w in writes]
        plans = write_plans(peer, writes, on_done, [None if b is None else b.size for b in bufs],
                            [None if t is None else t.nbytes for t in targets],
                            connected=info is not None)
        parts: list[tuple[np.ndarray, Target, SpanPlan]] = []
        for (_, name, remote, _), buf, target, plan in zip(writes, bufs, targets, plans,
                                                           strict=True):
            assert buf is not None  # write_plans checked it
            if not isinstance(target, Target):
                raise TransportError(f"post_writes {name!r} -> {remote!r}: a write from host "
                                     "memory into CUDA memory; shm writes host to host or "
                                     "device to device, not across")
            parts.append((buf, target, plan))
        assert info is not None  # write_plans checked it
        if len({t.lane for _, t, _ in parts}) > 1:  # one job copies on one lane
            _split_writes(self, peer, writes, on_done, checksum=checksum)
            return
        op = ShmOp(peer, info.ident, check_tag(writes[0][0]), True, parts[0][0], None, _ignore,
                   total=sum(p.total_bytes for _, _, p in parts))
        op.is_write = True
        op.on_done = _written_many(op, on_done)
        self._add(op)
        if self._dead(op):
            return
        bounds: tuple[int, ...]
        if len(parts) == 1:
            buf, target, plan = parts[0]
            src = plan.src_offsets + self._buffer_address(writes[0][1], buf)
            dst = plan.dst_offsets + target.base
            lens, bounds = plan.nbytes, (0, len(plan))
        else:  # every write's offsets back to back, each moved by its buffer's address
            counts = [len(p) for _, _, p in parts]
            src = np.concatenate([p.src_offsets for _, _, p in parts]) + np.repeat(
                np.array([self._buffer_address(w[1], b) for w, (b, _, _) in zip(writes, parts,
                                                                         strict=True)],
                         np.int64), counts)
            dst = np.concatenate([p.dst_offsets for _, _, p in parts]) + np.repeat(
                np.array([t.base for _, t, _ in parts], np.int64), counts)
            lens = np.concatenate([p.nbytes for _, _, p in parts])
            bounds = (0, *itertools.accumulate(counts))
        tamper = None if flips is None else {bounds[i] + k: 0 for i, k in flips.items()}
        job = CopyJob(src, dst, lens, parts[0][1], checksum, self._ended, owner=(op, None),
                      bounds=bounds, keep=tuple(t for _, t, _ in parts[1:]), tamper=tamper)
        if self._enter(op, job):
            self._copier.submit(job)

    def _buffer_address(self, name: str, buf: np.ndarray) -> int:
        """The address of registered host buffer `name` (`buf`: the array registered under
        it now; a name registered again gets the new array's)."""
        known = self._addrs.get(name)
        if known is not None and known[0] is buf:
            return known[1]
        addr = int(buf.ctypes.data)
        self._addrs[name] = (buf, addr)
        return addr

    def _ended(self, job: CopyJob) -> None:
        """(copy thread, or the poster's for a small job) A host write job's copy ended: the
        op completes here and its on_done runs on this thread (nothing of the write copies any
        more), instead of two more hand-offs (to the I/O thread, then to the callback
        thread)."""
        with self._lock:
            op, ok = self._end_locked(job)
            if ok:
                op.digests = tuple(job.digests)
                op.landed = tuple(job.landed) if job.landed[0] is not None else ()
            done = self._table.finish_locked([op], None if ok else job.error or "cancelled")
        if done:
            self._held.deliver(done, here=True)
        else:  # ended earlier (cancel, disconnect): its on_done waited for this
            self._held.settle([op], here=True)

    # ---- CUDA writes ----------------------------------------------------------------------

    def _post_device(self, peer: str, tag: int, name: str, remote: str, plan: SpanPlan,
                     on_done: OnWritten, checksum: bool) -> None:
        """A write of CUDA buffer `name` (a job of one), copied on the device lane's worker;
        its digest (devsum of the source) rides along on success."""
        if not callable(on_done):
            raise TransportError("post_writes: on_done must be callable")
        tag = check_tag(tag)
        buf, size = self._dev[name]
        with self._lock:
            info = self._peers.get(peer)
            target = info.remotes.get(remote) if info is not None else None
        plan = write_plan(peer, name, plan, size, remote,
                          None if target is None else target.nbytes, connected=info is not None)
        assert info is not None and target is not None  # write_plan checked both
        if not isinstance(target, DeviceTarget):
            raise TransportError(f"post_writes {name!r} -> {remote!r}: a write from CUDA "
                                 "memory into host memory; shm writes host to host or "
                                 "device to device, not across")
        op = ShmOp(peer, info.ident, tag, True, buf, None, _ignore, total=plan.total_bytes)
        op.is_write = True
        op.remote = (target, plan)  # its pieces are the copy's, as they are
        op.on_done = _written_one(op, on_done)
        self._add(op)
        self._io.put(self._on_write, op, checksum)

    def _on_write(self, poller: object, pidfds: object, op: ShmOp, checksum: bool) -> None:
        """(I/O thread) A CUDA write goes to the lane's worker (cuda.py). The peer's pidfd is
        read first: a copy into the IPC memory of a process that exited is never launched
        (its pidfd event may not have been handled yet)."""
        if op.finished or op.remote is None or self._dead(op):
            return
        target, plan = op.remote
        assert isinstance(target, DeviceTarget)
        if self._exited(op.peer):
            self._table.finish(op, f"peer {op.peer!r}: its process exited; no copy into its "
                               "device memory")
            return
        job = DeviceJob(op.buf, target.tensor, plan, checksum,
                        lambda j: self._io.put(self._on_written, j), owner=(op, None))
        if not self._enter(op, job):  # cancelled meanwhile: nothing launched
            return
        try:
            self._dev_lane.submit(job)
        except TransportError as e:
            job._end(str(e))

    def _on_written(self, poller: object, pidfds: object, job: DeviceJob) -> None:
        """(I/O thread) A CUDA write's copy ended (its event completed, or it failed)."""
        with self._lock:
            op, ok = self._end_locked(job)
        if ok:
            op.digest = job.digest
        self._table.finish(op, None if ok else job.error or "cancelled")
        self._held.settle([op])  # ended earlier (cancel, disconnect): on_done waited for this

    # ---- both -----------------------------------------------------------------------------

    def _add(self, op: ShmOp) -> None:
        """Enters a write op in the op table (its tag must not be pending with the peer)."""
        with self._lock:
            self._table.check_open()
            if op.peer not in self._table.peers:
                raise TransportError(f"post_writes: peer {op.peer!r} is not connected")
            key = (op.peer, op.tag, True)
            if key in self._table.ops:
                raise TransportError(f"post_writes: tag {op.tag} with peer {op.peer!r} is "
                                     "already pending")
            self._table.ops[key] = op

    def _end_locked(self, job: CopyJob | DeviceJob) -> tuple[ShmOp, bool]:
        """(lock held) `job` ended: it runs no more, and its bytes count if it succeeded;
        (its op, whether it did)."""
        op, _ = job.owner
        ok = job.error is None and not job.cancelled
        self._running.discard(job)
        if ok:
            self.bytes_written += job.total
        return op, ok

    def _enter(self, op: ShmOp, job: CopyJob | DeviceJob) -> bool:
        """Makes `job` the op's copy and counts it running, unless the op ended meanwhile
        (cancelled: nothing is started); whether it did."""
        with self._lock:
            if op.finished:
                return False
            op.job = job
            self._running.add(job)
        return True


def _ignore(exc: BaseException | None) -> None:
    """The on_done of a write op until its adapter replaced it."""


def _written_one(op: ShmOp, on_written: OnWritten) -> OnDone:
    """A CUDA write job's completion (a job of one write) as the op's on_done: its digest
    rides along on success."""
    def done(exc: BaseException | None) -> None:
        on_written(WriteResult(exc, (op.digest,)) if exc is None else WriteResult(exc))
    return done


def _written_many(op: ShmOp, on_written: OnWritten) -> OnDone:
    """A host write job's completion as the op's on_done: one digest per write on success
    (and the copy's landed sums where it read them)."""
    def done(exc: BaseException | None) -> None:
        on_written(WriteResult(None, op.digests, op.landed) if exc is None else WriteResult(exc))
    return done


__all__ = ["OneSidedWriter"]
