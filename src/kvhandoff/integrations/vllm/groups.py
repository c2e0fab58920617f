"""Which of vLLM's KV cache groups the connector moves, and the region of each layer, read from
vLLM's own per-layer specs (never from layer names or tensor shapes).

Accepted: ONE KV cache group, whose spec is

- a `FullAttentionSpec` (GQA) or `MLAAttentionSpec` shared by every layer: one region per page
  shape, as before (``roles`` is None);
- a `UniformTypeKVCacheSpecs` of `MLAAttentionSpec` layers: vLLM's group of a DSA model
  (DeepSeek-V3.2, GLM-5.x), where the MLA layers and their DSA indexer K caches
  (`DeepseekV32IndexerCache`: ``cache_role`` INDEXER, one head of uint8) share one block table;
  a block holds both caches' pages, so a prefix hit is a hit of both, and eviction frees both.
  The layers of one spec are one region, as vLLM allocates them (one ``KVCacheTensor`` per
  distinct spec): the indexer caches ``indexer``; the MLA layers ``kv``, or, where the MLA layers
  that run an indexer (``is_index_group_leader``) and those that reuse another layer's top-k have
  different specs, ``kv`` and ``kv_shared``. Draft (MTP) layers (``is_draft``) get the same
  names with ``draft_`` in front, as draft regions after the target model's layers.

- a `SlidingWindowSpec` shared by every layer (a Mistral-like model whose every layer has one
  window): one region as for full attention (``sliding_window`` says the window). vLLM frees a
  request's blocks that fell out of the window (its block table then starts with its null
  block), so only the pages in the window move: the decode's first page that vLLM allocated
  is its ``decode_prefix_len`` (`scheduler`).

- SEVERAL groups (vLLM's hybrid allocator, on by default for this connector: a model that mixes
  full-attention and sliding-window layers, Gemma 3, gpt-oss, Cohere 2 ...), each a
  `FullAttentionSpec` (GQA) or a `SlidingWindowSpec`: one region per group, since each group
  has its own block table (vLLM splits the layers of one kind into groups of one size, so two
  sliding-window groups are usual). Region ``kv_g<i>`` for a full-attention group,
  ``swa<window>_g<i>`` for a sliding-window one: the window is part of the layout identity
  both sides compare. A full-attention group moves whole from the decode's prefix; a
  sliding-window group only from its window on (`scheduler`: the room's per-region starts).
  Every group must use one block size (vLLM's hybrid allocator gives attention groups one
  page; another is refused naming both).

Refused at start with the reason: Mamba / SSM state (`MambaSpec`: a state per request, not
pages per token), several groups of which one is MLA, DSA or not moved by vLLM's connectors
(``enable_kv_transfer`` false), sliding-window MLA, two indexer specs ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.layout import CacheRole, layer_index

__all__ = ["GroupPlan", "plan_group"]


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """What `plan_group` read from vLLM's KV cache group."""

    mla: bool
    block_size: int
    dtype: str  # of the main KV
    roles: dict[str, CacheRole] | None  # None: one region per page shape (`build_layout`)
    main_layers: tuple[str, ...]
    indexer_layers: tuple[str, ...]
    num_layers: int  # target-model layers (0: from the layer ids)
    sliding_window: int = 0  # tokens of the window of every layer (0: full attention)
    # several groups (vLLM's hybrid allocator): per group, its region and window (0: full
    # attention); empty for one group
    group_regions: tuple[str, ...] = ()
    group_windows: tuple[int, ...] = ()
    group_extra: tuple[int, ...] = ()  # per group, vLLM's extra_retained_tokens of the window


def _dtype(spec: Any) -> str:
    return str(getattr(spec, "dtype", "")).removeprefix("torch.")


def _specs(spec: Any) -> list[Any]:
    """A group's spec, or its per-layer specs where the group mixes them."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    return list(per_layer.values()) if isinstance(per_layer, dict) else [spec]


def _kinds(spec: Any) -> list[str]:
    """The spec type names of a group."""
    return sorted({type(s).__name__ for s in _specs(spec)})


def plan_group(kv_cache_config: Any, *, model: str = "") -> GroupPlan:
    """The group vLLM planned (``kv_cache_config.kv_cache_groups``), or `ConfigError` naming
    what this connector cannot move (and `model`, the model vLLM serves, where given)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SparseCacheRole,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups
    kinds = [_kinds(g.kv_cache_spec) for g in groups]
    mamba = sorted({type(s).__name__ for g in groups for s in _specs(g.kv_cache_spec)
                    if isinstance(s, MambaSpec)})
    if mamba:
        who = f"model {model!r}" if model else "the model"
        raise ConfigError(
            f"kv_cache_groups: {who} has Mamba / SSM state layers ({mamba}, groups {kinds}); "
            "KVHandoffConnector moves attention KV pages, not a request's SSM / conv "
            "state (a state block covers another number of tokens than the attention page, "
            "docs/VLLM.md 'Hybrid models'): serve this model without a KV connector, or with "
            "one that moves SSM state (vLLM's NixlConnector)")
    if len(groups) > 1:
        return _plan_hybrid(groups, kinds)
    group = groups[0]
    spec = group.kv_cache_spec
    names = tuple(group.layer_names)
    if isinstance(spec, FullAttentionSpec):
        return GroupPlan(mla=isinstance(spec, MLAAttentionSpec), block_size=int(spec.block_size),
                         dtype=_dtype(spec), roles=None, main_layers=names, indexer_layers=(),
                         num_layers=0)
    if type(spec) is SlidingWindowSpec:  # subclasses (MLA, ...) are other page layouts
        return GroupPlan(mla=False, block_size=int(spec.block_size), dtype=_dtype(spec),
                         roles=None, main_layers=names, indexer_layers=(), num_layers=0,
                         sliding_window=int(spec.sliding_window))
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        raise ConfigError(f"kv_cache_groups[0]: KVHandoffConnector moves full-attention "
                          f"(GQA), sliding-window (GQA), MLA and DSA (MLA + indexer) caches, got "
                          f"{type(spec).__name__}")
    per_layer = spec.kv_cache_specs
    other = sorted({type(s).__name__ for s in per_layer.values()
                    if not isinstance(s, MLAAttentionSpec)})
    if other:
        raise ConfigError(f"kv_cache_groups[0]: a group of per-layer specs is moved when every "
                          f"layer is MLA (DSA models: MLA + indexer), got {other}")
    # one region per distinct spec, as vLLM allocates them (one KVCacheTensor per spec)
    # (is_draft is not part of a spec's equality: a draft layer's spec equals its target's)
    by_spec: dict[tuple[Any, bool], list[str]] = {}
    for n in names:
        by_spec.setdefault((per_layer[n], bool(per_layer[n].is_draft)), []).append(n)
    leaders = {d for (s, d) in by_spec
               if s.cache_role != SparseCacheRole.INDEXER and s.is_index_group_leader}
    roles: dict[str, CacheRole] = {}
    taken: dict[str, tuple[str, Any]] = {}
    for (s, draft), members in by_spec.items():
        indexer = s.cache_role == SparseCacheRole.INDEXER
        if indexer:
            base = "indexer"
        elif s.is_index_group_leader or draft not in leaders:
            base = "kv"
        else:  # MLA layers reusing another layer's top-k, beside the indexer-running ones
            base = "kv_shared"
        region = f"draft_{base}" if draft else base
        if region in taken:
            raise ConfigError(
                f"kv_cache_groups[0]: layers {taken[region][0]!r} and {members[0]!r} are both "
                f"{region!r} caches with different specs ({_spec_diff(taken[region][1], s)}); "
                "KVHandoffConnector does not know which page layout each one has")
        taken[region] = (members[0], s)
        for n in members:
            roles[n] = CacheRole(region=region, indexer=indexer, draft=draft)
        if indexer and int(s.tokens_per_state) != 1:
            raise ConfigError(
                f"kv_cache_groups[0]: indexer {members[0]!r} keeps one state per "
                f"{s.tokens_per_state} tokens (index_kpool); KVHandoffConnector moves indexer "
                "caches of one row per token")
    main = tuple(n for n in names if not roles[n].indexer)
    if not main:
        raise ConfigError("kv_cache_groups[0]: only indexer caches, no MLA layer")
    first = per_layer[main[0]]
    target_ids = [n for n in main if not roles[n].draft]
    num_layers = (max(layer_index(n) for n in target_ids) + 1) if target_ids else 0
    return GroupPlan(mla=True, block_size=int(spec.block_size), dtype=_dtype(first),
                     roles=roles, main_layers=main,
                     indexer_layers=tuple(n for n in names if roles[n].indexer),
                     num_layers=num_layers)


def _plan_hybrid(groups: Any, kinds: list[list[str]]) -> GroupPlan:
    """Several groups of full-attention and sliding-window GQA layers (module docstring)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    regions, windows, extra, sizes = [], [], [], []
    roles: dict[str, CacheRole] = {}
    layers: list[str] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if not getattr(g, "enable_kv_transfer", True):
            raise ConfigError(f"kv_cache_groups[{i}]: a group vLLM does not transfer "
                              "(enable_kv_transfer=false); KVHandoffConnector moves hybrid "
                              "models whose every group is transferred")
        if type(spec) is SlidingWindowSpec:
            window = int(spec.sliding_window)
            region = f"swa{window}_g{i}"
        elif type(spec) is FullAttentionSpec:  # subclasses (MLA, R-SWA, sinks ...) differ
            window, region = 0, f"kv_g{i}"
        else:
            raise ConfigError(
                f"kv_cache_groups[{i}]: vLLM's hybrid allocator made {len(groups)} groups "
                f"({kinds}); KVHandoffConnector moves several groups when each is "
                f"full-attention or sliding-window GQA, got {type(spec).__name__}")
        regions.append(region)
        windows.append(window)
        extra.append(int(getattr(spec, "extra_retained_tokens", 0) or 0))
        sizes.append(int(spec.block_size))
        for n in g.layer_names:
            roles[n] = CacheRole(region=region)
            layers.append(n)
    if len(set(sizes)) > 1:
        other = next(i for i, s in enumerate(sizes) if s != sizes[0])
        raise ConfigError(f"kv_cache_groups: block sizes {sizes} per group; KVHandoffConnector "
                          "moves the groups of a hybrid model when they share one block size: "
                          f"group 0 ({regions[0]}) has {sizes[0]} tokens, group {other} "
                          f"({regions[other]}) {sizes[other]}")
    dtypes = sorted({_dtype(g.kv_cache_spec) for g in groups})
    if len(dtypes) > 1:
        raise ConfigError(f"kv_cache_groups: the groups' KV dtypes differ ({dtypes}); "
                          "KVHandoffConnector moves one KV dtype")
    return GroupPlan(mla=False, block_size=sizes[0], dtype=dtypes[0], roles=roles,
                     main_layers=tuple(layers), indexer_layers=(), num_layers=0,
                     group_regions=tuple(regions), group_windows=tuple(windows),
                     group_extra=tuple(extra))


def _spec_diff(a: Any, b: Any) -> str:
    import dataclasses

    diffs = [f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
             for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return "; ".join(diffs) or "equal fields"
