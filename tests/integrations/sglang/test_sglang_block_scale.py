"""MXFP8 block-scaled KV (``StateType.BLOCK_SCALE`` / ``BLOCK_SCALE_SWA``: gpt-oss-like models
served with an MXFP8 KV cache on SGLang) through SGLang's own queues and pools on CPU.

Two families, both SGLang 0.5.23's ``MHATokenToKVPoolMXFP8`` (fp8 e4m3 K/V and, beside them, one
UE8M0 scale per 32 elements; an item of the scale buffers is one KV page's scales):

- **dense**: the MXFP8 pool alone, with a ``PagedTokenToKVPoolAllocator`` (state component
  ``block_scale``: SGLang's ``_full_kv_pages_payload``, the request's pages from token 0);
- **window + full** (gpt-oss-like): ``SWAKVPool`` with MXFP8 sub-pools
  (``token_to_kv_pool_class``) and its ``SWATokenToKVPoolAllocator`` (components ``swa``,
  ``block_scale`` for the full pool's scales, ``block_scale_swa`` for the window pool's: its
  ``_swa_payload``, the window's pages).

SGLang's ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` build the ``KVArgs``
(``setup_state_kv_args`` appends the scale components from ``get_kv_scale_buf_infos``) and the
kvhandoff managers. The prefill's state indices are made by SGLang's own ``_send_kv_chunk``
(prefill.py), the decode's by the calls of its payload functions (decode.py 0.5.23, 1672-1699)
on SGLang's allocator.

What must hold: K/V pages and their scale pages land byte for byte (the window's and the full
layers'), a scale page outside the request (or before the decode's cached prefix) stays
untouched on the decode; a decode without MXFP8 scales fails the handshake naming the region.
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
# head_dim 32: MXFP8 needs a multiple of its 32-element scale block
GPT_OSS_LIKE = dict(S.LLAMA, head_dim=32, num_hidden_layers=4)
SWA_LAYERS, FULL_LAYERS = (0, 2), (1, 3)  # gpt-oss alternates window and full layers


def dense_pool(mc: Any, *, pages: int, mxfp8: bool = True) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolMXFP8

    cls = MHATokenToKVPoolMXFP8 if mxfp8 else MHATokenToKVPool
    return cls(size=pages * PAGE, page_size=PAGE, dtype=torch.float8_e4m3fn,
               head_num=mc.get_num_kv_heads(1), head_dim=mc.head_dim,
               layer_num=mc.num_hidden_layers, device="cpu", enable_memory_saver=False)


def swa_pool(mc: Any, *, pages: int, swa_pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=pages * PAGE, size_swa=swa_pages * PAGE, page_size=PAGE,
                     dtype=torch.float8_e4m3fn, head_num=mc.get_num_kv_heads(1),
                     head_dim=mc.head_dim, swa_attention_layer_ids=list(SWA_LAYERS),
                     full_attention_layer_ids=list(FULL_LAYERS), device="cpu",
                     enable_memory_saver=False, token_to_kv_pool_class=MHATokenToKVPoolMXFP8)


def _u8(t: Any) -> Any:
    """uint8 [pages, bytes] of a K/V buffer (a row per token) or a scale buffer (flat: a row
    per token; one page's scales are ``PAGE`` rows)."""
    import torch

    return t.view(torch.uint8).reshape(t.shape[0] // PAGE, -1)


class Engine:
    """SGLang's allocator and request-to-token table over one side's pool."""

    def __init__(self, pool: Any) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.pool = pool
        self.swa = hasattr(pool, "swa_kv_pool")
        self.alloc = SWATokenToKVPoolAllocator(
            size=pool.size, size_swa=pool.size_swa, page_size=PAGE, dtype=torch.int64,
            device="cpu", kvcache=pool, need_sort=False) if self.swa else \
            PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.int64, "cpu", pool,
                                        need_sort=False)
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

    def decode_indices(self, row: int, seq_len: int, prefix: int, state_types: list[Any]
                       ) -> tuple[Any, list[Any]]:
        """What SGLang's decode sends: its suffix KV pages (decode.py 1639-1656) and each
        state component's indices, by the calls of its ``_swa_payload`` (1672-1684) and
        ``_full_kv_pages_payload`` (1686-1692)."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.mem_cache.common import kv_to_page_indices, page_align_floor

        rt = self.req_to_token.req_to_token
        kv = kv_to_page_indices(self.alloc.translate_kv_indices_for_transfer(
            rt[row][prefix:seq_len]), PAGE)
        start = page_align_floor(max(prefix, seq_len - WINDOW), PAGE)
        state: list[Any] = []
        for st in state_types:
            if st in (StateType.SWA, StateType.BLOCK_SCALE_SWA):
                state.append(kv_to_page_indices(
                    self.alloc.translate_swa_indices_for_transfer(rt[row, start:seq_len]),
                    PAGE))
            else:
                assert st == StateType.BLOCK_SCALE
                state.append(kv_to_page_indices(rt[row, :seq_len], PAGE))
        return kv, state

    def kv_views(self) -> list[Any]:
        """The full (or only) pool's K and V buffers, then their scale buffers."""
        fp = self.pool.full_kv_pool if self.swa else self.pool
        return [_u8(b) for b in (*fp.k_buffer, *fp.v_buffer, *fp.k_scale_buffer,
                                 *fp.v_scale_buffer)]

    def swa_views(self) -> list[Any]:
        sp = self.pool.swa_kv_pool
        return [_u8(b) for b in (*sp.k_buffer, *sp.v_buffer, *sp.k_scale_buffer,
                                 *sp.v_scale_buffer)]


def handoff(pre: S.Side, dec: S.Side, pe: Engine, de: Engine, port: int, room: int,
            seq_len: int, *, prefix: int = 0, chunk_at: int | None = None,
            skew: Any = None) -> tuple[int, int, str | None, dict[str, Any]]:
    """One request: SGLang allocates it on both sides (prefill row 1, decode row 2; the decode
    a request before it, so its pages differ), the decode sends its metadata (with a cached
    prefix of `prefix` tokens), the prefill's ``_send_kv_chunk`` sends from there (with
    `chunk_at`: a first chunk ending there)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    pe.admit(1, seq_len)
    de.admit(0, 3 * PAGE)
    de.admit(2, seq_len)
    types = list(dec.kv_manager.kv_args.state_types)
    d_kv, d_state = de.decode_indices(2, seq_len, prefix, types)
    if skew is not None:  # a decode whose state indices are not SGLang's (`skew` of them)
        d_state = skew(d_state)
    addr = f"127.0.0.1:{port}"
    s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
    end = time.monotonic() + 15
    while not dec.kv_manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
    r.init(0)
    r.send_metadata(d_kv, D_AUX, d_state, decode_prefix_len=prefix)
    if int(r.poll()) == KVPoll.Failed:  # refused on the decode before its metadata went out
        return int(KVPoll.Failed), int(s.poll()), S.failure_text(r), {}
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
                            sliding_window_size=WINDOW, req_to_token_pool=pe.req_to_token,
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


def _fill(views: list[Any], seed: int) -> None:
    import torch

    rng = np.random.default_rng(seed)
    for v in views:
        v.copy_(torch.from_numpy(rng.integers(1, 256, tuple(v.shape), dtype=np.uint8)))


def _check_pages(src: list[Any], dst: list[Any], before: list[Any], p_pages: Any,
                 d_pages: Any, what: str) -> None:
    """Each `p_pages` page of every source buffer equals its `d_pages` page on the decode;
    every other decode page is as it was."""
    import torch

    assert len(p_pages) == len(d_pages)
    for i, (a, b, b0) in enumerate(zip(src, dst, before, strict=True)):
        for sp, dp in zip(p_pages, d_pages, strict=True):
            assert torch.equal(a[int(sp)], b[int(dp)]), (what, i, sp, dp)
        for pg in sorted(set(range(b.shape[0])) - {int(x) for x in d_pages}):
            assert torch.equal(b[pg], b0[pg]), (what, "untouched", i, pg)


def _dense_sides(bootstrap: Any, *, dec_mxfp8: bool = True) -> tuple[S.Side, S.Side, Engine,
                                                                       Engine]:
    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(GPT_OSS_LIKE)
    pp, dp = dense_pool(mc, pages=12), dense_pool(mc, pages=12, mxfp8=dec_mxfp8)
    return (S.prefill_queue(mc, pp, sa, kv_dtype="fp8_e4m3"),
            S.decode_queues(mc, dp, sa, kv_dtype="fp8_e4m3"), Engine(pp), Engine(dp))


@pytest.mark.parametrize(("seq_len", "prefix", "chunk_at"),
                         [(70, 0, None), (70, 32, None), (100, 0, 48)],
                         ids=["whole", "decode-prefix", "two-chunks"])
def test_mxfp8_pool_hands_off_pages_and_block_scales_byte_exact(
        bootstrap: Any, seq_len: int, prefix: int, chunk_at: int | None) -> None:
    """SGLang's ``block_scale`` indices are the request's pages from token 0; the scales of
    the suffix's pages move (with each chunk's pages), the decode's cached prefix keeps its
    own."""
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    pre, dec, pe, de = _dense_sides(bootstrap)
    try:
        for side in (pre, dec):
            assert list(side.kv_manager.kv_args.state_types) == [StateType.BLOCK_SCALE]
            lay = side.kv_manager.built.kv_layout
            assert [r.name for r in lay.regions] == ["k", "v", "k_scale", "v_scale"]
            assert lay.region("k_scale").layer_ids == (0, 1, 2, 3)
            # one UE8M0 scale per 32 elements: 4 KV heads x 32 / 32 = 4 B a token
            assert lay.region("k_scale").bytes_per_token == 4
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
        _fill(pe.kv_views(), seq_len + prefix)
        before = [v.clone() for v in de.kv_views()]
        room = 9800 + seq_len + prefix
        rs, ss, reason, seen = handoff(pre, dec, pe, de, bootstrap.port, room, seq_len,
                                       prefix=prefix, chunk_at=chunk_at)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        n_all = -(-seq_len // PAGE)
        assert len(seen["p_state"][0]) == len(seen["d_state"][0]) == n_all  # from token 0
        assert len(seen["kv"]) == len(seen["d_kv"]) == n_all - prefix // PAGE
        _check_pages(pe.kv_views(), de.kv_views(), before, seen["kv"], seen["d_kv"], "kv")
        # the scale pages moved are SGLang's block_scale indices after the cached prefix
        assert seen["p_state"][0][prefix // PAGE:].tolist() == seen["kv"].tolist()
        t = pre.kv_manager.agent.room_timings(room)
        assert t is not None
        per_page = sum(v.shape[1] for v in pe.kv_views())
        assert int(t["bytes"]) == per_page * len(seen["kv"])
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_decode_without_block_scales_fails_the_handshake_naming_them(bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _dense_sides(bootstrap, dec_mxfp8=False)
    try:
        rs, _, reason, _ = handoff(pre, dec, pe, de, bootstrap.port, 9890, 40)
        assert rs == KVPoll.Failed
        assert reason is not None and "layout mismatch" in reason and "k_scale" in reason, \
            reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_decode_block_scale_pages_not_its_kv_pages_fail_the_request_naming_them(
        bootstrap: Any) -> None:
    """The scales move at the KV pages' indices: a decode whose ``block_scale`` indices end in
    other pages (here: reversed) fails at once, before its metadata goes out or any agent room
    opens, naming the component."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre, dec, pe, de = _dense_sides(bootstrap)
    try:
        rs, _, reason, _ = handoff(pre, dec, pe, de, bootstrap.port, 9891, 40,
                                   skew=lambda st: [np.asarray(st[0])[::-1]])
        assert rs == KVPoll.Failed
        assert reason is not None and "state_indices[0] (block_scale): its pages" in reason \
            and "are not the KV pages" in reason, reason
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


@pytest.mark.parametrize(("seq_len", "chunk_at"), [(30, None), (100, None), (100, 48)],
                         ids=["inside-window", "past-window", "past-window-two-chunks"])
def test_gpt_oss_like_mxfp8_window_pair_hands_off_both_pools_and_scales_byte_exact(
        bootstrap: Any, seq_len: int, chunk_at: int | None) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(GPT_OSS_LIKE)
    pp, dp = swa_pool(mc, pages=16, swa_pages=12), swa_pool(mc, pages=16, swa_pages=12)
    pre = S.prefill_queue(mc, pp, sa, kv_dtype="fp8_e4m3")
    dec = S.decode_queues(mc, dp, sa, kv_dtype="fp8_e4m3")
    pe, de = Engine(pp), Engine(dp)
    try:
        for side in (pre, dec):
            assert list(side.kv_manager.kv_args.state_types) == [
                StateType.SWA, StateType.BLOCK_SCALE, StateType.BLOCK_SCALE_SWA]
            b = side.kv_manager.built
            assert b.paged_regions == ("k", "v", "k_scale", "v_scale")
            assert b.swa_regions == ("swa_k", "swa_v", "swa_k_scale", "swa_v_scale")
            assert b.kv_layout.region("swa_k_scale").layer_ids == (0, 1)
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
        _fill([*pe.kv_views(), *pe.swa_views()], seq_len)
        kv0, swa0 = [v.clone() for v in de.kv_views()], [v.clone() for v in de.swa_views()]
        room = 9900 + seq_len + (chunk_at or 0)
        rs, ss, reason, seen = handoff(pre, dec, pe, de, bootstrap.port, room, seq_len,
                                       chunk_at=chunk_at)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        p_swa, p_scale, p_swa_scale = seen["p_state"]
        d_swa, _, d_swa_scale = seen["d_state"]
        assert p_swa.tolist() == p_swa_scale.tolist() and d_swa.tolist() == \
            d_swa_scale.tolist()
        n_pages = -(-seq_len // PAGE)
        n_win = n_pages - max(0, seq_len - WINDOW) // PAGE
        assert len(p_swa) == len(d_swa) == n_win and len(p_scale) == n_pages
        _check_pages(pe.kv_views(), de.kv_views(), kv0, seen["kv"], seen["d_kv"], "full")
        _check_pages(pe.swa_views(), de.swa_views(), swa0, p_swa, d_swa, "window")
        t = pre.kv_manager.agent.room_timings(room)
        assert t is not None
        full_page = sum(v.shape[1] for v in pe.kv_views())
        win_page = sum(v.shape[1] for v in pe.swa_views())
        assert int(t["bytes"]) == full_page * n_pages + win_page * n_win
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_paged_state_pages_must_be_the_suffixs_kv_pages() -> None:
    from kvhandoff.errors import ConfigError
    from kvhandoff.integrations.sglang.layout import (
        PagedState,
        paged_state_pages,
        swa_scale_pages,
    )

    pages = np.array([7, 3])
    whole = PagedState("block_scale", 2, ("k_scale",), from_token0=True)
    suffix = PagedState("minimax_index_k", 1, ("index_k",), from_token0=False)
    assert paged_state_pages(whole, np.array([1, 2, 7, 3], np.int32), pages).tolist() == [7, 3]
    assert paged_state_pages(suffix, [7, 3], pages).tolist() == [7, 3]
    with pytest.raises(ConfigError, match=r"state_indices\[2\] \(block_scale\): its pages "
                       r"\[2, 7\] are not the KV pages \[7, 3\]"):
        paged_state_pages(whole, [1, 2, 7], pages)
    with pytest.raises(ConfigError, match="expected the request's pages"):
        paged_state_pages(whole, [3], pages)
    with pytest.raises(ConfigError, match=r"minimax_index_k\): expected the request's pages "
                       r"\(the 2 suffix pages\), got 3"):
        paged_state_pages(suffix, [1, 7, 3], pages)
    swa_scale_pages([4, 5], np.array([4, 5]), "w")
    with pytest.raises(ConfigError, match=r"w: expected the window's pages \[4, 5\]"):
        swa_scale_pages([4], [4, 5], "w")


def test_state_types_not_moved_are_refused_at_start_naming_what_is_missing() -> None:
    from kvhandoff.errors import ConfigError
    from kvhandoff.integrations.sglang.layout import state_slots

    assert state_slots(["swa", "block_scale", "block_scale_swa"]) == {
        "swa": 0, "block_scale": 1, "block_scale_swa": 2}
    assert state_slots(["minimax_index_k", "minimax_dense_kv"]) == {
        "minimax_index_k": 0, "minimax_dense_kv": 1}
    assert state_slots(["mamba", "qsa_pending", "qsa_compressed"]) == {
        "mamba": 0, "qsa_pending": 1, "qsa_compressed": 2}
    with pytest.raises(ConfigError, match="'block_scale_swa' without 'swa'"):
        state_slots(["block_scale_swa"])
    for name, missing in (("swa_ring", "DeepSeekV4TokenToKVPool"),
                          ("c128_state", "mla_compression_ratios"),
                          ("request_row", "DeepSeek-V4")):
        with pytest.raises(ConfigError, match=rf"state_types\[1\]: state type '{name}' is not "
                           rf"supported.*{missing}"):
            state_slots(["swa", name])
