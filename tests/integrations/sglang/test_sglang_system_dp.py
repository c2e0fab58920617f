"""SGLang system DP (``--dp-size 2`` without DP attention): every replica's attention-DP rank is
0, and SGLang's bootstrap server files each prefill rank under its replica's
``system_dp_rank``; a decode looks the prefill up by that rank (``prefill_dp_rank``). The
agents must register under the same key: two prefill replicas (real managers, SGLang's own
registration and bootstrap server, the kvhandoff agents on TCP) are each found by a real decode
manager's route lookup for their DP rank. Before, both agents registered as DP 0: the second
replaced the first, and the lookup for DP 1 failed."""

from __future__ import annotations

from typing import Any

import pytest
import sglang_env as E

pytestmark = pytest.mark.usefixtures("sglang_loaded")


def _manager(mode: str, port: int, dp_rank: int) -> Any:
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.utils import DisaggregationMode

    sa = E.server_args(mode, port)
    # what SGLang's launcher publishes for replica `dp_rank` of --dp-size 2 (no DP attention:
    # attention-DP rank 0 everywhere) and what its scheduler puts in KVArgs
    rc.get_parallel().override_permanently(dp_size=2, dp_rank=dp_rank)
    args = E.kv_args(E.pools())
    args.system_dp_rank = dp_rank
    m = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return E.kv_class("MANAGER")(args, m, sa, True)


@pytest.fixture(autouse=True)
def _replica_stamp() -> Any:
    """`_manager` stamps this process's SGLang parallel context with a replica of --dp-size 2;
    what was stamped before is put back after the test, so later tests in this process do not
    run as replica 1 of 2 (their decode then never found its prefill)."""
    from sglang.srt import runtime_context as rc

    par = rc.get_parallel()
    saved = dict(par._stamp)
    yield
    par.clear_stamp()
    par._stamp.update(saved)


def test_each_replica_is_found_by_its_system_dp_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer
    from kvhandoff.integrations.sglang.conn import ENGINE_KV

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "tcp")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    made: list[Any] = []
    try:
        for k in (0, 1):
            made.append(_manager("prefill", srv.port, k))
        p0, p1 = made
        assert (p0.attn_dp_rank, p1.attn_dp_rank) == (0, 0)  # SGLang's: no DP attention
        # SGLang's own lookup (its receiver's GET /route): one prefill rank per system DP rank
        import httpx

        for k, p in ((0, p0), (1, p1)):
            r = httpx.get(f"http://127.0.0.1:{srv.port}/route", params={
                "prefill_dp_rank": k, "prefill_cp_rank": 0, "target_tp_rank": 0,
                "target_pp_rank": 0}, timeout=5)
            assert r.status_code == 200 and int(r.json()["rank_port"]) == p.rank_port, r.text
        decode = _manager("decode", srv.port, 0)
        made.append(decode)
        addr = f"127.0.0.1:{srv.port}"
        for k, p in ((0, p0), (1, p1)):
            kv, _aux, _tail, _state = decode.route(addr, k, 0, 1)
            assert kv == p.agent.address, (k, kv)
        from kvhandoff.bootstrap_server.client import BootstrapClient

        with BootstrapClient(f"http://{addr}") as c:
            for k, p in ((0, p0), (1, p1)):
                (rank,) = c.lookup_route(engine_id=ENGINE_KV, dp_rank=k, tp_rank=0, tp_size=1)
                assert rank.agent_address == p.agent.address
        assert (p0.dp_group, p1.dp_group, p1.dp_groups) == (0, 1, 2)
    finally:
        for m in reversed(made):
            m.close()
        srv.close()
