"""Host staging memory for device KV pages: one pinned host arena, registered with a host-only
transport, handed out in leases (span lists of the arena) and reused; and the copies between a
device buffer's span list and a lease.

Used by `runtime.staging.StagedTransport` only (the one owner): the prefill copies a layer's
device pages into a lease and the transport sends the lease; the decode receives into a lease
and copies it into its device pages before the layer counts as landed.

- The arena is one torch uint8 tensor of `limit_bytes` (``settings.host_staging_mib``), made
  on first use: pinned (`pin_memory`) where torch has CUDA, plain host memory elsewhere (the
  CPU stand-in). It is registered once with the transport under `ARENA`; the transport
  addresses a lease by its span list (offsets, lengths) in it.
- `take(n)` returns a lease of exactly ``n`` bytes made of free ranges (first fit, in
  `ALIGN`-byte units, as many ranges as it takes), or None while the free ranges hold less;
  a request larger than the whole arena raises, naming host_staging_mib. `give` returns a
  lease's ranges (merged with free neighbours).
- Copies: one `copy_` per piece of the paired span lists (device spans, lease ranges) on a
  private CUDA stream per device that the caller then waits on (that stream only, never the
  device); on the CPU stand-in the same ops on CPU tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans

ARENA = "kvh-staging"
ALIGN = 4096


@dataclass(frozen=True, slots=True)
class Lease:
    """Ranges of the arena holding `nbytes` bytes, in stream order (`offsets`, `lengths`:
    the span list the transport moves)."""

    offsets: np.ndarray
    lengths: np.ndarray
    nbytes: int
    units: tuple[tuple[int, int], ...]  # the ALIGN-rounded ranges taken (for `give`)


class StagingPool:
    """One host arena registered with a transport, handed out as leases (thread-safe)."""

    def __init__(self, register: Callable[[str, np.ndarray], None], *, limit_bytes: int,
                 pinned: bool | None = None) -> None:
        import torch

        self._torch = torch
        self._register = register
        self.limit_bytes = int(limit_bytes) // ALIGN * ALIGN
        if self.limit_bytes <= 0:
            raise TransportError(f"host staging: settings.host_staging_mib gives "
                                 f"{limit_bytes} bytes, less than one {ALIGN}-byte unit")
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._lock = threading.Lock()
        self.arena: Any = None  # the torch uint8 host tensor, made on first use
        self._free: list[tuple[int, int]] = [(0, self.limit_bytes)]  # sorted (offset, len)
        self.held_bytes = 0  # bytes of the arena once made

    def take(self, nbytes: int) -> Lease | None:
        """A lease of `nbytes` bytes, or None while the free ranges hold less.

        Raises:
            TransportError: `nbytes` exceeds the whole arena; names host_staging_mib.
        """
        n = int(nbytes)
        need = self.check(n)
        with self._lock:
            if sum(length for _, length in self._free) < need:
                return None
            if self.arena is None:
                t = self._torch.empty(self.limit_bytes, dtype=self._torch.uint8,
                                      pin_memory=self.pinned)
                self._register(ARENA, t.numpy())
                self.arena, self.held_bytes = t, self.limit_bytes
            units: list[tuple[int, int]] = []
            left = need
            while left:
                off, length = self._free[0]
                got = min(length, left)
                units.append((off, got))
                left -= got
                if got == length:
                    del self._free[0]
                else:
                    self._free[0] = (off + got, length - got)
        offs = np.array([u[0] for u in units], dtype=np.int64)
        lens = np.array([u[1] for u in units], dtype=np.int64)
        lens[-1] -= need - n if n else lens[-1]  # exactly n bytes (a 0-byte lease: no span)
        keep = lens > 0
        return Lease(offs[keep], lens[keep], n, tuple(units))

    def give(self, lease: Lease) -> None:
        """Returns `lease`'s ranges."""
        with self._lock:
            free = sorted([*self._free, *lease.units])
            merged: list[tuple[int, int]] = []
            for off, length in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged

    def check(self, nbytes: int) -> int:
        """The ALIGN-rounded size of a lease of `nbytes`.

        Raises:
            TransportError: it exceeds the whole arena; names host_staging_mib.
        """
        need = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        if need > self.limit_bytes:
            raise TransportError(
                f"host staging: {nbytes} bytes of one layer exceed settings.host_staging_mib="
                f"{self.limit_bytes >> 20} (the whole staging arena); raise host_staging_mib")
        return need

    def fits(self, nbytes: int) -> bool:
        """Whether `take(nbytes)` would give a lease now."""
        need = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        with self._lock:
            return need <= sum(length for _, length in self._free)

    def in_use(self) -> int:
        """Bytes leased now (in ALIGN units)."""
        with self._lock:
            return self.limit_bytes - sum(length for _, length in self._free)


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


def _pieces(dev: Any, host: Any, offsets: np.ndarray, nbytes: np.ndarray, lease: Lease
            ) -> list[tuple[Any, Any]]:
    """(device slice, host slice) of each piece where the device span list and the lease's
    ranges carry the same stream bytes."""
    plan = pair_spans(offsets, nbytes, lease.offsets, lease.lengths)
    return [(dev[d:d + n], host[h:h + n]) for d, h, n in
            zip(plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.nbytes.tolist(),
                strict=True)]


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


def copy_out(dev: Any, offsets: np.ndarray, nbytes: np.ndarray, host: Any, lease: Lease
             ) -> None:
    """Copies the spans of device buffer `dev` (a 1-D uint8 torch tensor), in order, into the
    lease's ranges of host tensor `host`; returns once the bytes are in `host`."""
    pieces = _pieces(dev, host, offsets, nbytes, lease)

    def copies() -> None:
        for d, h in pieces:
            h.copy_(d, non_blocking=True)

    _run(dev, copies)


def copy_in(host: Any, lease: Lease, dev: Any, offsets: np.ndarray, nbytes: np.ndarray
            ) -> None:
    """Copies the lease's ranges of `host`, in order, into the spans of device buffer `dev`;
    returns once the bytes are in `dev`."""
    pieces = _pieces(dev, host, offsets, nbytes, lease)

    def copies() -> None:
        for d, h in pieces:
            d.copy_(h, non_blocking=True)

    _run(dev, copies)
