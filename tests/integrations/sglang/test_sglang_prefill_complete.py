"""``--disaggregation-decode-allocation-policy prefill_complete`` on the kvhandoff backend: the
real SGLang manager/sender/receiver (both managers in this process, SGLang's pools), driven in
the order SGLang's deferred allocation takes: the prefill computes before the decode allocates
(``mark_prefill_complete``), the decode's ``BOOTSTRAP`` registration and the prefill's
readiness status go through SGLang's own handler, then the decode allocates and sends its
metadata, and the pages hand off byte-exact."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import sglang_pools as P

pytestmark = pytest.mark.usefixtures("sglang_loaded")


def _until(h: Any, done: Any) -> int:
    end = time.monotonic() + 20
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.005)
    return int(h.poll())


def test_prefill_complete_hands_off_after_the_deferred_bootstrap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    # four agents and the test in one process on a loaded 2-core machine: a lenient heartbeat
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL_S", "3")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    with rc.get_disagg().override(disaggregation_decode_allocation_policy="prefill_complete"):
        pre_pools, dec_pools = P.pools("small"), P.pools("small")
        pre = E.kv_class("MANAGER")(P.kv_args(pre_pools), DisaggregationMode.PREFILL, sa, True)
        dec = E.kv_class("MANAGER")(P.kv_args(dec_pools), DisaggregationMode.DECODE, sa, True)
        try:
            assert pre.deferred_bootstrap is not None  # SGLang's deferred allocation is on
            addr, room = f"127.0.0.1:{srv.port}", 8501
            s = E.kv_class("SENDER")(pre, addr, room)
            src = np.array([3, 5], np.int32)
            for layer in range(6):  # the prefill computes before the decode allocated
                pre_pools.target.kv_buffer[layer].view(torch.uint8).view(-1)[
                    3 * 64 * 656:6 * 64 * 656] = layer + 1
            s.mark_prefill_complete()
            end = time.monotonic() + 15
            while not dec.try_ensure_parallel_info(addr):
                assert time.monotonic() < end
                time.sleep(0.05)
            r = E.kv_class("RECEIVER")(dec, addr, room)
            r.init(0)  # SGLang's BOOTSTRAP registration; the prefill answers it is ready
            assert _until(r, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
            dst = np.array([1, 4], np.int32)  # the decode allocates now
            r.send_metadata(dst, 2, [dst], decode_prefix_len=0)
            assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
            s.init(2, 0)
            s.send(src, [src])
            assert _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == \
                KVPoll.Success, r.failure_exception()
            assert _until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
            # SGLang's per-request transfer figures (its kv transfer latency / speed metrics)
            # come from the agent rooms: at least the two main-KV pages of each of 6 layers
            m = s.get_transfer_metric()
            assert m.transfer_latency_s is not None and m.transfer_latency_s > 0
            assert m.transfer_total_bytes is not None
            assert m.transfer_total_bytes >= 2 * 64 * 656 * 6, m
            for layer in range(6):
                got = dec_pools.target.kv_buffer[layer].view(torch.uint8).reshape(-1, 64 * 656)
                want = pre_pools.target.kv_buffer[layer].view(torch.uint8).reshape(-1, 64 * 656)
                assert torch.equal(got[1], want[3]) and torch.equal(got[4], want[5])
                assert int(got[1][0]) == layer + 1
        finally:
            dec.close()
            pre.close()
            srv.close()
    # SGLang's zmq context of each manager ends with it, every cached socket closed (a context
    # left to the garbage collector with open sockets blocks the collecting thread for good)
    for mgr in (pre, dec):
        assert mgr._zmq_ctx.closed
        cached = [*mgr._socket_cache.values(), *mgr._monitor_cache.values()]
        assert all(sock.closed for sock in cached)
    assert pre._socket_cache, "the prefill sent to the decode through SGLang's cached sockets"
