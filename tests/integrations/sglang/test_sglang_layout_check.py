"""What SGLang does not check but kvhandoff's handshake does: a decode whose pool has another
shape than the prefill's (here one main-KV layer fewer, as with a different checkpoint; page
size and dtype equal, so SGLang's own checks pass) fails the request at the handshake with the
differing field named, instead of copying layers into the wrong places. Both managers run in
this process (real SGLang classes, kvhandoff bootstrap server on 127.0.0.1 port 0, UCX)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import sglang_env as E

pytestmark = pytest.mark.usefixtures("sglang_loaded")


def _until(h: Any, done: Any) -> int:
    end = time.monotonic() + 15
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.002)
    return int(h.poll())


def test_decode_with_another_pool_shape_fails_at_the_handshake(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    kv = lambda cls: get_kv_class(TransferBackend("kvhandoff"), cls)  # noqa: E731
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    pre_pools, dec_pools = E.pools("small"), E.pools("small-5")  # one layer fewer
    dec_args = E.kv_args(dec_pools)
    pre = kv(KVClassType.MANAGER)(E.kv_args(pre_pools), DisaggregationMode.PREFILL, sa, True)
    dec = kv(KVClassType.MANAGER)(dec_args, DisaggregationMode.DECODE, sa, True)
    try:
        addr = f"127.0.0.1:{srv.port}"
        room = 8301
        s = kv(KVClassType.SENDER)(pre, addr, room)
        end = time.monotonic() + 15
        while not dec.try_ensure_parallel_info(addr):  # SGLang's checks: they pass
            assert time.monotonic() < end
            time.sleep(0.05)
        r = kv(KVClassType.RECEIVER)(dec, addr, room)
        r.init(0)
        pages = np.array([1, 2], np.int32)
        r.send_metadata(pages, 0, [pages], decode_prefix_len=0)
        assert _until(r, lambda st: st in (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
        with pytest.raises(Exception, match=r"layout mismatch.*kv\.layer_ids") as e:
            r.failure_exception()
        assert type(e.value).__name__ == "KVTransferError"
        # the prefill was bootstrapped by SGLang's metadata; abort it as SGLang would
        assert _until(s, lambda st: st != KVPoll.Bootstrapping) == KVPoll.WaitingForInput
        s.abort()
    finally:
        dec.close()
        pre.close()
        srv.close()
