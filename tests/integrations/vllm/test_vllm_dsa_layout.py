"""DSA (GLM-5.x / DeepSeek-V3.2) KV caches as vLLM 0.33 plans them (`vllm_dsa_env`: the real
``DeepseekV32Attention`` layers, their specs, vLLM's grouping, planner and allocator) -> the
connector's layout: one KV cache group of MLA + indexer layers, an ``indexer`` region beside the
main ``kv`` region on the same layer ids, both suffix-only, and every byte vLLM's views hold at
the place the layout says, for block-outermost (one packed row of both caches) and layer-compact
layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_dsa_env as dsa  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheGroupSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm.backends import BACKENDS  # noqa: E402
from kvhandoff.integrations.vllm.groups import plan_group  # noqa: E402
from kvhandoff.integrations.vllm.layout import build_layout, layer_index  # noqa: E402
from kvhandoff.kv_layout import SendFrom, layout_compat_diff  # noqa: E402

SPARSE = BACKENDS["FLASHMLA_SPARSE"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model's layers and specs, once per module (building them takes seconds)."""
    root = tmp_path_factory.mktemp("dsa")
    model = dsa.model_dir(root)
    cfg = dsa.vllm_config(model, role="kv_consumer", engine_id="x", mtp=True)
    specs = dsa.build_layers(cfg, root, mtp=True)
    return {"model": model, "cfg": cfg, "specs": specs}


def target_specs(built: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in built["specs"].items()
            if not n.startswith(f"model.layers.{dsa.MTP_LAYER}.")}


def layout_of(built: dict[str, Any], layout: str, specs: dict[str, Any],
              indexer_scale: str = "fp32") -> tuple[Any, Any, Any]:
    cfg = built["cfg"]
    cfg.cache_config.kv_cache_layout = layout
    kcc = dsa.kv_cache_config(cfg, specs, num_blocks=6)
    views = dsa.allocate(cfg, kcc)
    plan = plan_group(kcc)
    vl = build_layout(views, backend=SPARSE, block_size=plan.block_size,
                      kv_dtype=f"auto:{plan.dtype}", model="vllm:glm_moe_dsa", total_kv_heads=1,
                      roles=plan.roles, num_layers=plan.num_layers,
                      indexer_scale=indexer_scale)
    return kcc, views, vl


def test_vllm_groups_mla_and_indexer_in_one_group(built: dict[str, Any]) -> None:
    """vLLM's grouping puts each MLA layer and its indexer cache in ONE group (one block
    table: a hit of one is a hit of both); the indexer shares the MLA layer's number."""
    specs = target_specs(built)
    cfg = built["cfg"]
    kcc = dsa.kv_cache_config(cfg, specs)
    (group,) = kcc.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    roles = {n: s.cache_role for n, s in group.kv_cache_spec.kv_cache_specs.items()}
    assert {n for n, r in roles.items() if r is SparseCacheRole.INDEXER} == set(dsa.indexer_names())
    plan = plan_group(kcc)
    assert plan.mla and plan.block_size == dsa.BLOCK_SIZE and plan.num_layers == dsa.NUM_LAYERS
    assert plan.roles is not None
    assert {plan.roles[n].region for n in dsa.indexer_names()} == {"indexer"}
    assert {plan.roles[n].region for n in dsa.main_names()} == {"kv"}
    assert [layer_index(n) for n in dsa.indexer_names()] == list(range(dsa.NUM_LAYERS))


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"])
def test_dsa_layout_matches_vllm_memory(built: dict[str, Any], layout: str) -> None:
    """Random bytes through every one of vLLM's views are found where the layout's address
    (page p of (region, layer)) and planes say: the main latent rows and the indexer's keys
    then scales. BLHNC: one packed row holding both caches' pages, in the order vLLM put
    them (its offsets are read, not assumed)."""
    kcc, views, vl = layout_of(built, layout, target_specs(built))
    lay = vl.layout
    assert vl.indexer_regions == ("indexer",)
    idx, kv = lay.region("indexer"), lay.region("kv")
    assert idx.layer_ids == kv.layer_ids == tuple(range(dsa.NUM_LAYERS))
    assert [(p.name, p.bytes_per_token) for p in kv.planes] == [("latent", 576 * 2)]
    assert [(p.name, p.bytes_per_token) for p in idx.planes] == [("key", 128), ("scale", 4)]
    # suffix-only past a decode prefix hit, both caches; whole pages where sizes match
    assert kv.send_from is SendFrom.DECODE_PREFIX and idx.send_from is SendFrom.DECODE_PREFIX
    assert kv.whole_pages and idx.whole_pages
    assert lay.page_size_tokens == dsa.BLOCK_SIZE and vl.pages_per_block == 1
    if layout == "BLHNC":
        (row,) = lay.rows
        assert set(row.regions) == {"indexer", "kv"} and set(vl.buffers) == {row.name}
        (tensor_idx, tensor_kv) = kcc.kv_cache_tensors  # vLLM: one tensor per spec
        first = "indexer" if tensor_idx.layers[0] in dsa.indexer_names() else "kv"
        assert row.regions[0] == first  # the order vLLM allocated, read from the views
    else:
        assert not lay.rows and set(vl.buffers) == {"indexer", "kv"}
    views_match(vl, views, kcc.num_blocks)


def views_match(vl: Any, views: dict[str, torch.Tensor], nb: int) -> None:
    """Random bytes written through each of vLLM's views are, page by page, where the layout's
    `address` says; a write through a view shows in the agent's buffer (no copy)."""
    lay = vl.layout
    g = torch.Generator().manual_seed(7)
    for v in views.values():
        u = v.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))
    for name, v in views.items():
        lid = layer_index(name)
        region = next(r.name for r in lay.regions if lid in r.layer_ids
                      and (r.name in vl.indexer_regions) == name.endswith(".k_cache"))
        page = lay.region(region).page_nbytes(lay.page_size_tokens)
        u = v.view(torch.uint8)  # [B, 1, N, C bytes]
        for b in range(nb):
            key, off = lay.address(region, lid, b)
            buf = vl.buffers[key] if lay.rows else vl.buffers[key][lid]
            assert torch.equal(buf[off: off + page], u[b].reshape(-1)), (name, b)
        key, off = lay.address(region, lid, 1)
        buf = vl.buffers[key] if lay.rows else vl.buffers[key][lid]
        u[1, 0, 5, 3] ^= 0xFF
        assert buf[off + 5 * u.shape[-1] + 3] == u[1, 0, 5, 3]


def test_layers_without_an_indexer(tmp_path: Path) -> None:
    """DeepSeek-V3.2 with an index pattern ("S" layers reuse the previous full layer's top-k):
    vLLM gives only the "F" layers an indexer cache, and their MLA spec differs
    (``is_index_group_leader``), so vLLM allocates three tensors: the block is the indexer
    pages, the indexer-running MLA pages, then the others; regions ``indexer`` and ``kv`` on
    layers 0 and 2, ``kv_shared`` on 1 and 3, every byte where the layout says."""
    cfg = dsa.vllm_config(dsa.model_dir(tmp_path, index_topk_pattern="FSFS"),
                          role="kv_consumer", engine_id="x", layout="BLHNC")
    specs = dsa.build_layers(cfg, tmp_path)
    kcc = dsa.kv_cache_config(cfg, specs, num_blocks=6)
    assert len(kcc.kv_cache_tensors) == 3
    views = dsa.allocate(cfg, kcc)
    plan = plan_group(kcc)
    vl = build_layout(views, backend=SPARSE, block_size=plan.block_size, kv_dtype="auto:bf16",
                      model="vllm:deepseek_v32", total_kv_heads=1, roles=plan.roles,
                      num_layers=plan.num_layers)
    lay = vl.layout
    assert {r.name: r.layer_ids for r in lay.regions} == {
        "indexer": (0, 2), "kv": (0, 2), "kv_shared": (1, 3)}
    (row,) = lay.rows
    assert row.regions == ("indexer", "kv", "kv_shared")
    views_match(vl, views, kcc.num_blocks)


def test_packed_prefill_pairs_with_per_layer_decode(built: dict[str, Any]) -> None:
    """What the handshake compares ignores packing: a BLHNC prefill and an LBHNC decode
    agree (the span builder addresses each side through its own layout)."""
    specs = target_specs(built)
    _, _, packed = layout_of(built, "BLHNC", specs)
    _, _, flat = layout_of(built, "LBHNC", specs)
    assert packed.layout.rows and not flat.layout.rows
    assert layout_compat_diff(packed.layout, flat.layout) == []


def test_mtp_layer_is_a_draft_region(built: dict[str, Any]) -> None:
    """With MTP, the draft layer's caches (the runner's ``is_draft`` spec) are draft regions
    after the target model's layers, in the same block."""
    _, _, vl = layout_of(built, "BLHNC", built["specs"])
    lay = vl.layout
    assert lay.num_layers == dsa.NUM_LAYERS
    for r in ("draft_kv", "draft_indexer"):
        assert lay.region(r).draft and lay.region(r).layer_ids == (dsa.MTP_LAYER,)
    assert set(vl.indexer_regions) == {"indexer", "draft_indexer"}
    (row,) = lay.rows
    assert set(row.regions) == {"indexer", "kv", "draft_indexer", "draft_kv"}


def test_unknown_caches_in_the_group_are_refused(built: dict[str, Any]) -> None:
    """An indexer keeping one state per 2 tokens (index_kpool) or a second, different
    indexer spec is refused at start, with the reason."""
    from dataclasses import replace

    specs = target_specs(built)
    cfg = built["cfg"]
    kcc = dsa.kv_cache_config(cfg, specs)
    (group,) = kcc.kv_cache_groups
    per = dict(group.kv_cache_spec.kv_cache_specs)
    n0, n1 = dsa.indexer_names()[:2]
    kpool = {n: (replace(s, tokens_per_state=2) if n in dsa.indexer_names() else s)
             for n, s in per.items()}
    kcc.kv_cache_groups = [KVCacheGroupSpec(group.layer_names,
                                            replace(group.kv_cache_spec, kv_cache_specs=kpool))]
    with pytest.raises(ConfigError, match="one state per 2 tokens"):
        plan_group(kcc)
    two = dict(per)
    two[n1] = replace(per[n1], head_size=264)
    kcc.kv_cache_groups = [KVCacheGroupSpec(group.layer_names,
                                            replace(group.kv_cache_spec, kv_cache_specs=two))]
    with pytest.raises(ConfigError, match=r"both 'indexer' caches with different specs.*"
                                          r"head_size: 132 vs 264"):
        plan_group(kcc)
    assert n0 != n1


def test_connector_registers_the_dsa_caches(built: dict[str, Any]) -> None:
    """KVHandoffConnector's worker takes vLLM's objects as they are: the backend from the real
    layers (FLASHMLA_SPARSE; the indexer's DEEPSEEK_V32_INDEXER), the roles from the specs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg = built["cfg"]
    cfg.cache_config.kv_cache_layout = "BLHNC"
    kcc = dsa.kv_cache_config(cfg, target_specs(built), num_blocks=4)
    views = dsa.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(views)
        assert conn.layout is not None
        assert conn.layout.backend.name == "FLASHMLA_SPARSE"
        assert {r.name for r in conn.layout.layout.regions} == {"indexer", "kv"}
        assert "not probed" not in (conn.probe_report or "")  # probe off in these tests
    finally:
        conn.shutdown()


def test_fp8_ds_mla_rows(tmp_path: Path) -> None:
    """GLM-5's usual cache dtype on vLLM: ``fp8_ds_mla``, one opaque 656-byte row per token
    (vLLM's spec: ``state_content_bytes`` 656, 41,984 B per 64-token page) beside the 132-byte
    indexer rows; registered with the probe on, which says it did not probe the quantised row
    (its write quantises: nothing to compare raw bytes with)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg = dsa.vllm_config(dsa.model_dir(tmp_path), role="kv_consumer", engine_id="x",
                          extra={"settings": {"layout_probe": True}})
    cfg.cache_config.cache_dtype = "fp8_ds_mla"
    specs = dsa.build_layers(cfg, tmp_path)
    kcc = dsa.kv_cache_config(cfg, specs, num_blocks=4)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(dsa.allocate(cfg, kcc))
        assert conn.layout is not None
        lay = conn.layout.layout
        assert [(p.name, p.bytes_per_token) for p in lay.region("kv").planes] == [("latent", 656)]
        assert lay.region("kv").page_nbytes(dsa.BLOCK_SIZE) == 41_984
        assert lay.region("indexer").page_nbytes(dsa.BLOCK_SIZE) == 8_448
        assert lay.kv_dtype == "fp8_ds_mla:uint8"
        assert "fp8_ds_mla rows not probed" in (conn.probe_report or "")
        # the same bytes per token and the same suffix-only rule as kvhandoff's GLM-5.3 preset
        from kvhandoff.kv_layout.presets import glm53

        pre = glm53()
        for mine, theirs in (("kv", "main_kv"), ("indexer", "indexer_k")):
            a, b = lay.region(mine), pre.region(theirs)
            assert [p.bytes_per_token for p in a.planes] == [p.bytes_per_token for p in b.planes]
            assert a.send_from is b.send_from is SendFrom.DECODE_PREFIX
    finally:
        conn.shutdown()


def test_rocm_shuffled_indexer_is_refused(tmp_path: Path) -> None:
    """vLLM's ROCm indexer cache (``DeepseekV32ROCmIndexerCache``) keeps aiter's shuffled
    tiles (``uses_shuffled_layout`` once its cache is bound) under the same backend name:
    refused at start, naming it. (The ROCm attention layer itself does not build on CPU; its
    indexer cache does, and takes the place of layer 0's.)"""
    import torch as th
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.models.deepseek_v32.amd.rocm import DeepseekV32ROCmIndexerCache

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg = dsa.vllm_config(dsa.model_dir(tmp_path), role="kv_consumer", engine_id="x")
    specs = dsa.build_layers(cfg, tmp_path)
    kcc = dsa.kv_cache_config(cfg, specs, num_blocks=4)
    views = dsa.allocate(cfg, kcc)
    name = dsa.indexer_names()[0]
    ctx = cfg.compilation_config.static_forward_context
    del ctx[name]
    with set_current_vllm_config(cfg):
        rocm = DeepseekV32ROCmIndexerCache(head_dim=132, dtype=th.uint8, prefix=name,
                                           cache_config=cfg.cache_config)
    rocm.bind_kv_cache(views[name])  # what vLLM's bind_kv_cache does before registering
    assert rocm.uses_shuffled_layout
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(ConfigError, match="shuffled value layout"):
            conn.register_kv_caches(views)
        assert conn.agent is None
    finally:
        conn.shutdown()


def test_indexer_scale_format_in_the_layout(built: dict[str, Any]) -> None:
    """The indexer's 4 scale bytes per 128 keys are an fp32, or (vLLM on SM100, where the MQA
    logits kernels take MX scales) four packed UE8M0 bytes: same size, another meaning. The
    format names the scale plane, so a pair that differs is refused at the handshake, the
    difference named; this machine's vLLM writes fp32."""
    from kvhandoff.integrations.vllm.worker import indexer_scale_format

    assert indexer_scale_format() == "fp32"  # no SM100 GPU here
    _, _, fp32 = layout_of(built, "LBHNC", target_specs(built))
    _, _, ue8m0 = layout_of(built, "LBHNC", target_specs(built), indexer_scale="ue8m0x4")
    assert [p.name for p in ue8m0.layout.region("indexer").planes] == ["key", "scale_ue8m0x4"]
    assert layout_compat_diff(fp32.layout, fp32.layout) == []
    diff = layout_compat_diff(fp32.layout, ue8m0.layout)
    assert diff and any("'scale'" in d and "scale_ue8m0x4" in d for d in diff), diff
