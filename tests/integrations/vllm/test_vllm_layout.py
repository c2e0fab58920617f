"""vLLM's per-layer KV views (allocated by vLLM's own planner and allocator) -> LayoutSpec.

For each layout the test writes random bytes through vLLM's logical ``[B, H, N, C]`` view and
reads them back from the flat per-layer buffer at the position the LayoutSpec's page/plane rule
gives (plane k of token i of page p at ``p*page + plane_offset_k*N + i*plane_bytes``): the spec
describes vLLM's memory exactly, or the test fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm.backends import BACKENDS  # noqa: E402
from kvhandoff.integrations.vllm.layout import build_layout, layer_index  # noqa: E402
from kvhandoff.kv_layout import TPSplit  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return env.model_dir(tmp_path_factory.mktemp("model"))


def views(model: Path, layout: str, spec: Any, blocks: int = 8,
          kernel: int | None = None) -> dict[str, torch.Tensor]:
    cfg = env.vllm_config(model, role="kv_consumer", engine_id="x", layout=layout)
    groups = [KVCacheGroupSpec(env.layer_names(), spec)]
    kcc = get_kv_cache_config_from_groups(cfg, groups,
                                          blocks * spec.page_size_bytes * env.NUM_LAYERS)
    return allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.
                             get_resolved_kv_cache_layout(),
                             kernel_block_sizes=[kernel] if kernel else None)


FA = BACKENDS["FLASH_ATTN"]  # rows K|V per token and head, HND or NHD pages
GQA = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)


def fill(kv: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(5)
    for v in kv.values():
        u = env.as_u8(v)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("layout,order", [("LBHNC", "HND"), ("LBNHC", "NHD")])
def test_gqa_layouts_match_vllm_memory(model: Path, layout: str, order: str) -> None:
    kv = views(model, layout, GQA)
    fill(kv)
    vl = build_layout(kv, block_size=16, kv_dtype="auto:bfloat16", model="m", backend=FA,
                      total_kv_heads=2)
    assert vl.order == order and vl.pages_per_block == 1
    (reg,) = vl.layout.regions
    assert vl.layout.page_size_tokens == 16
    assert reg.layer_ids == (0, 1, 2)
    c = 2 * 16 * 2  # K and V of one head, bf16
    if order == "HND":
        assert [(p.name, p.bytes_per_token) for p in reg.planes] == [("h0", c), ("h1", c)]
    else:
        assert [(p.name, p.bytes_per_token) for p in reg.planes] == [("kv", 2 * c)]
    page = reg.page_nbytes(16)
    for name, v in kv.items():
        flat = vl.buffers["kv"][layer_index(name)]
        assert flat.dtype == torch.uint8 and flat.numel() == 8 * page
        u = env.as_u8(v)  # [B, H, N, C]
        b, h, i = torch.meshgrid(torch.arange(8), torch.arange(2), torch.arange(16),
                                 indexing="ij")
        offs = reg.plane_offsets()
        if order == "HND":  # plane h: all tokens of head h
            base = b * page + torch.tensor(offs)[h] * 16 + i * c
        else:  # one plane: token i holds every head
            base = b * page + i * (2 * c) + h * c
        got = flat[base[..., None] + torch.arange(c)]
        assert torch.equal(got, u)
        # no copy: a write through vLLM's view is seen in the buffer the agent registers
        u[3, 1, 5, 7] ^= 0xFF
        assert flat[int(base[3, 1, 5]) + 7] == u[3, 1, 5, 7]


def test_mla_is_one_latent_plane(model: Path) -> None:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv = views(model, "LBHNC", spec)
    vl = build_layout(kv, block_size=16, kv_dtype="auto:bfloat16", model="m",
                      backend=BACKENDS["CPU_MLA"], total_kv_heads=1, tp_rank=1, tp_size=2)
    (reg,) = vl.layout.regions
    assert vl.order == "MLA"
    assert [(p.name, p.bytes_per_token) for p in reg.planes] == [("latent", 1152)]
    assert reg.tp_split is TPSplit.REPLICATED  # every TP rank holds the whole latent


def test_head_planes_are_named_by_global_head(model: Path) -> None:
    kv = views(model, "LBHNC", GQA)
    vl = build_layout(kv, block_size=16, kv_dtype="k", model="m", backend=FA, total_kv_heads=4,
                      tp_rank=1, tp_size=2)
    (reg,) = vl.layout.regions
    assert [p.name for p in reg.planes] == ["h2", "h3"]
    assert (reg.tp_split, reg.num_heads) == (TPSplit.HEAD_SHARDED, 2)
    with pytest.raises(ConfigError, match="holds 1 of the model's 4 KV heads"):
        build_layout(kv, block_size=16, kv_dtype="k", model="m", backend=FA, total_kv_heads=4,
                     tp_rank=1, tp_size=4)


def test_kernel_blocks_are_pages(model: Path) -> None:
    kv = views(model, "LBHNC", GQA, kernel=8)
    vl = build_layout(kv, block_size=16, kv_dtype="k", model="m", backend=FA, total_kv_heads=2)
    assert vl.layout.page_size_tokens == 8 and vl.pages_per_block == 2
    assert vl.expand_blocks([3, 5]).tolist() == [6, 7, 10, 11]


@pytest.mark.parametrize("layout,order", [("BLHNC", "HND"), ("BLNHC", "NHD")])
def test_packed_rows_match_vllm_memory(model: Path, layout: str, order: str) -> None:
    """Block-outermost: one block holds every layer's page; one row buffer over the blocks,
    and `LayoutSpec.address` finds every byte vLLM's views put there."""
    kv = views(model, layout, GQA)
    fill(kv)
    vl = build_layout(kv, block_size=16, kv_dtype="k", model="m", backend=FA, total_kv_heads=2)
    assert vl.order == order
    (row,) = vl.layout.rows
    assert row.regions == ("kv",)
    (reg,) = vl.layout.regions
    page = reg.page_nbytes(16)
    assert reg.page_stride(16) == env.NUM_LAYERS * page + row.pad_bytes
    flat = vl.buffers[row.name]
    assert set(vl.buffers) == {row.name}
    c = 2 * 16 * 2
    for name, v in kv.items():
        lid = layer_index(name)
        u = env.as_u8(v)
        for b in (0, 3, 7):
            key, off = vl.layout.address("kv", lid, b)
            assert key == row.name
            got = flat[off: off + page]
            if order == "HND":
                want = u[b].reshape(-1)
            else:
                want = u[b].permute(1, 0, 2).reshape(-1)
            assert got.numel() == 2 * 16 * c and torch.equal(got, want), (name, b)


def test_padded_pages_are_refused(model: Path) -> None:
    kv = views(model, "LBHNC", GQA)
    t = kv["model.layers.0.self_attn.attn"]
    strided = t[:, :, ::2]  # every other token: not a dense page
    with pytest.raises(ConfigError, match="dense pages"):
        build_layout({"model.layers.0.self_attn.attn": strided}, block_size=16, kv_dtype="k",
                     model="m", backend=FA, total_kv_heads=2)


def test_layer_names() -> None:
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ConfigError, match="exactly one layer number"):
        layer_index("model.mtp.0.layers.3.attn")
    with pytest.raises(ConfigError, match="exactly one layer number"):
        layer_index("lm_head")


def test_connector_refuses_caches_it_cannot_move(model: Path) -> None:
    """A chunked-local-attention group is not a cache this connector moves: building the
    connector says so, naming the spec (vLLM's engine fails at start, not at the first
    transfer). (A sliding-window group was refused here too; it is moved now:
    test_vllm_hybrid.py, tests/live/vllm/test_live_swa.py.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from kvhandoff.integrations.vllm import KVHandoffConnector

    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=16,
                                     dtype=torch.bfloat16, attention_chunk_size=64)
    cfg = env.vllm_config(model, role="kv_consumer", engine_id="x")
    kcc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(env.layer_names(), spec)],
                                          8 * spec.page_size_bytes * env.NUM_LAYERS)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="got ChunkedLocalAttentionSpec"):
            KVHandoffConnector(cfg, role, kcc)
