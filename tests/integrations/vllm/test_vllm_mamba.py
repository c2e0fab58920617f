"""Mamba / linear-attention state and the connector, with vLLM 0.33's own specs, grouping,
planning, allocation and blocks (the live pair is tests/live/vllm/test_live_mamba.py):

- a hybrid of attention and `MambaSpec` layers plans one region per state group
  (``state_g<i>``), its `StateSpec` read from vLLM's spec (shapes, dtypes, padded page, block
  size, cache mode); the connector starts on both sides;
- the state region's plane names the states' dtypes and shapes, the padding and the block size:
  two sides whose states differ in any of them differ in the layout both compare (the
  handshake's `layout_diff` names the region);
- the worker's state region is vLLM's own allocation: a block's bytes written through vLLM's
  ``[B, 1, 1, C]`` view of a state layer are that block's page of the region's buffer;
- which block holds a request's state: mode 'align' the block of the last token (vLLM's
  position-indexed table), mode 'none' its one non-null block; anything else fails the room
  with the reason;
- a prefill request's prompt is cut before its last token (vLLM's `Request`: token ids, the
  block hashes past the new end, max_tokens), once;
- refused at start naming the reason: mamba_cache_mode 'all', speculative state blocks, a model
  of state layers only; a load from a prefill of another TP size fails naming both sizes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvhandoff.errors import ConfigError, KVHandoffError  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.integrations.vllm.groups import (  # noqa: E402
    plan_group,
    state_table,
    truncate_for_state,
)
from kvhandoff.kv_layout import LayoutSpec, RegionSpec  # noqa: E402
from kvhandoff.kv_layout.compare import layout_diff  # noqa: E402

FULL = FullAttentionSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS,
                         head_size=env.HEAD_SIZE, dtype=torch.bfloat16)


def gdn(**kw: Any) -> MambaSpec:
    """A GDN-like state (a conv state, then a temporal state), padded to the attention page as
    vLLM pads a hybrid's specs."""
    base: dict[str, Any] = {"block_size": env.BLOCK_SIZE, "shapes": ((3, 16), (2, 4, 4)),
                            "dtypes": (torch.bfloat16, torch.bfloat16),
                            "page_size_padded": FULL.page_size_bytes,
                            "mamba_cache_mode": "align"}
    return MambaSpec(**{**base, **kw})


def plan(tmp_path: Path, specs: list[Any], role: str = "kv_consumer") -> tuple[Any, Any]:
    extra = {"load_mode": "async"} if role == "kv_consumer" else None
    cfg = env.vllm_config(env.model_dir(tmp_path), role=role, engine_id=env.ENGINE_D,
                          extra=extra, policy="recompute")
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    per_layer = dict(zip(env.layer_names(), specs, strict=True))
    groups = get_kv_cache_groups(cfg, per_layer)
    return cfg, get_kv_cache_config_from_groups(
        cfg, groups, env.NUM_BLOCKS * FULL.page_size_bytes * env.NUM_LAYERS)


def test_state_groups_planned_from_vllms_specs(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, gdn(), gdn()])
    p = plan_group(kcc)
    kinds = [type(g.kv_cache_spec) for g in kcc.kv_cache_groups]
    states = [i for i, k in enumerate(kinds) if k is MambaSpec]
    assert states and FullAttentionSpec in kinds
    assert [s.region for s in p.states] == [f"state_g{i}" for i in states]
    assert p.state_regions <= set(p.group_regions)
    for st in p.states:
        spec = kcc.kv_cache_groups[st.group].kv_cache_spec
        assert st.shapes == tuple(tuple(s) for s in spec.shapes)
        assert st.dtypes == ("bfloat16", "bfloat16")
        assert st.content_bytes == spec.state_content_size_bytes
        assert st.page_bytes == spec.page_size_bytes == FULL.page_size_bytes
        assert st.cache_mode == "align" and st.block_size == spec.block_size
        assert st.layers == tuple(kcc.kv_cache_groups[st.group].layer_names)
        assert p.roles is not None and not set(st.layers) & set(p.roles)  # not attention
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        KVHandoffConnector(cfg, role, kcc).shutdown()  # starts


def test_state_plane_names_dtype_shape_padding_and_block() -> None:
    st = plan_state(gdn())
    plane = st.plane(env.BLOCK_SIZE)
    assert plane.bytes_per_token * env.BLOCK_SIZE == FULL.page_size_bytes
    pad = FULL.page_size_bytes - (3 * 16 + 2 * 4 * 4) * 2
    assert plane.name == (f"{st.kind.lower()}:bfloat16[3x16],bfloat16[2x4x4]+pad{pad}"
                          f"/block{env.BLOCK_SIZE}")
    # another shape, another dtype, another block size: another layout, named by the handshake
    for other in (plan_state(gdn(shapes=((3, 16), (2, 4, 2)))),
                  plan_state(gdn(dtypes=(torch.bfloat16, torch.float32),
                                 page_size_padded=2 * FULL.page_size_bytes))):
        assert other.plane(env.BLOCK_SIZE).name != plane.name
        diff = layout_diff(state_layout(st), state_layout(other))
        assert diff and "state_g1" in str(diff), diff
    assert st.plane(env.BLOCK_SIZE * 2).name != plane.name
    with pytest.raises(ConfigError, match="does not split into 7 equal token rows"):
        st.plane(7)


def plan_state(spec: MambaSpec) -> Any:
    from kvhandoff.integrations.vllm.groups import state_spec

    return state_spec(1, spec, ("model.layers.1.linear_attn",))


def state_layout(st: Any) -> LayoutSpec:
    from kvhandoff.kv_layout import SendFrom

    return LayoutSpec(page_size_tokens=env.BLOCK_SIZE, kv_dtype="bf16", regions=(
        RegionSpec(st.region, (1,), (st.plane(env.BLOCK_SIZE),),
                   send_from=SendFrom.DECODE_PREFIX, whole_pages=True),))


def test_worker_state_region_is_vllms_allocation(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, gdn(), gdn()])
    caches = env.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(caches)
        vl = conn.layout
        assert vl is not None
        p = plan_group(kcc)
        assert set(vl.state_regions) == p.state_regions
        for st in p.states:
            reg = vl.layout.region(st.region)
            assert reg.page_nbytes(vl.layout.page_size_tokens) == st.page_bytes
            for name in st.layers:
                view = caches[name]  # vLLM's [B, 1, 1, C] bytes of the layer's state
                assert tuple(view.shape[1:]) == (1, 1, st.content_bytes)
                buf = vl.buffers[st.region][vl.layer_ids[name]]
                for block in (1, 5, int(kcc.num_blocks) - 1):
                    pattern = env.block_pattern(vl.layer_ids[name], block, (st.content_bytes,))
                    env.as_u8(view[block, 0, 0]).copy_(pattern)
                    page = buf[block * st.page_bytes:block * st.page_bytes + st.content_bytes]
                    assert torch.equal(page, pattern)
    finally:
        conn.shutdown()


def blocks(ids: list[int | None]) -> list[KVCacheBlock]:
    """vLLM's blocks; None is its null block (block 0)."""
    out = []
    for b in ids:
        blk = KVCacheBlock(block_id=0 if b is None else b)
        blk.is_null = b is None
        out.append(blk)
    return out


def test_state_block_by_cache_mode() -> None:
    bs = env.BLOCK_SIZE
    align = plan_state(gdn())
    # position-indexed: the state after t tokens is in the block of token t - 1
    table = blocks([None, 7, 9, 4])
    assert state_table(table, 3 * bs, align) == [9]
    assert state_table(table, 3 * bs + 1, align) == [4]
    assert state_table(table, 2 * bs + 1, align) == [9]
    with pytest.raises(KVHandoffError, match="null block"):
        state_table(table, bs, align)
    with pytest.raises(KVHandoffError, match="holds 4 blocks"):
        state_table(table, 4 * bs + 1, align)
    none = plan_state(gdn(mamba_cache_mode="none"))
    assert state_table(blocks([None, None, 11]), 3 * bs, none) == [11]
    with pytest.raises(KVHandoffError, match="holds 2"):
        state_table(blocks([5, 11]), 3 * bs, none)


def request(rid: str, prompt: list[int], params: dict[str, Any] | None, **kw: Any) -> Request:
    sp = SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": params}
                        if params is not None else None)
    return Request(rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None, **kw)


def test_prefill_prompt_cut_before_its_last_token() -> None:
    init_none_hash(sha256)
    req = request("p1", list(range(10, 22)), {"do_remote_decode": True},
                  block_hasher=get_request_block_hasher(4, sha256))
    assert len(req.block_hashes) == 3  # 12 tokens, 3 full blocks of 4
    assert truncate_for_state(req, 4)
    assert req.prompt_token_ids == list(range(10, 21)) and req.num_prompt_tokens == 11
    assert list(req.all_token_ids) == list(range(10, 21)) and req.num_tokens == 11
    assert len(req.block_hashes) == 2 and req.max_tokens == 1
    assert req.kv_transfer_params is not None
    assert req.kv_transfer_params["kvhandoff_state_cut"] is True
    # the hashes go on from the new end: a generated token completes block 2 again
    req.append_output_token_ids(99)
    assert len(req.block_hashes) == 3
    # a request without a remote decode, or a one-token prompt, is not cut
    plain = request("p2", [5, 6], None)
    assert not truncate_for_state(plain, 4) and plain.num_prompt_tokens == 2
    one = request("p3", [5], {"do_remote_decode": True})
    assert not truncate_for_state(one, 4) and one.num_prompt_tokens == 1


@pytest.mark.parametrize(("spec", "why"), [
    (dataclasses.replace(gdn(), mamba_cache_mode="all"), r"mamba_cache_mode 'all'"),
    (dataclasses.replace(gdn(), num_speculative_blocks=1), r"1 speculative state blocks"),
])
def test_state_groups_refused_naming_the_reason(tmp_path: Path, spec: MambaSpec,
                                                why: str) -> None:
    cfg, kcc = plan(tmp_path, [FULL, spec, spec])
    with pytest.raises(ConfigError, match=why):
        KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_state_layers_only_refused(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [gdn(page_size_padded=None)] * 3)
    with pytest.raises(ConfigError, match=r"model '.*tiny-llama' has Mamba / SSM state layers "
                                          r"only"):
        KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_decode_of_another_tp_size_fails_the_load_naming_both(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A room from a prefill of TP 2 into this TP-1 decode: the load fails at once, the
    reason naming both sizes (a rank's state is its share of the heads)."""
    import logging
    import time

    from kvhandoff.integrations.vllm import KVHandoffMetadata
    from kvhandoff.integrations.vllm.config import RecvReq

    cfg, kcc = plan(tmp_path, [FULL, gdn(), gdn()])
    groups = len(kcc.kv_cache_groups)
    worker = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        worker.register_kv_caches(env.allocate(cfg, kcc))
        rv = RecvReq(room=4242, bootstrap_addr="127.0.0.1:9", block_ids=[1], num_tokens=20,
                     local_tokens=0, load_tokens=20, sync=False, prefill_tp_size=2,
                     group_blocks=[[1 + i, 10 + i] for i in range(groups)],
                     group_starts=[0] * groups)
        with caplog.at_level(logging.ERROR, logger="kvhandoff"):
            logging.getLogger("kvhandoff").addHandler(caplog.handler)
            try:
                worker.bind_connector_metadata(KVHandoffMetadata(recvs={"d": rv}))
                worker.start_load_kv(None)  # type: ignore[arg-type]
                res = worker.get_transfer_results(set())
                deadline = time.monotonic() + 30
                while "d" not in res.finished_recving and time.monotonic() < deadline:
                    time.sleep(0.02)  # one engine step
                    res = worker.get_transfer_results(set())
            finally:
                logging.getLogger("kvhandoff").removeHandler(caplog.handler)
        assert res.finished_recving == {"d"} and res.failed_recving == {"d"}
        assert "the prefill has TP 2, this decode TP 1" in caplog.text, caplog.text
        assert "state_g" in caplog.text
    finally:
        worker.shutdown()
