"""vLLM's per-layer KV tensors -> a kvhandoff `LayoutSpec` and one flat byte buffer per layer.

vLLM 0.33 hands each attention layer a 4-D view ``[B, H, N, C]`` (blocks, head slots, tokens of
a kernel block, content bytes of one head and token: K then V for GQA, the latent for MLA) into a
shared backing allocation; the resolved ``KVCacheLayout`` decides the physical order through the
view's strides. This module reads that order from the strides, never from a name:

- ``LBNHC`` (token-major pages, vLLM's NHD): a page holds, per token, all heads -> one plane of
  ``H * C`` bytes per token.
- ``LBHNC`` (head-major pages, vLLM's HND): a page holds, per head, all tokens -> one plane per
  KV head, named by its global head id (``h<k>``), so decode ranks of another TP size can take a
  head subset (planes pair by name).
- MLA (``H == 1``): one plane ``latent`` of ``C`` bytes; the two orders coincide.

Memory: layer-compact layouts (``LBHNC``/``LBNHC``) give each layer one contiguous run, one
buffer per layer. Block-outermost layouts (``BLHNC``/``BLNHC``: one block is a row of every
layer's page, then padding) become a `PackedRow` of the region and ONE buffer over the blocks
(``LayoutSpec.rows``; the handshake ignores packing, so a packed prefill pairs with a per-layer
decode). A page itself must be dense; padded or strided pages are refused. A manager block
split into kernel blocks (``B = num_blocks * ratio``) is one page per kernel block;
`expand_blocks` maps vLLM block ids to those pages.

Pure apart from reading tensor metadata: no I/O, no vLLM import (the connector passes in what it
read from vLLM's config).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, PackedRow, Plane, RegionSpec, SendFrom, TPSplit
from kvhandoff.kv_layout.presets import heads_of_rank

_LAYER_RE = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_RE.findall(f".{name}.")
    if len(found) != 1:
        raise ConfigError(f"kv_caches[{name!r}]: expected exactly one layer number in the layer "
                          f"name, found {found or 'none'}")
    return int(found[0])


@dataclass(frozen=True)
class VllmLayout:
    """What `build_layout` found: the layout, the per-layer byte buffers and the mapping from
    vLLM's names and block ids to kvhandoff's layer ids and pages."""

    layout: LayoutSpec
    # region -> layer id -> 1-D uint8 tensor, or packed row name -> 1-D uint8 tensor (no copy)
    buffers: dict[str, Any]
    layer_ids: dict[str, int]  # vLLM layer name -> layer id
    order: str  # "NHD", "HND" or "MLA"
    pages_per_block: int  # kernel blocks per vLLM block

    def expand_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """vLLM block ids -> page ids of the layout (kernel blocks, in token order)."""
        b = np.asarray(block_ids, dtype=np.int64)
        r = self.pages_per_block
        if r == 1:
            return b
        out: np.ndarray = (b[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).reshape(-1)
        return out


def _physical(t: Any, where: str) -> tuple[list[int], Any]:
    """The dims of `t` from outermost to innermost in memory, and `t` permuted that way; the
    permuted view must be contiguous (one dense run of bytes)."""
    big = [d for d in range(t.dim()) if t.shape[d] > 1]
    order = sorted(big, key=lambda d: -t.stride(d))
    # size-1 dims carry no stride information: each goes back at its logical position
    for d in (d for d in range(t.dim()) if t.shape[d] <= 1):
        pos = next((i for i, e in enumerate(order) if e > d), len(order))
        order.insert(pos, d)
    p = t.permute(*order)
    if not p.is_contiguous():
        raise ConfigError(
            f"{where}: the layer's pages are not one contiguous run (strides {tuple(t.stride())} "
            f"for shape {tuple(t.shape)}): padded or strided pages are not supported by this "
            "connector; use a layout with dense pages (LBHNC, LBNHC, BLHNC or BLNHC)")
    return order, p


def build_layout(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    kv_dtype: str,
    model: str,
    mla: bool,
    total_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> VllmLayout:
    """Reads vLLM's per-layer KV views (``[B, H, N, C]``) into a `VllmLayout`.

    Args:
        kv_caches: layer name -> 4-D view, as `register_kv_caches` receives it.
        block_size: vLLM's (manager) block size in tokens.
        kv_dtype: a label of the cache dtype (both sides must agree).
        model: a label of the model (both sides must agree).
        mla: whether the layers are MLA (one latent per token, replicated over TP).
        total_kv_heads: KV heads of the model (GQA; ignored for MLA).
        tp_rank, tp_size: this worker's tensor-parallel rank and size.
    """
    if not kv_caches:
        raise ConfigError("kv_caches: no layers to register")
    if block_size <= 0:
        raise ConfigError(f"block_size: expected > 0, got {block_size}")
    groups: dict[tuple[Any, ...], list[tuple[int, str, Any]]] = {}
    seen: dict[int, str] = {}
    for name, t in kv_caches.items():
        where = f"kv_caches[{name!r}]"
        if not hasattr(t, "dim") or t.dim() != 4:
            raise ConfigError(f"{where}: expected a 4-D [blocks, heads, tokens, content] view, "
                              f"got {getattr(t, 'shape', type(t).__name__)}")
        lid = layer_index(name)
        if lid in seen:
            raise ConfigError(f"{where}: layer number {lid} also in {seen[lid]!r}")
        seen[lid] = name
        nb, nh, nt, nc = (int(s) for s in t.shape)
        elem = t.element_size()
        inner, _ = _physical(t[0], f"{where} (one block)")  # a page is one dense run
        page = nh * nt * nc * elem
        bstride = t.stride(0) * elem
        if nb > 1 and bstride < page:
            raise ConfigError(f"{where}: blocks {bstride} B apart hold {page}-byte pages: blocks "
                              "are not the outermost dimension; unsupported KV cache layout")
        packed = nb > 1 and bstride > page
        if block_size % nt:
            raise ConfigError(f"{where}: kernel block of {nt} tokens does not divide the block "
                              f"size {block_size}")
        if mla:
            if nh != 1:
                raise ConfigError(f"{where}: MLA expects one head slot, got {nh}")
            kind = "MLA"
        elif nh == 1 or inner.index(0) < inner.index(1):
            kind = "HND"  # one head: both orders are the same bytes; name the plane by head
        else:
            kind = "NHD"
        if packed:
            # a block of a packed row: this layer's page sits at its offset in every block
            buf: Any = (t.untyped_storage().data_ptr(), t.storage_offset() * elem, bstride)
        else:
            _, whole = _physical(t, where)
            buf = whole.reshape(-1).view(_uint8())
        key = (kind, nh, nt, nc * elem, nb, packed)
        groups.setdefault(key, []).append((lid, name, buf))
    if len({k[5] for k in groups}) > 1:
        raise ConfigError("kv_caches: some layers are packed into shared blocks, others are not")
    regions: list[RegionSpec] = []
    buffers: dict[str, Any] = {}
    rows: list[PackedRow] = []
    order_name = ""
    nt0 = 0
    for i, ((kind, nh, nt, content, nb, packed), members) in enumerate(sorted(groups.items())):
        name = "kv" if len(groups) == 1 else f"kv{i}"
        planes: tuple[Plane, ...]
        split = TPSplit.REPLICATED
        num_heads = 1
        if kind == "MLA":
            planes = (Plane("latent", content),)
        else:
            heads = _global_heads(nh, total_kv_heads, tp_rank, tp_size)
            if kind == "HND":
                planes = tuple(Plane(f"h{h}", content) for h in heads)
            else:
                planes = (Plane("kv", content * nh),)
            if tp_size > 1:
                split, num_heads = TPSplit.HEAD_SHARDED, nh
        members.sort(key=lambda m: m[0])
        regions.append(RegionSpec(name=name, layer_ids=tuple(m[0] for m in members),
                                  planes=planes, send_from=SendFrom.DECODE_PREFIX,
                                  tp_split=split, num_heads=num_heads))
        if packed:
            row, view = _packed_row(name, members, nh * nt * content, nb, kv_caches)
            rows.append(row)
            buffers[row.name] = view
        else:
            buffers[name] = {lid: b for lid, _, b in members}
        if order_name and (order_name != kind or nt0 != nt):
            raise ConfigError(f"kv_caches: layers disagree on the page order or kernel block "
                              f"({order_name}/{nt0} vs {kind}/{nt})")
        order_name, nt0 = kind, nt
    if len(rows) > 1:
        raise ConfigError("kv_caches: packed layers of different shapes share blocks; "
                          "unsupported KV cache layout")
    layout = LayoutSpec(page_size_tokens=nt0, kv_dtype=kv_dtype, regions=tuple(regions),
                        model=model, rows=tuple(rows))
    return VllmLayout(layout=layout, buffers=buffers, layer_ids={n: lid for lid, n in
                                                                 seen.items()},
                      order=order_name, pages_per_block=block_size // nt0)


def _packed_row(region: str, members: list[tuple[int, str, Any]], page: int, nb: int,
                kv_caches: Mapping[str, Any]) -> tuple[PackedRow, Any]:
    """The packed row of `region` (layers ascending, one page each per block, then padding)
    and one flat byte view over its blocks."""
    ptrs = {m[2][0] for m in members}
    strides = {m[2][2] for m in members}
    if len(ptrs) != 1 or len(strides) != 1:
        raise ConfigError(f"kv_caches: the packed layers of region {region!r} do not share one "
                          "backing allocation and block stride")
    stride = strides.pop()
    base = members[0][2][1]
    for k, (lid, name, (_, off, _)) in enumerate(members):
        if off != base + k * page:
            raise ConfigError(f"kv_caches[{name!r}]: layer {lid}'s page is at byte {off - base} "
                              f"of the block, expected {k * page} (layers ascending, one page "
                              "each); unsupported packing")
    pad = stride - len(members) * page
    if pad < 0:
        raise ConfigError(f"kv_caches: {len(members)} pages of {page} B do not fit a "
                          f"{stride}-byte block")
    import torch

    t0 = kv_caches[members[0][1]]
    storage = t0.untyped_storage()
    if base + nb * stride > storage.nbytes():
        raise ConfigError(f"kv_caches: {nb} blocks of {stride} B from byte {base} run past the "
                          f"{storage.nbytes()}-byte allocation")
    view = torch.empty((0,), dtype=torch.uint8, device=t0.device)
    view.set_(storage, base, (nb * stride,), (1,))
    return PackedRow(name=f"{region}_row", regions=(region,), pad_bytes=pad), view


def _global_heads(local: int, total: int, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The global KV head ids this rank's `local` head slots hold."""
    if total <= 0:
        raise ConfigError(f"total_kv_heads: expected > 0, got {total}")
    heads = heads_of_rank(total, tp_size, tp_rank)
    if len(heads) != local:
        raise ConfigError(f"kv_caches: {local} head slots per layer, but TP rank {tp_rank} of "
                          f"{tp_size} holds {len(heads)} of the model's {total} KV heads")
    return heads


def _uint8() -> Any:
    import torch

    return torch.uint8
