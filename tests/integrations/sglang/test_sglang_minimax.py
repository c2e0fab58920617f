"""MiniMax sparse attention (``StateType.MINIMAX_DENSE_KV`` / ``MINIMAX_INDEX_K``: MiniMax-M3
sparse on SGLang) through SGLang's own queues and pools on CPU.

The model is a MiniMax-M3-sparse-shaped config (4 layers: dense attention on 0 and 2, sparse on
1 and 3, K-only index keys of 32 dims on the sparse layers) parsed by SGLang's ``ModelConfig``;
SGLang's own ``get_minimax_sparse_attention_config`` / ``get_minimax_sparse_layer_ids`` /
``get_minimax_sparse_disable_value_layer_ids`` give the pool's layer sets, as its KV cache
configurator does. Both sides are SGLang 0.5.23's ``MiniMaxSparseKVPool`` (its main pool holds
every layer's K/V; the sparse layers' are the main KV, ``get_sparse_kv_buf_infos``; the dense
layers' the ``minimax_dense_kv`` component; the index-K pool the ``minimax_index_k`` one) with a
``PagedTokenToKVPoolAllocator``. SGLang's ``PrefillBootstrapQueue`` / ``DecodePreallocQueue``
build the ``KVArgs`` and the managers; the prefill's state indices come from SGLang's own
``_send_kv_chunk`` (``_full_kv_pages_payload`` and ``_minimax_payload``), the decode's from the
calls of its payload functions (decode.py 0.5.23, 1686-1702: ``kv_to_page_indices`` and
``minimax_index_transfer_pages``).

What must hold: every layer's K/V pages and the index keys of the suffix land byte for byte,
every other page of the decode stays untouched (its cached prefix included); a decode whose
index keys have another width fails the handshake naming the region.
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
MINIMAX_M3_LIKE = dict(S.LLAMA, architectures=["MiniMaxM3SparseForCausalLM"],
                       num_hidden_layers=4,
                       sparse_attention_config={"sparse_attention_freq": [0, 1, 0, 1],
                                                "sparse_disable_index_value": [0, 1, 0, 1],
                                                "sparse_index_dim": 32})


def minimax_pool(mc: Any, *, pages: int) -> Any:
    """SGLang's ``MiniMaxSparseKVPool`` of `mc`, its layer sets by SGLang's functions."""
    import torch
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_disable_value_layer_ids,
        get_minimax_sparse_layer_ids,
        is_minimax_sparse,
    )
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    assert is_minimax_sparse(mc.hf_config)
    cfg = get_minimax_sparse_attention_config(mc.hf_config)
    dense, sparse = get_minimax_sparse_layer_ids(cfg)
    return MiniMaxSparseKVPool(
        size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16,
        head_num=mc.get_num_kv_heads(1), head_dim=mc.head_dim,
        idx_head_dim=cfg["sparse_index_dim"], dense_layer_ids=dense, sparse_layer_ids=sparse,
        disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(cfg),
        device="cpu", start_layer=0, end_layer=mc.num_hidden_layers)


class Engine:
    def __init__(self, pool: Any) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.pool = pool
        self.alloc = PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.int64, "cpu", pool,
                                                 need_sort=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=pool.size, device="cpu",
                                           enable_memory_saver=False)

    def admit(self, row: int, seq_len: int) -> None:
        import torch

        one = torch.tensor([0], dtype=torch.int64)
        n = torch.tensor([seq_len], dtype=torch.int64)
        loc = self.alloc.alloc_extend(prefix_lens=one, prefix_lens_cpu=one, seq_lens=n,
                                      seq_lens_cpu=n, last_loc=torch.tensor([-1]),
                                      extend_num_tokens=seq_len)
        assert loc is not None
        self.req_to_token.req_to_token[row, :seq_len] = loc

    def decode_indices(self, row: int, seq_len: int, prefix: int, state_types: list[Any]
                       ) -> tuple[Any, list[Any]]:
        """The decode's suffix KV pages and its state indices, by SGLang's calls."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages
        from sglang.srt.mem_cache.common import kv_to_page_indices

        rt = self.req_to_token.req_to_token
        kv = kv_to_page_indices(self.alloc.translate_kv_indices_for_transfer(
            rt[row][prefix:seq_len]), PAGE)
        by = {StateType.MINIMAX_DENSE_KV: lambda: kv_to_page_indices(rt[row, :seq_len], PAGE),
              StateType.MINIMAX_INDEX_K: lambda: minimax_index_transfer_pages(
                  rt[row, :seq_len], page_size=PAGE, prefix_len=prefix)}
        return kv, [by[st]() for st in state_types]

    def views(self) -> list[Any]:
        """uint8 [pages, bytes] of every layer's K and V (the main pool) and of the index
        keys."""
        import torch

        mp, ip = self.pool.main_pool, self.pool.index_k_pool
        return [b.view(torch.uint8).reshape(b.shape[0] // PAGE, -1)
                for b in (*mp.k_buffer, *mp.v_buffer, *ip.k_buffer)]


def handoff(pre: S.Side, dec: S.Side, pe: Engine, de: Engine, port: int, room: int,
            seq_len: int, *, prefix: int = 0, chunk_at: int | None = None
            ) -> tuple[int, int, str | None, dict[str, Any]]:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    pe.admit(1, seq_len)
    de.admit(0, 3 * PAGE)  # another request first: the decode's pages differ
    de.admit(2, seq_len)
    d_kv, d_state = de.decode_indices(2, seq_len, prefix,
                                      list(dec.kv_manager.kv_args.state_types))
    addr = f"127.0.0.1:{port}"
    s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
    end = time.monotonic() + 15
    while not dec.kv_manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
    r.init(0)
    r.send_metadata(d_kv, D_AUX, d_state, decode_prefix_len=prefix)
    assert S.until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
    assert s.pop_decode_prefix_len() == prefix
    s.init(len(d_kv), S_AUX)
    seen: dict[str, Any] = {"kv": [], "d_kv": d_kv, "d_state": d_state}
    send = s.send

    def recorded(kv: Any, state: Any = None, **kw: Any) -> None:  # what SGLang hands us
        seen["kv"].append(np.asarray(kv))
        if state is not None:
            seen["p_state"] = [np.asarray(x) for x in state]
        send(kv, state, **kw)

    s.send = recorded
    # SGLang's _send_kv_chunk over a stand-in of the scheduler fields it reads (prefill.py
    # 0.5.23, 1528-1790; the metadata slot is filled by the test)
    sched = SimpleNamespace(token_to_kv_pool_allocator=pe.alloc, enable_staging=False,
                            disagg_metadata_buffers=SimpleNamespace(set_buf=lambda req: None),
                            req_to_token_pool=pe.req_to_token,
                            disagg_prefill_bootstrap_queue=pre.queue,
                            disagg_prefill_pending_chunk_rids=set())
    req = SimpleNamespace(rid=f"r{room}", start_send_idx=prefix,
                          origin_input_ids=list(range(seq_len)), extend_end=seq_len,
                          disagg_decode_prefix_len=prefix, kv=SimpleNamespace(req_pool_idx=1),
                          disagg_kv_sender=s)
    if chunk_at is not None:
        SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=False,
                                                           end_idx=chunk_at)
    SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=True)
    seen["kv"] = np.concatenate(seen["kv"])
    rs, ss, reason = S.outcome(r, s)
    return rs, ss, reason, seen


def _sides(bootstrap: Any, dec_index_dim: int = 32) -> tuple[S.Side, S.Side, Engine, Engine]:
    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(MINIMAX_M3_LIKE)
    dmc = mc if dec_index_dim == 32 else S.model_config(dict(
        MINIMAX_M3_LIKE, sparse_attention_config=dict(
            MINIMAX_M3_LIKE["sparse_attention_config"], sparse_index_dim=dec_index_dim)))
    pp, dp = minimax_pool(mc, pages=16), minimax_pool(dmc, pages=16)
    return S.prefill_queue(mc, pp, sa), S.decode_queues(dmc, dp, sa), Engine(pp), Engine(dp)


@pytest.mark.parametrize(("seq_len", "prefix", "chunk_at"),
                         [(70, 0, None), (70, 32, None), (100, 0, 48)],
                         ids=["whole", "decode-prefix", "two-chunks"])
def test_minimax_pair_built_by_sglangs_queues_hands_off_every_layer_and_index_keys(
        bootstrap: Any, seq_len: int, prefix: int, chunk_at: int | None) -> None:
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    pre, dec, pe, de = _sides(bootstrap)
    try:
        for side in (pre, dec):
            assert list(side.kv_manager.kv_args.state_types) == [
                StateType.MINIMAX_INDEX_K, StateType.MINIMAX_DENSE_KV]
            b = side.kv_manager.built
            assert b.paged_regions == ("k", "v", "dense_k", "dense_v", "index_k")
            assert b.kv_layout.region("index_k").bytes_per_token == 32 * 2  # bf16 keys
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
        rng = np.random.default_rng(seq_len + prefix)
        for v in pe.views():
            v.copy_(torch.from_numpy(rng.integers(1, 256, tuple(v.shape), dtype=np.uint8)))
        before = [v.clone() for v in de.views()]
        room = 9950 + seq_len + prefix
        rs, ss, reason, seen = handoff(pre, dec, pe, de, bootstrap.port, room, seq_len,
                                       prefix=prefix, chunk_at=chunk_at)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        n_all, n_suffix = -(-seq_len // PAGE), -(-seq_len // PAGE) - prefix // PAGE
        p_index, p_dense = seen["p_state"]
        assert len(p_dense) == n_all and len(p_index) == n_suffix == len(seen["kv"])
        assert p_index.tolist() == seen["kv"].tolist() == p_dense[prefix // PAGE:].tolist()
        for i, (a, b, b0) in enumerate(zip(pe.views(), de.views(), before, strict=True)):
            for sp, dp in zip(seen["kv"], seen["d_kv"], strict=True):
                assert torch.equal(a[int(sp)], b[int(dp)]), (i, sp, dp)
            for pg in sorted(set(range(b.shape[0])) - {int(x) for x in seen["d_kv"]}):
                assert torch.equal(b[pg], b0[pg]), ("untouched", i, pg)
        t = pre.kv_manager.agent.room_timings(room)
        assert t is not None
        assert int(t["bytes"]) == sum(v.shape[1] for v in pe.views()) * n_suffix
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_minimax_decode_with_other_index_keys_fails_the_handshake_naming_them(
        bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _sides(bootstrap, dec_index_dim=64)
    try:
        rs, _, reason, _ = handoff(pre, dec, pe, de, bootstrap.port, 9990, 40)
        assert rs == KVPoll.Failed
        assert reason is not None and "layout mismatch" in reason and "index_k" in reason, \
            reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()
