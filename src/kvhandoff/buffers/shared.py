"""KV buffers in shared memory, so that a same-host peer can map them and write into them.

`allocate_shared(layout, num_pages)` is `buffers.allocate` with every (region, layer) buffer
placed in one memfd-backed shared mapping owned by kvhandoff: same shape (CPU torch tensors,
or numpy arrays with `numpy_arrays=True`), but the `shm` transport recognises them (a buffer's
address lies in a segment of this process) and hands a proved same-host peer the segment's
memfd over a Unix socket (transports/shm/proof.py); that prefill maps the segment and copies
each span itself (one copy per byte, no staging, no syscall per span; see
transports/shm/transport.py). A buffer outside any segment still works, through cross-memory writes.

Rules: a segment lives as long as this process holds a view of it or the segment registry does
(segments are never unmapped while a view exists: the mapping is a Python `mmap` that numpy
views keep alive). `release_segments()` drops the registry's references (tests). Nothing is
left behind when the process dies: a memfd has no name in any file system.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec

_ALIGN = 4096
_LOCK = threading.Lock()
_SEGMENTS: list[SharedSegment] = []


@dataclass(frozen=True)
class SegmentRef:
    """Where a buffer lies in a shared segment of this process."""

    pid: int
    fd: int
    segment_nbytes: int
    offset: int


class SharedSegment:
    """One memfd-backed shared mapping of `nbytes` bytes (zero-filled), with a numpy view."""

    __slots__ = ("fd", "nbytes", "mm", "array", "addr")

    def __init__(self, nbytes: int, name: str = "kvhandoff-kv") -> None:
        if nbytes <= 0:
            raise ConfigError(f"shared segment: nbytes must be > 0, got {nbytes}")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except (AttributeError, OSError) as e:
            raise ConfigError(f"shared segment: memfd_create failed ({e}); this needs Linux") \
                from e
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"shared segment: cannot map {nbytes} bytes: {e}") from e
        self.fd = fd
        self.nbytes = nbytes
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        with _LOCK:
            _SEGMENTS.append(self)

    def __repr__(self) -> str:
        return f"SharedSegment(fd={self.fd}, nbytes={self.nbytes})"


def find_segment(addr: int, nbytes: int) -> SegmentRef | None:
    """The shared segment of this process holding [addr, addr + nbytes), None if none does."""
    with _LOCK:
        for seg in _SEGMENTS:
            if seg.addr <= addr and addr + nbytes <= seg.addr + seg.nbytes:
                return SegmentRef(pid=os.getpid(), fd=seg.fd, segment_nbytes=seg.nbytes,
                                  offset=addr - seg.addr)
    return None


def release_segments() -> None:
    """Forgets every segment (their memory goes once no view of it is left)."""
    with _LOCK:
        _SEGMENTS.clear()


def allocate_shared(layout: LayoutSpec, num_pages: int, *, numpy_arrays: bool = False
                    ) -> dict[str, dict[int, Any]]:
    """Zeroed buffers for every (region, layer) of `layout`, `num_pages` pages each, in one
    shared segment: CPU torch tensors (views of the segment), or numpy arrays."""
    if num_pages <= 0:
        raise ConfigError(f"num_pages: expected > 0, got {num_pages}")
    places: list[tuple[str, int, int, int]] = []  # region, layer, offset, bytes
    total = 0
    for reg in layout.regions:
        n = reg.page_nbytes(layout.page_size_tokens) * num_pages
        for lid in reg.layer_ids:
            places.append((reg.name, lid, total, n))
            total += -(-n // _ALIGN) * _ALIGN  # each buffer starts page-aligned
    seg = SharedSegment(max(total, _ALIGN))
    out: dict[str, dict[int, Any]] = {reg.name: {} for reg in layout.regions}
    for region, lid, off, n in places:
        view = seg.array[off:off + n]
        if numpy_arrays:
            out[region][lid] = view
        else:
            import torch

            out[region][lid] = torch.from_numpy(view)
    return out
