"""A prefill rank's view of SGLang's TP mappings, in this process: the real prefill manager and
sender (SGLang runtime context, kvhandoff bootstrap server on 127.0.0.1 port 0, UCX agents);
decode ranks are stood for by the metadata messages they send (built by the decode-side code,
pushed to the manager's real ZMQ socket).

- decode TP > prefill TP (MLA): `required_dst_info_num` decode ranks read one prefill rank; it
  is bootstrapped only when all of them sent their metadata;
- decode TP < prefill TP (MLA): the prefill ranks that are not the target get dummy metadata;
  they still start their chunks at the decode's prefix and conclude without a transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sglang_env as E
import zmq

pytestmark = pytest.mark.usefixtures("sglang_loaded")


@pytest.fixture
def prefill(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any]]:
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    pools = E.pools()
    mgr = get_kv_class(TransferBackend("kvhandoff"), KVClassType.MANAGER)(
        E.kv_args(pools), DisaggregationMode.PREFILL, sa, True)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{mgr.rank_port}")
    sender_cls = get_kv_class(TransferBackend("kvhandoff"), KVClassType.SENDER)
    try:
        yield mgr, sender_cls, push
    finally:
        push.close()
        ctx.term()
        mgr.close()
        srv.close()


def _meta(mgr: Any, room: int, port: int, *, required: int, dummy: bool, prefix: int,
          pages: int) -> list[bytes]:
    # what KVHandoffKVReceiver.send_metadata sends for one decode rank (SGLang's common
    # receiver calls this builder once per bootstrap info); the decode's endpoint differs
    msg: list[bytes] = mgr.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=required, kv_indices=np.arange(pages),
        aux_index=0, state_indices=None, decode_prefix_len=prefix, is_dummy=dummy)
    from kvhandoff.integrations.sglang.conn import Meta, _enc, _meta_dec

    m = _meta_dec.decode(msg[1])
    return [msg[0], _enc.encode(Meta(**{**{f: getattr(m, f) for f in Meta.__struct_fields__},
                                        "decode_port": port}))]


def _poll_until(s: Any, want: int) -> int:
    end = time.monotonic() + 10
    while int(s.poll()) != want and time.monotonic() < end:
        time.sleep(0.002)
    return int(s.poll())


def test_decode_tp_above_prefill_tp_waits_for_every_decode_rank(prefill: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, sender_cls, push = prefill
    s = sender_cls(mgr, f"127.0.0.1:{mgr.bootstrap_port}", 8101)
    push.send_multipart(_meta(mgr, 8101, 50001, required=2, dummy=False, prefix=16, pages=3))
    push.send_multipart(_meta(mgr, 8102, 50001, required=1, dummy=False, prefix=0, pages=1))
    other = sender_cls(mgr, f"127.0.0.1:{mgr.bootstrap_port}", 8102)
    # the other room's single metadata went through, so the first of 8101's two did too
    assert _poll_until(other, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert int(s.poll()) == KVPoll.Bootstrapping  # one of two decode ranks so far
    push.send_multipart(_meta(mgr, 8101, 50002, required=2, dummy=False, prefix=16, pages=3))
    assert _poll_until(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert s.pop_decode_prefix_len() == 16
    assert sorted(i.dst_port for i in mgr.real_infos(8101)) == [50001, 50002]
    s.abort()
    other.abort()


def test_dummy_prefill_rank_concludes_without_a_transfer(prefill: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, sender_cls, push = prefill
    s = sender_cls(mgr, f"127.0.0.1:{mgr.bootstrap_port}", 8201)
    push.send_multipart(_meta(mgr, 8201, 50003, required=1, dummy=True, prefix=8, pages=2))
    assert _poll_until(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert s.pop_decode_prefix_len() == 8  # same start token as the target rank
    s.init(2, 0)
    s.send(np.array([3], np.int32))
    assert int(s.poll()) == KVPoll.WaitingForInput
    s.send(np.array([4], np.int32), [np.array([3, 4], np.int32)])
    assert int(s.poll()) == KVPoll.Success
    assert mgr.agent.status()["rooms"] == {}  # no agent room was opened
