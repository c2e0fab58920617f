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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.spec import LayoutSpec, Plane, RegionSpec, SendFrom, TPSplit

GLM53_NUM_LAYERS = 78
GLM53_INDEXER_LAYER_IDS: tuple[int, ...] = (*range(0, 77, 4), 77)
MLA_FP8_BYTES_PER_TOKEN = 656
INDEXER_KEY_BYTES = 128
INDEXER_SCALE_BYTES = 4


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
) -> LayoutSpec:
    """An fp8_ds_mla main KV on every layer plus a suffix-only indexer K on the given layers."""
    regions = [
        RegionSpec(
            name="main_kv",
            layer_ids=tuple(range(num_layers)),
            planes=(Plane("latent", MLA_FP8_BYTES_PER_TOKEN),),
            send_from=SendFrom.START,
            tp_split=TPSplit.REPLICATED,
        )
    ]
    if indexer_layer_ids:
        regions.append(
            RegionSpec(
                name="indexer_k",
                layer_ids=tuple(sorted(indexer_layer_ids)),
                planes=(Plane("key", INDEXER_KEY_BYTES), Plane("scale", INDEXER_SCALE_BYTES)),
                send_from=SendFrom.DECODE_PREFIX,
                tp_split=TPSplit.REPLICATED,
            )
        )
    return LayoutSpec(
        page_size_tokens=page_size_tokens,
        kv_dtype="fp8_ds_mla",
        regions=tuple(regions),
        model=model,
        num_layers=num_layers,
    )


def glm53(*, page_size_tokens: int = 64, indexer_layers: int | None = None) -> LayoutSpec:
    """GLM-5.3; `indexer_layers` other than 21 spreads that many full layers evenly."""
    ids = (
        GLM53_INDEXER_LAYER_IDS
        if indexer_layers in (None, len(GLM53_INDEXER_LAYER_IDS))
        else _spread(int(indexer_layers or 0), GLM53_NUM_LAYERS)
    )
    return mla_dsa_layout(
        model="glm-5.3", num_layers=GLM53_NUM_LAYERS, indexer_layer_ids=ids,
        page_size_tokens=page_size_tokens,
    )


def deepseek_v32(*, page_size_tokens: int = 64, indexer_layers: int | None = None) -> LayoutSpec:
    """DeepSeek-V3.2: 61 layers, indexer on every layer."""
    n = 61
    ids = tuple(range(n)) if indexer_layers in (None, n) else _spread(int(indexer_layers or 0), n)
    return mla_dsa_layout(
        model="deepseek-v3.2", num_layers=n, indexer_layer_ids=ids,
        page_size_tokens=page_size_tokens,
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


def llama31_8b(*, page_size_tokens: int = 16, tp_size: int = 1, tp_rank: int = 0) -> LayoutSpec:
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
            send_from=SendFrom.START,
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
    "deepseek-v3.2": deepseek_v32,
    "llama-3.1-8b": llama31_8b,
}


def preset(name: str, **kwargs: int | None) -> LayoutSpec:
    """The layout of a known model by name (see `PRESETS`)."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ConfigError(f"model: unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    clean = {k: v for k, v in kwargs.items() if v is not None}
    return factory(**clean)
