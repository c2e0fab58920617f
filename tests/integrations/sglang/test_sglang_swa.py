"""Sliding-window models (``StateType.SWA``: Gemma-3, gpt-oss, Cohere-2, MiMo on SGLang) through
SGLang's own queues and pools on CPU.

Both sides are SGLang 0.5.23's ``SWAKVPool`` (an ``MHATokenToKVPool`` for the full-attention
layers and one for the window layers) with its ``SWATokenToKVPoolAllocator`` and
``ReqToTokenPool``; SGLang's ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` build the
``KVArgs`` (``setup_state_kv_args`` appends the window pool as the SWA state component) and the
kvhandoff managers. A request's pages come from SGLang's allocator (``alloc_extend``, which maps
each full-pool token to a window-pool token); the prefill's state indices are made by SGLang's
own ``_send_kv_chunk`` (prefill.py ``_swa_payload``: the window pages through
``translate_swa_indices_for_transfer``), which calls this backend's ``send``; the decode's are
its ``_swa_payload`` (decode.py 0.5.23, lines 1672-1684) on SGLang's allocator, the same calls.

What must hold: the full layers' pages and the window's pages land byte for byte; a window
pool page the window does not reach stays untouched on the decode and is not moved; another
window layer set is refused at the handshake naming the regions; a decode whose window covers
another number of pages is refused naming both.
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
WINDOW = 40
S_AUX, D_AUX = 1, 5
# a Gemma-3-like layer pattern: window layers around two full-attention layers
GEMMA_LIKE = dict(S.LLAMA, num_hidden_layers=6)
SWA_LAYERS, FULL_LAYERS = (0, 1, 3, 4), (2, 5)


def swa_pool(mc: Any, *, pages: int, swa_pages: int,
             swa_layers: tuple[int, ...] = SWA_LAYERS,
             full_layers: tuple[int, ...] = FULL_LAYERS) -> Any:
    """SGLang's ``SWAKVPool`` (bf16, MHA sub-pools) of `mc`."""
    import torch
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=pages * PAGE, size_swa=swa_pages * PAGE, page_size=PAGE,
                     dtype=torch.bfloat16, head_num=mc.get_num_kv_heads(1),
                     head_dim=mc.head_dim, swa_attention_layer_ids=list(swa_layers),
                     full_attention_layer_ids=list(full_layers), device="cpu",
                     enable_memory_saver=False)


class Engine:
    """SGLang's allocator and request-to-token table over one side's ``SWAKVPool``."""

    def __init__(self, pool: Any) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.pool = pool
        self.alloc = SWATokenToKVPoolAllocator(
            size=pool.size, size_swa=pool.size_swa, page_size=PAGE, dtype=torch.int64,
            device="cpu", kvcache=pool, need_sort=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=pool.size, device="cpu",
                                           enable_memory_saver=False)

    def admit(self, row: int, seq_len: int) -> None:
        """SGLang's ``alloc_extend`` of a new request of `seq_len` tokens into `row`."""
        import torch

        one = torch.tensor([0], dtype=torch.int64)
        n = torch.tensor([seq_len], dtype=torch.int64)
        loc = self.alloc.alloc_extend(prefix_lens=one, prefix_lens_cpu=one, seq_lens=n,
                                      seq_lens_cpu=n, last_loc=torch.tensor([-1]),
                                      extend_num_tokens=seq_len)
        assert loc is not None
        self.req_to_token.req_to_token[row, :seq_len] = loc

    def decode_indices(self, row: int, seq_len: int, window: int) -> tuple[Any, Any]:
        """What SGLang's decode sends for a request without a cached prefix: its KV pages
        (decode.py 1639-1656) and its SWA state indices (``_swa_payload``, decode.py
        1672-1684), with SGLang's own functions."""
        from sglang.srt.mem_cache.common import kv_to_page_indices, page_align_floor

        raw = self.req_to_token.req_to_token[row][0:seq_len]
        kv = kv_to_page_indices(self.alloc.translate_kv_indices_for_transfer(raw), PAGE)
        start = page_align_floor(max(0, seq_len - window), PAGE)
        win = self.alloc.translate_swa_indices_for_transfer(
            self.req_to_token.req_to_token[row, start:seq_len])
        return kv, kv_to_page_indices(win, PAGE)


def _u8(t: Any) -> Any:
    import torch

    return t.view(torch.uint8).reshape(t.shape[0] // PAGE, -1)


def views(pool: Any) -> tuple[list[Any], list[Any]]:
    """uint8 [pages, bytes] views of the full pool's and the window pool's K and V buffers."""
    full = [_u8(b) for b in (*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer)]
    swa = [_u8(b) for b in (*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer)]
    return full, swa


def _until(h: Any, done: Any, bound_s: float = 20.0) -> int:
    end = time.monotonic() + bound_s
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.005)
    return int(h.poll())


def _fill(pool: Any, meta: Any, seed: int) -> None:
    import torch

    rng = np.random.default_rng(seed)
    for v in (*views(pool)[0], *views(pool)[1]):
        v.copy_(torch.from_numpy(rng.integers(1, 256, tuple(v.shape), dtype=np.uint8)))
    for t in E._aux_tensors(meta):
        u = t.view(torch.uint8).reshape(t.shape[0], -1)
        u[S_AUX] = torch.from_numpy(rng.integers(1, 256, u.shape[1], dtype=np.uint8))


def prefill_send(pre: S.Side, eng: Engine, sender: Any, row: int, seq_len: int,
                 window: int, chunk_at: int | None = None) -> None:
    """SGLang's ``_send_kv_chunk`` of the request (with `chunk_at`: a first chunk ending
    there, then the last): it makes the KV pages and, with the last chunk, the state indices
    (its ``_swa_payload``) and calls the sender's ``send``. The scheduler is a
    stand-in of the fields that method reads (prefill.py 0.5.23, 1528-1790)."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    sched = SimpleNamespace(
        token_to_kv_pool_allocator=eng.alloc,  # :1536, 1587, 1608, 1737
        enable_staging=False,  # :1547, 1721
        disagg_metadata_buffers=SimpleNamespace(set_buf=lambda req: None),  # :1567 (the
        # test fills the metadata slot itself)
        sliding_window_size=window,  # :1594
        req_to_token_pool=eng.req_to_token,  # :1605, 1732
        disagg_prefill_bootstrap_queue=pre.queue,  # :1674
        disagg_prefill_pending_chunk_rids=set())  # :1786
    req = SimpleNamespace(rid=f"r{row}", start_send_idx=0,
                          origin_input_ids=list(range(seq_len)), extend_end=seq_len,
                          disagg_decode_prefix_len=0, kv=SimpleNamespace(req_pool_idx=row),
                          disagg_kv_sender=sender)
    if chunk_at is not None:
        SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=False,
                                                           end_idx=chunk_at)
        assert req.start_send_idx == chunk_at
    SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=True)


def handoff(pre: S.Side, dec: S.Side, pe: Engine, de: Engine, port: int, room: int,
            seq_len: int, *, windows: tuple[int, int] = (WINDOW, WINDOW),
            chunk_at: int | None = None) -> tuple[int, int, str | None, Any, Any, Any]:
    """One request of `seq_len` tokens: SGLang allocates it on both sides (prefill row 1,
    decode row 2), the decode sends its metadata, the prefill's ``_send_kv_chunk`` sends.
    The final states, the decode's failure, the decode's KV pages and both SWA index lists."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pe.admit(1, seq_len)
    de.admit(2, seq_len)
    d_kv, d_swa = de.decode_indices(2, seq_len, windows[1])
    addr = f"127.0.0.1:{port}"
    s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
    end = time.monotonic() + 15
    while not dec.kv_manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
    r.init(0)
    r.send_metadata(d_kv, D_AUX, [d_swa], decode_prefix_len=0)
    assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
    assert s.pop_decode_prefix_len() == 0
    s.init(len(d_kv), S_AUX)
    seen: dict[str, Any] = {"kv": [], "calls": 0}
    send = s.send

    def recorded(kv: Any, state: Any = None, **kw: Any) -> None:  # what SGLang hands us
        seen["kv"].append(np.asarray(kv))
        seen["calls"] += 1
        if state is not None:
            seen["swa"] = np.asarray(state[0])
        send(kv, state, **kw)

    s.send = recorded
    prefill_send(pre, pe, s, 1, seq_len, windows[0], chunk_at)
    assert seen["calls"] == (1 if chunk_at is None else 2)
    rs = _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    reason = None
    if rs == KVPoll.Failed:
        try:
            r.failure_exception()
        except Exception as e:  # SGLang's KVTransferError
            reason = str(e)
    ss = _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    return rs, ss, reason, (np.concatenate(seen["kv"]), d_kv), seen["swa"], d_swa


def _sides(bootstrap: Any, *, dec_layers: tuple[tuple[int, ...], tuple[int, ...]] = (
        SWA_LAYERS, FULL_LAYERS)) -> tuple[S.Side, S.Side, Engine, Engine]:
    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(GEMMA_LIKE)
    pp = swa_pool(mc, pages=12, swa_pages=8)
    dp = swa_pool(mc, pages=12, swa_pages=8, swa_layers=dec_layers[0],
                  full_layers=dec_layers[1])
    pre = S.prefill_queue(mc, pp, sa)
    dec = S.decode_queues(mc, dp, sa)
    return pre, dec, Engine(pp), Engine(dp)


@pytest.mark.parametrize(("seq_len", "chunk_at"), [(30, None), (100, None), (100, 48)],
                         ids=["inside-window", "past-window", "past-window-two-chunks"])
def test_swa_pair_built_by_sglangs_queues_hands_off_the_window_byte_exact(
        bootstrap: Any, seq_len: int, chunk_at: int | None) -> None:
    """With two chunks the first streams the full layers' pages only (SGLang gives the
    window's indices with the last chunk) and the window moves with the last."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    pre, dec, pe, de = _sides(bootstrap)
    try:
        for side in (pre, dec):
            args = side.kv_manager.kv_args
            assert list(args.state_types) == [StateType.SWA]  # what SGLang's code gave
            lay = side.kv_manager.built.kv_layout
            assert [r.name for r in lay.regions] == ["k", "v", "swa_k", "swa_v"]
            assert lay.region("swa_k").layer_ids == (0, 1, 2, 3)
            assert lay.region("k").layer_ids == (0, 1)
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
        # the window pool is not sliced by head: another decode TP is refused, naming it
        assert "its pool has state ['swa']" in (pre.kv_manager.tp_refusal(1, 2) or "")
        _fill(pre.pool, pre.metadata, seq_len)
        d_full0, d_swa0 = (list(map(torch.clone, v)) for v in views(dec.pool))
        rs, ss, reason, (p_kv, d_kv), p_swa, d_swa = handoff(
            pre, dec, pe, de, bootstrap.port, 9500 + seq_len, seq_len, chunk_at=chunk_at)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        n_pages = -(-seq_len // PAGE)
        n_win = n_pages - (max(0, seq_len - WINDOW) // PAGE)
        assert len(d_kv) == n_pages and len(d_swa) == len(p_swa) == n_win
        pf, ps = views(pre.pool)
        df, ds = views(dec.pool)
        for a, b in zip(pf, df, strict=True):
            for sp, dp in zip(p_kv, d_kv, strict=True):
                assert torch.equal(a[sp], b[dp]), ("full", sp, dp)
        for i, (a, b) in enumerate(zip(ps, ds, strict=True)):
            for sp, dp in zip(p_swa, d_swa, strict=True):
                assert torch.equal(a[sp], b[dp]), ("swa", i, sp, dp)
            # every window-pool page outside the decode's window: untouched
            for pg in sorted(set(range(b.shape[0])) - {int(x) for x in d_swa}):
                assert torch.equal(b[pg], d_swa0[i][pg]), ("swa untouched", i, pg)
        for i, b in enumerate(df):
            for pg in sorted(set(range(b.shape[0])) - {int(x) for x in d_kv}):
                assert torch.equal(b[pg], d_full0[i][pg]), ("full untouched", i, pg)
        # bytes moved: the full layers' pages and the window's pages, nothing before it
        page_bytes = pf[0].shape[1]
        t = pre.kv_manager.agent.room_timings(9500 + seq_len)
        assert t is not None
        assert int(t["bytes"]) == page_bytes * (2 * 2 * n_pages + 2 * 4 * n_win)
        for a, b in zip(E._aux_tensors(pre.metadata), E._aux_tensors(dec.metadata),
                        strict=True):
            ua, ub = (x.view(torch.uint8).reshape(x.shape[0], -1) for x in (a, b))
            assert torch.equal(ua[S_AUX], ub[D_AUX])
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_swa_pair_with_another_window_layer_set_fails_the_handshake_named(
        bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _sides(bootstrap, dec_layers=((0, 1, 3), (2, 4, 5)))
    try:
        rs, _, reason, *_ = handoff(pre, dec, pe, de, bootstrap.port, 9601, 50)
        assert rs == KVPoll.Failed
        assert reason is not None and "layout mismatch" in reason and "swa_k" in reason, reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_decode_window_of_another_page_count_is_refused_naming_both(bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _sides(bootstrap)
    try:
        rs, ss, reason, *_ = handoff(pre, dec, pe, de, bootstrap.port, 9602, 100,
                                     windows=(WINDOW, 80))
        assert rs == KVPoll.Failed and ss == KVPoll.Failed
        assert reason is not None and "swa: the prefill's window covers 4 pages, the " \
            "decode's [6]" in reason, reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_window_tables_are_the_suffixs_last_pages_and_refuse_what_is_not() -> None:
    from kvhandoff.errors import ConfigError
    from kvhandoff.integrations.sglang.layout import swa_send_table, swa_start_pages

    assert swa_start_pages(7, [9, 4, 5, 1], "w") == 3
    table = swa_send_table(7, [9, 4, 5, 1], 12, "w")
    # the window last, in SGLang's order; the three pages before it distinct and outside it
    assert table[3:].tolist() == [9, 4, 5, 1]
    assert len(set(table.tolist())) == 7 and not {9, 4, 5, 1} & set(table[:3].tolist())
    assert swa_send_table(2, [3, 0], 12, "w").tolist() == [3, 0]
    for bad in (None, [], list(range(8))):
        with pytest.raises(ConfigError, match=r"w: expected 1\.\.7 window pages"):
            swa_start_pages(7, bad, "w")
    with pytest.raises(ConfigError, match="the window pool has 5 pages, too few"):
        swa_send_table(7, [0, 1, 2, 3], 5, "w")
