# The copy engine of the shm transport: where a peer's buffer is reached from this process, and
# the threads that copy span lists into it.
#
# Two lanes, chosen per remote buffer:
# - "map": the peer's buffer lies in a kvhandoff shared segment (kvhandoff.buffers.shared); this
#   process maps the whole segment once, through the memfd the peer handed over its socket
#   (proof.py), and copies each piece with memmove (ctypes releases the GIL for each call).
#   One copy per byte, no syscall per piece.
#   The mapping is ours: a peer that dies mid-write leaves it valid, nothing faults.
# - "cma": any other buffer: process_vm_writev into the peer's address space, 1,024 iovecs per
#   call (GIL released). A dead peer is an error return (ESRCH), never a signal.
# A job's pieces (source address, destination address, length) are split by bytes into parts,
# one per copy thread, so the spans of a layer are copied by a few threads at once; a small job
# (`INLINE_MAX`) is copied on the submitting thread instead, and ends there. A job may
# carry several regions' pieces back to back (`bounds`: one one-sided write job per layer, one
# completion); with `checksum` each region runs as one part and hashes each of its source
# pieces (xxh3-64, stream order) just before copying it, while it is in cache (a fused
# copy+hash pass), so the job has one digest per region (`digests`). On the map lane it also
# hashes each destination piece right after copying it, read through the mapping at the
# addresses the peer reads, while still in cache: the writer's verification of what landed,
# one sum per region (`landed`; None on the cma lane, whose bytes are not mapped here), with
# no second pass over the job.
#
# The map lane copies through the native helper when it is built (native.py: one foreign call
# per batch of pieces, both hashes fused in C); else piece by piece from Python, with the same
# sums. `read_back` hashes what is now in a mapped target (the writer's private read-back,
# for a byte the fault wrapper flipped after a write landed). `CopyJob.tamper` is the
# fault-injection seam (testing.faults): a destination byte flipped inside the copy, after its
# piece was copied and before its landed hash, so the sum is of the byte the peer holds; a job
# with it copies from Python (a job without it, every real one, runs the fast path).
#
# Rules: a job ends exactly once (`_end`), after every part stopped; `cancel()` makes parts stop
# at their next batch boundary and `wait()` returns once none runs, so after it nothing of that
# job writes. Mappings are kept alive by the jobs that use them (Python references), so a
# mapping is never unmapped under a copy.
from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvhandoff.transports.shm.native import Native, native

IOV_MAX = 1024  # iovecs per process_vm_writev call
_BATCH = 64  # pieces between cancellation checks on the map lane
_PART_MIN = 1 << 20  # no part smaller than this many bytes
# a job of at most this many bytes (a layer of a prompt up to ~256 tokens of an 8B model) is
# copied on the thread that submits it (the poster: the agent's control thread) and ends there;
# a larger one goes to the copy threads, a checksummed one as runs of whole regions, one run
# per thread. Measured with `kvhandoff bench` on the shm lane (Llama-8B, 2 cores, both
# alternately): 2 MiB jobs (512-token layers, or two 256-token ones) on the threads took 12-16 %
# less wall time (a 512-token room 15.7 against 18.0-18.7 ms, its tail 0.86-0.95 against 1.0
# ms) and 20-35 % more CPU; a 16-token room's one 2 MiB job of 64 regions was even (3.2-3.9
# ms). Before the regions went as runs (one part per region), inline was the faster up to 2 MiB.
INLINE_MAX = 1 << 20
_EMPTY_XXH3 = int(xxhash.xxh3_64_intdigest(b""))  # the digest of a region with no bytes

_libc = ctypes.CDLL(None, use_errno=True)
_pvw = _libc.process_vm_writev
_pvw.restype = ctypes.c_ssize_t
_pvw.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                 ctypes.c_ulong]
_memmove = ctypes.memmove


class Target:
    """A peer's buffer as this process reaches it: a base address on a lane."""

    __slots__ = ("lane", "pid", "base", "nbytes", "mapping")

    def __init__(self, lane: str, pid: int, base: int, nbytes: int, mapping: Any) -> None:
        self.lane = lane  # "map" or "cma"
        self.pid = pid
        self.base = base  # address in this process (map) or in the peer (cma)
        self.nbytes = nbytes
        self.mapping = mapping  # the mmap (map lane); keeps it alive while referenced


def open_target(pid: int, memfd: int | None, segment_nbytes: int, offset: int, addr: int,
                nbytes: int, allow_map: bool, maps: dict[tuple[int, int], Any] | None = None, *,
                key: int = -1) -> Target:
    """The lane to a peer buffer: map its shared segment through `memfd` (the segment's memfd
    the peer handed over its socket; None: it has none) when it opens, else cross-memory
    writes to `addr` in process `pid` (the pid the peer's socket proved). `maps` caches one
    mapping per (key, size) of the peer (`key`: the memfd's number in the peer): every buffer
    of an `allocate_shared` pool lies in the same segment."""
    if allow_map and memfd is not None:
        cache = (key, segment_nbytes)
        mm = maps.get(cache) if maps is not None else None
        if mm is None:
            mm = _map_segment(memfd, segment_nbytes)
            if mm is not None and maps is not None:
                maps[cache] = mm
        if mm is not None and segment_nbytes >= offset + nbytes:
            base = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data) + offset
            return Target("map", pid, base, nbytes, mm)
    return Target("cma", pid, addr, nbytes, None)


def _map_segment(memfd: int, segment_nbytes: int) -> mmap.mmap | None:
    """A shared mapping of the peer's segment through the memfd it handed over, None if it is
    smaller than the peer says or cannot be mapped."""
    try:
        if os.fstat(memfd).st_size < segment_nbytes:
            return None
        return mmap.mmap(memfd, segment_nbytes, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None


class CopyJob:
    """One span-list copy into a Target (see module comment)."""

    __slots__ = ("src", "dst", "lens", "target", "checksum", "on_end", "cancelled", "error",
                 "digests", "landed", "tamper", "bounds", "keep", "_parts_left", "_lock",
                 "_ended", "_event", "total", "owner")

    def __init__(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, target: Target,
                 checksum: bool, on_end: Callable[[CopyJob], None], owner: Any = None, *,
                 bounds: tuple[int, ...] | None = None, keep: tuple[Target, ...] = (),
                 tamper: dict[int, int] | None = None) -> None:
        self.src = src  # int64 source addresses (this process)
        self.dst = dst  # int64 destination addresses (see Target.base)
        self.lens = lens
        self.total = int(lens.sum()) if lens.size else 0
        self.target = target  # its lane and process (every region's target is on the same)
        self.keep = keep  # the other regions' targets (their mappings stay alive)
        # the regions' pieces: region i is pieces bounds[i]:bounds[i + 1] (one region: all)
        self.bounds = bounds if bounds is not None else (0, int(lens.size))
        self.checksum = checksum
        self.on_end = on_end
        self.owner = owner  # what the caller wants back (its op)
        self.cancelled = False
        self.error: str | None = None
        # with checksum: the xxh3-64 of each region's source stream (an empty region's is
        # that of no bytes; the others are set by their part)
        self.digests: list[int | None] = ([_EMPTY_XXH3 if checksum else None]
                                          * (len(self.bounds) - 1))
        # with checksum on the map lane: the xxh3-64 of each region's destination pieces as
        # the copy left them, read right after each piece's copy (None: not read, cma)
        verify = checksum and target.lane == "map"
        self.landed: list[int | None] = [_EMPTY_XXH3 if verify else None] * (len(self.bounds) - 1)
        # fault injection only (see the module comment): piece index -> the byte of that
        # piece whose copy is flipped right after the piece was copied
        self.tamper = tamper
        self._parts_left = 0
        self._lock = threading.Lock()
        self._ended = False
        # made when first asked for (a cancel or close waits on it): an Event per job was a
        # tenth of the control thread's time for a short prompt's layer jobs
        self._event: threading.Event | None = None

    @property
    def ended_event(self) -> threading.Event:
        """Set once every part stopped."""
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
                if self._ended:
                    self._event.set()
            return self._event

    @property
    def digest(self) -> int | None:
        """The digest of a one-region job (None: several regions, or not hashed)."""
        return self.digests[0] if len(self.digests) == 1 else None

    def cancel(self) -> None:
        self.cancelled = True

    def _part_done(self, error: str | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._parts_left -= 1
            last = self._parts_left == 0
            if last:
                self._ended = True
            event = self._event
        if last:
            if event is not None:
                event.set()
            self.on_end(self)

    def wait(self, timeout: float) -> bool:
        """Whether every part stopped within `timeout` seconds."""
        return self.ended_event.wait(timeout)


class CopyPool:
    """`threads` daemon threads running parts of jobs (see module comment)."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = max(1, int(threads))
        self._queue: queue.SimpleQueue[tuple[CopyJob, int, int, int, int] | None] = \
            queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(self.threads)]
        for w in self._workers:
            w.start()

    def submit(self, job: CopyJob) -> None:
        n = job.lens.size
        if n == 0:
            job._parts_left = 1
            job._part_done(None)
            return
        inline = job.total <= INLINE_MAX  # a short prompt's layer(s): copied here, ended here
        items: list[tuple[int, int, int, int]]
        if job.checksum and inline:  # every region in one part, each hashing its own stream
            items = [(job.bounds[0], job.bounds[-1], 0, len(job.bounds) - 1)]
        elif job.checksum:  # runs of whole regions, one per copy thread, of about equal bytes
            items = _region_runs(job, self.threads)
        else:
            parts = max(1, min(self.threads, job.total // _PART_MIN))
            if parts == 1:
                bounds = [0, n]
            else:
                ends = np.cumsum(job.lens)
                cut = np.searchsorted(ends, np.arange(1, parts) * (job.total / parts))
                bounds = sorted({0, n, *[int(c) + 1 for c in cut if 0 <= int(c) + 1 < n]})
            items = [(lo, hi, -1, -1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        job._parts_left = len(items)
        if inline:
            for item in items:
                _run_part(job, *item)
            return
        for item in items:
            self._queue.put((job, *item))

    def stop(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            if w is not threading.current_thread():
                w.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run_part(*item)


def _region_runs(job: CopyJob, parts: int) -> list[tuple[int, int, int, int]]:
    """`job`'s regions cut into at most `parts` runs of whole regions of about equal bytes
    (each region hashes its own stream, so a region is never cut): (first piece, end piece,
    first region, end region) each; regions without pieces are left out."""
    bounds = job.bounds
    ends = np.cumsum(job.lens)
    nreg = len(bounds) - 1
    region_end = [int(ends[hi - 1]) if hi > 0 else 0 for hi in bounds[1:]]  # bytes up to each
    runs: list[tuple[int, int, int, int]] = []
    start = 0
    for k in range(1, parts + 1):
        while start < nreg and bounds[start] == bounds[start + 1]:
            start += 1  # a run starts at a region with pieces
        if start >= nreg:
            break
        goal = job.total * k / parts
        stop = start + 1  # at least one region
        while stop < nreg and region_end[stop] <= goal:
            stop += 1
        if k == parts:
            stop = nreg
        runs.append((bounds[start], bounds[stop], start, stop))
        start = stop
    return runs


def _run_part(job: CopyJob, lo: int, hi: int, rlo: int, rhi: int) -> None:
    """Runs one part of `job` on this thread and ends it (the job ends with its last part)."""
    try:
        err = _copy_part(job, lo, hi, rlo, rhi)
    except Exception as e:  # never lose a part: the job must end
        err = f"shm copy failed: {e!r}"
    job._part_done(err)


def _copy_part(job: CopyJob, lo: int, hi: int, rlo: int, rhi: int) -> str | None:
    """Copies pieces lo:hi of `job`; with checksum they are those of regions rlo:rhi, whose
    digests this sets (rlo = rhi = -1 without)."""
    if job.cancelled:
        return "cancelled"
    helper, _ = native()
    if (job.target.lane == "map" and helper is not None and job.tamper is None
            and (not job.checksum or helper.states() is not None)):
        return _copy_mapped_native(job, lo, hi, rlo, rhi, helper)
    one = _copy_mapped_python if job.target.lane == "map" else _copy_cma
    if rlo < 0:
        return one(job, lo, hi, -1)
    for seg in range(rlo, rhi):  # region by region, each hashing its own stream
        a, b = job.bounds[seg], job.bounds[seg + 1]
        err = one(job, a, b, seg) if b > a else None
        if err is not None:
            return err
    return None


def _copy_mapped_python(job: CopyJob, lo: int, hi: int, seg: int) -> str | None:
    """The map lane's copy of pieces lo:hi (region `seg`'s with checksum) from Python: without
    the native helper, without libxxhash, or with a fault to inject (`CopyJob.tamper`)."""
    src = job.src[lo:hi].tolist()
    dst = job.dst[lo:hi].tolist()
    lens = job.lens[lo:hi].tolist()
    h = xxhash.xxh3_64() if job.checksum else None
    hd = xxhash.xxh3_64() if job.checksum else None
    tamper = job.tamper or {}
    for b in range(0, len(lens), _BATCH):
        if job.cancelled:
            return "cancelled"
        for i, (s, d, n) in enumerate(zip(src[b:b + _BATCH], dst[b:b + _BATCH],
                                          lens[b:b + _BATCH], strict=True), lo + b):
            if h is not None:
                h.update((ctypes.c_char * n).from_address(s))
            _memmove(d, s, n)
            if i in tamper:
                _flip_mapped(d, n, tamper[i])
            if hd is not None:
                hd.update((ctypes.c_char * n).from_address(d))
    if h is not None and hd is not None:
        job.digests[seg] = int(h.intdigest())
        job.landed[seg] = int(hd.intdigest())
    return None


def _flip_mapped(addr: int, nbytes: int, at: int) -> None:
    """(fault injection) Flips byte `at` (clamped into the piece) of a piece just copied."""
    byte = ctypes.c_uint8.from_address(addr + min(max(at, 0), nbytes - 1))
    byte.value ^= 0xFF


def _copy_mapped_native(job: CopyJob, lo: int, hi: int, rlo: int, rhi: int,
                        helper: Native) -> str | None:
    """Pieces lo:hi in batches of IOV_MAX, one foreign call each (GIL released for the batch,
    cancellation checked between them); with checksum (regions rlo:rhi) every region's
    source and landed hashes fused into the copy in C (`kvh_copy_regions`), a digest pair
    per region, however many regions the batch spans."""
    src = np.ascontiguousarray(job.src, dtype=np.int64)
    dst = np.ascontiguousarray(job.dst, dtype=np.int64)
    lens = np.ascontiguousarray(job.lens, dtype=np.int64)
    sp, dp, lp = src.ctypes.data, dst.ctypes.data, lens.ctypes.data
    if not job.checksum:
        for b in range(lo, hi, IOV_MAX):
            if job.cancelled:
                return "cancelled"
            helper.copy(sp + 8 * b, dp + 8 * b, lp + 8 * b, min(IOV_MAX, hi - b))
        return None
    states = helper.states()
    assert states is not None  # _copy_part checked it
    bounds = np.asarray(job.bounds[rlo:rhi + 1], dtype=np.int64)
    out = np.zeros((2, rhi - rlo), dtype=np.uint64)
    for b in range(lo, hi, IOV_MAX):
        if job.cancelled:
            return "cancelled"
        rc = helper.copy_regions(sp, dp, lp, b, min(hi, b + IOV_MAX), bounds.ctypes.data,
                                 rhi - rlo, helper.update_fn, helper.reset_fn, helper.digest_fn,
                                 states[0], states[1], out.ctypes.data,
                                 out.ctypes.data + 8 * (rhi - rlo))
        if rc != 0:
            return f"shm copy: xxh3 update failed ({rc})"
    for k, (a, z) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        if z > a:  # an empty region keeps the digest of no bytes
            job.digests[rlo + k] = int(out[0, k])
            job.landed[rlo + k] = int(out[1, k])
    return None


def read_back(target: Target, offsets: np.ndarray, nbytes: np.ndarray) -> int | None:
    """The xxh3-64 of the pieces (`offsets` into the peer's buffer, `nbytes` each) of a mapped
    `target` as they are now, in order: what a write just left there, read at the addresses
    the peer reads (writer.OneSidedWriter.read_back). None on the cma lane (its bytes are not
    mapped here) or when a piece lies outside the target."""
    if target.lane != "map" or target.mapping is None or target.mapping.closed:
        return None
    if nbytes.size and int((offsets + nbytes).max()) > target.nbytes:
        return None
    ptrs = np.ascontiguousarray(offsets + target.base, dtype=np.int64)
    lens = np.ascontiguousarray(nbytes, dtype=np.int64)
    helper, _ = native()
    state = helper.new_hash() if helper is not None else None
    if helper is None or state is None:
        h = xxhash.xxh3_64()
        for p, n in zip(ptrs.tolist(), lens.tolist(), strict=True):
            h.update((ctypes.c_char * n).from_address(p))
        return int(h.intdigest())
    try:
        rc = helper.hash(ptrs.ctypes.data, lens.ctypes.data, lens.size, helper.update_fn, state)
    finally:
        digest = helper.digest(state)
    return digest if rc == 0 else None


def _copy_cma(job: CopyJob, lo: int, hi: int, seg: int) -> str | None:
    pid = job.target.pid
    h = xxhash.xxh3_64() if job.checksum else None
    tamper = job.tamper or {}
    for b in range(lo, hi, IOV_MAX):
        if job.cancelled:
            return "cancelled"
        e = min(hi, b + IOV_MAX)
        k = e - b
        local = np.empty((k, 2), np.uint64)
        remote = np.empty((k, 2), np.uint64)
        local[:, 0] = job.src[b:e]
        local[:, 1] = job.lens[b:e]
        remote[:, 0] = job.dst[b:e]
        remote[:, 1] = job.lens[b:e]
        if h is not None:
            for s, n in zip(job.src[b:e].tolist(), job.lens[b:e].tolist(), strict=True):
                h.update((ctypes.c_char * n).from_address(s))
        want = int(job.lens[b:e].sum())
        done = 0
        while done < want:  # a partial write leaves whole iovecs or a cut one: resume there
            r = _pvw(pid, local.ctypes.data, local.shape[0], remote.ctypes.data,
                     remote.shape[0], 0)
            if r < 0:
                errno = ctypes.get_errno()
                return (f"cross-memory write to peer process {pid} failed: "
                        f"{os.strerror(errno)} (errno {errno})")
            if r == 0:
                return f"cross-memory write to peer process {pid} made no progress"
            done += r
            if done < want:
                local, remote = _advance(local, r), _advance(remote, r)
        for i in [i for i in tamper if b <= i < e]:
            err = _flip_cma(pid, int(job.src[i]), int(job.dst[i]), int(job.lens[i]), tamper[i])
            if err is not None:
                return err
    if h is not None:
        job.digests[seg] = int(h.intdigest())
    return None


def _flip_cma(pid: int, src: int, dst: int, nbytes: int, at: int) -> str | None:
    """(fault injection) Writes the flipped source byte `at` (clamped into the piece) of a
    piece just copied over its copy in process `pid`."""
    at = min(max(at, 0), nbytes - 1)
    buf = ctypes.c_uint8(ctypes.c_uint8.from_address(src + at).value ^ 0xFF)
    local = (ctypes.c_uint64 * 2)(ctypes.addressof(buf), 1)
    remote = (ctypes.c_uint64 * 2)(dst + at, 1)
    if _pvw(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0) != 1:
        errno = ctypes.get_errno()
        return f"fault injection: flipping a byte in process {pid} failed: {os.strerror(errno)}"
    return None


def _advance(iov: np.ndarray, nbytes: int) -> np.ndarray:
    """The iovec array with its first `nbytes` bytes consumed."""
    ends = np.cumsum(iov[:, 1].astype(np.int64))
    i = int(np.searchsorted(ends, nbytes, side="right"))
    rest: np.ndarray = iov[i:].copy()
    consumed = nbytes - (int(ends[i - 1]) if i else 0)
    rest[0, 0] += np.uint64(consumed)
    rest[0, 1] -= np.uint64(consumed)
    return rest


def check_cma(pid: int) -> str | None:
    """Why cross-memory writes to `pid` cannot work (a zero-length probe), None if they can."""
    buf = ctypes.create_string_buffer(1)
    iov = (ctypes.c_uint64 * 2)(ctypes.addressof(buf), 0)
    r = _pvw(pid, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0)
    if r < 0:
        errno = ctypes.get_errno()
        return f"process_vm_writev to pid {pid}: {os.strerror(errno)}"
    return None


__all__ = ["IOV_MAX", "CopyPool", "CopyJob", "Target", "check_cma", "open_target", "read_back"]
