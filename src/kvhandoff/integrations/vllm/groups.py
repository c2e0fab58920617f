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

- Mamba / linear-attention state (`MambaSpec` groups beside attention groups: Qwen3-Next's
  Gated DeltaNet, Mamba2 / Nemotron-H-like ...): a request's state is one block per group (conv
  state then SSM / temporal state, in vLLM's layout for the backend), not pages per token. Each
  such group is its own region ``state_g<i>`` whose page is vLLM's whole state block
  (`layout.state_regions`: the states' dtypes and shapes, the padding and the block size are in
  the plane name, so both sides compare them); the block that holds the state after ``T``
  tokens (`state_table`) moves as the region's page of token ``T - 1``, nothing else. The
  state after the whole prompt cannot take the decode's recompute of the last prompt token
  (vLLM computes at least one token of every request, and a state cannot be rolled back), so
  a prefill of such a model computes the prompt but its last token (`truncate_for_state`), and
  the decode loads that state and computes the last token itself (``kvhandoff_resume``).

Refused at start with the reason: a Mamba state group whose blocks vLLM keeps otherwise
(``mamba_cache_mode`` 'all', speculative or prefill-checkpoint state blocks), a model of state
layers only, several groups of which one is MLA, DSA or not moved by vLLM's connectors
(``enable_kv_transfer`` false), sliding-window MLA, two indexer specs ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.integrations.vllm.layout import CacheRole, StateSpec, layer_index

__all__ = ["GroupPlan", "plan_group", "state_table", "truncate_for_state"]

# vLLM's mamba_cache_mode values this connector moves: "none" (one running state block per
# request), "align" (prefix caching of state: the table is position-indexed, the running
# state in the block of the last computed token)
STATE_CACHE_MODES = ("none", "align")


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
    # Mamba / linear-attention state groups (their regions are in group_regions too)
    states: tuple[StateSpec, ...] = ()

    @property
    def state_regions(self) -> frozenset[str]:
        return frozenset(s.region for s in self.states)

    def state_of(self, group: int) -> StateSpec | None:
        """The state spec of KV cache group `group`, None for an attention group."""
        return next((s for s in self.states if s.group == group), None)


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
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    if mamba and len(mamba) == len(groups):
        who = f"model {model!r}" if model else "the model"
        raise ConfigError(
            f"kv_cache_groups: {who} has Mamba / SSM state layers only (groups {kinds}); "
            "KVHandoffConnector moves a model's state beside its attention layers (Qwen3-Next, "
            "Nemotron-H-like hybrids), not a model without attention layers")
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
    """Several groups of full-attention and sliding-window GQA layers, and Mamba state groups
    beside them (module docstring)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    regions, windows, extra, sizes = [], [], [], []
    roles: dict[str, CacheRole] = {}
    layers: list[str] = []
    states: list[StateSpec] = []
    attn: list[int] = []  # the attention groups
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if not getattr(g, "enable_kv_transfer", True):
            raise ConfigError(f"kv_cache_groups[{i}]: a group vLLM does not transfer "
                              "(enable_kv_transfer=false); KVHandoffConnector moves hybrid "
                              "models whose every group is transferred")
        if isinstance(spec, MambaSpec):
            st = state_spec(i, spec, tuple(g.layer_names))
            states.append(st)
            regions.append(st.region)
            windows.append(0)
            extra.append(0)
            continue
        attn.append(i)
        if type(spec) is SlidingWindowSpec:
            window = int(spec.sliding_window)
            region = f"swa{window}_g{i}"
        elif type(spec) is FullAttentionSpec:  # subclasses (MLA, R-SWA, sinks ...) differ
            window, region = 0, f"kv_g{i}"
        else:
            raise ConfigError(
                f"kv_cache_groups[{i}]: vLLM's hybrid allocator made {len(groups)} groups "
                f"({kinds}); KVHandoffConnector moves several groups when each is "
                f"full-attention or sliding-window GQA (beside Mamba state groups), got "
                f"{type(spec).__name__}")
        regions.append(region)
        windows.append(window)
        extra.append(int(getattr(spec, "extra_retained_tokens", 0) or 0))
        sizes.append(int(spec.block_size))
        for n in g.layer_names:
            roles[n] = CacheRole(region=region)
            layers.append(n)
    if len(set(sizes)) > 1:
        other = next(i for i, s in enumerate(sizes) if s != sizes[0])
        first, second = attn[0], attn[other]
        raise ConfigError(f"kv_cache_groups: block sizes {sizes} per group; "
                          "KVHandoffConnector moves the groups of a hybrid model when they "
                          f"share one block size: group {first} ({regions[first]}) has "
                          f"{sizes[0]} tokens, group {second} ({regions[second]}) "
                          f"{sizes[other]}")
    for st in states:
        if st.cache_mode == "align" and st.block_size != sizes[0]:
            raise ConfigError(
                f"kv_cache_groups[{st.group}]: Mamba state blocks of {st.block_size} tokens "
                f"beside attention blocks of {sizes[0]} (mamba_cache_mode 'align'); "
                "KVHandoffConnector finds a request's state block by the attention page of "
                "its last token, so both must be one size")
    dtypes = sorted({_dtype(groups[i].kv_cache_spec) for i in attn})
    if len(dtypes) > 1:
        raise ConfigError(f"kv_cache_groups: the groups' KV dtypes differ ({dtypes}); "
                          "KVHandoffConnector moves one KV dtype")
    return GroupPlan(mla=False, block_size=sizes[0], dtype=dtypes[0], roles=roles,
                     main_layers=tuple(layers), indexer_layers=(), num_layers=0,
                     group_regions=tuple(regions), group_windows=tuple(windows),
                     group_extra=tuple(extra), states=tuple(states))


def state_spec(group: int, spec: Any, layer_names: tuple[str, ...]) -> StateSpec:
    """A Mamba state group (vLLM's `MambaSpec`) as the connector moves it, or `ConfigError`
    naming what makes vLLM keep a request's state in other blocks than the one this connector
    moves (module docstring)."""
    where = f"kv_cache_groups[{group}] (Mamba state, {_mamba_kind(spec)})"
    mode = str(spec.mamba_cache_mode)
    if mode not in STATE_CACHE_MODES:
        raise ConfigError(
            f"{where}: mamba_cache_mode {mode!r}; KVHandoffConnector moves the state of "
            f"mamba_cache_mode {' or '.join(map(repr, STATE_CACHE_MODES))} (one running state "
            "block per request); in 'all' vLLM keeps a state per block of the prompt: serve "
            "with --mamba-cache-mode align (the default with prefix caching) or none")
    if int(spec.num_speculative_blocks):
        raise ConfigError(
            f"{where}: {spec.num_speculative_blocks} speculative state blocks per request "
            "(speculative decoding with linear attention); KVHandoffConnector moves one state "
            "block per request, not the drafts' scratch states: serve the pair without "
            "speculative decoding")
    if int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0):
        raise ConfigError(
            f"{where}: {spec.num_prefill_checkpoint_blocks} prefill checkpoint blocks per "
            "request; KVHandoffConnector moves the running state block only")
    shapes = tuple(tuple(int(d) for d in shape) for shape in spec.shapes)
    dtypes = tuple(str(d).removeprefix("torch.") for d in spec.dtypes)
    return StateSpec(group=group, region=f"state_g{group}", kind=_mamba_kind(spec),
                     shapes=shapes, dtypes=dtypes,
                     content_bytes=int(spec.state_content_size_bytes),
                     page_bytes=int(spec.page_size_bytes), block_size=int(spec.block_size),
                     cache_mode=mode, layers=layer_names)


def _mamba_kind(spec: Any) -> str:
    """vLLM's name of the state's backend (``GDN_ATTN``, ``MAMBA2`` ...)."""
    kind = getattr(spec, "mamba_type", None)
    return str(getattr(kind, "name", kind) or "MAMBA")


def state_table(blocks: Sequence[Any], num_tokens: int, st: StateSpec) -> list[int]:
    """The block of a request's table (vLLM's blocks of state group `st`, ``block_id`` and
    ``is_null``) that holds its state after `num_tokens` tokens, as a one-block table:
    mode 'align' keeps the running state in the block of the last computed token (the table is
    position-indexed), mode 'none' in the request's one non-null block."""
    if num_tokens <= 0:
        raise KVHandoffError(f"{st.region}: no state before the first token")
    if st.cache_mode == "align":
        idx = (num_tokens - 1) // st.block_size
        if idx >= len(blocks) or blocks[idx].is_null:
            raise KVHandoffError(
                f"{st.region}: the state after {num_tokens} tokens is in block {idx} of the "
                f"request's table, which holds {len(blocks)} blocks"
                + (" (that one is vLLM's null block)" if idx < len(blocks) else ""))
        return [int(blocks[idx].block_id)]
    held = [int(b.block_id) for b in blocks if not b.is_null]
    if len(held) != 1:
        raise KVHandoffError(f"{st.region}: mamba_cache_mode 'none' keeps one state block per "
                             f"request, this request's table holds {len(held)}")
    return held


def truncate_for_state(request: Any, hash_block_size: int) -> bool:
    """A prefill request of a model with state: its prompt without the last token (vLLM's
    `Request` in place: prompt, token ids, the block hashes past the new end, max_tokens 1), so
    the state the prefill hands over is the one before the last token, which the decode
    computes (module docstring). True when it was cut here (marked in its
    ``kv_transfer_params``, so a rescheduled request is not cut twice)."""
    params = request.kv_transfer_params
    if (not params or not params.get("do_remote_decode")
            or params.get("kvhandoff_state_cut") or request.prompt_token_ids is None
            or request.num_prompt_tokens < 2 or request.num_computed_tokens):
        return False
    del request.prompt_token_ids[-1:]
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    if hash_block_size > 0:  # a hash that covered the dropped token is not this prompt's
        del request.block_hashes[len(request._all_token_ids) // hash_block_size:]
    request.max_tokens = 1
    params["kvhandoff_state_cut"] = True
    return True


def _spec_diff(a: Any, b: Any) -> str:
    import dataclasses

    diffs = [f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
             for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return "; ".join(diffs) or "equal fields"
