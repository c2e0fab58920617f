"""Work a client's request can make the bootstrap server do on its event loop, bounded per turn
of the loop (issue 48, docs/SECURITY.md "The bootstrap server"): a mass expiry (a registrant's
rooms or ranks all lapsing at once) is dropped EXPIRE_BATCH at a time, one pass per request and
the rest one pass per loop turn between requests; ``POST /query_dp_ranks`` looks its rooms up
QUERY_SLICE at a time, giving the loop back between slices. Real uvicorn on 127.0.0.1 port 0
with a fake clock; the assertions are on what is returned and on counts, never on time. Each
failed on the code before, which dropped everything due in one pass and looked up every room
of a query in one turn."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from test_bootstrap_bounds import metric

from kvhandoff.bootstrap_server.records import RegistrationRequest, Topology
from kvhandoff.bootstrap_server.registry import EXPIRE_BATCH, RankKey, Registry
from kvhandoff.bootstrap_server.routers.sglang import QUERY_SLICE
from kvhandoff.errors import BootstrapNotFound
from kvhandoff.state_machine.vocabulary import Role
from kvhandoff.testing.clock import FakeClock

Server = Callable[..., str]
WAIT_S = 60.0


def wait_for(pred: Callable[[], bool]) -> bool:
    """Polls the server until `pred` holds or WAIT_S passed (each poll is a request)."""
    end = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > end:
            return False
    return True


def test_a_mass_expiry_of_rooms_is_spread_over_loop_turns(bootstrap_server: Server) -> None:
    """20,480 rooms lapse at once: the request that finds them due drops EXPIRE_BATCH, the loop
    drops the rest a batch per turn between requests (so `/health` and `/ready` never wait
    behind the whole of it), and every room is forgotten in the end, none twice."""
    clock = FakeClock()
    url = bootstrap_server(room_retention_s=10, clock=clock)
    with httpx.Client(base_url=url) as c:
        for _ in range(5):
            c.post("/v1/rooms", json={"count": 4096}).raise_for_status()
        assert metric(url, "kvhandoff_bootstrap_rooms_live") == 5 * 4096
        clock.advance(11)
        assert c.get("/health").text == "OK"
        assert c.get("/ready").status_code == 503  # no rank: answered all the same
        assert wait_for(lambda: metric(url, "kvhandoff_bootstrap_rooms_live") == 0)
        assert metric(url, "kvhandoff_bootstrap_rooms_forgotten_total") == 5 * 4096
        assert metric(url, "kvhandoff_bootstrap_expiry_pass_max") == EXPIRE_BATCH


def test_query_dp_ranks_of_65536_rooms_is_answered_in_slices(bootstrap_server: Server) -> None:
    """The largest query SGLang's schema allows (65,536 rooms, 1,027 of them bound): the
    answer names exactly the bound rooms, its lookups ran QUERY_SLICE per loop turn, and one
    room more is refused naming the field."""
    url = bootstrap_server()
    with httpx.Client(base_url=url) as c:
        c.put("/route", json={
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 2, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": 17000, "page_size": 64, "kv_cache_dtype": "auto"}).raise_for_status()
        # more than a slice bound, so the answer is rendered in the thread pool
        bound = {room: room % 2 for room in range(100, 100 + QUERY_SLICE)}
        bound.update({11: 0, 70_000: 1, 123_456_789: 1})
        for room, dp in bound.items():
            c.post("/register_dp_rank",
                   json={"bootstrap_room": room, "dp_rank": dp}).raise_for_status()
        rooms = list(range(1, 65_537))
        rooms[-1], rooms[-2] = 123_456_789, 70_000
        r = c.post("/query_dp_ranks", json={"bootstrap_rooms": rooms})
        assert r.status_code == 200, r.text
        assert r.json() == {str(k): v for k, v in bound.items()}
        assert metric(url, "kvhandoff_bootstrap_query_dp_ranks_slice_max") == QUERY_SLICE
        r = c.post("/query_dp_ranks", json={"bootstrap_rooms": [*rooms, 1]})
        assert r.status_code == 422 and "bootstrap_rooms" in r.text
        assert c.get("/health").text == "OK"


def test_ranks_past_their_ttl_are_never_answered_while_a_backlog_drains() -> None:
    """The registry alone (the server's is the same object): 5 engines of 1,024 ranks lapse at
    once. One call drops EXPIRE_BATCH of them and no more; a rank not dropped yet is not
    answered as live (its heartbeat is told to register again, its registration is a new
    one), and `expire_step` drains the rest one batch per call."""
    clock = FakeClock()
    reg = Registry(clock=clock, rank_ttl_s=30, room_retention_s=30)

    def registration(engine: str, tp: int, gen: str = "g1") -> RegistrationRequest:
        return RegistrationRequest(
            key=RankKey(engine, 0, 0, tp, 0), role=Role.PREFILL,
            topology=Topology(1, 1024, 1, 1), agent_address=f"127.0.0.1:{7000 + tp}",
            generation=gen, layout_hash="h", layout={}, transport="inproc")

    for e in range(5):
        for tp in range(1024):
            reg.register(registration(f"e{e}", tp))
    assert reg.live_rank_count() == 5 * 1024
    clock.advance(31)
    assert reg.engine_count() == 1  # e0..e3 (the oldest 4,096) dropped, with their engines
    assert reg.stats.ranks_expired == EXPIRE_BATCH and reg.expiry_behind
    assert reg.live_rank_count() == 1024  # no second pass until expire_step
    last = RankKey("e4", 0, 0, 1023, 0)  # the newest: dropped last
    with pytest.raises(BootstrapNotFound):
        reg.heartbeat(last, "g1")
    _, replaced = reg.register(registration("e4", 1022, "g2"))
    assert replaced is False
    steps = 0
    while reg.expire_step():
        steps += 1
        assert steps < 5 * 1024
    assert reg.live_rank_count() == 1 and reg.engine_count() == 1
    assert reg.stats.expiry_pass_max == EXPIRE_BATCH
    assert reg.stats.ranks_expired == 5 * 1024  # each once; e4/tp1022 registered anew
