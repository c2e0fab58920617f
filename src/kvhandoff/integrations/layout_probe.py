"""The layout probe: does the `LayoutSpec` an adapter built say where the engine's kernel puts a
token? Backend-independent half (the engine adapters write the scratch cache).

How it works: an adapter allocates a scratch cache of the engine's per-layer shape and dtype
(one or two pages, same device, never the live pages), writes known keys/values (latent/rope,
indexer key/scale) for chosen slots through the engine's OWN cache-write op, and records, per
(slot, plane), the bytes that op was given. `check_region` reads each (slot, plane) back from the
scratch buffers at the address the layout gives (``LayoutSpec.address`` + plane offset * rows per
page + row * plane bytes) and returns every disagreement; `LayoutProbeError` turns them into a
refusal to start that names the backend, the slot, the plane, what the layout expected and where
the bytes really landed.

Rules:
- A slot is a row slot of the scratch cache: ``slot = page * rows_per_page + row`` (a row is a
  token unless the region compresses, `tokens_per_row`).
- `buffers` is what the adapter registers with the agent: region name -> {layer id -> 1-D uint8
  buffer}, or packed-row name -> 1-D uint8 buffer. A buffer is anything with the buffer protocol
  or a torch tensor (a device tensor is copied to the host once per buffer).
- Expected values should differ between every (slot, plane, byte) so that a misplaced plane
  cannot read back right by coincidence; `distinct_values` gives such a pattern.
- No engine import, no I/O, no clock; numpy only (torch is used only through the buffers'
  own methods).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, RegionSpec

__all__ = ["LayoutProbeError", "Mismatch", "check_region", "describe_region", "distinct_values",
           "require_agreement", "slot_address", "stray_writes"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One (slot, plane) whose bytes are not where the layout says."""

    region: str
    layer: int
    slot: int
    page: int
    row: int
    plane: str
    buffer: str  # buffer key (region or packed row name)
    offset: int  # byte offset the layout gives, in that buffer
    expected: bytes
    got: bytes
    found_at: int | None  # where the expected bytes really are in that buffer (None: nowhere)

    def describe(self) -> str:
        where = (f"found at byte {self.found_at}" if self.found_at is not None
                 else "not found anywhere in the scratch buffer")
        return (f"region {self.region!r} layer {self.layer} token slot {self.slot} (page "
                f"{self.page}, row {self.row}) plane {self.plane!r}: the layout puts it at byte "
                f"{self.offset} of buffer {self.buffer!r}; expected {_hex(self.expected)}, read "
                f"{_hex(self.got)}; the kernel's bytes were {where}")


class LayoutProbeError(ConfigError):
    """The engine's kernel wrote a token somewhere the layout does not say: refuse to start.

    Attributes:
        backend: the attention backend (or pool) probed, e.g. ``CPU_ATTN``.
        mismatches: every disagreement found (the message shows the first few).
        expected_layout: `describe_region` of the layout that was checked.
    """

    def __init__(self, backend: str, mismatches: Sequence[Mismatch], expected_layout: str) -> None:
        self.backend = backend
        self.mismatches = list(mismatches)
        self.expected_layout = expected_layout
        first = self.mismatches[0] if self.mismatches else None
        self.slot = first.slot if first else None
        self.plane = first.plane if first else None
        shown = "; ".join(m.describe() for m in self.mismatches[:3])
        more = (f" (and {len(self.mismatches) - 3} more)" if len(self.mismatches) > 3 else "")
        super().__init__(
            f"layout probe against {backend}: {len(self.mismatches)} (slot, plane) pairs are not "
            f"where the layout says: {shown}{more}. Expected layout: {expected_layout}. The "
            "connector refuses to start rather than move wrong KV; report this with the backend "
            "and engine version")


def distinct_values(n_bytes: int, *, salt: int) -> np.ndarray:
    """`n_bytes` pseudo-random bytes for one (slot, plane): different salts give different
    sequences, so a misplaced plane cannot match by coincidence (uint8)."""
    rng = np.random.default_rng(0x5EED_0000 + salt)
    out: np.ndarray = rng.integers(0, 256, size=n_bytes, dtype=np.uint8)
    return out


def slot_address(layout: LayoutSpec, region: str, layer: int, slot: int,
                 plane: str) -> tuple[str, int, int]:
    """(buffer key, byte offset, byte count) of `plane` of row slot `slot` of `layer`."""
    reg = layout.region(region)
    rows = reg.rows_per_page(layout.page_size_tokens)
    if slot < 0:
        raise ConfigError(f"slot: expected >= 0, got {slot}")
    page, row = divmod(slot, rows)
    idx = _plane_index(reg, plane)
    key, off = layout.address(region, layer, page)
    pl = reg.planes[idx]
    return key, off + reg.plane_offsets()[idx] * rows + row * pl.bytes_per_token, \
        pl.bytes_per_token


def check_region(layout: LayoutSpec, region: str, buffers: Mapping[str, Any],
                 expected: Mapping[tuple[int, str], bytes | np.ndarray], *,
                 layer: int | None = None) -> list[Mismatch]:
    """Every (slot, plane) of `expected` whose bytes in `buffers` differ from the expected ones.

    Args:
        layout: the layout the adapter built for the scratch cache (same shapes as the live one).
        region: the region probed.
        buffers: the scratch buffers, keyed as the adapter keys its live ones.
        expected: ``(slot, plane name) -> bytes`` the engine's write op was given.
        layer: the layer probed (default: the region's first live layer).

    Returns:
        The mismatches in (slot, plane) order; empty when the layout agrees with the kernel.
    """
    reg = layout.region(region)
    lid = reg.live_layer_ids[0] if layer is None else layer
    host: dict[str, np.ndarray] = {}
    out: list[Mismatch] = []
    rows = reg.rows_per_page(layout.page_size_tokens)
    for (slot, plane) in sorted(expected, key=lambda k: (k[0], _plane_index(reg, k[1]))):
        v = expected[(slot, plane)]
        want = v if isinstance(v, bytes) else np.asarray(v, dtype=np.uint8).tobytes()
        key, off, n = slot_address(layout, region, lid, slot, plane)
        if len(want) != n:
            raise ConfigError(f"expected[({slot}, {plane!r})]: {len(want)} bytes, but plane "
                              f"{plane!r} of region {region!r} holds {n} bytes per row")
        if key not in host:
            host[key] = _host_bytes(_buffer(buffers, key, lid), f"buffers[{key!r}]")
        arr = host[key]
        if off + n > arr.shape[0]:
            raise ConfigError(f"buffers[{key!r}]: {arr.shape[0]} bytes, the layout puts slot "
                              f"{slot} plane {plane!r} at bytes {off}..{off + n}")
        got = arr[off:off + n].tobytes()
        if got != want:
            found = arr.tobytes().find(want)
            page, row = divmod(slot, rows)
            out.append(Mismatch(region=region, layer=lid, slot=slot, page=page, row=row,
                                plane=plane, buffer=key, offset=off, expected=want, got=got,
                                found_at=None if found < 0 else found))
    return out


def stray_writes(layout: LayoutSpec, region: str, buffers: Mapping[str, Any],
                 expected: Mapping[tuple[int, str], Any], *, layer: int | None = None,
                 pages: int) -> list[tuple[str, int, int]]:
    """Runs of non-zero bytes in the first `pages` pages of `layer` of a ZEROED scratch buffer
    that no (slot, plane) of `expected` covers: the kernel wrote where the layout has nothing
    (a plane the layout lacks, a token written twice). ``(buffer key, byte offset, length)``,
    at most 8 runs."""
    reg = layout.region(region)
    lid = reg.live_layer_ids[0] if layer is None else layer
    key, base = layout.address(region, lid, 0)
    arr = _host_bytes(_buffer(buffers, key, lid), f"buffers[{key!r}]")
    stride = reg.page_stride(layout.page_size_tokens)
    page = reg.page_nbytes(layout.page_size_tokens)
    covered = np.zeros(arr.shape[0], dtype=bool)
    for (slot, plane) in expected:
        k, off, n = slot_address(layout, region, lid, slot, plane)
        if k == key:
            covered[off:off + n] = True
    live = np.zeros(arr.shape[0], dtype=bool)
    for p in range(pages):
        live[base + p * stride:base + p * stride + page] = True
    stray = (arr != 0) & ~covered & live
    out: list[tuple[str, int, int]] = []
    idx = np.flatnonzero(stray)
    if idx.size:
        cuts = np.flatnonzero(np.diff(idx) > 1)
        starts = np.concatenate(([idx[0]], idx[cuts + 1]))
        ends = np.concatenate((idx[cuts], [idx[-1]])) + 1
        out = [(key, int(a), int(b - a)) for a, b in zip(starts[:8], ends[:8], strict=True)]
    return out


def require_agreement(backend: str, layout: LayoutSpec, region: str, buffers: Mapping[str, Any],
                      expected: Mapping[tuple[int, str], bytes | np.ndarray], *,
                      layer: int | None = None) -> None:
    """`check_region`, raising `LayoutProbeError` on any mismatch."""
    bad = check_region(layout, region, buffers, expected, layer=layer)
    if bad:
        raise LayoutProbeError(backend, bad, describe_region(layout, region))


def describe_region(layout: LayoutSpec, region: str) -> str:
    """The layout of one page of `region`, for a person: rows, planes in order (long runs of
    same-sized planes are summarised), page bytes."""
    reg = layout.region(region)
    rows = reg.rows_per_page(layout.page_size_tokens)
    parts: list[str] = []
    planes = list(reg.planes)
    i = 0
    while i < len(planes):
        j = i
        while j + 1 < len(planes) and planes[j + 1].bytes_per_token == planes[i].bytes_per_token:
            j += 1
        if j - i >= 3:
            parts.append(f"{planes[i].name}..{planes[j].name} ({j - i + 1} planes of "
                         f"{planes[i].bytes_per_token} B/row)")
        else:
            parts.extend(f"{p.name} ({p.bytes_per_token} B/row)" for p in planes[i:j + 1])
        i = j + 1
    return (f"region {region!r}: a page of {rows} rows holds, plane after plane, all rows of "
            f"{', '.join(parts)} ({reg.page_nbytes(layout.page_size_tokens)} B per page)")


def _plane_index(reg: RegionSpec, plane: str) -> int:
    for i, p in enumerate(reg.planes):
        if p.name == plane:
            return i
    raise ConfigError(f"plane {plane!r}: not a plane of region {reg.name!r} "
                      f"({', '.join(p.name for p in reg.planes[:8])}"
                      f"{' ...' if len(reg.planes) > 8 else ''})")


def _buffer(buffers: Mapping[str, Any], key: str, layer: int) -> Any:
    if key not in buffers:
        raise ConfigError(f"buffers: no buffer {key!r} (have {sorted(buffers)})")
    b = buffers[key]
    if isinstance(b, Mapping):
        if layer not in b:
            raise ConfigError(f"buffers[{key!r}]: no buffer for layer {layer}")
        return b[layer]
    return b


def _host_bytes(buf: Any, where: str) -> np.ndarray:
    """A flat uint8 host copy (or view) of `buf`."""
    if hasattr(buf, "detach") and hasattr(buf, "cpu"):  # a torch tensor, maybe on a device
        t = buf.detach().reshape(-1)
        if getattr(t, "dtype", None) is not None and str(t.dtype) != "torch.uint8":
            raise ConfigError(f"{where}: expected a uint8 tensor, got {t.dtype}")
        arr: np.ndarray = t.cpu().numpy()
        return arr
    try:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    except TypeError as e:
        raise ConfigError(f"{where}: not a byte buffer ({type(buf).__name__})") from e


def _hex(b: bytes, limit: int = 8) -> str:
    return b[:limit].hex() + ("…" if len(b) > limit else "")
