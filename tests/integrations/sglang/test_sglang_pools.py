"""GLM-5.3 on the kvhandoff backend from SGLang's own pool objects (issue 22).

The KVArgs come from SGLang 0.5.23's classes on CPU (`sglang_pools`: ``DSATokenToKVPool`` with
its ``IndexKeyCache``, the MTP draft ``DSATokenToKVPool``, ``MetadataBuffers``) filled by
SGLang's own functions (``get_contiguous_buf_infos``, ``setup_state_kv_args`` ->
``IndexKeyCache.state_buf_infos`` / ``get_compress_tail_buf_infos``): all 78 layers listed,
the 57 skip-topk layers as 0-row placeholders (item length 0, data length 0).

- the manager starts (SGLang's ``get_kv_class``) for GLM-5.3, GLM-5.3 + MTP draft and
  ``index_kpool`` 2 with its tail; the layout says what SGLang gave;
- a draft cache on one side only, or another kpool, fails the handshake naming the field;
- two processes hand off byte-exact through the pools, the 0-row layers moving nothing, the
  decode's cached prefix pages untouched, the kpool tail slot by slot between rings.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import sglang_pools as P

GLM = ("glm-5.3", "glm-5.3-mtp", "glm-5.3-kpool2")
pytestmark = pytest.mark.usefixtures("sglang_loaded")


@pytest.mark.parametrize("config", GLM)
def test_manager_starts_on_sglangs_own_glm53_pools(config: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    p = P.pools(config)
    args = P.kv_args(p)
    # what SGLang lists: every layer, the skip-topk ones as 0-row placeholders
    assert len(args.state_item_lens[0]) == 78 + p.config.draft_layers
    assert sum(1 for x in args.state_item_lens[0][:78] if x == 0) == 57
    mgr = E.kv_class("MANAGER")(args, DisaggregationMode.PREFILL, sa, True)
    try:
        lay = mgr.built.kv_layout
        idx = lay.region("indexer")
        assert idx.layer_ids == tuple(range(78)) and idx.live_layer_ids == P.GLM53_FULL
        assert len(idx.empty_layers) == 57
        assert [pl.name for pl in idx.planes] == ["key", "scale"]
        assert idx.tokens_per_row == p.config.kpool
        assert lay.region("kv").num_live_layers == 78
        # nothing of a 0-row layer is a buffer of the agent
        assert sorted(mgr.built.kv_buffers["indexer"]) == list(P.GLM53_FULL)
        # bytes of one page: 78 main-KV items + 21 indexer items (+ the draft's)
        ps = p.config.page
        want = 78 * ps * 656 + 21 * ps // p.config.kpool * 132
        if p.config.draft_layers:
            want += ps * 656 + ps * 132
            d_kv, d_idx = lay.region("draft_kv"), lay.region("draft_indexer")
            assert d_kv.draft and d_idx.draft and d_kv.layer_ids == d_idx.layer_ids == (78,)
        else:
            assert not lay.draft_layer_ids
        assert lay.bytes_per_page == want
        tail = mgr.built.tail_layout
        if p.config.kpool > 1:
            assert tail is not None and [r.name for r in tail.regions] == ["tail_k",
                                                                           "tail_score"]
            assert tail.region("tail_k").live_layer_ids == P.GLM53_FULL
            assert mgr.tail_agent is not None
        else:
            assert tail is None and mgr.tail_agent is None
    finally:
        mgr.close()
        srv.close()


def _until(h: Any, done: Any) -> int:
    end = time.monotonic() + 15
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.002)
    return int(h.poll())


@pytest.mark.parametrize(("prefill", "decode", "field"), [
    ("glm-5.3", "glm-5.3-mtp", r"regions: prefill=\['indexer', 'kv'\] decode=\['draft_indexer',"
                               r" 'draft_kv', 'indexer', 'kv'\]"),
    ("glm-5.3-mtp", "glm-5.3", r"regions: prefill=\['draft_indexer', 'draft_kv'"),
])
def test_draft_cache_on_one_side_fails_the_handshake_named(
        prefill: str, decode: str, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    pre = E.kv_class("MANAGER")(P.kv_args(P.pools(prefill)), DisaggregationMode.PREFILL, sa, True)
    dec = E.kv_class("MANAGER")(P.kv_args(P.pools(decode)), DisaggregationMode.DECODE, sa, True)
    try:
        addr = f"127.0.0.1:{srv.port}"
        s = E.kv_class("SENDER")(pre, addr, 8401)
        end = time.monotonic() + 15
        while not dec.try_ensure_parallel_info(addr):
            assert time.monotonic() < end
            time.sleep(0.05)
        r = E.kv_class("RECEIVER")(dec, addr, 8401)
        r.init(0)
        pages = np.array([1, 2], np.int32)
        r.send_metadata(pages, 0, [pages], decode_prefix_len=0)
        assert _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
        with pytest.raises(Exception, match=rf"layout mismatch.*{field}"):
            r.failure_exception()
        _until(s, lambda st: st != KVPoll.Bootstrapping)
        s.abort()
    finally:
        dec.close()
        pre.close()
        srv.close()


def _pair(config: str, port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    out, logs, rc = E.run_pair(port, KVH_SGLANG_CONFIG=config)
    for role in ("prefill", "decode"):
        assert rc[role] == 0, logs[role][-4000:]
    return out["prefill"], out["decode"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", GLM)
def test_two_processes_hand_off_byte_exact_through_sglangs_pools(
        config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        pre, dec = _pair(config, srv.port)
    finally:
        srv.close()
    c = P.CONFIGS[config]
    page_item = 78 * c.page * 656 + 21 * c.page // c.kpool * 132
    if c.draft_layers:
        page_item += c.page * 656 + c.page * 132
    for name, pages in (("whole", 3), ("cached_prefix", 2)):
        # every live buffer of every moved page byte-exact; the decode's held prefix pages
        # and every ring slot outside the live tail untouched
        assert dec[name]["seen"][-1] == 4, dec[name]  # KVPoll.Success
        assert dec[name]["bad"] == [], dec[name]["bad"][:8]
        # the 57 0-row layers move nothing: the bytes are those of the live items only
        assert pre[name]["page_bytes"] == page_item
        kv_room, *rest = pre[name]["room_bytes"]
        assert kv_room == pages * page_item
        assert dec[name]["tail_slots"] == (1 if c.kpool > 1 else 0)
        if c.kpool > 1:  # one live tail token: one 256 B slot of keys and of scores per layer
            assert rest[1] == 2 * 21 * 256
        else:
            assert len(rest) == 1  # the aux room only
