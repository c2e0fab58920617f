"""The native /v1 API over real HTTP: readiness, duplicates, TTL, conflicts, routes, rooms."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvhandoff.bootstrap_server import BootstrapClient
from kvhandoff.errors import (
    BootstrapBadRequest,
    BootstrapConflict,
    BootstrapNotFound,
    BootstrapUnavailable,
)
from kvhandoff.kv_layout import layout_diff, layout_hash, preset
from kvhandoff.testing.clock import FakeClock

GLM = preset("glm-5.3")
LLAMA = preset("llama-3.1-8b")
Server = Callable[..., str]


def rank_body(engine: str = "p", *, tp: int = 0, tp_size: int = 2, dp: int = 0,
              dp_size: int = 1, gen: str = "g1", layout: Any = GLM, role: str = "prefill",
              **extra: Any) -> dict[str, Any]:
    return {"engine_id": engine, "role": role, "dp_rank": dp, "dp_size": dp_size,
            "tp_rank": tp, "tp_size": tp_size, "agent_address": f"127.0.0.1:{6000 + tp}",
            "generation": gen, "layout": layout.to_dict(), "layout_hash": layout_hash(layout),
            "transport": "inproc", **extra}


def register(c: BootstrapClient, engine: str = "p", *, tp: int, tp_size: int,
             gen: str = "g1", **kw: Any) -> None:
    c.register_rank(engine_id=engine, role="prefill", agent_address=f"127.0.0.1:{6000 + tp}",
                    generation=gen, layout=GLM, tp_rank=tp, tp_size=tp_size,
                    transport="inproc", **kw)


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ready_by_unique_rank_and_duplicate_counted_once(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = httpx.get(url + "/ready")
    assert r.status_code == 503 and r.json()["reason"] == "no rank has registered yet"
    assert httpx.post(url + "/v1/ranks", json=rank_body(tp=0)).status_code == 200
    again = httpx.post(url + "/v1/ranks", json=rank_body(tp=0, gen="g2"))
    assert again.status_code == 200 and again.json()["replaced"] is True
    r = httpx.get(url + "/ready")
    assert r.status_code == 503  # two PUTs of tp0 are one rank, tp1 is still missing
    body = r.json()
    assert body["live_ranks"] == 1 and body["expected_ranks"] == 2
    assert body["missing"] == [{"engine_id": "p", "dp_rank": 0, "cp_rank": 0, "tp_rank": 1,
                                "pp_rank": 0}]
    httpx.post(url + "/v1/ranks", json=rank_body(tp=1)).raise_for_status()
    r = httpx.get(url + "/ready")
    assert r.status_code == 200 and r.json()["ready"] is True
    assert metric(url, "kvhandoff_bootstrap_registrations_total") == 2
    assert metric(url, "kvhandoff_bootstrap_re_registrations_total") == 1
    topo = httpx.get(url + "/v1/engines/p").json()
    assert [rk["generation"] for rk in topo["ranks"]] == ["g2", "g1"] and topo["missing"] == []


def test_ttl_expiry_drops_rank_and_heartbeat_answers_404(bootstrap_server: Server) -> None:
    url = bootstrap_server(rank_ttl_s=0.3)
    c = BootstrapClient(url, total_wait_s=0)
    register(c, tp=0, tp_size=1)
    assert c.ready().ready
    deadline = time.monotonic() + 10
    while c.ready().ready:  # wait (bounded) for the condition: the rank is dropped
        assert time.monotonic() < deadline, "rank was never dropped"
        time.sleep(0.05)
    st = c.ready()
    # the engine left with its last rank: nothing is expected of it any more
    assert st.live_ranks == 0 and st.engine_count == 0 and st.expected_ranks == 0
    assert "missed rank_ttl_s" in st.reason
    with pytest.raises(BootstrapNotFound, match="register it again"):
        c.heartbeat(engine_id="p", tp_rank=0, generation="g1")
    register(c, tp=0, tp_size=1)  # what the agent does on that 404
    assert c.heartbeat(engine_id="p", tp_rank=0, generation="g1").rank_ttl_s == 0.3


def test_ttl_with_fake_clock_is_exact(bootstrap_server: Server) -> None:
    clock = FakeClock()
    url = bootstrap_server(rank_ttl_s=30, clock=clock)
    c = BootstrapClient(url, total_wait_s=0)
    register(c, tp=0, tp_size=1)
    clock.advance(29)
    c.heartbeat(engine_id="p", generation="g1")
    clock.advance(29)
    assert c.ready().ready  # 29 s since the heartbeat
    clock.advance(2)
    assert not c.ready().ready
    assert metric(url, "kvhandoff_bootstrap_ranks_expired_total") == 1


def test_conflicting_topology_and_layout_get_409_with_diff(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    httpx.post(url + "/v1/ranks", json=rank_body(tp=0)).raise_for_status()
    r = httpx.post(url + "/v1/ranks", json=rank_body(tp=1, tp_size=4))
    assert r.status_code == 409
    assert r.json()["diff"] == ["tp_size: registered=2 incoming=4"]
    r = httpx.post(url + "/v1/ranks", json=rank_body(tp=1, layout=LLAMA))
    assert r.status_code == 409
    diff = r.json()["diff"]
    assert diff[0].startswith("layout_hash:")
    assert "page_size_tokens: registered=64 incoming=16" in diff
    assert diff[1:] == layout_diff(GLM, LLAMA, names=("registered", "incoming"))
    c = BootstrapClient(url)
    with pytest.raises(BootstrapConflict) as ei:
        register(c, tp=1, tp_size=8)
    assert ei.value.diff == ["tp_size: registered=2 incoming=8"]
    assert str(url) in str(ei.value) and "/v1/ranks" in str(ei.value)


def test_wrong_layout_hash_is_refused_naming_the_field(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = httpx.post(url + "/v1/ranks", json=rank_body(layout_hash="v1:deadbeef"))
    assert r.status_code == 400 and r.json()["detail"].startswith("layout_hash:")
    bad_layout = GLM.to_dict()
    bad_layout["regions"][0]["planes"][0]["bytes_per_token"] = "656"
    r = httpx.post(url + "/v1/ranks", json={**rank_body(), "layout": bad_layout,
                                            "layout_hash": None})
    assert r.status_code == 400 and "bytes_per_token" in r.json()["detail"]


@pytest.mark.parametrize(("decode_tp", "prefill_tp", "replicated", "want"), [
    (2, 2, False, {0: [0], 1: [1]}),
    (4, 2, False, {0: [0], 1: [0], 2: [1], 3: [1]}),
    (1, 4, False, {0: [0, 1, 2, 3]}),
    (2, 4, False, {0: [0, 1], 1: [2, 3]}),
    (2, 4, True, {0: [0], 1: [1]}),
    (4, 2, True, {0: [0], 1: [1], 2: [0], 3: [1]}),
])
def test_route_lookup_tp_mapping(bootstrap_server: Server, decode_tp: int, prefill_tp: int,
                                 replicated: bool, want: dict[int, list[int]]) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=0)
    for tp in range(prefill_tp):
        register(c, tp=tp, tp_size=prefill_tp)
    for d, ranks in want.items():
        got = c.lookup_route(dp_rank=0, tp_rank=d, tp_size=decode_tp, replicated=replicated)
        assert [r.tp_rank for r in got] == ranks
        assert [r.agent_address for r in got] == [f"127.0.0.1:{6000 + p}" for p in ranks]
        assert all(r.layout_hash == layout_hash(GLM) and r.generation == "g1" for r in got)
    assert metric(url, 'kvhandoff_bootstrap_route_lookups_total{api="native",outcome="ok"}') \
        == len(want)


def test_route_lookup_errors(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=0)
    register(c, tp=0, tp_size=2)
    with pytest.raises(BootstrapUnavailable, match="tp1"):  # tp1 not registered yet
        c.lookup_route(dp_rank=0, tp_rank=1, tp_size=2)
    with pytest.raises(BootstrapBadRequest, match="tp_size"):
        c.lookup_route(dp_rank=0, tp_rank=0, tp_size=3)
    with pytest.raises(BootstrapBadRequest, match="dp_rank"):
        c.lookup_route(tp_rank=0, tp_size=2)
    with pytest.raises(BootstrapNotFound, match="engine 'nope'"):
        c.lookup_route(engine_id="nope", dp_rank=0)
    with pytest.raises(BootstrapNotFound, match="room 77"):
        c.lookup_route(room=77)


def test_rooms_allocate_bind_lookup_abort(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=0)
    for tp in range(2):
        register(c, tp=tp, tp_size=2, dp_size=2, dp_rank=1)
    rooms = c.allocate_rooms(64)
    assert len(set(rooms)) == 64 and all(0 < r < 2**63 for r in rooms)
    assert c.room(rooms[0]).state == "allocated"
    assert c.bind_room(rooms[0], "p", 1).state == "bound"
    got = c.lookup_route(room=rooms[0], tp_rank=1, tp_size=2)
    assert [(r.dp_rank, r.tp_rank) for r in got] == [(1, 1)]
    with pytest.raises(BootstrapBadRequest, match="dp_rank"):
        c.bind_room(rooms[1], "p", 2)
    aborted = c.abort_room(rooms[0], "decode out of memory")
    assert aborted.state == "aborted" and aborted.abort_reason == "decode out of memory"
    assert c.room(rooms[0]).abort_reason == "decode out of memory"
    with pytest.raises(BootstrapConflict, match="decode out of memory"):
        c.lookup_route(room=rooms[0], tp_rank=0, tp_size=2)
    assert metric(url, "kvhandoff_bootstrap_rooms_allocated_total") == 64
    assert metric(url, "kvhandoff_bootstrap_rooms_aborted_total") == 1


def test_client_retries_503_until_the_room_is_bound(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=20, backoff_max_s=0.1)
    register(c, tp=0, tp_size=1)
    (room,) = c.allocate_rooms(1)
    unavailable = 'kvhandoff_bootstrap_route_lookups_total{api="native",outcome="unavailable"}'
    bound = threading.Event()

    def bind_after_first_refusal() -> None:
        deadline = time.monotonic() + 15
        while metric(url, unavailable) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        BootstrapClient(url).bind_room(room, "p", 0)
        bound.set()

    t = threading.Thread(target=bind_after_first_refusal)
    t.start()
    got = c.lookup_route(room=room, tp_rank=0, tp_size=1)
    t.join(timeout=20)
    assert bound.is_set() and [r.tp_rank for r in got] == [0]
    assert metric(url, unavailable) >= 1


def test_client_gives_up_on_a_dead_server_within_its_bound() -> None:
    from kvhandoff.bootstrap_server.sockets import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    c = BootstrapClient(f"http://127.0.0.1:{port}", total_wait_s=0.3, backoff_max_s=0.05)
    with pytest.raises(BootstrapUnavailable) as ei:
        c.ready()
    msg = str(ei.value)
    assert f"GET http://127.0.0.1:{port}/ready" in msg and "unreachable" in msg


def test_deregister_and_generation_guard(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=0)
    register(c, tp=0, tp_size=1, gen="new")
    with pytest.raises(BootstrapConflict, match="generation"):
        c.deregister(engine_id="p", generation="old")
    c.deregister(engine_id="p", generation="new")
    with pytest.raises(BootstrapNotFound):
        c.topology("p")
    assert metric(url, "kvhandoff_bootstrap_deregistrations_total") == 1


def test_async_client_round_trip(bootstrap_server: Server) -> None:
    import asyncio

    from kvhandoff.bootstrap_server import AsyncBootstrapClient

    url = bootstrap_server()

    async def main() -> list[int]:
        async with AsyncBootstrapClient(url, total_wait_s=0) as c:
            await c.register_rank(engine_id="p", role="prefill", agent_address="h:1",
                                  generation="g", layout=GLM)
            (room,) = await c.allocate_rooms(1)
            await c.bind_room(room, "p", 0)
            return [r.tp_rank for r in await c.lookup_route(room=room)]

    assert asyncio.run(main()) == [0]


def test_gqa_tp_ranks_with_their_own_heads_form_one_engine(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    c = BootstrapClient(url, total_wait_s=0)
    per_rank = [preset("llama-3.1-8b", tp_size=2, tp_rank=tp) for tp in range(2)]
    assert layout_hash(per_rank[0]) != layout_hash(per_rank[1])  # different heads per rank
    for tp, lay in enumerate(per_rank):
        c.register_rank(engine_id="g", role="prefill", agent_address=f"h:{7000 + tp}",
                        generation="g", layout=lay, tp_rank=tp, tp_size=2)
    got = c.lookup_route(engine_id="g", dp_rank=0, tp_rank=0, tp_size=1)
    assert [r.layout_hash for r in got] == [layout_hash(x) for x in per_rank]
    # a real difference (page size) is still refused
    with pytest.raises(BootstrapConflict, match="page_size_tokens"):
        c.register_rank(engine_id="g", role="prefill", agent_address="h:7001", generation="g",
                        layout=per_rank[1].with_page_size(32), tp_rank=1, tp_size=2)


def test_both_clients_from_settings_carry_the_token(bootstrap_server: Server) -> None:
    import asyncio

    from kvhandoff.bootstrap_server import AsyncBootstrapClient
    from kvhandoff.errors import BootstrapUnauthorized, ConfigError
    from kvhandoff.settings import Settings

    url = bootstrap_server(auth_token="s3cret")
    good = Settings(bootstrap_url=url, auth_token="s3cret")
    sync = BootstrapClient.from_settings(good, total_wait_s=0)
    assert type(sync) is BootstrapClient
    assert len(sync.allocate_rooms(2)) == 2  # a write: refused without the token
    with pytest.raises(BootstrapUnauthorized):
        BootstrapClient.from_settings(Settings(bootstrap_url=url, auth_token=None),
                                      total_wait_s=0).allocate_rooms(1)

    async def main() -> int:
        async with AsyncBootstrapClient.from_settings(good, total_wait_s=0) as c:
            assert type(c) is AsyncBootstrapClient
            return len(await c.allocate_rooms(1))

    assert asyncio.run(main()) == 1
    with pytest.raises(ConfigError, match="bootstrap_url"):
        BootstrapClient.from_settings(Settings(bootstrap_url=None))


def test_a_stopped_client_gives_up_in_its_retries() -> None:
    """A client given a `stop` event (a registration thread's) gives up its retries once it is
    set, saying so, instead of retrying for its whole wait: the thread is joined before the
    client is closed (before: a registration against a dead server outlived its agent's close
    and its next try raised on the closed client)."""
    from kvhandoff.bootstrap_server.sockets import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    stop = threading.Event()
    tried = threading.Event()

    class Seen(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            tried.set()
            return super().handle_request(request)

    c = BootstrapClient(f"http://127.0.0.1:{port}", total_wait_s=3600, stop=stop,
                        transport=Seen())
    got: list[BaseException] = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(BootstrapUnavailable,
                                                                 c.ready).value))
    t.start()
    assert tried.wait(20)
    stop.set()
    t.join(60)
    assert not t.is_alive() and len(got) == 1 and "stopped after" in str(got[0])
    c.close()


def test_the_clients_of_a_process_share_one_tls_context(
        bootstrap_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each httpx client builds a TLS context by default, whatever its URL's scheme (CPU that
    an agent's control loop needs while it starts: 0.6-1 s each when three threads build one
    at once on a loaded host). The bootstrap clients of a process and the route lookups'
    transport share one, built on first use."""
    import asyncio
    import ssl

    import kvhandoff.bootstrap_server.client as client_mod
    from kvhandoff.bootstrap_server import AsyncBootstrapClient

    built: list[ssl.SSLContext] = []
    make = ssl.create_default_context

    def counted(*a: Any, **kw: Any) -> ssl.SSLContext:
        built.append(make(*a, **kw))
        return built[-1]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    monkeypatch.setattr(client_mod, "_tls", None, raising=False)  # a fresh process
    url = bootstrap_server()
    with BootstrapClient(url) as a, BootstrapClient(url) as b:
        assert a.allocate_rooms(1) and b.allocate_rooms(1)

    async def main() -> None:
        async with AsyncBootstrapClient(url) as c:
            assert await c.allocate_rooms(1)

    asyncio.run(main())
    assert len(built) == 1 and client_mod.tls_context() is built[0]
    assert built[0].verify_mode is ssl.CERT_REQUIRED and built[0].check_hostname  # httpx's
