"""Layouts of the models kvhandoff knows by name.

GLM-5.3 (`fp8_ds_mla`, page 64): main KV 656 B/token/layer on all 78 layers (512 fp8 latent +
64 bf16 RoPE = 576 B, plus 5 blocks x 4 fp32 scales = 80 B... packed as one 656 B plane), indexer
K on 21 "full" layers only: 128 fp8 key bytes then 4 fp32 scale bytes per token, stored as two
planes (all keys of the page, then all scales).

The 21 full indexer layers follow the model's index pattern, which the config lists as
`indexer_types`. The public sources available to us do not spell the list out, so the preset
uses a documented stand-in with the same shape (one full layer in four, ~1/4, plus the last
layer): layers 0, 4, 8, ..., 76 and 77. It is deliberately NOT "the first 21": nothing in
kvhandoff may assume indexer layers are contiguous. Pass `indexer_layer_ids` to use the real
list of a checkpoint.

Variants (issue 17), all the same bytes per token:
- ``mtp_layers=N`` (preset ``glm-5.3-mtp``: one MTP layer): draft regions ``draft_main_kv``
  and ``draft_indexer_k`` on layer ids 78.., kept apart from the target model's regions.
- ``index_kpool=2`` (preset ``glm-5.3-kpool2``, page 128): one indexer row holds the state of
  2 tokens; the indexer's physical page is ``page_size // index_kpool`` = 64 rows and shares
  the main page's id.
- ``packing="block"`` (preset ``glm-5.3-vllm``): vLLM's single-group block, ONE buffer whose
  block p is the 78 MLA pages then the 21 indexer pages of page p: 3,452,160 B per 64 tokens.
  The order is this preset's; vLLM 0.33's own allocation of its DSA layers puts the indexer
  pages first (one tensor per spec, in the order the model registers its layers), and the vLLM
  connector reads the order from vLLM's views (`integrations.vllm.layout`), never from here.
  ``packing="mla"`` (``glm-5.3-vllm-mla``): only the MLA pages packed (3,274,752 B rows); the
  indexer keeps one buffer per layer (its own 8,448 B stride).

Main KV is suffix-only (`SendFrom.DECODE_PREFIX`) like the indexer: a decode's prefix-cache hit
covers both caches (seed 000: one slot id indexes the main KV and the indexer rows, one radix
hit holds both), so the handoff moves both from the decode's page-aligned cached prefix on and
never writes into its (radix-shared) prefix pages. ``whole_sequence=True`` (every preset) is the
named option for an engine that wants the main KV of the whole sequence sent whatever it holds
(its prefix pages are then written; the indexer stays suffix-only).

Kernel page rules: FlashMLA reads 64-token main-KV pages and the DSA indexer's paged-MQA
kernel 64-row indexer pages; the MLA presets declare both (`kv_layout.rules`). With
``index_kpool`` > 1 the main page is a multiple of 64 (SGLang's pool: 128 for kpool 2), which
FlashMLA does not read, so only the indexer rule is declared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.spec import (
    LayoutSpec,
    PackedRow,
    PageRule,
    Plane,
    RegionSpec,
    RuleKind,
    SendFrom,
    TPSplit,
)

GLM53_NUM_LAYERS = 78
GLM53_INDEXER_LAYER_IDS: tuple[int, ...] = (*range(0, 77, 4), 77)
MLA_FP8_BYTES_PER_TOKEN = 656
INDEXER_KEY_BYTES = 128
INDEXER_SCALE_BYTES = 4
KERNEL_PAGE_ROWS = 64  # FlashMLA and the DSA indexer's paged-MQA kernel
FLASHMLA = "FlashMLA"
DSA_INDEXER = "DSA indexer paged-MQA"
PACKINGS = ("none", "block", "mla")


def main_send_from(whole_sequence: bool) -> SendFrom:
    """Where main KV starts: the decode's cached prefix (default), or token 0."""
    return SendFrom.START if whole_sequence else SendFrom.DECODE_PREFIX


def _spread(count: int, total: int) -> tuple[int, ...]:
    """`count` layer ids spread evenly over `total` layers, always including the last."""
    if not 0 < count <= total:
        raise ConfigError(f"indexer_layers: expected 1..{total}, got {count}")
    if count == total:
        return tuple(range(total))
    ids = {round(i * (total - 1) / (count - 1)) for i in range(count)} if count > 1 else {0}
    return tuple(sorted(ids))


def mla_dsa_layout(
    *,
    model: str,
    num_layers: int,
    indexer_layer_ids: Sequence[int],
    page_size_tokens: int = 64,
    mtp_layers: int = 0,
    index_kpool: int = 1,
    packing: str = "none",
    whole_sequence: bool = False,
) -> LayoutSpec:
    """An fp8_ds_mla main KV on every layer plus an indexer K on the given layers, both
    suffix-only (`whole_sequence`: the main KV from token 0); `mtp_layers` draft layers (main
    KV and indexer each) after the model's layers; `index_kpool` tokens per indexer row;
    `packing` none / block / mla (see the module doc)."""
    if mtp_layers < 0:
        raise ConfigError(f"mtp_layers: expected >= 0, got {mtp_layers}")
    if index_kpool <= 0:
        raise ConfigError(f"index_kpool: expected > 0, got {index_kpool}")
    if packing not in PACKINGS:
        raise ConfigError(f"packing: expected one of {', '.join(PACKINGS)}, got {packing!r}")
    main_planes = (Plane("latent", MLA_FP8_BYTES_PER_TOKEN),)
    main_from = main_send_from(whole_sequence)
    idx_planes = (Plane("key", INDEXER_KEY_BYTES), Plane("scale", INDEXER_SCALE_BYTES))
    regions = [
        RegionSpec(
            name="main_kv",
            layer_ids=tuple(range(num_layers)),
            planes=main_planes,
            send_from=main_from,
            tp_split=TPSplit.REPLICATED,
        )
    ]
    if indexer_layer_ids:
        regions.append(
            RegionSpec(
                name="indexer_k",
                layer_ids=tuple(sorted(indexer_layer_ids)),
                planes=idx_planes,
                send_from=SendFrom.DECODE_PREFIX,
                tp_split=TPSplit.REPLICATED,
                tokens_per_row=index_kpool,
            )
        )
    if mtp_layers:
        draft_ids = tuple(range(num_layers, num_layers + mtp_layers))
        regions.append(RegionSpec(name="draft_main_kv", layer_ids=draft_ids, planes=main_planes,
                                  send_from=main_from, draft=True))
        regions.append(RegionSpec(name="draft_indexer_k", layer_ids=draft_ids,
                                  planes=idx_planes, send_from=SendFrom.DECODE_PREFIX,
                                  tokens_per_row=index_kpool, draft=True))
    names = [r.name for r in regions]
    rows: tuple[PackedRow, ...] = ()
    if packing == "block":
        rows = (PackedRow("kv_block", tuple(n for n in names if not n.startswith("draft_"))),)
    elif packing == "mla":
        rows = (PackedRow("mla_row", ("main_kv",)),)
    rules = []
    for r in regions:
        if r.name.endswith("indexer_k"):
            rules.append(PageRule(r.name, DSA_INDEXER, RuleKind.EQ, KERNEL_PAGE_ROWS))
        elif index_kpool == 1:
            rules.append(PageRule(r.name, FLASHMLA, RuleKind.EQ, KERNEL_PAGE_ROWS))
    return LayoutSpec(
        page_size_tokens=page_size_tokens,
        kv_dtype="fp8_ds_mla",
        regions=tuple(regions),
        model=model,
        num_layers=num_layers,
        rows=rows,
        page_rules=tuple(rules),
    )


def glm53(*, page_size_tokens: int | None = None, indexer_layers: int | None = None,
          mtp_layers: int = 0, index_kpool: int = 1, packing: str = "none",
          whole_sequence: bool = False) -> LayoutSpec:
    """GLM-5.3; `indexer_layers` other than 21 spreads that many full layers evenly. The page
    defaults to 64 tokens (64 * `index_kpool`: the indexer's physical page stays 64 rows)."""
    ids = (
        GLM53_INDEXER_LAYER_IDS
        if indexer_layers in (None, len(GLM53_INDEXER_LAYER_IDS))
        else _spread(int(indexer_layers or 0), GLM53_NUM_LAYERS)
    )
    return mla_dsa_layout(
        model="glm-5.3", num_layers=GLM53_NUM_LAYERS, indexer_layer_ids=ids,
        page_size_tokens=(KERNEL_PAGE_ROWS * index_kpool if page_size_tokens is None
                          else page_size_tokens),
        mtp_layers=mtp_layers, index_kpool=index_kpool, packing=packing,
        whole_sequence=whole_sequence,
    )


def glm53_mtp(*, page_size_tokens: int | None = None, indexer_layers: int | None = None,
              mtp_layers: int = 1, whole_sequence: bool = False) -> LayoutSpec:
    """GLM-5.3 with its MTP draft layer(s) (draft regions after layer 77)."""
    return glm53(page_size_tokens=page_size_tokens, indexer_layers=indexer_layers,
                 mtp_layers=mtp_layers, whole_sequence=whole_sequence)


def glm53_kpool2(*, page_size_tokens: int | None = None, indexer_layers: int | None = None,
                 whole_sequence: bool = False) -> LayoutSpec:
    """GLM-5.3 with index_kpool = 2: main page 128 tokens, indexer page 64 rows."""
    return glm53(page_size_tokens=page_size_tokens, indexer_layers=indexer_layers,
                 index_kpool=2, whole_sequence=whole_sequence)


def glm53_vllm(*, page_size_tokens: int | None = None, indexer_layers: int | None = None,
               mtp_layers: int = 0, whole_sequence: bool = False) -> LayoutSpec:
    """GLM-5.3 as vLLM registers it: one packed block of 78 MLA + 21 indexer pages."""
    return glm53(page_size_tokens=page_size_tokens, indexer_layers=indexer_layers,
                 mtp_layers=mtp_layers, packing="block", whole_sequence=whole_sequence)


def glm53_vllm_mla(*, page_size_tokens: int | None = None, indexer_layers: int | None = None,
                   mtp_layers: int = 0, whole_sequence: bool = False) -> LayoutSpec:
    """GLM-5.3 with only the MLA pages packed (BLHNC rows); the indexer passes through."""
    return glm53(page_size_tokens=page_size_tokens, indexer_layers=indexer_layers,
                 mtp_layers=mtp_layers, packing="mla", whole_sequence=whole_sequence)


def deepseek_v32(*, page_size_tokens: int = 64, indexer_layers: int | None = None,
                 whole_sequence: bool = False) -> LayoutSpec:
    """DeepSeek-V3.2: 61 layers, indexer on every layer."""
    n = 61
    ids = tuple(range(n)) if indexer_layers in (None, n) else _spread(int(indexer_layers or 0), n)
    return mla_dsa_layout(
        model="deepseek-v3.2", num_layers=n, indexer_layer_ids=ids,
        page_size_tokens=page_size_tokens, whole_sequence=whole_sequence,
    )


def heads_of_rank(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """The KV heads TP rank `tp_rank` of `tp_size` holds (replicated when heads < ranks)."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank/tp_size: expected 0 <= tp_rank < tp_size, got "
                          f"{tp_rank}/{tp_size}")
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise ConfigError(f"tp_size: {tp_size} does not divide the {num_heads} KV heads")
        per = num_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % num_heads:
        raise ConfigError(f"tp_size: {tp_size} is not a multiple of the {num_heads} KV heads")
    return (tp_rank * num_heads // tp_size,)


def llama31_8b(*, page_size_tokens: int = 16, tp_size: int = 1, tp_rank: int = 0,
               whole_sequence: bool = False) -> LayoutSpec:
    """Llama-3.1-8B (GQA): 32 layers, 8 KV heads x 128 dims bf16, K and V separate buffers.

    Each KV head is one plane named by its global head id (``h0`` .. ``h7``): a page holds all
    tokens of head 0, then all tokens of head 1, ... (HND), so a head slice is a set of planes
    and moves as whole-plane spans. With `tp_size` > 1 this is the layout of rank `tp_rank`:
    its share of the heads (a head is replicated on several ranks when heads < ranks).
    """
    heads, head_bytes = 8, 128 * 2
    mine = heads_of_rank(heads, tp_size, tp_rank)
    regions = tuple(
        RegionSpec(
            name=name,
            layer_ids=tuple(range(32)),
            planes=tuple(Plane(f"h{h}", head_bytes) for h in mine),
            send_from=main_send_from(whole_sequence),
            tp_split=TPSplit.HEAD_SHARDED,
            num_heads=len(mine),
        )
        for name in ("main_k", "main_v")
    )
    return LayoutSpec(
        page_size_tokens=page_size_tokens, kv_dtype="bfloat16", regions=regions,
        model="llama-3.1-8b", num_layers=32,
    )


PRESETS: dict[str, Callable[..., LayoutSpec]] = {
    "glm-5.3": glm53,
    "glm-5.3-mtp": glm53_mtp,
    "glm-5.3-kpool2": glm53_kpool2,
    "glm-5.3-vllm": glm53_vllm,
    "glm-5.3-vllm-mla": glm53_vllm_mla,
    "deepseek-v3.2": deepseek_v32,
    "llama-3.1-8b": llama31_8b,
}


def preset(name: str, **kwargs: int | str | bool | None) -> LayoutSpec:
    """The layout of a known model by name (see `PRESETS`); ``whole_sequence=True`` sends its
    main KV from token 0 even when the decode holds a cached prefix."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ConfigError(f"model: unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    clean = {k: v for k, v in kwargs.items() if v is not None}
    return factory(**clean)
