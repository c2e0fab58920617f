"""The cap on live rooms holds on every route that adds one, over real HTTP: allocate, bind and
abort of a room the server never saw, and SGLang's register_dp_rank all answer 503 once the
server holds ``max_live_rooms``, and the count never passes it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from kvhandoff.kv_layout import preset

Server = Callable[..., str]
CAP = 4
SGLANG_PUT = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0,
              "pp_size": 1, "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 7001,
              "page_size": 64, "kv_cache_dtype": "auto"}


def _rooms_live(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvhandoff_bootstrap_rooms_live "):
            return float(line.split()[1])
    raise AssertionError("no kvhandoff_bootstrap_rooms_live in /metrics")


def _prefill(url: str) -> None:
    r = httpx.post(url + "/v1/ranks", json={
        "engine_id": "p", "role": "prefill", "agent_address": "127.0.0.1:7000",
        "generation": "g", "layout": preset("glm-5.3").to_dict()})
    assert r.status_code == 200, r.text


ROUTES: dict[str, Callable[[str, int], httpx.Response]] = {
    "bind": lambda url, room: httpx.post(f"{url}/v1/rooms/{room}/bind",
                                         json={"engine_id": "p", "dp_rank": 0}),
    "abort": lambda url, room: httpx.post(f"{url}/v1/rooms/{room}/abort", json={"reason": "x"}),
    "register_dp_rank": lambda url, room: httpx.post(
        f"{url}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 0}),
    "allocate": lambda url, room: httpx.post(f"{url}/v1/rooms", json={"count": 1}),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_route_cannot_add_rooms_past_the_cap(bootstrap_server: Server, route: str) -> None:
    url = bootstrap_server(max_live_rooms=CAP)
    _prefill(url)
    assert httpx.put(url + "/route", json=SGLANG_PUT).status_code == 200
    add = ROUTES[route]
    for room in range(1, CAP + 1):
        r = add(url, 1000 + room)
        assert r.status_code == 200, r.text
    for room in range(CAP + 1, 3 * CAP):
        r = add(url, 1000 + room)
        assert r.status_code == 503, (route, room, r.text)
        assert f"limit {CAP}" in r.json()["detail"]
    assert _rooms_live(url) == CAP
    metrics = httpx.get(url + "/metrics").text
    assert f"kvhandoff_bootstrap_rooms_refused_total {2 * CAP - 1}.0" in metrics
