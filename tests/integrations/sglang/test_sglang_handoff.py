"""A real SGLang 1P1D pair on the kvhandoff backend: two processes (sglang_worker.py), the
prefill's manager/sender and the decode's manager/receiver built by SGLang's get_kv_class from
KVArgs over CPU tensors shaped like GLM-5.3 (main KV + DSA indexer + metadata buffers), driven
in SGLang's call order, with kvhandoff's bootstrap server class on 127.0.0.1 port 0, UCX.

Rooms: several chunks; a cached prefix on decode (suffix-only, held pages untouched); an abort
by decode; an abort by prefill; a prefill process that dies between two chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
import sglang_env as E

Failed, Bootstrapping, WaitingForInput, Transferring, Success = range(5)  # SGLang's KVPoll


def _run_pair(port: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    out, logs, rc = E.run_pair(port, KVHANDOFF_HEARTBEAT_INTERVAL_S="0.2",
                               KVHANDOFF_LEASE_S="0.5")
    assert rc["decode"] == 0, logs["decode"][-4000:]
    assert "prefill_dies" in out["prefill"], logs["prefill"][-4000:]
    return out["prefill"], out["decode"], rc["prefill"]


def _monotonic_to(seen: list[int], final: int) -> None:
    """SGLang's order: states only move forward, and end at `final`."""
    assert seen[-1] == final, seen
    body = seen[:-1] if final == Failed else seen
    assert body == sorted(body) and set(body) <= {Bootstrapping, WaitingForInput, Transferring,
                                                  Success}, seen


@pytest.mark.timeout(300)
def test_sglang_pair_over_kvhandoff(sglang_loaded: None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        pre, dec, prefill_rc = _run_pair(srv.port)
    finally:
        srv.close()
    assert pre["ready"]["manager"] == dec["ready"]["manager"] == "KVHandoffKVManager"
    page_bytes = E.MAIN_LAYERS * E.PAGE * E.MAIN_BPT + E.INDEXER_LAYERS * E.PAGE * E.INDEXER_BPT

    # three chunks, whole sequence: byte-exact in every layer of main KV, indexer and aux;
    # the prefill's "forward" before its first chunk outlasts the agents' lease setting
    _monotonic_to(pre["chunks"]["seen"], Success)
    _monotonic_to(dec["chunks"]["seen"], Success)
    assert Transferring in dec["chunks"]["seen"]
    assert dec["chunks"]["bad"] == [] and dec["chunks"]["pages_checked"] == 5
    # the KV room moved main KV and indexer; SGLang's transfer metric counts every room of
    # the request (KV and aux), as the agents' room timings do
    assert pre["chunks"]["room_bytes"][0] == 5 * page_bytes
    assert pre["chunks"]["bytes"] == sum(pre["chunks"]["room_bytes"])
    # chunked prefill streams: the main KV of the first two chunks (4 pages) had moved before
    # the last chunk's send() (the indexer and aux go with the last one)
    assert pre["streamed"]["want"] == 4 * E.MAIN_LAYERS * E.PAGE * E.MAIN_BPT
    assert pre["streamed"]["got"] == pre["streamed"]["want"]

    # decode holds 16 tokens (2 pages): only the 6 suffix pages move, main KV and indexer;
    # the held pages keep their content (checked byte by byte on decode)
    _monotonic_to(dec["cached_prefix"]["seen"], Success)
    assert dec["cached_prefix"]["bad"] == []
    assert pre["cached_prefix"]["room_bytes"][0] == 6 * page_bytes
    assert pre["cached_prefix"]["bytes"] == sum(pre["cached_prefix"]["room_bytes"])

    # decode aborts after its metadata: both sides Failed, with the reason
    _monotonic_to(dec["decode_abort"]["seen"], Failed)
    _monotonic_to(pre["decode_abort"]["seen"], Failed)
    assert "Aborted by AbortReq" in dec["decode_abort"]["failure"]
    assert "KVTransferError" in pre["decode_abort"]["failure"]
    assert "Aborted by the decode" in pre["decode_abort"]["failure"]

    # prefill aborts before its first chunk: decode learns it, with prefill's reason
    _monotonic_to(pre["prefill_abort"]["seen"], Failed)
    _monotonic_to(dec["prefill_abort"]["seen"], Failed)
    assert "Aborted by AbortReq on the prefill" in dec["prefill_abort"]["failure"]

    # the prefill process dies between two chunks: decode fails (peer lost), not hangs
    assert pre["prefill_dies"]["dying"] and prefill_rc == 3
    _monotonic_to(dec["prefill_dies"]["seen"], Failed)
    assert "KVTransferError" in dec["prefill_dies"]["failure"]
    assert "silent" in dec["prefill_dies"]["failure"]
    # the dead prefill's agent addresses are forgotten: the next request looks them up again
    assert dec["chunks"]["routes_cached"] == 1 and dec["prefill_dies"]["routes_cached"] == 0
