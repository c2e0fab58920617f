"""The KV buffers an agent owns: one flat byte view per live (region, layer).

Engines hand in torch tensors (CPU or CUDA) or numpy arrays:
- per-layer regions: one buffer per layer (a dict layer -> buffer, or a sequence aligned with
  the region's layer ids), each ``pages x item_len`` bytes. A layer holding 0 rows
  (`RegionSpec.empty_layers`, SGLang's 0-row placeholders) may be absent or given as an empty
  buffer; it owns no memory and gets no view.
- packed rows (`LayoutSpec.rows`, vLLM's BLHNC blocks): ONE buffer per row, keyed by the row's
  name, ``blocks x row_stride`` bytes; block p holds page p of every member layer.

The agent asks for each live (region, layer) a contiguous 1-D uint8 view (no copy) whose byte 0
is page 0 of that layer: for a per-layer buffer the buffer itself; for a packed row the slice
from the layer's offset in the block on, so page p of the layer is at ``p * row_stride`` of the
view, which is where `build_spans` puts it. Views of one row overlap; transports address them
by name and offset only. A buffer that is not contiguous, or whose size is not a whole number
of pages (blocks), is refused with the region (row) and layer named.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, RegionSpec
from kvhandoff.transfer.protocol import BufferDesc


def as_bytes(buf: Any, where: str) -> Any:
    """A 1-D uint8 view of `buf` (numpy array or torch tensor), no copy."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ConfigError(f"{where}: buffer must be contiguous")
        return buf.reshape(-1).view(np.uint8)
    import torch

    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ConfigError(f"{where}: tensor must be contiguous")
        flat = buf.reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    raise ConfigError(f"{where}: expected a numpy array or torch tensor, got {type(buf).__name__}")


def _nbytes(view: Any) -> int:
    return int(view.shape[0])


class BufferSet:
    """Byte views of every live (region, layer) of a layout, per-layer or inside packed rows."""

    __slots__ = ("layout", "_bufs", "_pages", "_rows")

    def __init__(self, layout: LayoutSpec, buffers: Mapping[str, Any]) -> None:
        self.layout = layout
        self._bufs: dict[tuple[str, int], Any] = {}
        self._pages: dict[str, int] = {}
        self._rows: dict[str, Any] = {}
        ps = layout.page_size_tokens
        for row in layout.rows:
            if row.name not in buffers:
                raise ConfigError(f"buffers: packed row {row.name!r} (regions "
                                  f"{', '.join(row.regions)}) missing (have "
                                  f"{', '.join(map(str, buffers))})")
            view = as_bytes(buffers[row.name], f"buffers[{row.name}]")
            stride = layout.region(row.regions[0]).page_stride(ps)
            n = _nbytes(view)
            if n % stride:
                raise ConfigError(f"buffers[{row.name}]: {n} bytes is not a whole number of "
                                  f"{stride}-byte blocks")
            blocks = n // stride
            self._rows[row.name] = view
            for rn in row.regions:
                reg = layout.region(rn)
                if rn in buffers:
                    raise ConfigError(f"buffers[{rn}]: region {rn!r} lives in packed row "
                                      f"{row.name!r}; pass buffers[{row.name!r}] only")
                self._pages[rn] = blocks
                for lid in reg.live_layer_ids:
                    off = layout.layer_offset(rn, lid)
                    end = off + (blocks - 1) * stride + reg.page_nbytes(ps) if blocks else off
                    self._bufs[(rn, lid)] = view[off:end]
        for reg in layout.regions:
            if reg.placement is not None:
                continue
            self._per_layer(reg, buffers, ps)

    def _per_layer(self, reg: RegionSpec, buffers: Mapping[str, Any], ps: int) -> None:
        if reg.name not in buffers:
            raise ConfigError(f"buffers: region {reg.name!r} missing (have "
                              f"{', '.join(map(str, buffers))})")
        given = buffers[reg.name]
        if isinstance(given, Mapping):
            per_layer = dict(given)
        elif isinstance(given, Sequence) or isinstance(given, np.ndarray):
            if len(given) != reg.num_layers:
                raise ConfigError(f"buffers[{reg.name}]: expected {reg.num_layers} layer "
                                  f"buffers, got {len(given)}")
            per_layer = dict(zip(reg.layer_ids, given, strict=True))
        else:
            raise ConfigError(f"buffers[{reg.name}]: expected a dict layer -> buffer or a "
                              "list aligned with the region's layer ids")
        pnb = reg.page_nbytes(ps)
        pages: int | None = None
        for lid in reg.layer_ids:
            where = f"buffers[{reg.name}][{lid}]"
            if reg.is_empty(lid):
                if lid in per_layer and _nbytes(as_bytes(per_layer[lid], where)):
                    raise ConfigError(f"{where}: layer {lid} holds 0 rows (empty_layers) but "
                                      "its buffer is not empty")
                continue
            if lid not in per_layer:
                raise ConfigError(f"buffers[{reg.name}]: layer {lid} missing")
            view = as_bytes(per_layer[lid], where)
            n = _nbytes(view)
            if n % pnb:
                raise ConfigError(f"{where}: {n} bytes is not a whole number of {pnb}-byte "
                                  "pages")
            pages = n // pnb if pages is None else min(pages, n // pnb)
            self._bufs[(reg.name, lid)] = view
        self._pages[reg.name] = pages or 0

    @staticmethod
    def name(region: str, layer: int) -> str:
        return f"{region}/{layer}"

    def array(self, region: str, layer: int) -> Any:
        """The view of (region, layer): byte 0 is page 0 of the layer."""
        try:
            return self._bufs[(region, layer)]
        except KeyError:
            raise ConfigError(f"buffers: no live layer {layer} in region {region!r}") from None

    def row(self, name: str) -> Any:
        """The whole buffer of a packed row."""
        return self._rows[name]

    def num_pages(self, region: str) -> int:
        return self._pages[region]

    def views(self) -> Iterator[tuple[str, Any]]:
        """(name, view) of every live (region, layer); 0-byte views are left out."""
        for (region, layer), v in self._bufs.items():
            if _nbytes(v):
                yield self.name(region, layer), v

    def descs(self) -> list[BufferDesc]:
        return [BufferDesc(region=r, layer=lid, nbytes=_nbytes(v))
                for (r, lid), v in self._bufs.items()]


def allocate(layout: LayoutSpec, num_pages: int, *, fill: int | None = 0) -> dict[str, Any]:
    """CPU torch buffers for `layout` with `num_pages` pages: per-layer regions get a dict
    layer -> buffer (0-row layers an empty placeholder), packed rows one buffer each."""
    import torch

    def buf(n: int) -> Any:
        return (torch.zeros(n, dtype=torch.uint8) if fill == 0 else
                torch.full((n,), fill, dtype=torch.uint8) if fill is not None else
                torch.empty(n, dtype=torch.uint8))

    ps = layout.page_size_tokens
    out: dict[str, Any] = {}
    for row in layout.rows:
        out[row.name] = buf(layout.region(row.regions[0]).page_stride(ps) * num_pages)
    for reg in layout.regions:
        if reg.placement is not None:
            continue
        n = reg.page_nbytes(ps) * num_pages
        out[reg.name] = {lid: buf(0 if reg.is_empty(lid) else n) for lid in reg.layer_ids}
    return out
