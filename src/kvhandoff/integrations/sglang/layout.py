"""SGLang ``KVArgs`` -> kvhandoff layouts and buffers.

Two layouts per rank, one agent each (an agent has one page size):

- the **KV layout** (page size = SGLang's ``page_size``): the main KV buffers
  (``kv_data_ptrs/lens/item_lens``; MLA: one buffer per layer, region ``kv``; MHA: K buffers
  then V buffers, regions ``k`` and ``v``; draft/MTP entries, the last ``num_draft_entries``,
  as ``draft_kv`` or ``draft_k``/``draft_v``) and the DSA indexer (state component
  ``StateType.DSA``, region ``indexer``, suffix-only). Every other state type is refused at
  startup, naming it.
- the **aux layout** (page size 1): one region ``aux<i>`` per SGLang metadata buffer
  (``aux_data_ptrs/lens/item_lens``), a page being one request slot of ``item_len`` bytes.

A page of a region is one SGLang item (``item_len`` bytes = ``page_size`` tokens of one plane of
``item_len // page_size`` bytes), so SGLang pages map 1:1 onto kvhandoff pages. The layout's
``model`` field carries what SGLang itself requires to be equal on both sides (page size, KV
dtype, KV head counts, PP size; the attention TP size for non-MLA pools, which this backend
moves rank to rank): it is part of the layout hash both agents compare at the handshake, so a
mismatch fails the handshake with the differing field named.

Buffers are zero-copy views of SGLang's memory: numpy views of host pointers, or CUDA tensors
built through ``__cuda_array_interface__`` for device pointers (the KV pool and DSA state on a
CUDA device; SGLang's metadata buffers are host memory there).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom, TPSplit

DSA_STATE = "dsa"


@dataclass(frozen=True)
class Parallel:
    """What of the SGLang topology goes into the layout identity."""

    attn_tp_size: int = 1
    pp_size: int = 1


@dataclass
class Built:
    kv_layout: LayoutSpec
    kv_buffers: dict[str, dict[int, Any]]
    aux_layout: LayoutSpec | None
    aux_buffers: dict[str, dict[int, Any]]
    dsa_slot: int | None  # index of the DSA component in state_types / state_indices
    kv_regions: tuple[str, ...]  # regions fed by the send() page lists (not the indexer)
    region_entries: dict[str, list[int]] = field(default_factory=dict)


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


def check_state_types(state_types: Sequence[Any]) -> int | None:
    """The slot of the DSA component; any other state type is refused, named."""
    dsa = None
    for i, t in enumerate(state_types or ()):
        name = _state_name(t)
        if name == DSA_STATE and dsa is None:
            dsa = i
            continue
        raise ConfigError(
            f"kv_args.state_types[{i}]: state type {name!r} is not supported by the kvhandoff "
            f"SGLang backend (supported: main KV, draft KV, aux buffers and the DSA indexer "
            f"state '{DSA_STATE}'); use another transfer backend for this model")
    return dsa


def _plane_bytes(item_len: int, page_size: int, where: str) -> int:
    if item_len <= 0 or item_len % page_size:
        raise ConfigError(f"{where}: item length {item_len} B is not a positive multiple of "
                          f"page_size={page_size}")
    return item_len // page_size


def _region(name: str, entries: list[int], ptrs: Sequence[int], lens: Sequence[int],
            item_lens: Sequence[int], page_size: int, device: str, where: str,
            send_from: SendFrom, layer_ids: Sequence[int] | None = None
            ) -> tuple[RegionSpec, dict[int, Any]]:
    sizes = {int(item_lens[e]) for e in entries}
    if len(sizes) != 1:
        raise ConfigError(f"{where}: region {name!r} has buffers of different item lengths "
                          f"{sorted(sizes)}; kvhandoff needs one page size per region")
    bpt = _plane_bytes(sizes.pop(), page_size, f"{where}[{entries[0]}]")
    ids = list(layer_ids) if layer_ids is not None else list(range(len(entries)))
    if len(ids) != len(entries) or ids != sorted(set(ids)) or any(i < 0 for i in ids):
        ids = list(range(len(entries)))  # not usable as region layer ids: positions
    bufs: dict[int, Any] = {}
    for lid, e in zip(ids, entries, strict=True):
        n = int(lens[e])
        if n % int(item_lens[e]):
            raise ConfigError(f"{where}[{e}]: buffer length {n} B is not a whole number of "
                              f"{item_lens[e]} B items")
        bufs[lid] = view(int(ptrs[e]), n, device, f"{where}[{e}]")
    spec = RegionSpec(name=name, layer_ids=tuple(ids), planes=(Plane("page", bpt),),
                      send_from=send_from, tp_split=TPSplit.REPLICATED)
    return spec, bufs


def build(kv_args: Any, *, is_mla: bool, parallel: Parallel, device: str) -> Built:
    """The kvhandoff layouts and buffer views of one SGLang rank's ``KVArgs``."""
    ps = int(kv_args.page_size)
    if ps <= 0:
        raise ConfigError(f"kv_args.page_size: expected > 0, got {ps}")
    dtype = str(kv_args.kv_cache_dtype_str)
    dsa_slot = check_state_types(getattr(kv_args, "state_types", []) or [])
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    n = len(ptrs)
    if not n or len(lens) != n or len(items) != n:
        raise ConfigError(f"kv_args.kv_data_ptrs/lens/item_lens: expected equal non-zero "
                          f"lengths, got {len(ptrs)}/{len(lens)}/{len(items)}")
    n_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    layer_ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    groups: list[tuple[str, list[int]]] = []
    for prefix, entries in (("", list(range(n - n_draft))),
                            ("draft_", list(range(n - n_draft, n)))):
        if not entries:
            continue
        if is_mla:
            groups.append((f"{prefix}kv", entries))
        else:
            if len(entries) % 2:
                raise ConfigError(f"kv_args.kv_data_ptrs: a non-MLA pool has K and V buffers "
                                  f"per layer, got an odd count {len(entries)}")
            half = len(entries) // 2
            groups += [(f"{prefix}k", entries[:half]), (f"{prefix}v", entries[half:])]
    regions: list[RegionSpec] = []
    buffers: dict[str, dict[int, Any]] = {}
    for name, entries in groups:
        ids = [layer_ids[e] for e in entries] if len(layer_ids) == n else None
        spec, bufs = _region(name, entries, ptrs, lens, items, ps, device,
                             "kv_args.kv_data_ptrs", SendFrom.START, ids)
        regions.append(spec)
        buffers[name] = bufs
    kv_regions = tuple(r.name for r in regions)
    if dsa_slot is not None:
        sp = kv_args.state_data_ptrs[dsa_slot]
        sl = kv_args.state_data_lens[dsa_slot]
        si = kv_args.state_item_lens[dsa_slot]
        sids = list((getattr(kv_args, "state_layer_ids", None) or [[]] * (dsa_slot + 1))
                    [dsa_slot] or []) or None
        spec, bufs = _region("indexer", list(range(len(sp))), sp, sl, si, ps, device,
                             f"kv_args.state_data_ptrs[{dsa_slot}]", SendFrom.DECODE_PREFIX,
                             sids)
        regions.append(spec)
        buffers["indexer"] = bufs
    head_num = getattr(kv_args, "kv_head_num", None) if not is_mla else 1
    total_heads = getattr(kv_args, "total_kv_head_num", None) if not is_mla else 1
    ident = (f"sglang;mla={int(is_mla)};dtype={dtype};page_size={ps};pp={parallel.pp_size};"
             f"kv_heads={head_num}/{total_heads}")
    if not is_mla:
        ident += f";attn_tp={parallel.attn_tp_size}"
    kv_layout = LayoutSpec(page_size_tokens=ps, kv_dtype=dtype, regions=tuple(regions),
                           model=ident)
    aux_layout = None
    aux_buffers: dict[str, dict[int, Any]] = {}
    aptrs = list(getattr(kv_args, "aux_data_ptrs", None) or [])
    if aptrs:
        alens, aitems = kv_args.aux_data_lens, kv_args.aux_item_lens
        aregions = []
        for i in range(len(aptrs)):
            # SGLang's metadata buffers live in host memory (MetadataBuffers: device "cpu"
            # on CUDA builds), whatever the KV pool's device
            spec, bufs = _region(f"aux{i}", [i], aptrs, alens, aitems, 1, "cpu",
                                 "kv_args.aux_data_ptrs", SendFrom.START, [i])
            aregions.append(spec)
            aux_buffers[spec.name] = bufs
        aux_layout = LayoutSpec(page_size_tokens=1, kv_dtype="bytes", regions=tuple(aregions),
                                model=f"sglang-aux;n={len(aptrs)}")
    return Built(kv_layout=kv_layout, kv_buffers=buffers, aux_layout=aux_layout,
                 aux_buffers=aux_buffers, dsa_slot=dsa_slot, kv_regions=kv_regions)
