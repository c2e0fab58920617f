"""Auth on write routes, body size limit, and bad input -> 4xx with a message (never 5xx)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from kvhandoff.bootstrap_server import BootstrapClient
from kvhandoff.errors import BootstrapUnauthorized
from kvhandoff.kv_layout import preset

Server = Callable[..., str]
GLM = preset("glm-5.3").to_dict()
TOKEN = "s3cret-token"


def native_rank() -> dict[str, object]:
    return {"engine_id": "p", "role": "prefill", "agent_address": "127.0.0.1:7000",
            "generation": "g", "layout": GLM}


SGLANG_PUT = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0,
              "pp_size": 1, "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 7001,
              "page_size": 64, "kv_cache_dtype": "auto"}

WRITES = [
    ("POST", "/v1/ranks", native_rank()),
    ("POST", "/v1/ranks/heartbeat", {"engine_id": "p"}),
    ("POST", "/v1/ranks/deregister", {"engine_id": "p"}),
    ("POST", "/v1/rooms", {"count": 1}),
    ("POST", "/v1/rooms/5/bind", {"engine_id": "p", "dp_rank": 0}),
    ("POST", "/v1/rooms/5/abort", {"reason": "x"}),
    ("PUT", "/route", SGLANG_PUT),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0}),
]


@pytest.mark.parametrize(("method", "path", "body"), WRITES, ids=[w[1] for w in WRITES])
def test_every_write_route_fails_closed_without_the_token(
        bootstrap_server: Server, method: str, path: str, body: dict[str, object]) -> None:
    url = bootstrap_server(auth_token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": "Basic " + TOKEN}):
        r = httpx.request(method, url + path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert "Authorization" in r.json()["detail"]


def test_right_token_passes_and_reads_need_none(bootstrap_server: Server) -> None:
    url = bootstrap_server(auth_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(url + "/v1/ranks", json=native_rank(), headers=auth).status_code == 200
    assert httpx.put(url + "/route", json=SGLANG_PUT, headers=auth).status_code == 200
    assert httpx.get(url + "/ready").status_code == 200
    assert httpx.get(url + "/v1/route?dp_rank=0&engine_id=p").status_code == 200
    with pytest.raises(BootstrapUnauthorized, match="401"):
        BootstrapClient(url, token="nope").allocate_rooms(1)
    assert len(BootstrapClient(url, token=TOKEN).allocate_rooms(2)) == 2


def test_huge_bodies_get_413(bootstrap_server: Server) -> None:
    url = bootstrap_server(max_body_bytes=4096)
    big = {**native_rank(), "generation": "g" * 100, "padding": "x" * 10_000}
    r = httpx.post(url + "/v1/ranks", json=big)
    assert r.status_code == 413 and "4096" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no content-length: the streamed bytes are counted
        yield b'{"engine_id": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(url + "/v1/ranks", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    # under the limit still works
    assert httpx.post(url + "/v1/ranks", json=native_rank()).status_code == 200


@pytest.mark.parametrize(("body", "field"), [
    ({k: v for k, v in native_rank().items() if k != "role"}, "role"),
    ({**native_rank(), "role": "middle"}, "role"),
    ({**native_rank(), "tp_size": "two"}, "tp_size"),
    ({**native_rank(), "tp_rank": 3, "tp_size": 2}, "tp_rank"),
    ({**native_rank(), "agent_address": "nohost"}, "agent_address"),
    ({**native_rank(), "agent_address": "h:99999"}, "agent_address"),
    ({**native_rank(), "dp_size": 4096, "tp_size": 4096}, "dp_size"),
    ({**native_rank(), "engine_id": "a b"}, "engine_id"),
    ({**native_rank(), "tp_sise": 2}, "tp_sise"),
    ({**native_rank(), "layout": []}, "layout"),
    ({**native_rank(), "layout": {"regions": []}}, "layout"),
])
def test_bad_registration_is_4xx_naming_the_field(
        bootstrap_server: Server, body: dict[str, object], field: str) -> None:
    url = bootstrap_server()
    r = httpx.post(url + "/v1/ranks", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.json()["detail"]


def test_broken_json_unknown_routes_and_methods(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = httpx.post(url + "/v1/ranks", content=b'{"engine_id": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["detail"]
    r = httpx.get(url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["detail"] == "no route /v2/nothing"
    r = httpx.delete(url + "/v1/rooms")
    assert r.status_code == 405 and "DELETE" in r.json()["detail"]
    r = httpx.get(url + "/v1/rooms/notanumber")
    assert r.status_code == 422 and "room" in r.json()["detail"]
    r = httpx.get(url + f"/v1/rooms/{2**64}")
    assert r.status_code == 422
    r = httpx.get(url + "/v1/route?tp_size=0")
    assert r.status_code == 422 and "tp_size" in r.json()["detail"]
    r = httpx.post(url + "/v1/rooms", json={"count": 10**9})
    assert r.status_code == 422 and "count" in r.json()["detail"]
    r = httpx.post(url + "/v1/ranks", content=b"\xff\xfe", headers={"content-length": "2",
                                                                   "content-type": "text/x"})
    assert 400 <= r.status_code < 500
