"""SGLang-compatible routes with the payloads SGLang's CommonKVManager/Receiver send."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

Server = Callable[..., str]

# the fields of SGLang 0.5.23's PrefillServerInfo dataclass (the decode does
# PrefillServerInfo(**data)); dsv41_spec_layout and kv_layout only when set
SGLANG_SERVER_INFO_FIELDS = [
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
    "follow_bootstrap_room", "enable_dsa_cache_layer_split", "decode_allocation_policy",
    "enable_kv_cache_sharding", "prefill_http_port",
    "target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
    "required_dst_info_num", "required_prefill_response_num",
]


def put_payload(*, dp: int, tp: int, dp_size: int = 2, tp_size: int = 2, port: int | None = None,
                **over: Any) -> dict[str, Any]:
    """What CommonKVManager.register_to_bootstrap PUTs."""
    body = {
        "attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": dp_size, "attn_dp_rank": dp, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "10.0.0.7",
        "rank_port": port or 17000 + dp * 10 + tp, "page_size": 64,
        "kv_cache_dtype": "fp8_e4m3", "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False, "prefill_http_port": 30000,
    }
    body.update(over)
    return body


def route(url: str, dp: int | str, cp: int | str, tp: int | str, pp: int | str
          ) -> httpx.Response:
    return httpx.get(url + f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
                           f"&target_tp_rank={tp}&target_pp_rank={pp}")


def test_registration_readiness_and_route_answers(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    assert route(url, -1, -1, -1, -1).status_code == 503
    for _ in range(4):  # the same rank four times: SGLang would count 4 and call it ready
        r = httpx.put(url + "/route", json=put_payload(dp=0, tp=0))
        assert r.status_code == 200 and r.text == "OK"
    r = route(url, -1, -1, -1, -1)
    assert r.status_code == 503 and "not fully registered" in r.json()["detail"]
    assert route(url, 0, 0, 0, 0).status_code == 503
    for dp in range(2):
        for tp in range(2):
            httpx.put(url + "/route", json=put_payload(dp=dp, tp=tp)).raise_for_status()
    info = route(url, -1, -1, -1, -1)
    assert info.status_code == 200
    body = info.json()
    assert list(body) == SGLANG_SERVER_INFO_FIELDS
    assert (body["attn_tp_size"], body["dp_size"], body["attn_cp_size"], body["pp_size"]) \
        == (2, 2, 1, 1)
    assert (body["page_size"], body["kv_cache_dtype"], body["follow_bootstrap_room"],
            body["prefill_http_port"]) == (64, "fp8_e4m3", True, 30000)
    r = route(url, 1, 0, 1, 0)
    assert r.status_code == 200 and r.json() == {"rank_ip": "10.0.0.7", "rank_port": 17011}
    assert route(url, 1, 0, 1, 3).status_code == 404
    assert httpx.get(url + "/ready").status_code == 200
    assert httpx.get(url + "/health").text == "OK"


def test_system_dp_ranks_come_from_system_dp(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for sdp in range(2):
        httpx.put(url + "/route", json=put_payload(
            dp=0, tp=0, dp_size=1, tp_size=1, system_dp_size=2, system_dp_rank=sdp,
            port=18000 + sdp)).raise_for_status()
    assert route(url, -1, -1, -1, -1).json()["dp_size"] == 2
    assert route(url, 1, 0, 0, 0).json()["rank_port"] == 18001


def test_inconsistent_registrant_is_refused_with_what_differs(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    httpx.put(url + "/route", json=put_payload(dp=0, tp=0)).raise_for_status()
    r = httpx.put(url + "/route", json=put_payload(dp=0, tp=1, tp_size=4, page_size=32))
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert "tp_size: registered=2 incoming=4" in detail
    assert "page_size: registered=64 incoming=32" in detail


def test_bad_route_queries_are_400_naming_the_input(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = httpx.get(url + "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0")
    assert r.status_code == 400 and "target_pp_rank" in r.json()["detail"]
    r = route(url, "zero", 0, 0, 0)
    assert r.status_code == 400 and "prefill_dp_rank" in r.json()["detail"]
    r = httpx.put(url + "/route", json=put_payload(dp=0, tp=0, attn_tp_rank=5))
    assert r.status_code == 400 and "attn_tp_rank" in r.json()["detail"]


def test_bad_put_bodies_are_4xx_naming_the_field(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = httpx.put(url + "/route", json=put_payload(dp=0, tp=0, rank_port="seventeen"))
    assert r.status_code == 422 and "rank_port" in r.json()["detail"]
    body = put_payload(dp=0, tp=0)
    del body["attn_dp_rank"]
    r = httpx.put(url + "/route", json=body)
    assert r.status_code == 422 and "attn_dp_rank" in r.json()["detail"]
    r = httpx.put(url + "/route", content=b'{"attn_tp_size": 2,',
                  headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "ValidationError"
    r = httpx.post(url + "/route", json=put_payload(dp=0, tp=0))
    assert r.status_code == 405 and "POST" in r.json()["detail"]


def test_register_and_query_dp_ranks(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for dp in range(2):
        for tp in range(2):
            httpx.put(url + "/route", json=put_payload(dp=dp, tp=tp)).raise_for_status()
    r = httpx.post(url + "/register_dp_rank", json={"bootstrap_room": 123456789, "dp_rank": 1})
    assert r.status_code == 200 and r.text == "OK"
    httpx.post(url + "/register_dp_rank", json={"bootstrap_room": 0, "dp_rank": 0}
               ).raise_for_status()
    r = httpx.post(url + "/query_dp_ranks", json={"bootstrap_rooms": [123456789, 0, 42]})
    assert r.status_code == 200 and r.json() == {"123456789": 1, "0": 0}  # 42 is unknown
    r = httpx.post(url + "/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 2})
    assert r.status_code == 400 and "dp_rank" in r.json()["detail"]
    r = httpx.post(url + "/register_dp_rank", json={"bootstrap_room": "x", "dp_rank": 0})
    assert r.status_code == 422 and "bootstrap_room" in r.json()["detail"]
    r = httpx.post(url + "/query_dp_ranks", json={"bootstrap_rooms": "123"})
    assert r.status_code == 422 and "bootstrap_rooms" in r.json()["detail"]
    # the native API sees the same room
    assert httpx.get(url + "/v1/rooms/123456789").json()["dp_rank"] == 1


# only what SGLang 0.5.23's PUT /route handler reads unconditionally
REQUIRED_ONLY = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
                 "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size", "system_dp_rank",
                 "rank_ip", "rank_port", "page_size", "kv_cache_dtype")


def test_rank_with_only_required_fields_is_accepted_beside_a_full_one(
        bootstrap_server: Server) -> None:
    url = bootstrap_server()
    full = put_payload(dp=0, tp=0, dp_size=1)
    httpx.put(url + "/route", json=full).raise_for_status()
    bare = {k: v for k, v in put_payload(dp=0, tp=1, dp_size=1).items() if k in REQUIRED_ONLY}
    r = httpx.put(url + "/route", json=bare)
    assert r.status_code == 200, r.text
    info = route(url, -1, -1, -1, -1).json()
    # the values the full rank sent stay: the bare rank left them out
    assert info["prefill_http_port"] == 30000 and info["follow_bootstrap_room"] is True
    assert route(url, 0, 0, 1, 0).json()["rank_port"] == bare["rank_port"]
    # a value that really differs is still refused, naming the field
    r = httpx.put(url + "/route", json=put_payload(dp=0, tp=1, dp_size=1, prefill_http_port=1))
    assert r.status_code == 400 and "prefill_http_port" in r.json()["detail"]


def test_allocation_policy_and_dsv41_layout_must_agree(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    spec = {"num_draft_tokens": 4, "compression_ratios": [2, 4]}
    first = put_payload(dp=0, tp=0, dp_size=1, decode_allocation_policy="late",
                        dsv41_spec_layout=spec)
    httpx.put(url + "/route", json=first).raise_for_status()
    for over, field in (({"decode_allocation_policy": "early"}, "decode_allocation_policy"),
                        ({"decode_allocation_policy": None}, "decode_allocation_policy"),
                        ({"dsv41_spec_layout": {**spec, "num_draft_tokens": 8}},
                         "dsv41_spec_layout")):
        body = {**first, "attn_tp_rank": 1, "rank_port": 17101, **over}
        if over.get("decode_allocation_policy", "") is None:
            del body["decode_allocation_policy"]  # absent = "early", as SGLang reads it
        r = httpx.put(url + "/route", json=body)
        assert r.status_code == 400 and field in r.json()["detail"], (over, r.text)
    second = {k: v for k, v in first.items() if k != "dsv41_spec_layout"}
    r = httpx.put(url + "/route", json={**second, "attn_tp_rank": 1, "rank_port": 17101})
    assert r.status_code == 400 and "dsv41_spec_layout" in r.json()["detail"]
    httpx.put(url + "/route", json={**first, "attn_tp_rank": 1}).raise_for_status()
    info = route(url, -1, -1, -1, -1).json()
    assert info["decode_allocation_policy"] == "late" and info["dsv41_spec_layout"] == spec
    assert info["enable_kv_cache_sharding"] is False and "kv_layout" not in info


def test_string_kv_layout_and_sharding_reach_the_server_info(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for tp in range(2):
        httpx.put(url + "/route", json=put_payload(
            dp=0, tp=tp, dp_size=1, kv_layout="NHD", enable_kv_cache_sharding=True,
        )).raise_for_status()
    info = route(url, -1, -1, -1, -1).json()
    assert info["kv_layout"] == "NHD" and info["enable_kv_cache_sharding"] is True
    assert list(info) == [*SGLANG_SERVER_INFO_FIELDS[:8], "kv_layout",
                          *SGLANG_SERVER_INFO_FIELDS[8:]]
