"""`SglangRoutes`: answers prepared per registry change (no HTTP)."""

from __future__ import annotations

import json

from kvhandoff.bootstrap_server.records import RankKey, RegistrationRequest, Topology
from kvhandoff.bootstrap_server.registry import Registry
from kvhandoff.bootstrap_server.sglang_answers import SGLANG_ENGINE_ID, SglangRoutes
from kvhandoff.state_machine.vocabulary import Role
from kvhandoff.testing.clock import FakeClock

Q = b"prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0"
INFO = b"prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def rank(tp: int, port: int) -> RegistrationRequest:
    return RegistrationRequest(
        key=RankKey(SGLANG_ENGINE_ID, 0, 0, tp, 0), role=Role.PREFILL, topology=Topology(1, 2),
        agent_address=f"127.0.0.1:{port}", generation=f"127.0.0.1:{port}", layout_hash="",
        layout={}, transport="sglang", attributes={"page_size": 64, "kv_cache_dtype": None},
        strict_attributes={"decode_allocation_policy": "early", "dsv41_spec_layout": None},
        expires=False)


def test_answers_are_prepared_once_and_follow_each_registry_change() -> None:
    reg = Registry(clock=FakeClock(), rank_ttl_s=10, room_retention_s=10)
    routes = SglangRoutes(reg)
    first = routes.for_query_string(Q)
    assert first is not None and first.status == 503
    assert first.headers[-1] == (b"retry-after", b"1")
    reg.register(rank(0, 7000))
    reg.register(rank(1, 7001))
    ok = routes.for_query_string(Q)
    assert ok is not None and ok.status == 200 and ok.outcome == "ok"
    assert json.loads(ok.body) == {"rank_ip": "127.0.0.1", "rank_port": 7001}
    assert routes.for_query_string(Q) is ok  # prepared: the same object, not recomputed
    assert routes.answer((0, 0, 1, 0)) is routes.answer((0, 0, 1, 0))
    assert ok.header_lines == b"content-length: %d\r\ncontent-type: application/json\r\n" % len(
        ok.body)
    reg.register(rank(1, 9001))  # re-registration: a new version, a new answer
    moved = routes.for_query_string(Q)
    assert moved is not None and json.loads(moved.body)["rank_port"] == 9001
    info = routes.for_query_string(INFO)
    assert info is not None and json.loads(info.body)["page_size"] == 64
    reg.deregister(RankKey(SGLANG_ENGINE_ID, 0, 0, 1, 0))
    gone = routes.for_query_string(Q)
    assert gone is not None and gone.status == 503 and gone.outcome == "unavailable"


def test_queries_it_does_not_cover_are_left_to_the_fastapi_route() -> None:
    routes = SglangRoutes(Registry(clock=FakeClock(), rank_ttl_s=10, room_retention_s=10))
    assert routes.for_query_string(Q + b"&prefill_dp_rank=0") is None  # repeated
    assert routes.for_query_string(b"prefill_dp_rank=" + b"1" * 40) is None  # too long
    assert routes.for_query_string("prefill_dp_rank=é".encode()) is None  # not ASCII
    bad = routes.for_query_string(b"prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0"
                                  b"&target_pp_rank=0")
    assert bad is not None and bad.status == 400
    assert json.loads(bad.body) == {"error": "ConfigError",
                                    "detail": "prefill_dp_rank: expected an integer, got 'x'"}
