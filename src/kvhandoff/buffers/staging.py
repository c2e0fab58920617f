"""Host staging memory for device KV pages: pinned host slabs, registered with a host-only
transport, handed out in contiguous leases and reused; and the copies between a device
buffer's span list and a lease.

Used by `runtime.staging.StagedTransport` only (the one owner): the prefill copies a layer's
device pages into a lease and the transport sends the lease; the decode receives into a lease
and copies it into its device pages before the layer counts as landed.

- Slabs are torch uint8 tensors, pinned (`pin_memory`) where torch has CUDA, plain host memory
  elsewhere (the CPU stand-in). Each slab is registered once with the transport under
  ``SLAB_PREFIX + index``; the transport addresses a lease by (slab name, offset, length).
- `take(n)` finds a free range of ``n`` bytes (rounded up to `ALIGN`) in a slab (first fit),
  else adds a slab of max(`slab_bytes`, n); the slabs together never exceed `limit_bytes`
  (``settings.host_staging_mib``): beyond it `take` raises naming that setting (it never waits:
  two agents waiting on each other's staging memory could deadlock). `give` returns the range.
- Copies: one `copy_` per span between the device buffer and the lease, on a private CUDA
  stream per device that the caller then waits on (that stream only, never the device); on
  the CPU stand-in the same ops on CPU tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import TransportError

SLAB_PREFIX = "kvh-staging/"
ALIGN = 4096
SLAB_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Lease:
    """A contiguous range of one staging slab: `name` is the slab's transport name."""

    slab: int
    name: str
    offset: int
    nbytes: int


class StagingPool:
    """Pinned host slabs registered with a transport, handed out as leases (thread-safe)."""

    def __init__(self, register: Callable[[str, np.ndarray], None], *, limit_bytes: int,
                 slab_bytes: int = SLAB_BYTES, pinned: bool | None = None) -> None:
        import torch

        self._torch = torch
        self._register = register
        self.limit_bytes = int(limit_bytes)
        self.slab_bytes = min(int(slab_bytes), self.limit_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._lock = threading.Lock()
        self._slabs: list[Any] = []  # torch uint8 host tensors
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted free (offset, length)
        self.held_bytes = 0  # bytes of all slabs

    def slab(self, index: int) -> Any:
        """The host tensor of slab `index`."""
        return self._slabs[index]

    def take(self, nbytes: int) -> Lease:
        """A lease of at least `nbytes` bytes.

        Raises:
            TransportError: the slabs would exceed `limit_bytes`; names host_staging_mib.
        """
        need = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        with self._lock:
            for i, free in enumerate(self._free):
                for k, (off, length) in enumerate(free):
                    if length >= need:
                        if length == need:
                            del free[k]
                        else:
                            free[k] = (off + need, length - need)
                        return Lease(i, SLAB_PREFIX + str(i), off, need)
            size = max(self.slab_bytes, need)
            if self.held_bytes + size > self.limit_bytes:
                raise TransportError(
                    f"host staging: {need} more bytes would exceed "
                    f"settings.host_staging_mib={self.limit_bytes >> 20} "
                    f"({self.held_bytes} bytes held, in use by the layers in flight); raise "
                    "host_staging_mib")
            t = self._torch.empty(size, dtype=self._torch.uint8, pin_memory=self.pinned)
            i = len(self._slabs)
            self._register(SLAB_PREFIX + str(i), t.numpy())
            self._slabs.append(t)
            self._free.append([(need, size - need)] if size > need else [])
            self.held_bytes += size
            return Lease(i, SLAB_PREFIX + str(i), 0, need)

    def give(self, lease: Lease) -> None:
        """Returns `lease`'s range (merged with its free neighbours)."""
        with self._lock:
            free = self._free[lease.slab]
            free.append((lease.offset, lease.nbytes))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free[lease.slab] = merged

    def in_use(self) -> int:
        """Bytes leased now."""
        with self._lock:
            return self.held_bytes - sum(n for f in self._free for _, n in f)


def check_spans(name: str, size: int, offsets: Any, nbytes: Any) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """The span list as int64 arrays, inside a buffer of `size` bytes.

    Raises:
        TransportError: mismatched or non-1-D lists, a negative value, a span out of bounds.
    """
    off = np.asarray(offsets, dtype=np.int64)
    nb = np.asarray(nbytes, dtype=np.int64)
    if off.ndim != 1 or off.shape != nb.shape:
        raise TransportError(f"{name}: offsets and nbytes must be 1-D lists of equal length")
    if len(off) and (off.min() < 0 or nb.min() < 0 or int((off + nb).max()) > size):
        raise TransportError(f"{name}: a span is outside the buffer's {size} bytes")
    return off, nb


def _pairs(dev: Any, host: Any, at: int, offsets: np.ndarray, nbytes: np.ndarray
           ) -> list[tuple[Any, Any]]:
    out, pos = [], at
    for o, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
        if n:
            out.append((dev[o:o + n], host[pos:pos + n]))
            pos += n
    return out


def _run(dev: Any, copies: Callable[[], None]) -> None:
    """Runs `copies` on a private stream of `dev`'s CUDA device and waits for that stream;
    on a CPU tensor (the stand-in) runs them as they are."""
    import torch

    if dev.device.type != "cuda":
        copies()
        return
    stream = _stream(dev.device)
    stream.wait_stream(torch.cuda.current_stream(dev.device))
    with torch.cuda.stream(stream):
        copies()
    stream.synchronize()


_streams: dict[Any, Any] = {}
_streams_lock = threading.Lock()


def _stream(device: Any) -> Any:
    import torch

    with _streams_lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return s


def copy_out(dev: Any, offsets: np.ndarray, nbytes: np.ndarray, host: Any, at: int) -> None:
    """Copies the spans of device buffer `dev` (a 1-D uint8 torch tensor) in order into host
    tensor `host` from byte `at` on; returns once the bytes are in `host`."""
    pairs = _pairs(dev, host, at, offsets, nbytes)

    def copies() -> None:
        for d, h in pairs:
            h.copy_(d, non_blocking=True)

    _run(dev, copies)


def copy_in(host: Any, at: int, dev: Any, offsets: np.ndarray, nbytes: np.ndarray) -> None:
    """Copies `host` from byte `at` on into the spans of device buffer `dev`, in order;
    returns once the bytes are in `dev`."""
    pairs = _pairs(dev, host, at, offsets, nbytes)

    def copies() -> None:
        for d, h in pairs:
            d.copy_(h, non_blocking=True)

    _run(dev, copies)
