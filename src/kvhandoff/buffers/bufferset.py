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

Memory kinds: every buffer of one agent lives in one kind of memory, host (numpy, CPU tensors)
or CUDA (CUDA tensors, or any object exposing ``__cuda_array_interface__``: CuPy, Numba, ...),
and all CUDA buffers on one device; a mix is refused with a `ConfigError` naming the buffer
that differs (`BufferSet.memory` / `.device` say which kind it is). A CUDA array interface
object becomes a torch tensor over the same memory where torch has CUDA, else a
`DeviceBytes` (address, size; sliceable), so sizes and kinds are checked on any machine.
Transports that move host memory only refuse CUDA views at `register`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, RegionSpec


class DeviceBytes:
    """A 1-D byte range of CUDA memory known only by address (from a
    ``__cuda_array_interface__`` where torch has no CUDA): size, slicing and its own array
    interface; the object it came from is kept alive. Nothing reads or writes through it."""

    __slots__ = ("ptr", "nbytes", "device", "_owner")

    def __init__(self, ptr: int, nbytes: int, device: int | None, owner: Any) -> None:
        self.ptr, self.nbytes, self.device, self._owner = ptr, nbytes, device, owner

    @property
    def shape(self) -> tuple[int]:
        return (self.nbytes,)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> DeviceBytes:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("DeviceBytes: only contiguous slices")
        start, stop, _ = key.indices(self.nbytes)
        return DeviceBytes(self.ptr + start, max(0, stop - start), self.device, self._owner)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"data": (self.ptr, False), "shape": (self.nbytes,), "typestr": "|u1",
                "strides": None, "version": 3}

    def __repr__(self) -> str:
        return f"DeviceBytes(ptr={self.ptr:#x}, nbytes={self.nbytes}, device={self.device})"


def _cuda_torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch if torch.cuda.is_available() else None


def as_bytes(buf: Any, where: str) -> Any:
    """A 1-D uint8 view of `buf` (numpy array, torch tensor or CUDA array interface object),
    no copy: a numpy array for host memory, a torch tensor (or `DeviceBytes`) for CUDA."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ConfigError(f"{where}: buffer must be contiguous")
        return buf.reshape(-1).view(np.uint8)
    if isinstance(buf, DeviceBytes):
        return buf
    import torch

    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ConfigError(f"{where}: tensor must be contiguous")
        if buf.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{where}: tensor on device {buf.device.type!r}; expected cpu "
                              "or cuda")
        flat = buf.reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    if hasattr(buf, "__cuda_array_interface__"):
        from kvhandoff.buffers.devsum import memory_kind

        try:
            info = memory_kind(buf)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        tc = _cuda_torch()
        if tc is not None:
            try:  # no device argument: torch keeps the memory where it is (never a copy)
                t = tc.as_tensor(buf)
            except (TypeError, RuntimeError, ValueError) as e:
                raise ConfigError(f"{where}: torch cannot use its CUDA array interface: "
                                  f"{e}") from None
            if t.device.type != "cuda" or (info.nbytes and t.data_ptr() != info.ptr):
                raise ConfigError(f"{where}: torch did not map its CUDA array interface in "
                                  f"place (got {t.device}); pass a torch tensor instead")
            return t.reshape(-1).view(tc.uint8)
        return DeviceBytes(info.ptr, info.nbytes, info.device, buf)
    raise ConfigError(f"{where}: expected a numpy array, a torch tensor or an object with "
                      f"__cuda_array_interface__, got {type(buf).__name__}")


def view_memory(view: Any) -> tuple[str, int | None]:
    """("host", None) or ("cuda", device index or None when unknown) of a view from
    `as_bytes`."""
    if isinstance(view, np.ndarray):
        return "host", None
    if isinstance(view, DeviceBytes):
        return "cuda", view.device
    return "cuda", view.device.index  # a CUDA torch tensor


def _nbytes(view: Any) -> int:
    return int(view.shape[0])


def buffer_name(region: str, layer: int) -> str:
    """The transport name of the buffer of (region, layer): what transports register, what a
    Hello's buffer descriptors and the data effects name."""
    return f"{region}/{layer}"


class Extent(NamedTuple):
    """One live (region, layer) buffer and its size."""

    region: str
    layer: int
    nbytes: int


class BufferSet:
    """Byte views of every live (region, layer) of a layout, per-layer or inside packed rows."""

    __slots__ = ("layout", "_bufs", "_pages", "_rows", "memory", "device", "_first")

    def __init__(self, layout: LayoutSpec, buffers: Mapping[str, Any]) -> None:
        self.layout = layout
        self._bufs: dict[tuple[str, int], Any] = {}
        self._pages: dict[str, int] = {}
        self._rows: dict[str, Any] = {}
        self.memory: str | None = None  # "host" or "cuda": the kind of every buffer
        self.device: int | None = None  # the CUDA device of every buffer (None: host/unknown)
        self._first = ""  # the buffer that set the kind, for the error naming both
        ps = layout.page_size_tokens
        for row in layout.rows:
            if row.name not in buffers:
                raise ConfigError(f"buffers: packed row {row.name!r} (regions "
                                  f"{', '.join(row.regions)}) missing (have "
                                  f"{', '.join(map(str, buffers))})")
            view = self._view(buffers[row.name], f"buffers[{row.name}]")
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
            view = self._view(per_layer[lid], where)
            n = _nbytes(view)
            if n % pnb:
                raise ConfigError(f"{where}: {n} bytes is not a whole number of {pnb}-byte "
                                  "pages")
            pages = n // pnb if pages is None else min(pages, n // pnb)
            self._bufs[(reg.name, lid)] = view
        self._pages[reg.name] = pages or 0

    def _view(self, buf: Any, where: str) -> Any:
        """`as_bytes`, and the one-memory-kind-per-agent rule (one CUDA device too)."""
        view = as_bytes(buf, where)
        kind, dev = view_memory(view)
        if self.memory is None:
            self.memory, self.device, self._first = kind, dev, where
        elif kind != self.memory:
            raise ConfigError(f"{where}: {_kind_words(kind, dev)} but {self._first} is "
                              f"{_kind_words(self.memory, self.device)}; one agent's buffers "
                              "must all be host memory or all CUDA memory on one device")
        elif kind == "cuda" and dev is not None:
            if self.device is None:
                self.device = dev
            elif dev != self.device:
                raise ConfigError(f"{where}: CUDA memory on cuda:{dev} but {self._first} is "
                                  f"on cuda:{self.device}; one agent's buffers must all be "
                                  "on one device")
        return view

    @staticmethod
    def name(region: str, layer: int) -> str:
        return buffer_name(region, layer)

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

    def extents(self) -> list[Extent]:
        """(region, layer, bytes) of every live (region, layer), what a Hello announces
        (`protocol.handshake.buffer_descs`)."""
        return [Extent(r, lid, _nbytes(v)) for (r, lid), v in self._bufs.items()]


def _kind_words(kind: str, dev: int | None) -> str:
    if kind == "host":
        return "host memory"
    return "CUDA memory" + (f" (cuda:{dev})" if dev is not None else "")


def allocate(layout: LayoutSpec, num_pages: int, *, fill: int | None = 0,
             device: str = "cpu") -> dict[str, Any]:
    """Torch buffers for `layout` with `num_pages` pages on `device` ("cpu", "cuda",
    "cuda:N"): per-layer regions get a dict layer -> buffer (0-row layers an empty
    placeholder), packed rows one buffer each."""
    import torch

    dev = torch.device(device)

    def buf(n: int) -> Any:
        return (torch.zeros(n, dtype=torch.uint8, device=dev) if fill == 0 else
                torch.full((n,), fill, dtype=torch.uint8, device=dev) if fill is not None
                else torch.empty(n, dtype=torch.uint8, device=dev))

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
