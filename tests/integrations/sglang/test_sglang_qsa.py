"""QSA compressed sparse attention (``StateType.QSA_PENDING`` / ``QSA_COMPRESSED``: Qwen4-Exp on
SGLang, beside its Gated DeltaNet state) through SGLang's own queues and pools on CPU.

The model is the Qwen3-Next-shaped config of `test_sglang_mamba` (GDN layers 0-2, full
attention on 3) with a QSA indexer (``indexer_*``: 1 key head of 32, compress ratio 4), parsed
by SGLang's ``ModelConfig``; SGLang's ``parse_qsa_profile`` gives the pool's QSA geometry, as
its KV cache configurator does. Both sides are SGLang 0.5.23's ``QSATokenToKVPool`` (a
``HybridLinearKVPool``) over the ``MambaPool`` of a ``HybridReqToTokenPool``, with a
``PagedTokenToKVPoolAllocator``: components ``mamba``, ``qsa_pending`` (the index-key ring of
each full layer and the shared RoPE-position ring, ``ratio`` slots a request, at its
request-pool row) and ``qsa_compressed`` (one compressed page per KV page, SGLang's
``_full_kv_pages_payload``: the request's pages from token 0). SGLang's queues build the
``KVArgs`` and the managers; the prefill's state indices come from SGLang's own
``_send_kv_chunk``, the decode's from the calls of its payload functions (decode.py 0.5.23:
``_mamba_payload``, ``get_qsa_pending_state_indices``, ``kv_to_page_indices``).

What must hold: the full layer's pages, the compressed pages of the suffix, the request's ring
rows and Mamba row land byte for byte in the decode's own (other) pages and rows; every other
page and row of the decode stays untouched; another compress ratio fails the handshake.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import sglang_sched as S
from test_sglang_mamba import QWEN3_NEXT

pytestmark = pytest.mark.usefixtures("sglang_loaded")

PAGE = 16
S_AUX, D_AUX = 1, 5
QWEN4_EXP_LIKE = dict(QWEN3_NEXT, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32,
                      indexer_budget=2048, indexer_compress_ratio=4)


class Engine:
    """SGLang's request pool (with its ``MambaPool``), ``QSATokenToKVPool`` and allocator."""

    def __init__(self, mc: Any) -> None:
        import torch
        from sglang.srt.layers.attention.qsa.config import parse_qsa_profile
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

        hf = mc.hf_config
        prof = parse_qsa_profile(hf)
        assert prof is not None
        self.ratio = prof.compress_ratio
        self.req_pool = HybridReqToTokenPool(
            size=4, mamba_size=4, mamba_spec_state_size=4, max_context_len=256, device="cpu",
            enable_memory_saver=False, cache_params=hf.mamba2_cache_params,
            mamba_layer_ids=hf.linear_layer_ids, enable_mamba_extra_buffer=False)
        self.pool = QSATokenToKVPool(
            size=12 * PAGE, dtype=torch.bfloat16, page_size=PAGE,
            head_num=mc.get_num_kv_heads(1), head_dim=mc.head_dim,
            full_attention_layer_ids=hf.full_attention_layer_ids, device="cpu",
            mamba_pool=self.req_pool.mamba_pool, qsa_index_kv_heads=prof.kv_heads,
            qsa_index_head_dim=prof.head_dim, qsa_compress_ratio=prof.compress_ratio,
            qsa_token_topk=prof.budget,
            num_request_slots=self.req_pool.req_to_token.shape[0])
        self.alloc = PagedTokenToKVPoolAllocator(self.pool.size, PAGE, torch.int64, "cpu",
                                                 self.pool, need_sort=False)

    def admit(self, seq_len: int) -> int:
        """SGLang's allocation of a new request: its row and Mamba row, its KV slots."""
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

    def decode_indices(self, row: int, seq_len: int, prefix: int, state_types: list[Any]
                       ) -> tuple[Any, list[Any]]:
        """The decode's suffix KV pages and its state indices, by SGLang's calls."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import get_qsa_pending_state_indices
        from sglang.srt.mem_cache.common import kv_to_page_indices

        rt = self.req_pool.req_to_token
        kv = kv_to_page_indices(self.alloc.translate_kv_indices_for_transfer(
            rt[row][prefix:seq_len]), PAGE)
        by = {
            StateType.MAMBA: lambda: [self.req_pool.translate_mamba_indices(
                self.req_pool.req_index_to_mamba_index_mapping[row]).cpu().numpy()],
            StateType.QSA_PENDING: lambda: get_qsa_pending_state_indices(
                SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row))),
            StateType.QSA_COMPRESSED: lambda: kv_to_page_indices(rt[row, :seq_len], PAGE)}
        return kv, [by[st]() for st in state_types]

    def page_views(self) -> list[Any]:
        """uint8 [pages, bytes]: the full layer's K and V, then its compressed keys (one
        compressed page per KV page)."""
        import torch

        fp = self.pool.full_kv_pool
        rows = PAGE // self.ratio
        return [b.view(torch.uint8).reshape(b.shape[0] // PAGE, -1)
                for b in (*fp.k_buffer, *fp.v_buffer)] + \
            [b.view(torch.uint8).reshape(b.shape[0] // rows, -1)
             for b in self.pool.qsa_compressed_k_buffer_pool]

    def ring_views(self) -> list[Any]:
        """uint8 [request rows, bytes] of the pending key rings and the RoPE ring."""
        import torch

        n = self.pool.qsa_num_request_slots
        return [b.view(torch.uint8).reshape(n, -1)
                for b in (*self.pool.qsa_key_state_buffer_pool,
                          self.pool.qsa_rope_position_buffer)]

    def mamba_views(self) -> list[Any]:
        import torch

        c = self.req_pool.mamba_pool.mamba_cache
        return [t.view(torch.uint8) for t in (*c.conv, c.temporal)]

    def mamba_row(self, row: int) -> int:
        return int(self.req_pool.req_index_to_mamba_index_mapping[row])


def handoff(pre: S.Side, dec: S.Side, pe: Engine, de: Engine, port: int, room: int,
            seq_len: int, *, prefix: int = 0, chunk_at: int | None = None
            ) -> tuple[int, int, str | None, dict[str, Any]]:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    p_row = pe.admit(seq_len)
    de.admit(2 * PAGE)  # another request first: the decode's rows and pages differ
    d_row = de.admit(seq_len)
    d_kv, d_state = de.decode_indices(d_row, seq_len, prefix,
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
    seen: dict[str, Any] = {"kv": [], "d_kv": d_kv, "d_state": d_state, "p_row": p_row,
                            "d_row": d_row}
    send = s.send

    def recorded(kv: Any, state: Any = None, **kw: Any) -> None:  # what SGLang hands us
        seen["kv"].append(np.asarray(kv))
        if state is not None:
            seen["p_state"] = state
        send(kv, state, **kw)

    s.send = recorded
    # SGLang's _send_kv_chunk over a stand-in of the scheduler fields it reads (prefill.py
    # 0.5.23, 1528-1790; the metadata slot is filled by the test)
    sched = SimpleNamespace(token_to_kv_pool_allocator=pe.alloc, enable_staging=False,
                            disagg_metadata_buffers=SimpleNamespace(set_buf=lambda req: None),
                            req_to_token_pool=pe.req_pool,
                            disagg_prefill_bootstrap_queue=pre.queue,
                            disagg_prefill_pending_chunk_rids=set())
    req = SimpleNamespace(rid=f"r{room}", start_send_idx=prefix,
                          origin_input_ids=list(range(seq_len)), extend_end=seq_len,
                          disagg_decode_prefix_len=prefix,
                          kv=SimpleNamespace(req_pool_idx=p_row), disagg_kv_sender=s)
    if chunk_at is not None:
        SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=False,
                                                           end_idx=chunk_at)
    SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=True)
    seen["kv"] = np.concatenate(seen["kv"])
    rs, ss, reason = S.outcome(r, s)
    return rs, ss, reason, seen


def _sides(bootstrap: Any, dec_ratio: int = 4) -> tuple[S.Side, S.Side, Engine, Engine]:
    sa = E.server_args("prefill", bootstrap.port)  # publishes the parallel context first
    mc = S.model_config(QWEN4_EXP_LIKE)
    dmc = mc if dec_ratio == 4 else S.model_config(dict(
        QWEN4_EXP_LIKE, indexer_compress_ratio=dec_ratio, indexer_budget=2048 * dec_ratio))
    pe, de = Engine(mc), Engine(dmc)
    return S.prefill_queue(mc, pe.pool, sa), S.decode_queues(dmc, de.pool, sa), pe, de


def _unchanged_but(b: Any, b0: Any, rows: set[int], what: Any) -> None:
    import torch

    for x in sorted(set(range(b.shape[0])) - rows):
        assert torch.equal(b[x], b0[x]), (what, "untouched", x)


@pytest.mark.parametrize(("seq_len", "prefix", "chunk_at"),
                         [(70, 0, None), (70, 32, None), (100, 0, 48)],
                         ids=["whole", "decode-prefix", "two-chunks"])
def test_qsa_pair_built_by_sglangs_queues_hands_off_rings_compressed_pages_and_state(
        bootstrap: Any, seq_len: int, prefix: int, chunk_at: int | None) -> None:
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    pre, dec, pe, de = _sides(bootstrap)
    try:
        for side in (pre, dec):
            assert list(side.kv_manager.kv_args.state_types) == [
                StateType.MAMBA, StateType.QSA_PENDING, StateType.QSA_COMPRESSED]
            b = side.kv_manager.built
            assert b.paged_regions == ("k", "v", "qsa_compressed")
            assert b.kv_layout.region("qsa_compressed").layer_ids == (3,)
            st = b.state_layout
            assert st is not None and [r.name for r in st.regions] == [
                "mamba0", "mamba1", "qsa_pending_k", "qsa_rope"]
            assert st.region("qsa_pending_k").layer_ids == (3,)
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
        assert pre.kv_manager.state_agent.layout_hash == dec.kv_manager.state_agent.layout_hash
        rng = np.random.default_rng(seq_len + prefix)
        for v in (*pe.page_views(), *pe.ring_views(), *pe.mamba_views()):
            v.copy_(torch.from_numpy(rng.integers(1, 256, tuple(v.shape), dtype=np.uint8)))
        pages0 = [v.clone() for v in de.page_views()]
        rings0 = [v.clone() for v in de.ring_views()]
        mamba0 = [v.clone() for v in de.mamba_views()]
        room = 9700 + seq_len + prefix
        rs, ss, reason, seen = handoff(pre, dec, pe, de, bootstrap.port, room, seq_len,
                                       prefix=prefix, chunk_at=chunk_at)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        p_row, d_row = seen["p_row"], seen["d_row"]
        assert p_row != d_row
        _, p_pending, p_compressed = seen["p_state"]
        assert np.asarray(p_pending).tolist() == [p_row]  # SGLang's index: the request row
        n_all = -(-seq_len // PAGE)
        assert len(p_compressed) == n_all and len(seen["kv"]) == n_all - prefix // PAGE
        assert np.asarray(p_compressed)[prefix // PAGE:].tolist() == seen["kv"].tolist()
        for i, (a, b, b0) in enumerate(zip(pe.page_views(), de.page_views(), pages0,
                                           strict=True)):
            for sp, dp in zip(seen["kv"], seen["d_kv"], strict=True):
                assert torch.equal(a[int(sp)], b[int(dp)]), ("page", i, sp, dp)
            _unchanged_but(b, b0, {int(x) for x in seen["d_kv"]}, ("page", i))
        for i, (a, b, b0) in enumerate(zip(pe.ring_views(), de.ring_views(), rings0,
                                           strict=True)):
            assert torch.equal(a[p_row], b[d_row]), ("ring", i)
            _unchanged_but(b, b0, {d_row}, ("ring", i))
        pm, dm = pe.mamba_row(p_row), de.mamba_row(d_row)
        for i, (a, b, b0) in enumerate(zip(pe.mamba_views(), de.mamba_views(), mamba0,
                                           strict=True)):
            assert torch.equal(a[:, pm], b[:, dm]), ("mamba", i)
            for other in set(range(b.shape[1])) - {dm}:
                assert torch.equal(b[:, other], b0[:, other]), ("mamba untouched", i, other)
        t = pre.kv_manager.state_agent.room_timings(room)
        assert t is not None
        assert int(t["bytes"]) == sum(v[0].nbytes for v in pe.ring_views()) + sum(
            v[:, 0].nbytes for v in pe.mamba_views())
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_qsa_decode_of_another_compress_ratio_fails_the_handshake(bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _sides(bootstrap, dec_ratio=8)
    try:
        rs, _, reason, _ = handoff(pre, dec, pe, de, bootstrap.port, 9799, 40)
        assert rs == KVPoll.Failed
        assert reason is not None and "layout mismatch" in reason, reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()
