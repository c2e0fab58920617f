"""vLLM's per-layer KV tensors -> a kvhandoff `LayoutSpec` and one flat byte buffer per layer.

vLLM (0.32 CPU build, 0.33) hands each attention layer a 4-D view ``[B, H, N, C]`` (blocks, head
slots, tokens of a kernel block, content) into a shared backing allocation; the resolved
``KVCacheLayout`` decides the physical order through the view's strides. This module reads the
page order (head-major or token-major) from the strides, and what a token is inside a page from
the attention backend (`backends.Backend`: the layout the kernel writes, never guessed from
shapes):

- head-major pages (vLLM's HND: LBHNC, BLHNC): one plane per KV head, named by its global head
  id (``h<g>``), so decode ranks of another TP size take their head subset (planes pair by name);
  for CPU_ATTN, whose K is column-major inside a (block, head), one plane per element of K
  (``h<g>.k<d>``) then one for V (``h<g>.v``).
- token-major pages (NHD: LBNHC, BLNHC): one plane ``kv`` of ``H * C`` bytes per token.
- MLA (``H == 1``): one plane ``latent`` of ``C`` bytes.
- the DSA indexer K cache (DeepSeek-V3.2, GLM-5.x: ``roles`` marks its layers): one head slot of
  uint8, ``C = d + d / 128 * 4`` bytes per token; the indexer's write keeps, per page, every
  token's ``d`` fp8 key bytes, then every token's fp32 scales: planes ``key`` then ``scale``. Its
  layers share their layer numbers with the MLA layers (another region, same layer id).

``roles`` (layer name -> `CacheRole`, from vLLM's per-layer specs: `groups.layer_roles`) names
the region of each layer; without it, layers of one shape are one region (``kv``, or ``kv<i>``).

GQA regions are head-sharded at every TP size (a rank of TP 1 holds all heads), so the
TP-invariant form both sides compare is the same for any TP size; every region moves whole
pages where both sides use one page size (`RegionSpec.whole_pages`).

Memory: layer-compact layouts (``LBHNC``/``LBNHC``) give each layer one contiguous run, one
buffer per layer. Block-outermost layouts (``BLHNC``/``BLNHC``: one block is a row of every
layer's page, then padding) become ONE `PackedRow` of every region and ONE buffer over the
blocks (``LayoutSpec.rows``); the order of the pages inside a block is read from the views'
offsets (vLLM puts the layers of one spec side by side, specs in the order the model registered
them: a DSA block is every indexer page, then every MLA page), never assumed. The handshake
ignores packing, so a packed prefill pairs with a per-layer decode. A page itself must be
dense; padded or strided pages are refused. A manager block
split into kernel blocks (``B = num_blocks * ratio``) is one page per kernel block;
`expand_blocks` maps vLLM block ids to those pages.

Mamba / linear-attention state (`with_state_regions`, one region per vLLM state group, read from
its `StateSpec`): vLLM views a state layer's cache as ``[B, 1, 1, C]`` bytes, ``C`` the states'
content (conv state then SSM / temporal state, as vLLM's spec lists them), each block ``page``
bytes apart (the content padded to the attention page). The region's page is that whole block,
one plane whose name holds the states' dtypes and shapes, the padding and the block size: two
sides whose states differ in any of them are refused at the handshake naming both planes. The
plane spreads the block over the page's tokens (``page / page_size_tokens`` bytes each), so a
region moves whole blocks only: both sides must use one block size (it is in the name).

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
from kvhandoff.integrations.vllm.backends import Backend
from kvhandoff.kv_layout import LayoutSpec, PackedRow, Plane, RegionSpec, SendFrom, TPSplit
from kvhandoff.kv_layout.presets import heads_of_rank
from kvhandoff.kv_layout.spec import infer_packed_row

_LAYER_RE = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_RE.findall(f".{name}.")
    if len(found) != 1:
        raise ConfigError(f"kv_caches[{name!r}]: expected exactly one layer number in the layer "
                          f"name, found {found or 'none'}")
    return int(found[0])


# the DSA indexer's quantisation: one 4-byte scale per 128 key bytes, either an fp32 or (where
# vLLM's MQA logits kernels take MX scales: SM100) four equal packed UE8M0 bytes
INDEXER_QUANT_BLOCK = 128
INDEXER_SCALE_BYTES = 4
INDEXER_SCALE_FP32 = "fp32"
INDEXER_SCALE_UE8M0X4 = "ue8m0x4"
INDEXER_SCALE_FORMATS = (INDEXER_SCALE_FP32, INDEXER_SCALE_UE8M0X4)


@dataclass(frozen=True, slots=True)
class CacheRole:
    """Which region a vLLM layer's cache belongs to (`groups.layer_roles` reads it from vLLM's
    per-layer specs)."""

    region: str
    indexer: bool = False  # a DSA indexer K cache (keys then scales per page)
    draft: bool = False  # a draft (MTP) model's layer


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A Mamba state group of vLLM (`groups.state_spec` reads it from vLLM's `MambaSpec`)."""

    group: int  # the KV cache group
    region: str
    kind: str  # vLLM's state backend (GDN_ATTN, MAMBA2 ...)
    shapes: tuple[tuple[int, ...], ...]  # per state (conv, then SSM / temporal), one rank's
    dtypes: tuple[str, ...]
    content_bytes: int  # the states' bytes in a block
    page_bytes: int  # a block's bytes (the content padded to the attention page)
    block_size: int  # tokens of a block (the attention groups')
    cache_mode: str  # vLLM's mamba_cache_mode
    layers: tuple[str, ...] = ()

    def plane(self, page_size_tokens: int) -> Plane:
        """The region's one plane: the whole block over the page's tokens, named by what it
        holds (module docstring)."""
        if page_size_tokens <= 0 or self.page_bytes % page_size_tokens:
            raise ConfigError(
                f"{self.region}: a state block of {self.page_bytes} B does not split into "
                f"{page_size_tokens} equal token rows; KVHandoffConnector moves a state block "
                "as one page of the attention groups' page size")
        states = ",".join(f"{d}[{'x'.join(map(str, sh))}]"
                          for d, sh in zip(self.dtypes, self.shapes, strict=True))
        pad = self.page_bytes - self.content_bytes
        return Plane(f"{self.kind.lower()}:{states}+pad{pad}/block{page_size_tokens}",
                     self.page_bytes // page_size_tokens)


@dataclass(frozen=True)
class VllmLayout:
    """What `build_layout` found: the layout, the per-layer byte buffers and the mapping from
    vLLM's names and block ids to kvhandoff's layer ids and pages."""

    layout: LayoutSpec
    backend: Backend
    # region -> layer id -> 1-D uint8 tensor, or packed row name -> 1-D uint8 tensor (no copy)
    buffers: dict[str, Any]
    layer_ids: dict[str, int]  # vLLM layer name -> layer id (an indexer shares its MLA layer's)
    order: str  # "NHD", "HND" or "MLA"
    pages_per_block: int  # kernel blocks per vLLM block
    indexer_regions: tuple[str, ...] = ()  # the regions holding DSA indexer caches
    state_regions: tuple[str, ...] = ()  # the regions holding Mamba state blocks

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
    backend: Backend,
    block_size: int,
    kv_dtype: str,
    model: str,
    total_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    roles: Mapping[str, CacheRole] | None = None,
    num_layers: int = 0,
    indexer_scale: str = INDEXER_SCALE_FP32,
) -> VllmLayout:
    """Reads vLLM's per-layer KV views (``[B, H, N, C]``) into a `VllmLayout`.

    Args:
        kv_caches: layer name -> 4-D view, as `register_kv_caches` receives it.
        backend: the attention backend writing the main caches (`backends.resolve`).
        block_size: vLLM's (manager) block size in tokens.
        kv_dtype: a label of the cache dtype (both sides must agree).
        model: a label of the model (both sides must agree).
        total_kv_heads: KV heads of the model (GQA; ignored for MLA).
        tp_rank, tp_size: this worker's tensor-parallel rank and size.
        roles: the region of each layer (module docstring); every layer must have one.
        num_layers: the target model's layers (draft layer ids follow them); 0: from the ids.
    """
    if not kv_caches:
        raise ConfigError("kv_caches: no layers to register")
    if block_size <= 0:
        raise ConfigError(f"block_size: expected > 0, got {block_size}")
    if roles is not None:
        missing = sorted(set(kv_caches) - set(roles))
        if missing:
            raise ConfigError(f"kv_caches: no KV cache spec says which cache {missing[:3]} "
                              "hold")
    mla = backend.mla
    groups: dict[tuple[Any, ...], list[tuple[int, str, Any]]] = {}
    seen: dict[tuple[str, int], str] = {}
    ids: dict[str, int] = {}
    for name, t in kv_caches.items():
        where = f"kv_caches[{name!r}]"
        if not hasattr(t, "dim") or t.dim() != 4:
            raise ConfigError(f"{where}: expected a 4-D [blocks, heads, tokens, content] view, "
                              f"got {getattr(t, 'shape', type(t).__name__)}")
        role = roles[name] if roles is not None else None
        lid = layer_index(name)
        rkey = role.region if role is not None else ""
        if (rkey, lid) in seen:
            raise ConfigError(f"{where}: layer number {lid} also in {seen[rkey, lid]!r}")
        seen[rkey, lid] = name
        ids[name] = lid
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
        if role is not None and role.indexer:
            _check_indexer(where, nh, nc, elem)
            kind = "INDEXER"
        elif mla:
            if nh != 1:
                raise ConfigError(f"{where}: MLA expects one head slot, got {nh}")
            kind = "MLA"
        elif nh == 1 or inner.index(0) < inner.index(1):
            kind = "HND"  # one head: both orders are the same bytes; name the plane by head
        else:
            kind = "NHD"
        if kind != "INDEXER" and kind not in backend.orders:
            raise ConfigError(f"{where}: {backend.name} reads {'/'.join(backend.orders)} pages, "
                              f"but this view's strides {tuple(t.stride())} give {kind} pages")
        if kind != "INDEXER" and backend.k_columns and nc % 2:
            raise ConfigError(f"{where}: {backend.name} expects K and V of one head in the last "
                              f"dim, got {nc} elements")
        if packed:
            # a block of a packed row: this layer's page sits at its offset in every block
            buf: Any = (t.untyped_storage().data_ptr(), t.storage_offset() * elem, bstride)
        else:
            _, whole = _physical(t, where)
            buf = whole.reshape(-1).view(_uint8())
        key = (rkey, kind, nh, nt, nc * elem, nb, packed, elem)
        groups.setdefault(key, []).append((lid, name, buf))
    if len({k[6] for k in groups}) > 1:
        raise ConfigError("kv_caches: some layers are packed into shared blocks, others are not")
    named = {k[0] for k in groups}
    if roles is not None and len(named) != len(groups):
        raise ConfigError("kv_caches: the layers of one region have different shapes: "
                          f"{sorted((k[0], k[2:6]) for k in groups)}")
    regions: list[RegionSpec] = []
    buffers: dict[str, Any] = {}
    packed_members: dict[str, list[tuple[int, str, Any]]] = {}
    order_name = ""
    nt0 = 0
    indexers: list[str] = []
    for i, ((rname, kind, nh, nt, content, _nb, packed, elem), members) in enumerate(
            sorted(groups.items())):
        name = rname or ("kv" if len(groups) == 1 else f"kv{i}")
        role = roles[members[0][1]] if roles is not None else None
        split = TPSplit.REPLICATED
        num_heads = 1
        if kind == "INDEXER":
            planes: tuple[Plane, ...] = _indexer_planes(content, indexer_scale)
            indexers.append(name)
        elif kind == "MLA":
            planes = (Plane("latent", content),)
        else:
            heads = _global_heads(nh, total_kv_heads, tp_rank, tp_size)
            planes = _head_planes(backend, kind, heads, content, elem)
            # head-sharded at every TP size: a TP-1 rank holds all heads, and its TP-invariant
            # form is the one a rank of any other TP size registers
            split, num_heads = TPSplit.HEAD_SHARDED, nh
        members.sort(key=lambda m: m[0])
        regions.append(RegionSpec(name=name, layer_ids=tuple(m[0] for m in members),
                                  planes=planes, send_from=SendFrom.DECODE_PREFIX,
                                  tp_split=split, num_heads=num_heads, whole_pages=True,
                                  draft=bool(role and role.draft)))
        if packed:
            packed_members[name] = members
        else:
            buffers[name] = {lid: b for lid, _, b in members}
        if nt0 and nt0 != nt:
            raise ConfigError(f"kv_caches: the layers' kernel blocks differ ({nt0} vs {nt} "
                              "tokens): every cache of a block must hold the same tokens")
        if kind != "INDEXER":
            if order_name and order_name != kind:
                raise ConfigError(f"kv_caches: layers disagree on the page order ({order_name} "
                                  f"vs {kind})")
            order_name = kind
        nt0 = nt
    if not order_name:
        raise ConfigError("kv_caches: only indexer caches; the main KV layers are missing")
    layout = LayoutSpec(page_size_tokens=nt0, kv_dtype=kv_dtype, regions=tuple(regions),
                        model=model, num_layers=num_layers)
    if packed_members:
        row, view = _packed_row(layout, packed_members, kv_caches)
        layout = layout._replace(rows=(row,))
        buffers[row.name] = view
    return VllmLayout(layout=layout, backend=backend, buffers=buffers, layer_ids=ids,
                      order=order_name, pages_per_block=block_size // nt0,
                      indexer_regions=tuple(indexers))


def with_state_regions(vl: VllmLayout, kv_caches: Mapping[str, Any],
                       states: Sequence[StateSpec], *, num_blocks: int,
                       num_layers: int = 0) -> VllmLayout:
    """`vl` with a region per Mamba state group (module docstring): each state layer's
    ``[B, 1, 1, C]`` byte view (as vLLM registers it) becomes one buffer of `num_blocks`
    blocks of ``page_bytes``, the block's padding included (no copy)."""
    if not states:
        return vl
    lay = vl.layout
    ps = lay.page_size_tokens
    if lay.rows or vl.pages_per_block != 1:
        raise ConfigError(
            "kv_caches: Mamba state beside attention pages that are "
            f"{'packed into shared blocks' if lay.rows else 'kernel blocks of a larger block'}"
            "; KVHandoffConnector moves state blocks beside layer-compact attention pages of "
            "the block size (LBHNC / LBNHC)")
    regions: list[RegionSpec] = []
    buffers: dict[str, Any] = {}
    ids: dict[str, int] = {}
    for st in states:
        if st.block_size != ps and st.cache_mode == "align":
            raise ConfigError(f"{st.region}: state blocks of {st.block_size} tokens, attention "
                              f"pages of {ps}")
        plane = st.plane(ps)
        bufs: dict[int, Any] = {}
        for name in st.layers:
            if name not in kv_caches:
                raise ConfigError(f"kv_caches: no cache registered for state layer {name!r}")
            lid = layer_index(name)
            if lid in bufs:
                raise ConfigError(f"kv_caches[{name!r}]: layer number {lid} twice in "
                                  f"{st.region}")
            bufs[lid] = _state_buffer(f"kv_caches[{name!r}]", kv_caches[name], st, num_blocks)
            ids[name] = lid
        regions.append(RegionSpec(name=st.region, layer_ids=tuple(sorted(bufs)),
                                  planes=(plane,), send_from=SendFrom.DECODE_PREFIX,
                                  tp_split=TPSplit.REPLICATED, whole_pages=True))
        buffers[st.region] = bufs
    layout = LayoutSpec(page_size_tokens=ps, kv_dtype=lay.kv_dtype,
                        regions=lay.regions + tuple(regions), model=lay.model,
                        num_layers=num_layers)
    return VllmLayout(layout=layout, backend=vl.backend, buffers={**vl.buffers, **buffers},
                      layer_ids={**vl.layer_ids, **ids}, order=vl.order,
                      pages_per_block=vl.pages_per_block, indexer_regions=vl.indexer_regions,
                      state_regions=vl.state_regions + tuple(r.name for r in regions))


def _state_buffer(where: str, t: Any, st: StateSpec, num_blocks: int) -> Any:
    """One flat byte view over `num_blocks` state blocks of `t` (vLLM's ``[B, 1, 1, C]`` view
    of a state layer), each ``page_bytes`` long."""
    if not hasattr(t, "dim") or t.dim() != 4:
        raise ConfigError(f"{where}: expected vLLM's 4-D [blocks, 1, 1, bytes] view of a state "
                          f"layer, got {getattr(t, 'shape', type(t).__name__)}")
    nb, nh, nt, nc = (int(d) for d in t.shape)
    elem = t.element_size()
    if (nh, nt) != (1, 1) or nc * elem != st.content_bytes:
        raise ConfigError(f"{where}: a state block of {nh}x{nt}x{nc * elem} B, but vLLM's spec "
                          f"of {st.region} holds {st.content_bytes} B per block")
    if nb != num_blocks:
        raise ConfigError(f"{where}: {nb} state blocks, the KV cache has {num_blocks}")
    if t.stride(3) != 1 or (nb > 1 and t.stride(0) * elem != st.page_bytes):
        raise ConfigError(f"{where}: state blocks {t.stride(0) * elem} B apart (strides "
                          f"{tuple(t.stride())}), vLLM's spec says {st.page_bytes}; "
                          "KVHandoffConnector moves dense state blocks")
    import torch

    storage = t.untyped_storage()
    base = t.storage_offset() * elem
    if base + nb * st.page_bytes > storage.nbytes():
        raise ConfigError(f"{where}: {nb} blocks of {st.page_bytes} B from byte {base} run past "
                          f"the {storage.nbytes()}-byte allocation")
    view = torch.empty((0,), dtype=torch.uint8, device=t.device)
    view.set_(storage, base, (nb * st.page_bytes,), (1,))
    return view


def _check_indexer(where: str, nh: int, nc: int, elem: int) -> None:
    step = INDEXER_QUANT_BLOCK + INDEXER_SCALE_BYTES
    if nh != 1 or elem != 1 or nc % step:
        raise ConfigError(f"{where}: a DSA indexer cache is one head slot of uint8 rows of "
                          f"d + d/{INDEXER_QUANT_BLOCK}*{INDEXER_SCALE_BYTES} bytes; got {nh} "
                          f"slots of {nc} elements of {elem} B")


def _indexer_planes(content: int, scale: str) -> tuple[Plane, ...]:
    """Keys then scales: the indexer's write keeps, per page, every token's fp8 key bytes and
    then every token's 4 scale bytes (vLLM's ``indexer_k_quant_and_cache``). The scale plane is
    named by what those bytes mean: ``scale`` (fp32, as before and as kvhandoff's presets
    name it), ``scale_ue8m0x4`` (packed UE8M0); two sides that read them differently have
    different planes, and the handshake refuses the pair naming both."""
    if scale not in INDEXER_SCALE_FORMATS:
        raise ConfigError(f"indexer_scale: expected one of {INDEXER_SCALE_FORMATS}, got "
                          f"{scale!r}")
    blocks = content // (INDEXER_QUANT_BLOCK + INDEXER_SCALE_BYTES)
    return (Plane("key", blocks * INDEXER_QUANT_BLOCK),
            Plane("scale" if scale == INDEXER_SCALE_FP32 else f"scale_{scale}",
                  blocks * INDEXER_SCALE_BYTES))


def _packed_row(layout: LayoutSpec, members: Mapping[str, list[tuple[int, str, Any]]],
                kv_caches: Mapping[str, Any]) -> tuple[PackedRow, Any]:
    """The packed row of every region (the order of the pages inside a block as the views'
    offsets show it) and one flat byte view over its blocks."""
    flat = [m for ms in members.values() for m in ms]
    ptrs = {m[2][0] for m in flat}
    strides = {m[2][2] for m in flat}
    if len(ptrs) != 1 or len(strides) != 1:
        raise ConfigError(f"kv_caches: the packed layers of regions {sorted(members)} do not "
                          "share one backing allocation and block stride")
    stride = strides.pop()
    base = min(m[2][1] for m in flat)
    offsets = {(rn, lid): buf[1] - base for rn, ms in members.items() for lid, _, buf in ms}
    name = "kv_row" if len(members) > 1 else f"{next(iter(members))}_row"
    try:
        row = infer_packed_row(layout, name, tuple(members), offsets=offsets,
                               block_stride=stride)
    except ConfigError as e:
        raise ConfigError(f"kv_caches: unsupported packing of the blocks: {e}") from e
    import torch

    t0 = kv_caches[flat[0][1]]
    storage = t0.untyped_storage()
    nb = int(t0.shape[0])
    if base + nb * stride > storage.nbytes():
        raise ConfigError(f"kv_caches: {nb} blocks of {stride} B from byte {base} run past the "
                          f"{storage.nbytes()}-byte allocation")
    view = torch.empty((0,), dtype=torch.uint8, device=t0.device)
    view.set_(storage, base, (nb * stride,), (1,))
    return row, view


def _head_planes(backend: Backend, kind: str, heads: tuple[int, ...], content: int,
                 elem: int) -> tuple[Plane, ...]:
    """The planes of a GQA page: what `backend`'s kernel keeps where (module docstring)."""
    if kind == "NHD":
        return (Plane("kv", content * len(heads)),)
    if not backend.k_columns:
        return tuple(Plane(f"h{h}", content) for h in heads)
    d = content // elem // 2  # head_size: K then V of one head in the declared last dim
    out: list[Plane] = []
    for h in heads:
        out.extend(Plane(f"h{h}.k{i}", elem) for i in range(d))
        out.append(Plane(f"h{h}.v", d * elem))
    return tuple(out)


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
