"""Mamba / linear-attention hybrids (``StateType.MAMBA``: Qwen3-Next, Nemotron-H, Falcon-H1 on
SGLang) through SGLang's own queues and pools on CPU.

The model is a Qwen3-Next-shaped config (4 layers: Gated DeltaNet layers 0-2, full attention
on layer 3) parsed by SGLang into its ``Qwen3NextConfig``, whose ``mamba2_cache_params`` give
the state shape (conv [128, 3] bf16, temporal [4, 16, 16] fp32). Both sides are SGLang 0.5.23's
``HybridLinearKVPool`` over the ``MambaPool`` of a ``HybridReqToTokenPool``, with a
``PagedTokenToKVPoolAllocator``.
SGLang's ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` build the ``KVArgs``
(``setup_state_kv_args`` appends the Mamba component with its layer ids and per-tensor dims) and
the kvhandoff managers. The request's rows come from SGLang's own ``HybridReqToTokenPool.alloc``
(its Mamba row) and ``alloc_extend``; the prefill's state index is made by SGLang's own
``_send_kv_chunk`` (prefill.py ``_mamba_payload``), the decode's by the same calls as its
``_mamba_payload`` (decode.py 0.5.23, lines 1661-1670).

What must hold: the full layer's pages and the request's Mamba row of every state tensor and
layer land byte for byte in the decode's own row; every other row of the decode's state pool
stays untouched; a decode whose state has another shape fails the handshake.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import sglang_sched as S

pytestmark = pytest.mark.usefixtures("sglang_loaded")

PAGE = 16
S_AUX, D_AUX = 1, 5
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
              "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 16, "num_hidden_layers": 4,
              "vocab_size": 256, "max_position_embeddings": 4096, "full_attention_interval": 4,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16", "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 64}
MAMBA_LAYERS = [0, 1, 2]


class Engine:
    """SGLang's request pool (with its ``MambaPool``), ``HybridLinearKVPool`` and allocator."""

    def __init__(self, mc: Any) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        hf = mc.hf_config
        self.req_pool = HybridReqToTokenPool(
            size=4, mamba_size=4, mamba_spec_state_size=4, max_context_len=256, device="cpu",
            enable_memory_saver=False, cache_params=hf.mamba2_cache_params,
            mamba_layer_ids=hf.linear_layer_ids, enable_mamba_extra_buffer=False)
        self.pool = HybridLinearKVPool(
            size=8 * PAGE, dtype=torch.bfloat16, page_size=PAGE, head_num=mc.get_num_kv_heads(1),
            head_dim=mc.head_dim, full_attention_layer_ids=hf.full_attention_layer_ids,
            device="cpu", mamba_pool=self.req_pool.mamba_pool)
        self.alloc = PagedTokenToKVPoolAllocator(self.pool.size, PAGE, torch.int64, "cpu",
                                                 self.pool, need_sort=False)

    def admit(self, seq_len: int) -> int:
        """SGLang's allocation of a new request: its row and Mamba row
        (``HybridReqToTokenPool.alloc``), its KV slots (``alloc_extend``); the row."""
        import torch
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        req = SimpleNamespace(kv=ReqKvInfo())
        (row,) = self.req_pool.alloc([req])
        one = torch.tensor([0], dtype=torch.int64)
        n = torch.tensor([seq_len], dtype=torch.int64)
        loc = self.alloc.alloc_extend(prefix_lens=one, prefix_lens_cpu=one, seq_lens=n,
                                      seq_lens_cpu=n, last_loc=torch.tensor([-1]),
                                      extend_num_tokens=seq_len)
        assert loc is not None
        self.req_pool.req_to_token[row, :seq_len] = loc
        return int(row)

    def decode_indices(self, row: int, seq_len: int) -> tuple[Any, list[Any]]:
        """The decode's KV pages and its Mamba state index, by SGLang's calls."""
        from sglang.srt.mem_cache.common import kv_to_page_indices

        raw = self.req_pool.req_to_token[row][0:seq_len]
        kv = kv_to_page_indices(self.alloc.translate_kv_indices_for_transfer(raw), PAGE)
        mamba = [self.req_pool.translate_mamba_indices(
            self.req_pool.req_index_to_mamba_index_mapping[row]).cpu().numpy()]
        return kv, mamba

    def mamba_row(self, row: int) -> int:
        return int(self.req_pool.req_index_to_mamba_index_mapping[row])

    def state_tensors(self) -> list[Any]:
        """Every state tensor of the Mamba pool ([layers, rows, ...]), SGLang's order."""
        import torch

        c = self.req_pool.mamba_pool.mamba_cache
        # bytes (random bytes are NaNs as floats, which never compare equal)
        return [t.view(torch.uint8) for t in (*c.conv, c.temporal)]

    def full_pages(self) -> list[Any]:
        import torch

        fp = self.pool.full_kv_pool
        return [b.view(torch.uint8).reshape(b.shape[0] // PAGE, -1)
                for b in (*fp.k_buffer, *fp.v_buffer)]


def _until(h: Any, done: Any, bound_s: float = 20.0) -> int:
    end = time.monotonic() + bound_s
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.005)
    return int(h.poll())


def handoff(pre: S.Side, dec: S.Side, pe: Engine, de: Engine, port: int, room: int,
            seq_len: int) -> tuple[int, int, str | None, dict[str, Any]]:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    p_row = pe.admit(seq_len)
    de.admit(seq_len)  # another request first: the decode's rows differ from the prefill's
    d_row = de.admit(seq_len)
    d_kv, d_mamba = de.decode_indices(d_row, seq_len)
    addr = f"127.0.0.1:{port}"
    s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
    end = time.monotonic() + 15
    while not dec.kv_manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
    r.init(0)
    r.send_metadata(d_kv, D_AUX, [d_mamba], decode_prefix_len=0)
    assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
    s.init(len(d_kv), S_AUX)
    seen: dict[str, Any] = {"p_row": p_row, "d_row": d_row, "d_kv": d_kv}
    send = s.send

    def recorded(kv: Any, state: Any = None, **kw: Any) -> None:  # what SGLang hands us
        seen["kv"], seen["mamba"] = np.asarray(kv), state[0]
        send(kv, state, **kw)

    s.send = recorded
    # SGLang's _send_kv_chunk over a stand-in of the scheduler fields it reads (prefill.py
    # 0.5.23, 1528-1790; the metadata slot is filled by the test)
    sched = SimpleNamespace(token_to_kv_pool_allocator=pe.alloc, enable_staging=False,
                            disagg_metadata_buffers=SimpleNamespace(set_buf=lambda req: None),
                            req_to_token_pool=pe.req_pool,
                            disagg_prefill_bootstrap_queue=pre.queue,
                            disagg_prefill_pending_chunk_rids=set())
    req = SimpleNamespace(rid="r", start_send_idx=0, origin_input_ids=list(range(seq_len)),
                          extend_end=seq_len, disagg_decode_prefix_len=0,
                          kv=SimpleNamespace(req_pool_idx=p_row), disagg_kv_sender=s)
    SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=True)
    rs = _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    reason = None
    if rs == KVPoll.Failed:
        try:
            r.failure_exception()
        except Exception as e:  # SGLang's KVTransferError
            reason = str(e)
    ss = _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    return rs, ss, reason, seen


def _sides(bootstrap: Any, dec_heads: int = 4) -> tuple[S.Side, S.Side, Engine, Engine]:
    sa = E.server_args("prefill", bootstrap.port)  # publishes the parallel context first
    mc = S.model_config(QWEN3_NEXT)
    dmc = mc if dec_heads == 4 else S.model_config(dict(QWEN3_NEXT,
                                                        linear_num_value_heads=dec_heads))
    pe, de = Engine(mc), Engine(dmc)
    return S.prefill_queue(mc, pe.pool, sa), S.decode_queues(dmc, de.pool, sa), pe, de


def test_mamba_pair_built_by_sglangs_queues_hands_off_the_state_row_byte_exact(
        bootstrap: Any) -> None:
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    pre, dec, pe, de = _sides(bootstrap)
    try:
        for side in (pre, dec):
            assert list(side.kv_manager.kv_args.state_types) == [StateType.MAMBA]
            st = side.kv_manager.built.state_layout
            assert st is not None and [r.name for r in st.regions] == ["mamba0", "mamba1"]
            assert st.region("mamba0").layer_ids == tuple(MAMBA_LAYERS)
            assert side.kv_manager.built.kv_layout.region("k").layer_ids == (3,)
        assert pre.kv_manager.state_agent.layout_hash == dec.kv_manager.state_agent.layout_hash
        rng = np.random.default_rng(7)
        for u in (*pe.state_tensors(), *pe.full_pages()):
            u.copy_(torch.from_numpy(rng.integers(1, 256, tuple(u.shape), dtype=np.uint8)))
        before = [t.clone() for t in de.state_tensors()]
        rs, ss, reason, seen = handoff(pre, dec, pe, de, bootstrap.port, 9701, 40)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        p_row, d_row = pe.mamba_row(seen["p_row"]), de.mamba_row(seen["d_row"])
        assert int(np.asarray(seen["mamba"]).reshape(-1)[0]) == p_row  # SGLang's index
        assert p_row != d_row
        for a, b, b0 in zip(pe.state_tensors(), de.state_tensors(), before, strict=True):
            for li in range(len(MAMBA_LAYERS)):
                assert torch.equal(a[li, p_row], b[li, d_row]), (li, p_row, d_row)
                for other in range(b.shape[1]):
                    if other != d_row:
                        assert torch.equal(b[li, other], b0[li, other]), ("untouched", other)
        for a, b in zip(pe.full_pages(), de.full_pages(), strict=True):
            for sp, dp in zip(seen["kv"], seen["d_kv"], strict=True):
                assert torch.equal(a[sp], b[dp])
        # the state room moved one row of each tensor and layer, nothing more
        t = pre.kv_manager.state_agent.room_timings(9701)
        assert t is not None
        assert int(t["bytes"]) == sum(x[0, 0].nbytes * len(MAMBA_LAYERS)
                                      for x in pe.state_tensors())
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_mamba_state_of_another_shape_fails_the_handshake(bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _sides(bootstrap, dec_heads=8)
    try:
        rs, _, reason, _ = handoff(pre, dec, pe, de, bootstrap.port, 9702, 40)
        assert rs == KVPoll.Failed
        assert reason is not None and "layout mismatch" in reason, reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_mamba_row_index_is_read_as_sglang_gives_it_and_refused_otherwise() -> None:
    from kvhandoff.errors import ConfigError
    from kvhandoff.integrations.sglang.layout import mamba_row

    assert mamba_row([np.array(3, np.int32)], "m") == 3
    assert mamba_row([np.array([5])], "m") == 5
    for bad in (None, [], [np.array([1, 2])], [np.array(-1)]):
        with pytest.raises(ConfigError, match="m: expected"):
            mamba_row(bad, "m")
