"""Hybrid models and the connector: vLLM 0.33's own grouping (`get_kv_cache_groups`), planning
of per-layer specs (full attention, sliding window, Mamba), allocation, and its `Scheduler`,
handed to `KVHandoffConnector` as vLLM's engine hands them.

- the connector implements ``SupportsHMA`` (vLLM's own check says so), so vLLM keeps its hybrid
  allocator on for it;
- a model whose every layer has one sliding window is one `SlidingWindowSpec` group: accepted,
  its window read (the live pair is tests/live/vllm/test_live_swa.py);
- a model mixing full-attention and sliding-window layers under the hybrid allocator is several
  groups: accepted, one region per group (the window in its name); the worker's layout puts
  each region's layers at vLLM's own views; vLLM's scheduler hands the prefill and the decode
  every group's table, and the decode's sliding-window groups load from their window on (the
  blocks vLLM never allocated are not written); groups of two block sizes are refused naming
  both (the live pair is tests/live/vllm/test_live_hybrid.py);
- with ``--disable-hybrid-kv-cache-manager`` vLLM makes one full-attention group, which starts;
- a Mamba / SSM hybrid: test_vllm_mamba.py.

The platform here (vLLM's CUDA build without a GPU) turns the hybrid allocator off whatever the
connector says; the tests set it as vLLM sets it on a GPU for a connector that supports it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.groups import plan_group  # noqa: E402
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

FULL = FullAttentionSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS,
                         head_size=env.HEAD_SIZE, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS,
                        head_size=env.HEAD_SIZE, dtype=torch.bfloat16, sliding_window=40)


def plan(tmp_path: Path, specs: list[Any], *, hybrid: bool, role: str = "kv_consumer",
         engine: str = env.ENGINE_D, extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """vLLM's config and its KV cache plan for the tiny model's layers with `specs` (a decode
    loads async unless `extra` says: a decode of several groups must)."""
    extra = {"load_mode": "async", **(extra or {})} if role == "kv_consumer" else extra
    cfg = env.vllm_config(env.model_dir(tmp_path), role=role, engine_id=engine, extra=extra,
                          policy="recompute")
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    per_layer = dict(zip(env.layer_names(), specs, strict=True))
    groups = get_kv_cache_groups(cfg, per_layer)
    return cfg, get_kv_cache_config_from_groups(
        cfg, groups, env.NUM_BLOCKS * FULL.page_size_bytes * env.NUM_LAYERS)


def test_vllm_sees_hma_support(tmp_path: Path) -> None:
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)


def test_sliding_window_model_is_one_group(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [SWA, SWA, SWA], hybrid=True)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [SlidingWindowSpec]
    p = plan_group(kcc)
    assert p.sliding_window == 40 and not p.mla and p.block_size == env.BLOCK_SIZE
    KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)  # starts




def test_full_and_sliding_without_hma_starts(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=False)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [FullAttentionSpec]
    assert plan_group(kcc).sliding_window == 0  # moved whole
    KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


# ---- several groups (vLLM's hybrid allocator on): every group moves

PROMPT = 100  # 7 blocks of 16; a 40-token window keeps the blocks from token 48 on


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        with BootstrapClient(url) as c:  # the prefill worker would register its rank
            layout = LayoutSpec(page_size_tokens=16, kv_dtype="bf16", regions=(
                RegionSpec("kv", (0,), (Plane("kv", 64),)),))
            c.register_rank(engine_id=env.ENGINE_P, role="prefill", agent_address="127.0.0.1:9",
                            generation="1", layout=layout, transport="tcp")
        yield url


def test_full_and_sliding_under_hma_are_one_region_per_group(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=True)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [
        FullAttentionSpec, SlidingWindowSpec, SlidingWindowSpec]  # vLLM's groups
    p = plan_group(kcc)
    assert p.group_regions == ("kv_g0", "swa40_g1", "swa40_g2")
    assert p.group_windows == (0, 40, 40) and p.block_size == env.BLOCK_SIZE
    assert p.roles is not None and {n: r.region for n, r in p.roles.items()} == {
        n: reg for g, reg in zip(kcc.kv_cache_groups, p.group_regions, strict=True)
        for n in g.layer_names}
    KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)  # starts


def test_worker_layout_is_one_region_per_group_at_vllms_views(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=True)
    caches = env.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(caches)
        vl = conn.layout
        assert vl is not None
        regions = {r.name: r for r in vl.layout.regions}
        assert sorted(regions) == ["kv_g0", "swa40_g1", "swa40_g2"]
        for g, name in zip(kcc.kv_cache_groups, ("kv_g0", "swa40_g1", "swa40_g2"), strict=True):
            lids = tuple(sorted(vl.layer_ids[n] for n in g.layer_names))
            assert regions[name].layer_ids == lids
            for n in g.layer_names:  # the region's buffer is vLLM's own view of the layer
                assert vl.buffers[name][vl.layer_ids[n]].data_ptr() == caches[n].data_ptr()
                assert vl.buffers[name][vl.layer_ids[n]].numel() == caches[n].numel() * 2
    finally:
        conn.shutdown()


def test_groups_of_two_block_sizes_refused_naming_both(tmp_path: Path) -> None:
    # a sliding-window layer of half the page: vLLM's planner doubles its block to give every
    # group one page size, so the groups' blocks differ
    half = SlidingWindowSpec(block_size=env.BLOCK_SIZE, num_kv_heads=1,
                             head_size=env.HEAD_SIZE, dtype=torch.bfloat16, sliding_window=40)
    cfg, kcc = plan(tmp_path, [FULL, half, half], hybrid=True)
    sizes = [int(g.kv_cache_spec.block_size) for g in kcc.kv_cache_groups]
    assert sizes == [16, 32, 32]
    with pytest.raises(ConfigError, match=re.escape(
            "block sizes [16, 32, 32] per group; KVHandoffConnector moves the groups of a "
            "hybrid model when they share one block size: group 0 (kv_g0) has 16 tokens, "
            "group 1 (swa40_g1) 32")):
        KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def _scheduler(tmp_path: Path, role: str, **extra: Any) -> Scheduler:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=True, role=role,
                    engine=env.ENGINE_P if role == "kv_producer" else env.ENGINE_D, extra=extra)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=env.BLOCK_SIZE)


def _request(rid: str, params: dict[str, Any]) -> Request:
    sp = SamplingParams(max_tokens=1 if params.get("do_remote_decode") else 4,
                        extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(3, 3 + PROMPT)), sp, None,
                   block_hasher=get_request_block_hasher(env.BLOCK_SIZE, sha256))


def _output(out: Any, sampled: dict[str, int], **kv: Any) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
                             kv_connector_output=KVConnectorOutput(**kv))


def test_scheduler_hands_every_group_window_groups_from_their_window(
        tmp_path: Path, bootstrap: str) -> None:
    init_none_hash(sha256)
    s = _scheduler(tmp_path / "p", "kv_producer", bootstrap_url=bootstrap)
    s.add_request(_request("p1", {"do_remote_decode": True}))
    out = s.schedule()
    send = out.kv_connector_metadata.sends["p1"]
    tables = [list(t) for t in s.kv_cache_manager.get_block_ids("p1")]
    assert len(tables) == 3 and send.group_blocks == tables and send.block_ids == tables[0]
    outputs = s.update_from_output(out, _output(out, {"p1": 7}))
    params = next(o.kv_transfer_params for eco in outputs.values() for o in eco.outputs
                  if o.request_id == "p1")
    # vLLM freed the sliding-window groups' blocks before token 100 - 40 + 1 = 61: 3 blocks
    assert params["remote_window_start"] == 48

    d = _scheduler(tmp_path / "d", "kv_consumer", load_mode="async")
    d.add_request(_request("d1", dict(params)))
    out = d.schedule()
    rv = out.kv_connector_metadata.recvs["d1"]
    got = [list(t) for t in d.kv_cache_manager.get_block_ids("d1")]
    null = d.kv_cache_manager.block_pool.null_block.block_id
    assert rv.group_blocks == got and len(got[0]) == 7
    assert got[1][:3] == [null] * 3 and null not in got[1][3:]  # vLLM never allocated them
    assert rv.local_tokens == 0 and rv.group_starts == [0, 48, 48]
    assert rv.load_tokens == PROMPT and rv.refuse is None
    # what a load error reports: every group's blocks it writes, never the null block
    assert rv.loaded_blocks(env.BLOCK_SIZE) == got[0] + got[1][3:] + got[2][3:]


def test_decode_window_before_the_prefills_pages_declines(tmp_path: Path,
                                                          bootstrap: str) -> None:
    init_none_hash(sha256)
    s = _scheduler(tmp_path / "p", "kv_producer", bootstrap_url=bootstrap)
    s.add_request(_request("p2", {"do_remote_decode": True}))
    out = s.schedule()
    outputs = s.update_from_output(out, _output(out, {"p2": 7}))
    params = next(o.kv_transfer_params for eco in outputs.values() for o in eco.outputs
                  if o.request_id == "p2")
    params["remote_window_start"] = 64  # a prefill that kept less than this decode needs
    d = _scheduler(tmp_path / "d", "kv_consumer", load_mode="async")
    d.add_request(_request("d2", dict(params)))
    out = d.schedule()
    meta = out.kv_connector_metadata
    assert "d2" not in meta.recvs and "d2" in meta.declines
    assert "window starts at token 48" in meta.declines["d2"].reason


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_layerwise_decode_of_several_groups_refused_at_start(tmp_path: Path,
                                                             role: KVConnectorRole) -> None:
    # vLLM takes a failed load of a model of several groups by request only while it waits
    # for its KV (async): a failed layerwise load could not be reported
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=True, extra={"load_mode": "layerwise"})
    with pytest.raises(ConfigError, match=r"load_mode='layerwise': this model has 3 KV cache "
                                          r"groups .* use load_mode 'async'"):
        KVHandoffConnector(cfg, role, kcc)


def test_failed_load_reported_by_request_and_vllm_recomputes(tmp_path: Path,
                                                             bootstrap: str) -> None:
    """A failed async load of a hybrid decode: the worker reports the request in
    ``failed_recving`` (and ``finished_recving``) and no block ids; vLLM's own scheduler takes
    that output and recomputes the prompt (policy recompute). Block ids would stop vLLM's
    engine: it refuses block-level errors with several groups."""
    init_none_hash(sha256)
    s = _scheduler(tmp_path / "p", "kv_producer", bootstrap_url=bootstrap)
    s.add_request(_request("p3", {"do_remote_decode": True}))
    out = s.schedule()
    outputs = s.update_from_output(out, _output(out, {"p3": 7}))
    params = next(o.kv_transfer_params for eco in outputs.values() for o in eco.outputs
                  if o.request_id == "p3")
    d = _scheduler(tmp_path / "d", "kv_consumer", load_mode="async")
    d.add_request(_request("d3", dict(params)))
    out = d.schedule()
    rv = out.kv_connector_metadata.recvs["d3"]
    cfg, kcc = plan(tmp_path / "w", [FULL, SWA, SWA], hybrid=True,
                    extra={"load_mode": "async"})
    worker = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        worker.register_kv_caches(env.allocate(cfg, kcc))
        meta = KVHandoffMetadata(recvs={"d3": dataclasses.replace(
            rv, refuse="the test refuses this load")})
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        res = worker.get_transfer_results(set())
        deadline = time.monotonic() + 30
        while "d3" not in res.finished_recving and time.monotonic() < deadline:
            time.sleep(0.02)  # one engine step
            res = worker.get_transfer_results(set())
        assert res.finished_recving == {"d3"} and res.failed_recving == {"d3"}
        invalid = worker.get_block_ids_with_load_errors()
        assert invalid == set()
    finally:
        worker.shutdown()
    # vLLM's scheduler takes the output: the prompt is computed locally
    d.update_from_output(out, _output(out, {}, finished_recving=res.finished_recving,
                                      failed_recving=res.failed_recving,
                                      invalid_block_ids=invalid))
    out = d.schedule()
    assert out.num_scheduled_tokens == {"d3": PROMPT}
    # what block ids would have done to the engine
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        d.update_from_output(out, _output(out, {}, invalid_block_ids={rv.block_ids[0]}))
