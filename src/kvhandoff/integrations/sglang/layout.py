"""SGLang ``KVArgs`` -> kvhandoff layouts and buffers.

Up to three layouts per rank, one agent each (an agent has one page size):

- the **KV layout** (page size = SGLang's ``page_size``): the main KV buffers
  (``kv_data_ptrs/lens/item_lens``; MLA: one buffer per layer, region ``kv``; MHA: K buffers
  then V buffers, regions ``k`` and ``v``), the draft/MTP main KV (the last
  ``num_draft_entries``: ``draft_kv`` or ``draft_k``/``draft_v``) and the DSA indexer (state
  component ``StateType.DSA``: region ``indexer``, and ``draft_indexer`` for the entries SGLang
  appends after the target's when the draft pool is a DSA pool too).
- the **aux layout** (page size 1): one region ``aux<i>`` per SGLang metadata buffer
  (``aux_data_ptrs/lens/item_lens``), a page being one request slot of ``item_len`` bytes.
- the **tail layout** (page size 1, only with ``index_kpool`` compression: state component
  ``StateType.DSA_TAIL``): regions ``tail_k`` and ``tail_score`` (``draft_tail_k`` /
  ``draft_tail_score``), the bf16 key and score of the request's last ``seq_len % index_kpool``
  tokens, which live in a per-request ring of ``tail_size`` slots. A page is one ring slot
  (`TAIL_SLOT_BYTES`): page ``row * tail_size + slot``, so the live slots of prefill and decode
  pair up one by one even when their rings differ in size (speculative slots).

- the **sliding-window pool** (state component ``StateType.SWA``: SGLang's ``SWAKVPool``, the
  pages of its window layers, from ``swa_kv_pool.get_contiguous_buf_infos``): regions
  ``swa_k`` / ``swa_v`` (MHA; ``swa_kv`` for an MLA-class window pool) in the KV layout, same
  page size, their own layer band (SGLang lists the window layers by position, as it lists the
  full ones for this pool). Their pages are SGLang's SWA state indices: the window's pages
  ``[max(decode_prefix_len, seq_len - window), seq_len)`` page-aligned down, on both sides;
  they are the last pages of the room's suffix (the decode states where they start: the
  agent's ``region_starts``), so nothing before the window moves or is read.

- the **state layout** (page size 1, only with ``StateType.MAMBA``: SGLang's ``MambaPool`` of a
  ``HybridLinearKVPool``): one region ``mamba<t>`` per state tensor in SGLang's order (the conv
  state(s), then the temporal/SSM state), layer ids the global Mamba / linear-attention layer
  ids SGLang gives (``state_layer_ids``), a page being one request row of ``item_len`` bytes
  (plane ``row``). A request's page is its Mamba row (SGLang's one-element state index), on
  each side its own. The identity holds each tensor's sliceable dimension and outer row count
  (``state_dim_per_tensor``, ``state_slice_outer_counts``) and the attention TP size (the state
  is split by heads across ranks; this backend moves it rank to rank), so another state shape
  or TP fails the handshake.
  With QSA (``QSATokenToKVPool``, ``StateType.QSA_PENDING``) the state layout also holds
  regions ``qsa_pending_k`` (each full layer's pending index-key ring) and ``qsa_rope`` (the
  RoPE-position ring they share), a page being one request's ring at its request-pool row
  (SGLang's index ``[req_pool_idx]``); `RowState` names each component's regions and slot.
- **QSA's compressed keys** (``StateType.QSA_COMPRESSED``: one compressed page per KV page, on
  SGLang's full-attention layer ids): region ``qsa_compressed`` of the KV layout, one row of
  the whole item per page, fed by each chunk's KV pages like the block scales (`PagedState`).

- the **MXFP8 block scales** (state components ``StateType.BLOCK_SCALE`` and
  ``BLOCK_SCALE_SWA``: ``MHATokenToKVPoolMXFP8.get_kv_scale_buf_infos``, the K scales of a
  sub-pool's layers then the V scales, an item being one KV page's scales): regions
  ``k_scale`` / ``v_scale`` on the full layers, fed by the main KV pages of each chunk (a
  page's scales live at its page index; SGLang's ``block_scale`` indices, the request's pages
  from token 0, are checked to end in the suffix's pages), and ``swa_k_scale`` /
  ``swa_v_scale`` on the window layers, among the SWA regions (their indices, SGLang's window
  pages, checked equal to the SWA state's).

- **MiniMax** (``MiniMaxSparseKVPool``: main KV = its sparse layers; state components
  ``StateType.MINIMAX_DENSE_KV``, the dense layers' K and V, and ``MINIMAX_INDEX_K``, the index
  keys of the K-only sparse layers, both at the main KV pages' indices): regions ``dense_k`` /
  ``dense_v`` and ``index_k`` in the KV layout, layers by position, fed by each chunk's KV
  pages like the block scales (SGLang's indices checked: the dense ones are the request's
  pages from token 0, the index keys' the suffix's).

Every other state type is refused at startup, naming it and what is missing (the DeepSeek-V4
ones, ``swa_ring``, ``c128_state`` and ``request_row``, with its pool: ``mla_compression_ratios``
given is refused too).

A page of a main KV region is one SGLang item (``item_len`` bytes = ``page_size`` tokens of
``item_len // page_size`` bytes). An indexer item holds ``page_size // index_kpool`` rows of a
128-byte fp8 key (all keys of the page first) and a 4-byte fp32 scale (then all scales), planes
``key`` and ``scale``; ``index_kpool`` (`RegionSpec.tokens_per_row`) is what the item length
says: ``page_size * 132 // item_len``.

Layer ids: the target's from ``kv_layer_ids`` when SGLang gives them, else positions; draft
layers follow the target's (``num_layers + i``, SGLang's own band), in regions marked `draft`, so
a draft cache can only land in the peer's draft regions. An entry of item length 0 (SGLang's
0-row placeholders: skip-topk indexer layers, layers another rank owns) is an empty layer of
its region (`RegionSpec.empty_layers`): no view, nothing moves for it.

Non-MLA K / V regions between attention TP sizes: a token's row, all ranks together, is cut into
`ROW_SLICES` slices; rank ``r`` of ``T`` holds slices ``[r * ROW_SLICES / T, (r + 1) *
ROW_SLICES / T)`` (SGLang's heads ``[r * H / T, (r + 1) * H / T)``, side by side in the row),
the region's planes ``s<i>`` (token-major pages), so a decode rank's planes pair by name with the
prefill ranks holding them (`hetero_tp_refusal`: the pairs that cannot). A pool with per-rank
state, or a TP size not dividing `ROW_SLICES`, keeps one plane and moves rank to rank only.

The layout's ``model`` field carries what SGLang itself requires to be equal on both sides (page
size, KV dtype, PP size; the attention TP size for non-MLA pools moved rank to rank; a rank's KV
heads are in its regions' bytes per token): it is part of the layout
hash both agents compare at the handshake, so a mismatch (another layer set, a draft cache on
one side only, another kpool) fails the handshake with the differing field named.

Buffers are zero-copy views of SGLang's memory: numpy views of host pointers, or CUDA tensors
built through ``__cuda_array_interface__`` for device pointers (the KV pool and DSA state on a
CUDA device; SGLang's metadata buffers are host memory there).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom, TPSplit

DSA_STATE = "dsa"
DSA_TAIL_STATE = "dsa_tail"
SWA_STATE = "swa"
MAMBA_STATE = "mamba"
BLOCK_SCALE_STATE = "block_scale"
BLOCK_SCALE_SWA_STATE = "block_scale_swa"
MINIMAX_INDEX_K_STATE = "minimax_index_k"
MINIMAX_DENSE_KV_STATE = "minimax_dense_kv"
QSA_PENDING_STATE = "qsa_pending"
QSA_COMPRESSED_STATE = "qsa_compressed"
SUPPORTED_STATES = (DSA_STATE, DSA_TAIL_STATE, SWA_STATE, MAMBA_STATE, BLOCK_SCALE_STATE,
                    BLOCK_SCALE_SWA_STATE, MINIMAX_INDEX_K_STATE, MINIMAX_DENSE_KV_STATE,
                    QSA_PENDING_STATE, QSA_COMPRESSED_STATE)
INDEXER_KEY_BYTES = 128  # SGLang's DSA pool: index_head_dim == 128 (asserted), fp8
INDEXER_SCALE_BYTES = 4  # one fp32 scale per 128-element block
INDEXER_ROW_BYTES = INDEXER_KEY_BYTES + INDEXER_SCALE_BYTES
TAIL_SLOT_BYTES = 128 * 2  # one ring slot of the kpool tail: 128 bf16 values
# A non-MLA pool's K (and V) row of one token, all ranks together, is cut into this many equal
# slices; attention TP rank r of T holds slices [r * ROW_SLICES / T, (r + 1) * ROW_SLICES / T)
# (SGLang gives rank r the KV heads [r * H / T, (r + 1) * H / T), side by side in a token's
# row). Planes named by slice pair across TP sizes (`hetero_tp_refusal` says which pairs).
ROW_SLICES = 64


@dataclass(frozen=True)
class Parallel:
    """What of the SGLang topology goes into the layout identity."""

    attn_tp_size: int = 1
    pp_size: int = 1
    attn_tp_rank: int = 0


@dataclass(frozen=True)
class PagedState:
    """A state component that lives at the main KV pages' indices (MXFP8 block scales of the
    full pool, MiniMax's dense layers and index keys): its regions are fed by each chunk's
    KV pages, and SGLang's indices of it, given with the last chunk, are checked to be those
    pages (`paged_state_pages`)."""

    state: str  # SGLang's StateType value
    slot: int  # its index in state_types / state_indices
    regions: tuple[str, ...]
    from_token0: bool  # SGLang's indices are the request's pages from token 0, not the
    # suffix's (``_full_kv_pages_payload``): the suffix's are their last ones


@dataclass(frozen=True)
class RowState:
    """A state component of the state layout addressed by one request row (SGLang's
    one-element index: the Mamba row, QSA's request-pool row), on each side its own."""

    state: str  # SGLang's StateType value
    slot: int
    regions: tuple[str, ...]


@dataclass
class Built:
    kv_layout: LayoutSpec
    kv_buffers: dict[str, dict[int, Any]]
    aux_layout: LayoutSpec | None
    aux_buffers: dict[str, dict[int, Any]]
    dsa_slot: int | None  # index of the DSA component in state_types / state_indices
    kv_regions: tuple[str, ...]  # regions fed by the send() page lists (not the indexer)
    region_entries: dict[str, list[int]] = field(default_factory=dict)
    tail_layout: LayoutSpec | None = None
    tail_buffers: dict[str, dict[int, Any]] = field(default_factory=dict)
    tail_slot: int | None = None  # index of the DSA_TAIL component
    swa_slot: int | None = None  # index of the SWA component
    swa_regions: tuple[str, ...] = ()  # regions fed by the SWA state's page list
    swa_capacity: int = 0  # pages of the window pool (its smallest buffer)
    state_layout: LayoutSpec | None = None  # the Mamba state (page = one request row)
    state_buffers: dict[str, dict[int, Any]] = field(default_factory=dict)
    mamba_slot: int | None = None  # index of the MAMBA component
    row_states: tuple[RowState, ...] = ()  # the state layout's components (Mamba, QSA ring)
    paged_states: tuple[PagedState, ...] = ()  # components at the KV pages' indices
    swa_scale_slot: int | None = None  # index of the BLOCK_SCALE_SWA component (its regions
    # are among `swa_regions`: fed by the window's pages)
    head_slices: int = 0  # slices of the model's KV row this rank's K / V rows hold (0: MLA,
    # or the pool moves rank to rank only)
    tp_fixed: str | None = None  # why a non-MLA pool moves rank to rank only (None: its
    # K / V rows are sliced, any attention TP size dividing ROW_SLICES pairs)

    @property
    def paged_regions(self) -> tuple[str, ...]:
        """The regions fed by the main KV pages of every chunk: main KV and the state
        components at its pages' indices (`paged_states`)."""
        return self.kv_regions + tuple(r for p in self.paged_states for r in p.regions)

    @property
    def indexer_regions(self) -> tuple[str, ...]:
        """The regions fed by the DSA state's page list (target and draft indexer)."""
        return tuple(r.name for r in self.kv_layout.regions
                     if r.name not in self.paged_regions and r.name not in self.swa_regions)


class _CudaBytes:
    """A device byte range for ``torch.as_tensor`` (``__cuda_array_interface__``, no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def view(ptr: int, nbytes: int, device: str, where: str) -> Any:
    """A zero-copy 1-D uint8 view of SGLang memory at `ptr`."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise ConfigError(f"{where}: expected a non-null pointer, got {ptr!r}")
    if nbytes <= 0:
        raise ConfigError(f"{where}: expected a positive length, got {nbytes}")
    if device == "cpu":
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    import torch

    return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)


def _state_name(t: Any) -> str:
    return str(getattr(t, "value", t))


_DSV4 = (" (a DeepSeek-V4 state: SGLang's DeepSeekV4TokenToKVPool lists its KV and window state "
         "grouped by compression ratio, KVArgs.mla_compression_ratios, which this backend's "
         "layouts do not pair; its ring slots or request rows alone would not hand off a "
         "request)")
_REFUSED = {
    "swa_ring": _DSV4, "c128_state": _DSV4, "request_row": _DSV4,
}


def state_slots(state_types: Sequence[Any]) -> dict[str, int]:
    """The slot (index in ``state_types`` / ``state_indices``) of each state component this
    backend moves, by its SGLang value; any other state type is refused, named."""
    found: dict[str, int] = {}
    for i, t in enumerate(state_types or ()):
        name = _state_name(t)
        if name in SUPPORTED_STATES and name not in found:
            found[name] = i
            continue
        raise ConfigError(
            f"kv_args.state_types[{i}]: state type {name!r} is not supported by the kvhandoff "
            f"SGLang backend (supported: main KV, draft KV, aux buffers, the DSA indexer state "
            f"'{DSA_STATE}' and its kpool tail '{DSA_TAIL_STATE}', the sliding-window pool "
            f"'{SWA_STATE}', the Mamba / linear-attention state '{MAMBA_STATE}', the MXFP8 "
            f"block scales '{BLOCK_SCALE_STATE}' and '{BLOCK_SCALE_SWA_STATE}', MiniMax's "
            f"'{MINIMAX_INDEX_K_STATE}' and '{MINIMAX_DENSE_KV_STATE}', QSA's "
            f"'{QSA_PENDING_STATE}' and '{QSA_COMPRESSED_STATE}')"
            f"{_REFUSED.get(name, '')}; use another transfer backend for this model")
    if DSA_TAIL_STATE in found and DSA_STATE not in found:
        raise ConfigError(f"kv_args.state_types: '{DSA_TAIL_STATE}' without '{DSA_STATE}'")
    if BLOCK_SCALE_SWA_STATE in found and SWA_STATE not in found:
        raise ConfigError(f"kv_args.state_types: '{BLOCK_SCALE_SWA_STATE}' without "
                          f"'{SWA_STATE}' (the window pool's scales move with its pages)")
    return found


def check_state_types(state_types: Sequence[Any]) -> tuple[int | None, int | None]:
    """The slots of the DSA component and of its kpool tail (`state_slots`)."""
    found = state_slots(state_types)
    return found.get(DSA_STATE), found.get(DSA_TAIL_STATE)


@dataclass(frozen=True)
class _Entries:
    """One region's entries of a SGLang buffer list."""

    name: str
    entries: list[int]
    layer_ids: list[int]
    draft: bool = False


def _region(g: _Entries, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int],
            device: str, where: str, *, send_from: SendFrom,
            planes: Any) -> tuple[RegionSpec, dict[int, Any]] | None:
    """The region of `g` (None when every entry is a 0-row placeholder); `planes(item_len,
    where)` -> (planes, tokens_per_row) for the live item length."""
    live = [(lid, e) for lid, e in zip(g.layer_ids, g.entries, strict=True)
            if int(item_lens[e]) > 0]
    for e in g.entries:
        if int(item_lens[e]) < 0 or (int(item_lens[e]) == 0 and int(lens[e]) != 0):
            raise ConfigError(f"{where}[{e}]: item length {item_lens[e]} with a buffer of "
                              f"{lens[e]} B (a 0-row layer has item length 0 and 0 bytes)")
    if not live:
        return None
    sizes = {int(item_lens[e]) for _, e in live}
    if len(sizes) != 1:
        raise ConfigError(f"{where}: region {g.name!r} has live buffers of different item "
                          f"lengths {sorted(sizes)}; kvhandoff needs one page size per region")
    item = sizes.pop()
    plane_list, per_row = planes(item, f"{where}[{live[0][1]}]")
    bufs: dict[int, Any] = {}
    for lid, e in live:
        n = int(lens[e])
        if n % item:
            raise ConfigError(f"{where}[{e}]: buffer length {n} B is not a whole number of "
                              f"{item} B items")
        bufs[lid] = view(int(ptrs[e]), n, device, f"{where}[{e}]")
    empty = tuple(lid for lid in g.layer_ids if lid not in bufs)
    spec = RegionSpec(name=g.name, layer_ids=tuple(g.layer_ids), planes=tuple(plane_list),
                      send_from=send_from, tp_split=TPSplit.REPLICATED, tokens_per_row=per_row,
                      empty_layers=empty, draft=g.draft)
    return spec, bufs


def _opaque(page_size: int) -> Any:
    def planes(item_len: int, where: str) -> tuple[list[Plane], int]:
        if item_len % page_size:
            raise ConfigError(f"{where}: item length {item_len} B is not a multiple of "
                              f"page_size={page_size}")
        return [Plane("page", item_len // page_size)], 1
    return planes


def _indexer(page_size: int) -> Any:
    def planes(item_len: int, where: str) -> tuple[list[Plane], int]:
        rows = item_len // INDEXER_ROW_BYTES
        if item_len % INDEXER_ROW_BYTES or not rows or page_size % rows:
            raise ConfigError(
                f"{where}: DSA indexer item length {item_len} B is not page_size={page_size} "
                f"// index_kpool rows of {INDEXER_KEY_BYTES} key + {INDEXER_SCALE_BYTES} scale "
                f"bytes")
        return [Plane("key", INDEXER_KEY_BYTES), Plane("scale", INDEXER_SCALE_BYTES)], \
            page_size // rows
    return planes


def _tail(item_len: int, where: str) -> tuple[list[Plane], int]:
    if item_len % TAIL_SLOT_BYTES:
        raise ConfigError(f"{where}: DSA tail row of {item_len} B is not a whole number of "
                          f"{TAIL_SLOT_BYTES} B ring slots")
    return [Plane("slot", TAIL_SLOT_BYTES)], 1


def _split_state(name: str, n_state: int, target: list[int], draft: list[int],
                 where: str, parts: int = 1) -> list[_Entries]:
    """The DSA (or tail: `parts` = 2, key list then score list) entries of the target layers,
    then of the draft layers (SGLang appends a DSA draft pool's entries after the target's)."""
    nt, nd = len(target), len(draft)
    if n_state == parts * nt:
        nd = 0
    elif n_state != parts * (nt + nd):
        raise ConfigError(
            f"{where}: {n_state} entries; expected {parts} x {nt} target layers"
            + (f" (+ {parts} x {nd} draft layers)" if nd else ""))
    out: list[_Entries] = []
    names = ("",) if parts == 1 else ("_k", "_score")
    for p, suffix in enumerate(names):
        out.append(_Entries(f"{name}{suffix}", list(range(p * nt, (p + 1) * nt)), target))
    base = parts * nt
    for p, suffix in enumerate(names):
        if nd:
            out.append(_Entries(f"draft_{name}{suffix}",
                                list(range(base + p * nd, base + (p + 1) * nd)), draft,
                                draft=True))
    return out


def build(kv_args: Any, *, is_mla: bool, parallel: Parallel, device: str) -> Built:
    """The kvhandoff layouts and buffer views of one SGLang rank's ``KVArgs``."""
    ps = int(kv_args.page_size)
    if ps <= 0:
        raise ConfigError(f"kv_args.page_size: expected > 0, got {ps}")
    dtype = str(kv_args.kv_cache_dtype_str)
    slots = state_slots(getattr(kv_args, "state_types", []) or [])
    if getattr(kv_args, "mla_compression_ratios", None):
        raise ConfigError("kv_args.mla_compression_ratios: a DeepSeek-V4 pool (KV and window "
                          "state grouped by compression ratio) is not supported by the "
                          "kvhandoff SGLang backend; use another transfer backend for this "
                          "model")
    dsa_slot, tail_slot = slots.get(DSA_STATE), slots.get(DSA_TAIL_STATE)
    swa_slot, mamba_slot = slots.get(SWA_STATE), slots.get(MAMBA_STATE)
    swa_scale_slot = slots.get(BLOCK_SCALE_SWA_STATE)
    mha_only = [st for st in (BLOCK_SCALE_STATE, BLOCK_SCALE_SWA_STATE, MINIMAX_INDEX_K_STATE,
                              MINIMAX_DENSE_KV_STATE) if st in slots]
    if mha_only and is_mla:
        raise ConfigError(f"kv_args.state_types: {mha_only} with an MLA pool (SGLang gives "
                          "these for its MHA pools only)")
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    n = len(ptrs)
    if not n or len(lens) != n or len(items) != n:
        raise ConfigError(f"kv_args.kv_data_ptrs/lens/item_lens: expected equal non-zero "
                          f"lengths, got {len(ptrs)}/{len(lens)}/{len(items)}")
    n_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if not 0 <= n_draft < n:
        raise ConfigError(f"kv_args.num_draft_entries: expected 0..{n - 1}, got {n_draft}")
    per_layer = 1 if is_mla else 2  # MLA: one buffer per layer; MHA: K then V
    if (n - n_draft) % per_layer or n_draft % per_layer:
        raise ConfigError(f"kv_args.kv_data_ptrs: a non-MLA pool has K and V buffers per "
                          f"layer, got {n - n_draft} target and {n_draft} draft entries")
    nt, nd = (n - n_draft) // per_layer, n_draft // per_layer
    given = [int(x) for x in (getattr(kv_args, "kv_layer_ids", None) or [])]
    target = given[:nt] if len(given) == n and given[:nt] == sorted(set(given[:nt])) \
        and min(given[:nt]) >= 0 else list(range(nt))
    num_layers = max(target) + 1
    swa_groups: list[_Entries] = []
    if swa_slot is not None:
        swa_groups = _swa_entries(kv_args, swa_slot, per_layer)
        num_layers = max(num_layers, *(max(g.layer_ids) + 1 for g in swa_groups))
    draft = list(range(num_layers, num_layers + nd))
    groups: list[_Entries] = []
    names = ("kv",) if is_mla else ("k", "v")
    for i, nm in enumerate(names):
        groups.append(_Entries(nm, list(range(i * nt, (i + 1) * nt)), target))
    for i, nm in enumerate(names):
        if nd:
            groups.append(_Entries(f"draft_{nm}", list(range(n - n_draft + i * nd,
                                                             n - n_draft + (i + 1) * nd)),
                                   draft, draft=True))
    regions: list[RegionSpec] = []
    buffers: dict[str, dict[int, Any]] = {}
    for g in groups:
        built = _region(g, ptrs, lens, items, device, "kv_args.kv_data_ptrs",
                        send_from=SendFrom.START, planes=_opaque(ps))
        if built is None:
            raise ConfigError(f"kv_args.kv_item_lens: every {g.name!r} buffer has item "
                              "length 0")
        regions.append(built[0])
        buffers[g.name] = built[1]
    kv_regions = tuple(r.name for r in regions)
    head_slices, tp_fixed = 0, None
    if not is_mla:
        head_slices, tp_fixed = _row_slices(regions, parallel, slots)
        if head_slices:
            regions = [_sliced(r, head_slices, parallel.attn_tp_rank) for r in regions]
    paged: list[PagedState] = []
    for st, from0 in ((BLOCK_SCALE_STATE, True), (MINIMAX_DENSE_KV_STATE, True),
                      (MINIMAX_INDEX_K_STATE, False), (QSA_COMPRESSED_STATE, True)):
        slot = slots.get(st)
        if slot is None:
            continue
        where = f"kv_args.state_data_ptrs[{slot}] ({st})"
        groups_st = _scale_entries(kv_args, slot, target, "", where) \
            if st == BLOCK_SCALE_STATE else _paged_entries(kv_args, slot, st, where)
        st_regions: list[str] = []
        # QSA's compressed keys: one item per KV page (page_size / ratio rows of keys; the
        # ratio is not in KVArgs), one row of the whole item per page
        planes = (lambda item, w: ([Plane("group", item)], ps)) \
            if st == QSA_COMPRESSED_STATE else _opaque(ps)
        for g in groups_st:
            built = _region(g, *_state_lists(kv_args, slot), device, where,
                            send_from=SendFrom.START, planes=planes)
            if built is None:
                raise ConfigError(f"{where}: every {g.name!r} buffer has item length 0")
            regions.append(built[0])
            buffers[g.name] = built[1]
            st_regions.append(g.name)
        paged.append(PagedState(st, slot, tuple(st_regions), from0))
    if dsa_slot is not None:
        sp = kv_args.state_data_ptrs[dsa_slot]
        sl = kv_args.state_data_lens[dsa_slot]
        si = kv_args.state_item_lens[dsa_slot]
        where = f"kv_args.state_data_ptrs[{dsa_slot}]"
        if not len(sp) == len(sl) == len(si):
            raise ConfigError(f"{where}: ptrs/lens/item_lens of different lengths "
                              f"{len(sp)}/{len(sl)}/{len(si)}")
        for g in _split_state("indexer", len(sp), target, draft, where):
            built = _region(g, sp, sl, si, device, where, send_from=SendFrom.DECODE_PREFIX,
                            planes=_indexer(ps))
            if built is not None:
                regions.append(built[0])
                buffers[g.name] = built[1]
    swa_regions: list[str] = []
    swa_capacity = 0
    if swa_slot is not None:
        where = f"kv_args.state_data_ptrs[{swa_slot}] ({SWA_STATE})"
        sp = kv_args.state_data_ptrs[swa_slot]
        sl = kv_args.state_data_lens[swa_slot]
        si = kv_args.state_item_lens[swa_slot]
        for g in swa_groups:
            built = _region(g, sp, sl, si, device, where, send_from=SendFrom.START,
                            planes=_opaque(ps))
            if built is None:
                raise ConfigError(f"{where}: every {g.name!r} buffer has item length 0")
            regions.append(built[0])
            buffers[g.name] = built[1]
            swa_regions.append(g.name)
            page_bytes = built[0].bytes_per_token * ps
            cap = min(len(v) // page_bytes for v in built[1].values())
            swa_capacity = cap if not swa_capacity else min(swa_capacity, cap)
        if swa_scale_slot is not None:
            where = f"kv_args.state_data_ptrs[{swa_scale_slot}] ({BLOCK_SCALE_SWA_STATE})"
            for g in _scale_entries(kv_args, swa_scale_slot, swa_groups[0].layer_ids, "swa_",
                                    where):
                built = _region(g, *_state_lists(kv_args, swa_scale_slot), device, where,
                                send_from=SendFrom.START, planes=_opaque(ps))
                if built is None:
                    raise ConfigError(f"{where}: every {g.name!r} buffer has item length 0")
                regions.append(built[0])
                buffers[g.name] = built[1]
                swa_regions.append(g.name)
                cap = min(len(v) // (built[0].bytes_per_token * ps) for v in built[1].values())
                swa_capacity = min(swa_capacity, cap)
    # Only what both sides are given: SGLang's decode fills ``kv_head_num`` and
    # ``total_kv_head_num`` only for its staging buffers (refused here), its prefill always for
    # a non-MLA pool, so the head counts cannot be part of it. A rank's heads are in its bytes
    # per token (the regions' planes) and, with the attention TP size, the model's.
    ident = f"sglang;mla={int(is_mla)};dtype={dtype};page_size={ps};pp={parallel.pp_size}"
    if not is_mla and not head_slices:  # moved rank to rank: the same TP size on both sides
        ident += f";attn_tp={parallel.attn_tp_size}"
    swa_layout = getattr(kv_args, "swa_kv_cache_layout", None)
    if swa_slot is not None and swa_layout is not None:
        ident += f";swa_kv_cache_layout={swa_layout}"
    kv_layout = LayoutSpec(page_size_tokens=ps, kv_dtype=dtype, regions=tuple(regions),
                           model=ident, num_layers=num_layers)
    aux_layout, aux_buffers = _aux(kv_args)
    tail_layout: LayoutSpec | None = None
    tail_buffers: dict[str, dict[int, Any]] = {}
    if tail_slot is not None:
        tail_layout, tail_buffers = _tail_layout(kv_args, tail_slot, target, draft, device,
                                                 num_layers, ident)
    state_layout: LayoutSpec | None = None
    state_buffers: dict[str, dict[int, Any]] = {}
    row_states: list[RowState] = []
    if mamba_slot is not None:
        state_layout, state_buffers = _mamba_layout(kv_args, mamba_slot, device, ident,
                                                    parallel)
        row_states.append(RowState(MAMBA_STATE, mamba_slot,
                                   tuple(r.name for r in state_layout.regions)))
    qsa_slot = slots.get(QSA_PENDING_STATE)
    if qsa_slot is not None:
        state_layout, state_buffers, qsa_names = _qsa_pending(
            kv_args, qsa_slot, device, ident, state_layout, state_buffers)
        row_states.append(RowState(QSA_PENDING_STATE, qsa_slot, qsa_names))
    return Built(kv_layout=kv_layout, kv_buffers=buffers, aux_layout=aux_layout,
                 aux_buffers=aux_buffers, dsa_slot=dsa_slot, kv_regions=kv_regions,
                 tail_layout=tail_layout, tail_buffers=tail_buffers, tail_slot=tail_slot,
                 swa_slot=swa_slot, swa_regions=tuple(swa_regions),
                 swa_capacity=swa_capacity, state_layout=state_layout,
                 state_buffers=state_buffers, mamba_slot=mamba_slot, paged_states=tuple(paged),
                 row_states=tuple(row_states),
                 swa_scale_slot=swa_scale_slot, head_slices=head_slices, tp_fixed=tp_fixed)


def _row_slices(regions: list[RegionSpec], parallel: Parallel, slots: dict[str, int]
                ) -> tuple[int, str | None]:
    """How many `ROW_SLICES` slices this rank's K / V rows hold (0: none, they move rank to
    rank only, and why)."""
    t = parallel.attn_tp_size
    others = sorted(st for st in slots if st != DSA_STATE)
    if others:
        return 0, (f"its pool has state {others} (held per rank: moved rank to rank only)")
    if t <= 0 or ROW_SLICES % t:
        return 0, (f"attn_tp_size={t} does not divide {ROW_SLICES} (a K/V row is cut into "
                   f"{ROW_SLICES} slices shared out by attention TP rank)")
    n = ROW_SLICES // t
    for r in regions:
        if r.bytes_per_token % n:
            return 0, (f"region {r.name!r}: a row of {r.bytes_per_token} B is not {n} equal "
                       f"slices (attn_tp_size={t})")
    return n, None


def _sliced(r: RegionSpec, n: int, rank: int) -> RegionSpec:
    """`r` (one plane of a token's row of this rank's heads) as the `n` slices of the model's
    row this rank holds, token-major (a token's slices side by side, as SGLang's pool keeps its
    heads)."""
    b = r.bytes_per_token // n
    planes = tuple(Plane(f"s{rank * n + i}", b) for i in range(n))
    return dataclasses.replace(r, planes=planes, tp_split=TPSplit.HEAD_SHARDED, token_major=True)


def _state_lists(kv_args: Any, slot: int) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    return (kv_args.state_data_ptrs[slot], kv_args.state_data_lens[slot],
            kv_args.state_item_lens[slot])


def _scale_entries(kv_args: Any, slot: int, layer_ids: list[int], prefix: str,
                   where: str) -> list[_Entries]:
    """The MXFP8 block-scale regions of one sub-pool (``get_kv_scale_buf_infos``: the K
    scales of its layers, then the V scales; an item is one KV page's scales), on the layers
    of the KV they describe."""
    sp, sl, si = _state_lists(kv_args, slot)
    nl = len(layer_ids)
    if not len(sp) == len(sl) == len(si) == 2 * nl:
        raise ConfigError(f"{where}: {len(sp)}/{len(sl)}/{len(si)} ptrs/lens/item_lens; "
                          f"expected the K then V scales of the {nl} layers of its KV")
    return [_Entries(f"{prefix}k_scale", list(range(nl)), list(layer_ids)),
            _Entries(f"{prefix}v_scale", list(range(nl, 2 * nl)), list(layer_ids))]


def _paged_entries(kv_args: Any, slot: int, state: str, where: str) -> list[_Entries]:
    """MiniMax's components (``MiniMaxSparseKVPool``): ``minimax_dense_kv``, the dense
    layers' K buffers then V buffers (``get_dense_kv_state_buf_infos``), and
    ``minimax_index_k``, one index-key buffer per K-only sparse layer
    (``get_index_k_state_buf_infos``); an item is one page, layers by position (KVArgs does
    not name them)."""
    sp, sl, si = _state_lists(kv_args, slot)
    n = len(sp)
    if not n or not n == len(sl) == len(si):
        raise ConfigError(f"{where}: expected equal non-zero ptrs/lens/item_lens, got "
                          f"{n}/{len(sl)}/{len(si)}")
    if state == MINIMAX_INDEX_K_STATE:
        return [_Entries("index_k", list(range(n)), list(range(n)))]
    if state == QSA_COMPRESSED_STATE:  # one buffer per full-attention layer, SGLang's ids
        ids = [int(x) for x in (list(getattr(kv_args, "state_layer_ids", None) or [])
                                [slot:slot + 1] or [[]])[0]]
        return [_Entries("qsa_compressed", list(range(n)), ids if len(ids) == n
                         and ids == sorted(set(ids)) else list(range(n)))]
    if n % 2:
        raise ConfigError(f"{where}: {n} entries; expected K then V buffers of the dense "
                          "layers")
    h = n // 2
    return [_Entries("dense_k", list(range(h)), list(range(h))),
            _Entries("dense_v", list(range(h, n)), list(range(h)))]


def paged_state_pages(p: PagedState, indices: Any, pages: np.ndarray) -> np.ndarray:
    """The pages of `p`'s regions in the room's suffix, from SGLang's indices of it: their
    last ``len(pages)`` when SGLang gives the request's pages from token 0 (the decode holds
    its cached prefix's with that prefix), else all of them; they must be the suffix's KV
    pages (the component lives at its KV page's index and moved with each chunk's pages)."""
    where = f"state_indices[{p.slot}] ({p.state})"
    flat = None if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if flat is None or len(flat) < len(pages) or (not p.from_token0
                                                   and len(flat) != len(pages)):
        raise ConfigError(f"{where}: expected the request's pages ("
                          f"{'at least ' if p.from_token0 else ''}the {len(pages)} suffix "
                          f"pages), got {None if flat is None else len(flat)}")
    tail = flat[len(flat) - len(pages):]
    if not np.array_equal(tail, pages):
        raise ConfigError(f"{where}: its pages {tail.tolist()[:8]} are not the KV pages "
                          f"{pages.tolist()[:8]} of the suffix")
    return tail


def swa_scale_pages(scales: Any, swa: Any, where: str) -> None:
    """Checks SGLang's ``block_scale_swa`` indices are the window's pages (both are its
    ``_swa_payload``): the window pool's scales move with the window's pages."""
    a = None if scales is None else np.asarray(scales, dtype=np.int64).reshape(-1)
    b = None if swa is None else np.asarray(swa, dtype=np.int64).reshape(-1)
    if a is None or b is None or not np.array_equal(a, b):
        raise ConfigError(f"{where}: expected the window's pages "
                          f"{None if b is None else b.tolist()[:8]}, got "
                          f"{None if a is None else a.tolist()[:8]}")


def _mamba_layout(kv_args: Any, slot: int, device: str, ident: str, parallel: Parallel
                  ) -> tuple[LayoutSpec, dict[str, dict[int, Any]]]:
    """The state layout of SGLang's Mamba component: its entries are tensor-major x layer
    (``MambaPool.get_contiguous_buf_infos``), one region per tensor."""
    where = f"kv_args.state_data_ptrs[{slot}] ({MAMBA_STATE})"
    sp = list(kv_args.state_data_ptrs[slot])
    sl = list(kv_args.state_data_lens[slot])
    si = list(kv_args.state_item_lens[slot])
    ids = [int(x) for x in (list(getattr(kv_args, "state_layer_ids", None) or [])[slot:slot + 1]
                            or [[]])[0]]
    n = len(sp)
    if not n or not len(sl) == len(si) == n:
        raise ConfigError(f"{where}: expected equal non-zero ptrs/lens/item_lens, got "
                          f"{n}/{len(sl)}/{len(si)}")
    if len(ids) != n:
        raise ConfigError(f"kv_args.state_layer_ids[{slot}]: expected one layer id per "
                          f"{MAMBA_STATE} entry ({n}), got {len(ids)}")
    layers = list(dict.fromkeys(ids))
    nl = len(layers)
    if n % nl or any(ids[t * nl:(t + 1) * nl] != layers for t in range(n // nl)):
        raise ConfigError(f"kv_args.state_layer_ids[{slot}]: expected the same layers for "
                          f"every state tensor (tensor-major x layer), got {ids}")
    order = sorted(range(nl), key=lambda i: layers[i])
    dims = list(getattr(kv_args, "state_dim_per_tensor", None) or [])
    outer = list(getattr(kv_args, "state_slice_outer_counts", None) or [])

    def per_tensor(v: list[Any]) -> list[int]:
        part = v[slot] if slot < len(v) else []
        return [int(part[t * nl]) for t in range(n // nl)] if len(part) == n else []

    regions: list[RegionSpec] = []
    buffers: dict[str, dict[int, Any]] = {}
    for t in range(n // nl):
        g = _Entries(f"mamba{t}", [t * nl + i for i in order], [layers[i] for i in order])
        built = _region(g, sp, sl, si, device, where, send_from=SendFrom.START,
                        planes=lambda item, w: ([Plane("row", item)], 1))
        if built is None:
            raise ConfigError(f"{where}: every entry of state tensor {t} has item length 0")
        regions.append(built[0])
        buffers[g.name] = built[1]
    model = (f"{ident};mamba;dims={per_tensor(dims)};outer={per_tensor(outer)};"
             f"attn_tp={parallel.attn_tp_size}")
    return LayoutSpec(page_size_tokens=1, kv_dtype="bytes", regions=tuple(regions),
                      model=model, num_layers=max(layers) + 1), buffers


QSA_ROPE_LAYER_ID = (1 << 32) - 2  # SGLang's layer id of QSA's request-wide RoPE ring


def _qsa_pending(kv_args: Any, slot: int, device: str, ident: str, layout: LayoutSpec | None,
                 buffers: dict[str, dict[int, Any]]
                 ) -> tuple[LayoutSpec, dict[str, dict[int, Any]], tuple[str, ...]]:
    """QSA's pending state (``QSATokenToKVPool.get_qsa_pending_state_buf_infos``: the index-key
    ring of each full-attention layer, then the RoPE-position ring all of them share; an item
    is one request's ring of ``ratio`` slots, at its request-pool row) added to the state
    layout (`layout`, the Mamba one, or a new one): regions ``qsa_pending_k`` (the layers
    SGLang names in ``state_layer_ids``) and ``qsa_rope`` (one layer, 0)."""
    where = f"kv_args.state_data_ptrs[{slot}] ({QSA_PENDING_STATE})"
    sp, sl, si = _state_lists(kv_args, slot)
    n = len(sp)
    ids = [int(x) for x in (list(getattr(kv_args, "state_layer_ids", None) or [])[slot:slot + 1]
                            or [[]])[0]]
    if n < 2 or not n == len(sl) == len(si):
        raise ConfigError(f"{where}: expected the key rings and the RoPE ring, got "
                          f"{n}/{len(sl)}/{len(si)} ptrs/lens/item_lens")
    if len(ids) != n or ids[-1] != QSA_ROPE_LAYER_ID or QSA_ROPE_LAYER_ID in ids[:-1]:
        raise ConfigError(f"kv_args.state_layer_ids[{slot}]: expected the full-attention layer "
                          f"ids then the RoPE ring's {QSA_ROPE_LAYER_ID} (a QSA draft pool's "
                          f"pending state is not supported), got {ids}")
    groups = [_Entries("qsa_pending_k", list(range(n - 1)), ids[:-1]),
              _Entries("qsa_rope", [n - 1], [0])]
    regions = list(layout.regions) if layout is not None else []
    out = dict(buffers)
    for g in groups:
        built = _region(g, sp, sl, si, device, where, send_from=SendFrom.START,
                        planes=lambda item, w: ([Plane("ring", item)], 1))
        if built is None:
            raise ConfigError(f"{where}: every {g.name!r} buffer has item length 0")
        regions.append(built[0])
        out[g.name] = built[1]
    model = (layout.model if layout is not None else ident) + ";qsa_pending"
    num_layers = max([*(r + 1 for r in ids[:-1]), layout.num_layers if layout else 1])
    return (LayoutSpec(page_size_tokens=1, kv_dtype="bytes", regions=tuple(regions),
                       model=model, num_layers=num_layers), out,
            tuple(g.name for g in groups))


def row_pages(b: Built, state_indices: list[Any] | None
              ) -> dict[str, np.ndarray | list[int]]:
    """The state room's page table: each row state's regions at the request's row (SGLang's
    one-element index of it); `ConfigError` naming the component when one is missing."""
    out: dict[str, np.ndarray | list[int]] = {}
    for rs in b.row_states:
        raw = None if state_indices is None or rs.slot >= len(state_indices) \
            else state_indices[rs.slot]
        row = mamba_row(raw, f"state_indices[{rs.slot}] ({rs.state})")
        out.update({name: [row] for name in rs.regions})
    return out


def mamba_row(indices: Any, where: str) -> int:
    """The request's row from SGLang's state index (``[row]``, the row a one-element array or
    an int, as its ``_mamba_payload`` gives it; QSA's one-element array of the request-pool
    row)."""
    if indices is None or len(indices) != 1:
        raise ConfigError(f"{where}: expected SGLang's one row index, got {indices!r}")
    flat = np.asarray(indices[0]).reshape(-1)
    if len(flat) != 1 or int(flat[0]) < 0:
        raise ConfigError(f"{where}: expected one row index >= 0, got {flat.tolist()}")
    return int(flat[0])


def _swa_entries(kv_args: Any, slot: int, per_layer: int) -> list[_Entries]:
    """The regions of SGLang's sliding-window pool (``SWAKVPool.get_state_buf_infos``: its
    window pool's K buffers then V buffers, or one buffer per layer for an MLA-class window
    pool, as the main pool's), layer ids by position."""
    sp = kv_args.state_data_ptrs[slot]
    n = len(sp)
    where = f"kv_args.state_data_ptrs[{slot}] ({SWA_STATE})"
    if not n or not len(sp) == len(kv_args.state_data_lens[slot]) \
            == len(kv_args.state_item_lens[slot]):
        raise ConfigError(f"{where}: expected equal non-zero ptrs/lens/item_lens, got "
                          f"{n}/{len(kv_args.state_data_lens[slot])}/"
                          f"{len(kv_args.state_item_lens[slot])}")
    if n % per_layer:
        raise ConfigError(f"{where}: a non-MLA window pool has K and V buffers per layer, got "
                          f"{n} entries")
    ns = n // per_layer
    names = ("swa_kv",) if per_layer == 1 else ("swa_k", "swa_v")
    return [_Entries(nm, list(range(i * ns, (i + 1) * ns)), list(range(ns)))
            for i, nm in enumerate(names)]


def swa_start_pages(num_pages: int, swa: Sequence[int] | None, where: str) -> int:
    """The suffix page the sliding window starts at: SGLang's SWA state indices are the last
    pages of the request's suffix (its window, or the whole suffix when the decode's prefix
    reaches into the window)."""
    n = 0 if swa is None else len(swa)
    if swa is None or not 0 < n <= num_pages:
        raise ConfigError(f"{where}: expected 1..{num_pages} window pages (the last pages of "
                          f"the {num_pages} suffix pages), got {None if swa is None else n}")
    return num_pages - n


def swa_send_table(num_pages: int, swa: Sequence[int] | None, capacity: int,
                   where: str) -> np.ndarray:
    """The prefill's SWA table from suffix page 0: SGLang's window pages last, the pages before
    the window (which the request no longer holds in the window pool) as distinct page ids
    outside the window. They are never read: the decode's window starts at the same page (its
    SWA page count is checked equal to the prefill's before the room opens) and the agent reads
    a region from its start on."""
    start = swa_start_pages(num_pages, swa, where)
    win = np.asarray(swa, dtype=np.int64).reshape(-1)
    if not start:
        return win
    held = set(win.tolist())
    spare = [p for p in range(capacity) if p not in held][:start]
    if len(spare) < start:
        raise ConfigError(f"{where}: the window pool has {capacity} pages, too few to stand "
                          f"for the {start} pages before the window")
    return np.concatenate([np.asarray(spare, dtype=np.int64), win])


def _aux(kv_args: Any) -> tuple[LayoutSpec | None, dict[str, dict[int, Any]]]:
    aptrs = list(getattr(kv_args, "aux_data_ptrs", None) or [])
    if not aptrs:
        return None, {}
    alens, aitems = kv_args.aux_data_lens, kv_args.aux_item_lens
    aregions = []
    buffers: dict[str, dict[int, Any]] = {}
    for i in range(len(aptrs)):
        # SGLang's metadata buffers live in host memory (MetadataBuffers: device "cpu" on
        # CUDA builds), whatever the KV pool's device
        built = _region(_Entries(f"aux{i}", [i], [i]), aptrs, alens, aitems, "cpu",
                        "kv_args.aux_data_ptrs", send_from=SendFrom.START, planes=_opaque(1))
        if built is None:
            raise ConfigError(f"kv_args.aux_item_lens[{i}]: item length 0")
        aregions.append(built[0])
        buffers[built[0].name] = built[1]
    return LayoutSpec(page_size_tokens=1, kv_dtype="bytes", regions=tuple(aregions),
                      model=f"sglang-aux;n={len(aptrs)}"), buffers


def _tail_layout(kv_args: Any, slot: int, target: list[int], draft: list[int], device: str,
                 num_layers: int, ident: str
                 ) -> tuple[LayoutSpec | None, dict[str, dict[int, Any]]]:
    tp = kv_args.state_data_ptrs[slot]
    tl = kv_args.state_data_lens[slot]
    ti = kv_args.state_item_lens[slot]
    where = f"kv_args.state_data_ptrs[{slot}] ({DSA_TAIL_STATE})"
    regions: list[RegionSpec] = []
    buffers: dict[str, dict[int, Any]] = {}
    for g in _split_state("tail", len(tp), target, draft, where, parts=2):
        built = _region(g, tp, tl, ti, device, where, send_from=SendFrom.START, planes=_tail)
        if built is not None:
            regions.append(built[0])
            buffers[g.name] = built[1]
    if not regions:
        return None, {}
    return LayoutSpec(page_size_tokens=1, kv_dtype="bfloat16", regions=tuple(regions),
                      model=f"{ident};dsa_tail", num_layers=num_layers), buffers


def tail_pages(indices: Sequence[int] | None, where: str) -> np.ndarray:
    """The ring slots (pages of the tail layout) of one request's live tail tokens, in token
    order, from SGLang's 6-tuple ``[row, off1, n1, off2, n2, tail_size]``
    (``get_dsa_tail_state_indices``); no live tail (``[]``): no pages."""
    if not indices:
        return np.zeros(0, np.int64)
    v = [int(x) for x in indices]
    if len(v) != 6:
        raise ConfigError(f"{where}: expected SGLang's 6-tuple [row, off1, n1, off2, n2, "
                          f"tail_size], got {v}")
    row, o1, n1, o2, n2, size = v
    if row < 0 or size <= 0 or min(o1, n1, o2, n2) < 0 or o1 + n1 > size or o2 + n2 > size:
        raise ConfigError(f"{where}: ring segments {v} do not fit a ring of {size} slots")
    slots = [*range(o1, o1 + n1), *range(o2, o2 + n2)]
    return np.asarray(slots, dtype=np.int64) + row * size


def hetero_tp_refusal(built: Built, prefill_tp: int, decode_tp: int,
                      total_kv_heads: int = 0) -> str | None:
    """Why a non-MLA pool cannot hand off between these attention TP sizes (None: it can,
    each decode rank taking its share of the heads from the prefill ranks that hold them).
    `total_kv_heads`: the model's KV heads where this side knows them (SGLang states them on
    the prefill only), 0 where not."""
    if prefill_tp == decode_tp:
        return None
    pair = f"prefill attn_tp_size={prefill_tp}, decode attn_tp_size={decode_tp}"
    if built.tp_fixed is not None:
        return (f"kvhandoff: an MHA/GQA KV pool of another attention TP size on each side "
                f"({pair}) is split by head, but this pool moves rank to rank only: "
                f"{built.tp_fixed}; run both with the same --tp")
    for t, side in ((prefill_tp, "prefill"), (decode_tp, "decode")):
        if t <= 0 or ROW_SLICES % t:
            return (f"kvhandoff: {side} attn_tp_size={t} does not divide {ROW_SLICES} ({pair}): "
                    f"heads are shared out between TP sizes dividing {ROW_SLICES} only; run "
                    f"both with the same --tp")
    if total_kv_heads:
        for t, side in ((prefill_tp, "prefill"), (decode_tp, "decode")):
            if total_kv_heads % t:
                return (f"kvhandoff: the model's {total_kv_heads} KV heads "
                        f"(total_kv_head_num) do not split evenly over {side} "
                        f"attn_tp_size={t} ({pair}); run both with the same --tp, or a --tp "
                        f"dividing {total_kv_heads}")
    return None

