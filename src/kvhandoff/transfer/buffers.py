"""The KV buffers an agent owns: one flat byte view per (region, layer).

Engines hand in torch tensors (CPU or CUDA) or numpy arrays, one per layer buffer of each
region; the agent needs each as a contiguous 1-D uint8 view (no copy) holding whole pages. A
buffer that is not contiguous, or whose size is not a whole number of pages, is refused with the
region and layer named.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec
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


class BufferSet:
    """Byte views of every (region, layer) buffer of a layout."""

    __slots__ = ("layout", "_bufs", "_pages")

    def __init__(self, layout: LayoutSpec, buffers: Mapping[str, Any]) -> None:
        self.layout = layout
        self._bufs: dict[tuple[str, int], Any] = {}
        self._pages: dict[str, int] = {}
        for reg in layout.regions:
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
            pnb = reg.page_nbytes(layout.page_size_tokens)
            pages = None
            for lid in reg.layer_ids:
                if lid not in per_layer:
                    raise ConfigError(f"buffers[{reg.name}]: layer {lid} missing")
                view = as_bytes(per_layer[lid], f"buffers[{reg.name}][{lid}]")
                n = int(view.shape[0])
                if n % pnb:
                    raise ConfigError(f"buffers[{reg.name}][{lid}]: {n} bytes is not a whole "
                                      f"number of {pnb}-byte pages")
                pages = n // pnb if pages is None else min(pages, n // pnb)
                self._bufs[(reg.name, lid)] = view
            self._pages[reg.name] = pages or 0

    @staticmethod
    def name(region: str, layer: int) -> str:
        return f"{region}/{layer}"

    def array(self, region: str, layer: int) -> Any:
        return self._bufs[(region, layer)]

    def num_pages(self, region: str) -> int:
        return self._pages[region]

    def views(self) -> Iterator[tuple[str, Any]]:
        for (region, layer), v in self._bufs.items():
            yield self.name(region, layer), v

    def descs(self) -> list[BufferDesc]:
        return [BufferDesc(region=r, layer=lid, nbytes=int(v.shape[0]))
                for (r, lid), v in self._bufs.items()]


def allocate(layout: LayoutSpec, num_pages: int, *, fill: int | None = 0
             ) -> dict[str, dict[int, Any]]:
    """CPU torch buffers for every (region, layer) of `layout` with `num_pages` pages each."""
    import torch

    out: dict[str, dict[int, Any]] = {}
    for reg in layout.regions:
        n = reg.page_nbytes(layout.page_size_tokens) * num_pages
        out[reg.name] = {
            lid: (torch.zeros(n, dtype=torch.uint8) if fill == 0 else
                  torch.full((n,), fill, dtype=torch.uint8) if fill is not None else
                  torch.empty(n, dtype=torch.uint8))
            for lid in reg.layer_ids
        }
    return out
