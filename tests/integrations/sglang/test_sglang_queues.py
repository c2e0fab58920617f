"""Handoffs whose ``KVArgs`` SGLang's own scheduler code builds, on both sides: SGLang's
``PrefillBootstrapQueue`` and ``DecodePreallocQueue`` (with its ``DecodeTransferQueue``) over
SGLang's pools on CPU construct the kvhandoff managers in their ``_init_kv_manager``
(`sglang_sched`); the test sets no field of ``KVArgs``. A request then goes through SGLang's
sender and receiver of this backend in the order ``prefill.py``/``decode.py`` call them, and
the decode's pages must equal the prefill's, byte for byte.

Dense models (Llama, Qwen, Mistral: ``MHATokenToKVPool``) are the case SGLang's two sides fill
differently: its prefill states the KV head counts, its decode does not."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import sglang_sched as S

pytestmark = pytest.mark.usefixtures("sglang_loaded")

PAGE = 16
S_AUX, D_AUX = 1, 5  # the request's metadata buffer slot on prefill and on decode


def _until(h: Any, done: Any, bound_s: float = 20.0) -> int:
    end = time.monotonic() + bound_s
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.005)
    return int(h.poll())


def _u8(t: Any, rows: int) -> Any:
    import torch

    return t.view(torch.uint8).reshape(rows, -1)


def page_views(side: S.Side) -> list[Any]:
    """uint8 [pages, bytes] views of every main-KV buffer of `side`'s pools (target, draft)."""
    out = []
    for pool in (side.pool, side.draft):
        if pool is None:
            continue
        rows = (pool.size + pool.page_size) // pool.page_size
        bufs = [*pool.k_buffer, *pool.v_buffer] if hasattr(pool, "k_buffer") \
            else list(pool.kv_buffer)
        out += [_u8(b, rows) for b in bufs]
        if hasattr(pool, "index_key_cache"):  # the DSA indexer's live layers
            out += [_u8(b, b.shape[0]) for b in pool.index_key_cache.buffer if b.shape[0]]
    return out


def handoff(pre: S.Side, dec: S.Side, port: int, room: int, src: list[int],
            dst: list[int]) -> tuple[int, int, str | None]:
    """One request through SGLang's sender/receiver of this backend: the prefill's pages `src`
    filled with random bytes, the decode's `dst`; the two final states and the decode's
    failure."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    rng = np.random.default_rng(room)
    import torch

    for v in page_views(pre):
        for p in src:
            v[p] = torch.from_numpy(rng.integers(0, 256, v.shape[1], dtype=np.uint8))
    for t in E._aux_tensors(pre.metadata):  # SGLang's metadata buffers: slot S_AUX
        _u8(t, t.shape[0])[S_AUX] = torch.from_numpy(
            rng.integers(0, 256, _u8(t, t.shape[0]).shape[1], dtype=np.uint8))
    addr = f"127.0.0.1:{port}"
    s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
    end = time.monotonic() + 15
    while not dec.kv_manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
    r.init(0)
    dsa = dec.kv_manager.built.dsa_slot is not None
    r.send_metadata(np.asarray(dst, np.int32), D_AUX, [np.asarray(dst, np.int32)] if dsa
                    else None, decode_prefix_len=0)
    assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
    assert s.pop_decode_prefix_len() == 0
    s.init(len(src), S_AUX)
    s.send(np.asarray(src, np.int32), [np.asarray(src, np.int32)] if dsa else None)
    rs = _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    reason = None
    if rs == KVPoll.Failed:
        try:
            r.failure_exception()
        except Exception as e:  # SGLang's KVTransferError
            reason = str(e)
    ss = _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed))
    return rs, ss, reason


def assert_pages_equal(pre: S.Side, dec: S.Side, src: list[int], dst: list[int]) -> None:
    import torch

    views = list(zip(page_views(pre), page_views(dec), strict=True))
    assert views
    for i, (a, b) in enumerate(views):
        for sp, dp in zip(src, dst, strict=True):
            assert torch.equal(a[sp], b[dp]), (i, sp, dp)
            assert int(a[sp].sum()) > 0
    for a, b in zip(E._aux_tensors(pre.metadata), E._aux_tensors(dec.metadata), strict=True):
        assert torch.equal(_u8(a, a.shape[0])[S_AUX], _u8(b, b.shape[0])[D_AUX])


def test_dense_llama_pair_built_by_sglangs_queues_hands_off_byte_exact(bootstrap: Any) -> None:
    """A Llama-shaped GQA model: SGLang's prefill queue states ``kv_head_num`` 4 of 4, its
    decode queue states none; the pair must still agree and hand off."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)
    pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    try:
        # what SGLang's code gave each side (the reason the identity cannot hold head counts)
        assert pre.kv_manager.kv_args.kv_head_num == 4
        assert not hasattr(dec.kv_manager.kv_args, "kv_head_num")
        assert [r.name for r in dec.kv_manager.built.kv_layout.regions] == ["k", "v"]
        src, dst = [2, 7, 4], [6, 1, 3]
        rs, ss, reason = handoff(pre, dec, bootstrap.port, 9301, src, dst)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        assert_pages_equal(pre, dec, src, dst)
        assert pre.kv_manager.agent.layout_hash == dec.kv_manager.agent.layout_hash
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_a_token_protected_bootstrap_server_takes_sglangs_own_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """KVHANDOFF_AUTH_TOKEN set: the server SGLang starts refuses tokenless writes, and the
    writes SGLang's own code makes (the prefill queue's ``PUT /route`` registration, a
    sender's ``POST /register_dp_rank``) carry the process's token, so the pair hands off. A
    process with another token is refused at start, naming the setting."""
    import httpx
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    from kvhandoff.errors import ConfigError
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL_S", "3")
    monkeypatch.setenv("KVHANDOFF_AUTH_TOKEN", "s3cret-token")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    pre = dec = None
    try:
        # the server enforces the token: SGLang's own (tokenless) registration is refused
        body = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
                "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
                "rank_port": 1, "page_size": PAGE}
        assert httpx.put(f"{srv.url}/route", json=body).status_code == 401
        assert httpx.post(f"{srv.url}/register_dp_rank",
                          json={"bootstrap_room": 1, "dp_rank": 0}).status_code == 401
        sa = E.server_args("prefill", srv.port)
        mc = S.model_config(S.LLAMA)
        pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
        dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
        rs, ss, reason = handoff(pre, dec, srv.port, 9311, [1, 5], [4, 2])
        assert (rs, ss) == (KVPoll.Success, KVPoll.Success), reason
        assert_pages_equal(pre, dec, [1, 5], [4, 2])
        # the per-request write SGLang makes when the decode must look the dp rank up
        s = E.kv_class("SENDER")(pre.kv_manager, f"127.0.0.1:{srv.port}", 9312)
        s._register_prefill_dp_rank()
        r = httpx.post(f"{srv.url}/query_dp_ranks", json={"bootstrap_rooms": [9312]})
        assert r.json() == {"9312": pre.kv_manager.attn_dp_rank}
        # SGLang's own method, on the same sender, is what the server would refuse
        monkeypatch.setenv("KVHANDOFF_AUTH_TOKEN", "another-token")
        s2 = E.kv_class("SENDER")(pre.kv_manager, f"127.0.0.1:{srv.port}", 9313)
        s2._register_prefill_dp_rank()
        assert int(s2.poll()) == KVPoll.Failed
        with pytest.raises(Exception, match="KVHANDOFF_AUTH_TOKEN"):
            s2.failure_exception()
        CommonKVSender._register_prefill_dp_rank(s2)  # tokenless: logged by SGLang, unbound
        assert httpx.post(f"{srv.url}/query_dp_ranks",
                          json={"bootstrap_rooms": [9313]}).json() == {}
        with pytest.raises(ConfigError, match="KVHANDOFF_AUTH_TOKEN.*refused this prefill"):
            S.prefill_queue(mc, S.mha_pool(mc, pages=2, page=PAGE), sa)
    finally:
        for side in (dec, pre):
            if side is not None:
                side.kv_manager.close()
        srv.close()


def _ranks(mc: Any, tp: int, mode: str, sa: Any) -> list[S.Side]:
    """Every attention-TP rank of one side, each built by SGLang's own queue over its own
    ``MHATokenToKVPool`` (the heads ``ModelConfig.get_num_kv_heads(tp)`` gives a rank)."""
    out = []
    for r in range(tp):
        with S.tp_rank(tp, r):
            pool = S.mha_pool(mc, pages=8, page=PAGE, tp_size=tp)
            out.append(S.prefill_queue(mc, pool, sa, rank=r) if mode == "prefill"
                       else S.decode_queues(mc, pool, sa, rank=r))
    return out


def _heads(side: S.Side) -> list[Any]:
    """uint8 [pages, PAGE tokens, heads, head bytes] views of every K then V buffer."""
    n = side.pool.head_num
    return [v.reshape(v.shape[0], PAGE, n, -1) for v in page_views(side)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_dense_pair_of_different_attention_tp_hands_off_each_ranks_heads(
        bootstrap: Any, p_tp: int, d_tp: int) -> None:
    """A Llama-shaped prefill and decode (4 KV heads) of different attention TP sizes, every
    rank built by SGLang's own queue: TP 1 -> 2, the prefill rank feeds both decode ranks, each
    its 2 heads; TP 2 -> 1, the decode rank gathers its 4 heads from both prefill ranks; 2 -> 4
    and 4 -> 2 the same with 1-head ranks on one side; the prefill sends in two chunks. Each
    decode rank's pages hold exactly the prefill's bytes of its heads, token by token; the
    metadata buffers come from the first prefill rank of each decode rank."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)
    pres = _ranks(mc, p_tp, "prefill", sa)
    decs = _ranks(mc, d_tp, "decode", sa)
    try:
        assert [s.pool.head_num for s in pres] == [4 // p_tp] * p_tp
        assert [s.pool.head_num for s in decs] == [4 // d_tp] * d_tp
        addr, room = f"127.0.0.1:{bootstrap.port}", 9302
        src, dsts = [2, 7, 4], [[6, 1, 3], [0, 5, 2], [4, 7, 1], [3, 2, 6]][:d_tp]
        rng = np.random.default_rng(room)
        for pre in pres:
            for v in page_views(pre):
                for sp in src:
                    v[sp] = torch.from_numpy(rng.integers(0, 256, v.shape[1], dtype=np.uint8))
            for t in E._aux_tensors(pre.metadata):
                _u8(t, t.shape[0])[S_AUX] = torch.from_numpy(
                    rng.integers(0, 256, _u8(t, t.shape[0]).shape[1], dtype=np.uint8))
        senders = [E.kv_class("SENDER")(pre.kv_manager, addr, room) for pre in pres]
        receivers = []
        for d, dec in enumerate(decs):
            end = time.monotonic() + 15
            while not dec.kv_manager.try_ensure_parallel_info(addr):
                assert time.monotonic() < end
                time.sleep(0.05)
            r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
            r.init(0)
            r.send_metadata(np.asarray(dsts[d], np.int32), D_AUX, None, decode_prefix_len=0)
            receivers.append(r)
        for s in senders:
            assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
            assert s.pop_decode_prefix_len() == 0
            s.init(len(src), S_AUX)
            # two chunks: the first streams before the last send() (per decode rank's slices)
            s.send(np.asarray(src[:2], np.int32), None)
            s.send(np.asarray(src[2:], np.int32), None)
        for r in receivers:
            rs = _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed))
            assert rs == KVPoll.Success, S.failure_text(r)
        for s in senders:
            assert _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        # rank r of T holds heads [r * 4 / T, (r + 1) * 4 / T)
        for d, dec in enumerate(decs):
            for p, pre in enumerate(pres):
                lo, hi = max(d * 4 // d_tp, p * 4 // p_tp), min((d + 1) * 4 // d_tp,
                                                                (p + 1) * 4 // p_tp)
                if lo >= hi:
                    continue
                for i, (a, b) in enumerate(zip(_heads(pre), _heads(dec), strict=True)):
                    for sp, dp in zip(src, dsts[d], strict=True):
                        want = a[sp, :, lo - p * 4 // p_tp:hi - p * 4 // p_tp]
                        got = b[dp, :, lo - d * 4 // d_tp:hi - d * 4 // d_tp]
                        assert torch.equal(got, want), (d, p, i, sp, dp)
                        assert int(want.sum()) > 0
            first = pres[d * p_tp // d_tp] if p_tp <= d_tp else pres[d * (p_tp // d_tp)]
            for a, b in zip(E._aux_tensors(first.metadata), E._aux_tensors(dec.metadata),
                            strict=True):
                assert torch.equal(_u8(a, a.shape[0])[S_AUX], _u8(b, b.shape[0])[D_AUX])
        # one KV room a prefill rank; only the first of a decode rank's prefill ranks sends
        # the metadata buffers (aux room)
        assert [len(s._handles) for s in senders] == [
            2 if p_tp <= d_tp or p % (p_tp // d_tp) == 0 else 1 for p in range(p_tp)]
    finally:
        for side in (*decs, *pres):
            side.kv_manager.close()


def test_dense_heads_not_divisible_by_the_decode_tp_are_refused_named(bootstrap: Any) -> None:
    """6 KV heads: a prefill of attention TP 2 (3 heads a rank) and a decode of TP 4 (SGLang
    gives each decode rank max(1, 6 // 4) = 1 head) cannot share the heads out evenly; the
    prefill, which SGLang tells the model's KV head count, fails the request naming it and
    both sizes before it opens any agent room, and the decode fails too."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvhandoff.integrations.sglang.layout import hetero_tp_refusal

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(dict(S.LLAMA, num_attention_heads=12, num_key_value_heads=6,
                             hidden_size=192))
    pres = _ranks(mc, 2, "prefill", sa)  # SGLang's bootstrap answers once both registered
    pre = pres[0]
    with S.tp_rank(4, 0):
        dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE, tp_size=4), sa)
    try:
        want = (r"6 KV heads \(total_kv_head_num\) do not split evenly over decode "
                r"attn_tp_size=4 \(prefill attn_tp_size=2, decode attn_tp_size=4\)")
        assert pre.kv_manager.kv_args.total_kv_head_num == 6
        assert pre.kv_manager.tp_refusal(2, 1) is None  # 2 -> 1 shares 6 heads out fine
        # the decode, which SGLang does not tell the head count, cannot tell itself
        assert dec.kv_manager.tp_refusal(2, 4) is None
        assert hetero_tp_refusal(dec.kv_manager.built, 2, 4, total_kv_heads=6) is not None
        # a TP size that does not divide the row's slices: its rows move rank to rank only
        with S.tp_rank(3, 0):
            dec3 = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE, tp_size=3), sa)
        try:
            assert dec3.kv_manager.built.head_slices == 0
            assert "attn_tp=3" in dec3.kv_manager.built.kv_layout.model
            assert re.search(r"\(prefill attn_tp_size=2, decode attn_tp_size=3\).*moves rank "
                             r"to rank only: attn_tp_size=3 does not divide 64",
                             dec3.kv_manager.tp_refusal(2, 3) or "")
            assert dec3.kv_manager.tp_refusal(3, 3) is None
        finally:
            dec3.kv_manager.close()
        addr, room = f"127.0.0.1:{bootstrap.port}", 9303
        s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
        end = time.monotonic() + 15
        while not dec.kv_manager.try_ensure_parallel_info(addr):
            assert time.monotonic() < end
            time.sleep(0.05)
        r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
        r.init(0)
        r.send_metadata(np.asarray([1, 2], np.int32), D_AUX, None, decode_prefix_len=0)
        assert _until(s, lambda st: st == KVPoll.Failed) == KVPoll.Failed
        with pytest.raises(Exception, match=want):
            s.failure_exception()
        # the decode fails too: with the prefill's reason, or, where its agent's handshake
        # with the prefill's ends first, with the slices' sizes that differ
        assert _until(r, lambda st: st == KVPoll.Failed) == KVPoll.Failed
        with pytest.raises(Exception, match=rf"{want}|layout mismatch: k\.planes\[0\]"):
            r.failure_exception()
        assert pre.kv_manager.agent.status()["rooms"] == {}
    finally:
        dec.kv_manager.close()
        for side in pres:
            side.kv_manager.close()


@pytest.mark.parametrize("family", ["mla", "mla-mtp", "dsa", "dsa-mtp"])
def test_mla_and_dsa_pairs_built_by_sglangs_queues_hand_off_byte_exact(
        bootstrap: Any, family: str) -> None:
    """DeepSeek-V3-shaped MLA (``MLATokenToKVPool``), GLM-5-shaped DSA (``DSATokenToKVPool``:
    indexer on layers 0, 2, 5), each also with a one-layer MTP draft pool: both managers built
    by SGLang's queues, every main-KV, draft and live indexer page byte-exact on decode."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    sa = E.server_args("prefill", bootstrap.port)
    if family.startswith("mla"):
        mc = S.model_config(S.DEEPSEEK)

        def pool() -> Any:
            return S.mla_pool(mc, pages=8, page=PAGE)

        def draft() -> Any:
            return S.mla_pool(mc, pages=8, page=PAGE, layers=1) if family == "mla-mtp" \
                else None
        dtype = "bfloat16"
    else:
        mc = S.model_config(S.GLM_DSA)

        def pool() -> Any:
            return S.dsa_pool(mc, pages=4, full=(0, 2, 5))

        def draft() -> Any:
            return S.dsa_pool(mc, pages=4, layers=1) if family == "dsa-mtp" else None
        dtype = "fp8_e4m3"
    pre = S.prefill_queue(mc, pool(), sa, draft=draft(), kv_dtype=dtype)
    dec = S.decode_queues(mc, pool(), sa, draft=draft(), kv_dtype=dtype)
    try:
        names = [r.name for r in dec.kv_manager.built.kv_layout.regions]
        assert names == {"mla": ["kv"], "mla-mtp": ["kv", "draft_kv"],
                         "dsa": ["kv", "indexer"],
                         "dsa-mtp": ["kv", "draft_kv", "indexer", "draft_indexer"]}[family]
        # the layout probe ran on the target pool, draft or not (a bf16 MLA pool's write op
        # runs on a CPU; the DSA pool's is a Triton kernel, see test_sglang_probe.py)
        for side in (pre, dec):
            report = side.kv_manager.probe_report
            if family.startswith("mla"):
                assert report.startswith("layout verified against MLATokenToKVPool"), report
            else:
                assert "DSATokenToKVPool's write kernel did not run" in report, report
        src, dst = [3, 1], [2, 4]
        rs, ss, reason = handoff(pre, dec, bootstrap.port, 9310, src, dst)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        assert_pages_equal(pre, dec, src, dst)
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


class ForwardEvent:
    """Stands for the CUDA event SGLang records on its forward stream for an early send
    (prefill.py:1496-1498, ``torch.cuda.Event`` with ``query()``): complete only once the test
    fires it; counts the polls."""

    def __init__(self) -> None:
        import threading

        self.fired = False
        self.polls = 0
        self.polled_thrice = threading.Event()

    def query(self) -> bool:
        self.polls += 1
        if self.polls >= 3:
            self.polled_thrice.set()
        return self.fired

    def synchronize(self) -> None:  # what SGLang's own backends call; never complete here
        raise AssertionError("the scheduler-side send must not block on the forward")


def test_early_send_of_a_cached_prefix_reads_no_page_before_the_forward_event(
        bootstrap: Any) -> None:
    """SGLang's early send of a cached prefix under overlap scheduling attaches an event
    recorded on the forward stream (``_early_send_wait_event``); the previous step's forward
    may still write those pages. Until the event completes, nothing of them is read: the
    agent polls it, has sent 0 bytes and the decode's pages are untouched; the pages written
    afterwards, then the event, are what lands."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)
    pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    try:
        addr, room = f"127.0.0.1:{bootstrap.port}", 9320
        src, dst = [2, 7, 4], [6, 1, 3]
        s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
        end = time.monotonic() + 15
        while not dec.kv_manager.try_ensure_parallel_info(addr):
            assert time.monotonic() < end
            time.sleep(0.05)
        r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
        r.init(0)
        r.send_metadata(np.asarray(dst, np.int32), D_AUX, None, decode_prefix_len=0)
        assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
        s.init(len(src), S_AUX)
        for v in page_views(pre):
            v[src] = 1  # what the pages held before the forward wrote them
        ev = ForwardEvent()
        s._early_send_wait_event = ev  # as SGLang's maybe_send_cached_prefix_chunk sets it
        s.send(np.asarray(src[:2], np.int32))  # the cached prefix, early
        assert s._early_send_wait_event is None  # taken by this chunk only
        assert ev.polled_thrice.wait(20), "the agent never waited on the forward's event"
        assert s._kv.stats()["bytes"] == 0
        assert all(int(v[dst].sum()) == 0 for v in page_views(dec))
        rng = np.random.default_rng(room)
        for v in page_views(pre):  # the forward's writes land, then its event completes
            for p in src:
                v[p] = torch.from_numpy(rng.integers(0, 256, v.shape[1], dtype=np.uint8))
        ev.fired = True
        s.send(np.asarray(src[2:], np.int32))
        rs = _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed))
        assert rs == KVPoll.Success
        assert _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        assert_pages_equal(pre, dec, src, dst)
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()


def test_decode_abort_keeps_pages_held_by_sglang_until_the_rooms_are_released(
        bootstrap: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's deferred release (``DecodeTransferQueue._defer_release`` /
    ``resolve_deferred_releases``, on by default) asks the backend whether an aborted
    request's pages may go back. Shared-memory lane, one-sided: the decode aborts while the
    prefill has been told to write and has not confirmed it stopped (its control thread is
    held by the test, after the handshake and its chunk's event fired); SGLang keeps holding
    the pages, then frees them once the decode's agent room is released."""
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest

    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "shm")
    if not dist.is_initialized():  # SGLang reduces its hold flags over the TP group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)
    pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    gate = threading.Event()
    holder: threading.Thread | None = None
    try:
        tq = dec.transfer_queue
        freed: list[int] = []
        # the one stand-in: SGLang's release of the request's KV (radix tree + allocator)
        tq._release_request = lambda d: freed.append(d.req.bootstrap_room)
        addr, room = f"127.0.0.1:{bootstrap.port}", 9330
        # a first request: the agents know each other, the decode's buffers are installed
        # for the prefill's one-sided writes (a room that starts before that goes two-sided)
        rs, _, reason = handoff(pre, dec, bootstrap.port, room - 1, [5], [5])
        assert rs == KVPoll.Success, reason
        src, dst = [2, 7, 4], [6, 1, 3]
        s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
        r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
        r.init(0)
        slot = tq.req_to_metadata_buffer_idx_allocator.alloc()
        r.send_metadata(np.asarray(dst, np.int32), slot, None, decode_prefix_len=0)
        assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
        s.init(len(src), S_AUX)
        ev = ForwardEvent()  # the chunk's event: the prefill agent waits for it to write
        s.send(np.asarray(src, np.int32), indices_event=ev)
        assert ev.polled_thrice.wait(20)
        assert _until(r, lambda st: st != KVPoll.WaitingForInput) == KVPoll.Transferring
        assert s._handles[0].stats()["one_sided"]  # the prefill writes into the decode's pages
        entered = threading.Event()

        def hold(_session: Any) -> None:
            entered.set()
            gate.wait(60)

        holder = threading.Thread(target=lambda: pre.kv_manager.agent._loop.query(hold, 90))
        holder.start()
        assert entered.wait(20)  # the prefill agent's control thread is held from here
        ev.fired = True  # the forward is done: the prefill is to write the pages (one-sided)
        r.abort()  # SGLang's AbortReq on the decode
        assert int(r.poll()) == KVPoll.Failed
        # what SGLang's pop_transferred reads to hold the pages instead of freeing them
        assert tq.enable_deferred_kv_release and dec.kv_manager.enable_deferred_decode_kv_release
        assert r.abort_notified
        with pytest.raises(Exception, match="Aborted"):
            r.failure_exception()  # SGLang reads the reason (and clears the receiver) first
        d = DecodeRequest(req=SimpleNamespace(bootstrap_room=room), kv_receiver=r,
                          metadata_buffer_index=slot)
        tq._defer_release(d)
        tq.resolve_deferred_releases()
        # the request's agent rooms: the main KV one and the aux one (a second agent);
        # SGLang may free the pages only once every one of them is released
        handles = dec.kv_manager.room_handles[room]
        assert len(handles) == 2 and not handles[0].released  # the prefill may still write
        assert freed == [] and len(tq._deferred_releases) == 1
        gate.set()  # the prefill runs again, stops writing and says so
        # (waiting on the main room alone raced the aux room's release on a busy host:
        # SGLang then still held the pages)
        assert all(h.wait_released(20) for h in handles)
        tq.resolve_deferred_releases()
        assert freed == [room] and not tq._deferred_releases
        assert room not in dec.kv_manager.room_handles
    finally:
        gate.set()
        if holder is not None:
            holder.join(30)
        dec.kv_manager.close()
        pre.kv_manager.close()


@pytest.mark.parametrize("seen_by", ["sglang_heartbeat", "failed_request"])
def test_a_restarted_prefill_is_found_again_on_its_new_ports(
        bootstrap: Any, monkeypatch: pytest.MonkeyPatch, seen_by: str) -> None:
    """A prefill process restarts: same bootstrap address, new rank socket and agents on new
    ports. The decode forgets what it cached of it, seen either by SGLang's heartbeat checker
    (started by this backend as by SGLang's other backends) or, before any heartbeat missed,
    by a request open with it failing with the peer lost; the next request looks it up again
    and hands off byte-exact."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    if seen_by == "sglang_heartbeat":
        monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")  # SGLang's minimum
        monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "1")
    else:  # SGLang's checker does not look in this test's time; the agents' heartbeats do
        monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "3600")
        monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL_S", "1")
    port = bootstrap.port
    addr = f"127.0.0.1:{port}"
    sa = E.server_args("prefill", port)
    mc = S.model_config(S.LLAMA)
    pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    srv2 = None
    try:
        rs, ss, reason = handoff(pre, dec, port, 9340, [1, 2], [3, 4])
        assert rs == KVPoll.Success, reason
        old_rank_port, old_agent = pre.kv_manager.rank_port, pre.kv_manager.agent.address
        assert addr in dec.kv_manager.prefill_info_table
        if seen_by == "failed_request":  # a request the decode has open with it
            s2 = E.kv_class("SENDER")(pre.kv_manager, addr, 9342)
            r2 = E.kv_class("RECEIVER")(dec.kv_manager, addr, 9342)
            r2.init(0)
            r2.send_metadata(np.asarray([5], np.int32), D_AUX, None, decode_prefix_len=0)
            assert _until(s2, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
        pre.kv_manager.close()  # the prefill process goes away, its bootstrap server too
        bootstrap.close()
        if seen_by == "failed_request":
            assert _until(r2, lambda st: st == KVPoll.Failed) == KVPoll.Failed
            with pytest.raises(Exception, match="silent for"):
                r2.failure_exception()
        end = time.monotonic() + 30
        while addr in dec.kv_manager.prefill_info_table and time.monotonic() < end:
            time.sleep(0.05)
        assert addr not in dec.kv_manager.prefill_info_table, \
            "the decode still holds the dead prefill's connection info"
        assert not [k for k in dec.kv_manager._routes if k[0] == addr]
        srv2 = KVHandoffKVBootstrapServer("127.0.0.1", port)  # it comes back
        pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
        assert pre.kv_manager.rank_port != old_rank_port
        assert pre.kv_manager.agent.address != old_agent
        src, dst = [5, 6], [1, 7]
        rs, ss, reason = handoff(pre, dec, port, 9341, src, dst)
        assert rs == KVPoll.Success, reason
        assert ss == KVPoll.Success
        assert_pages_equal(pre, dec, src, dst)
    finally:
        dec.kv_manager.close()
        pre.kv_manager.close()
        if srv2 is not None:
            srv2.close()


def test_settings_this_backend_cannot_serve_are_refused_at_start(
        bootstrap: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refused when SGLang's queue builds the manager, naming the setting and why:
    ``--disaggregation-ib-device`` (SGLang's ``_init_kv_manager`` puts it in ``KVArgs``),
    ``prefill_complete`` (which SGLang's own argument checks already refuse for any backend
    but Mooncake), metadata buffers in CUDA memory (``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=
    INTRA_NODE_NVLINK``) and ``--enable-hisparse``."""
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.runtime_context import get_disagg
    from sglang.srt.server_args import ServerArgs

    from kvhandoff.errors import ConfigError

    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)

    def pool() -> Any:
        return S.mha_pool(mc, pages=2, page=PAGE)

    with get_disagg().override(disaggregation_ib_device="mlx5_0"), \
            pytest.raises(ConfigError, match=r"--disaggregation-ib-device mlx5_0 \(this backend"):
        S.prefill_queue(mc, pool(), sa)
    pc = ServerArgs(model_path="dummy", host="127.0.0.1", device="cpu",
                    disaggregation_mode="decode", disaggregation_transfer_backend="kvhandoff",
                    disaggregation_bootstrap_port=bootstrap.port,
                    disaggregation_decode_allocation_policy="prefill_complete")
    with pytest.raises(ValueError, match="transfer backends other than Mooncake"):
        handle_pd_disaggregation(pc)  # SGLang's own check
    with get_disagg().override(disaggregation_decode_allocation_policy="prefill_complete"), \
            pytest.raises(ConfigError, match=r"prefill_complete \(only 'early'"):
        S.decode_queues(mc, pool(), sa)
    meta = S.metadata()  # (with the setting, SGLang would allocate them on the GPU)
    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK")
    with pytest.raises(ConfigError, match="INTRA_NODE_NVLINK .it puts SGLang's metadata"):
        S.prefill_queue(mc, pool(), sa, meta=meta)
    monkeypatch.delenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
    hs = ServerArgs(model_path="dummy", host="127.0.0.1", device="cpu",
                    disaggregation_mode="prefill", disaggregation_transfer_backend="kvhandoff",
                    disaggregation_bootstrap_port=bootstrap.port, enable_hisparse=True)
    with pytest.raises(ConfigError, match="--enable-hisparse"):
        S.prefill_queue(mc, pool(), hs)


def test_decode_abort_before_the_prefill_opened_its_room_frees_no_page_a_write_can_reach(
        bootstrap: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/SGLANG.md's former known gap, through SGLang's release path: the decode aborts while
    the prefill still holds its transfer request unopened (the prefill's forward not done, its
    agent's control thread held by the test so the abort is not handled yet), then the prefill
    opens the room and its chunk's event fires, one-sided over the shared-memory lane. SGLang's
    deferred release must keep the decode's pages until no write can land, and no byte may land
    in them once SGLang freed them."""
    import threading
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest

    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "shm")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sa = E.server_args("prefill", bootstrap.port)
    mc = S.model_config(S.LLAMA)
    pre = S.prefill_queue(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    dec = S.decode_queues(mc, S.mha_pool(mc, pages=8, page=PAGE), sa)
    gate = threading.Event()
    holder: threading.Thread | None = None
    try:
        tq = dec.transfer_queue
        freed: list[int] = []
        views = page_views(dec)
        src, dst = [2, 7, 4], [6, 1, 3]
        sentinel = 0xA5

        def release(d: Any) -> None:  # SGLang's release of the request's KV: the pages are
            freed.append(d.req.bootstrap_room)  # free from here, someone else's soon
            for v in views:
                for p in dst:
                    v[p] = sentinel

        tq._release_request = release
        addr, room = f"127.0.0.1:{bootstrap.port}", 9440
        rs, _, reason = handoff(pre, dec, bootstrap.port, room - 1, [5], [5])
        assert rs == KVPoll.Success, reason  # the agents know each other; one-sided from here
        s = E.kv_class("SENDER")(pre.kv_manager, addr, room)
        r = E.kv_class("RECEIVER")(dec.kv_manager, addr, room)
        r.init(0)
        slot = tq.req_to_metadata_buffer_idx_allocator.alloc()
        r.send_metadata(np.asarray(dst, np.int32), slot, None, decode_prefix_len=0)
        assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
        # the decode's request reached the prefill agent before its room exists: SGLang's
        # metadata above came over its own channel; the agent's TransferRequest goes on the
        # decode agent's control thread, and an abort before it went out frees the pages at
        # once (rightly: no write was ever asked for). Wait for it in the prefill agent's
        # store of messages for rooms not opened yet.
        from kvhandoff.protocol.wire import TransferRequest

        def request_held() -> bool:
            held = pre.kv_manager.agent._loop.query(lambda sess: sess._early.held(room), 30)
            return any(isinstance(m, TransferRequest) for m in held)

        end = time.monotonic() + 30
        while not request_held() and time.monotonic() < end:
            time.sleep(0.01)
        assert request_held(), "the decode's TransferRequest never reached the prefill agent"
        entered = threading.Event()

        def hold(_session: Any) -> None:
            entered.set()
            gate.wait(60)

        holder = threading.Thread(target=lambda: pre.kv_manager.agent._loop.query(hold, 90))
        holder.start()
        assert entered.wait(20)  # the prefill agent handles nothing from here
        r.abort()  # SGLang's AbortReq on the decode
        assert int(r.poll()) == KVPoll.Failed
        with pytest.raises(Exception, match="Aborted"):
            r.failure_exception()
        d = DecodeRequest(req=SimpleNamespace(bootstrap_room=room), kv_receiver=r,
                          metadata_buffer_index=slot)
        tq._defer_release(d)
        tq.resolve_deferred_releases()
        handles = dec.kv_manager.room_handles.get(room, [])
        # the KV agent room (the first) is held: its prefill agent, held above, was asked to
        # write and has not said it stopped. The aux slot's room may be released already (the
        # prefill's aux agent, not held, acknowledged the abort of a room it never opened);
        # SGLang frees nothing until every room of the request is.
        assert handles and handles[0]._agent is dec.kv_manager.agent and not handles[0].released, \
            "the decode's pages were released at once"
        assert not dec.kv_manager.is_abort_release_safe(room, 0)
        assert freed == []
        # the prefill's forward ends: the engine opens the room and its chunk's event fires
        # while the abort still waits behind the held control thread
        s.init(len(src), S_AUX)
        ev = ForwardEvent()
        ev.fired = True
        for v in page_views(pre):
            for p in src:
                v[p] = 0x5A
        s.send(np.asarray(src, np.int32), indices_event=ev)
        gate.set()  # the prefill agent runs again
        assert all(h.wait_released(30) for h in handles)
        tq.resolve_deferred_releases()
        assert freed == [room]  # SGLang freed the pages (and the test marked them)
        assert _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
        # the prefill is done with the room: nothing of it may land in the freed pages
        if holder is not None:
            holder.join(30)
        pre.kv_manager.agent._loop.query(lambda _s: None, 30)  # its last events are handled
        for i, v in enumerate(views):
            for p in dst:
                assert bool((v[p] == sentinel).all()), (i, p, torch.unique(v[p])[:4])
    finally:
        gate.set()
        if holder is not None:
            holder.join(30)
        dec.kv_manager.close()
        pre.kv_manager.close()
