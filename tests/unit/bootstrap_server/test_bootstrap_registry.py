"""Registry rules with a fake clock: identities, conflicts, TTL, rooms, routes (no HTTP)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from kvhandoff.bootstrap_server.registry import (
    MAX_ROOMS_PER_CALL,
    RankKey,
    RegistrationRequest,
    Registry,
    RoomAssignment,
    Topology,
)
from kvhandoff.bootstrap_server.schemas import READY_LIST_MAX
from kvhandoff.bootstrap_server.views import ReadyCache, ready_status
from kvhandoff.errors import (
    BootstrapConflict,
    BootstrapNotFound,
    BootstrapUnavailable,
    ConfigError,
)
from kvhandoff.kv_layout import layout_hash, preset
from kvhandoff.state_machine.vocabulary import Role
from kvhandoff.testing.clock import FakeClock

GLM = preset("glm-5.3")
LLAMA = preset("llama-3.1-8b")


def reg(engine: str = "p", *, dp: int = 0, tp: int = 0, cp: int = 0, pp: int = 0,
        topo: Topology = Topology(1, 2), role: Role = Role.PREFILL, gen: str = "g1",
        layout=GLM, expires: bool = True, port: int = 5000) -> RegistrationRequest:
    return RegistrationRequest(
        key=RankKey(engine, dp, cp, tp, pp), role=role, topology=topo,
        agent_address=f"127.0.0.1:{port + tp}", generation=gen,
        layout_hash=layout_hash(layout), layout=layout.to_dict(), transport="inproc",
        expires=expires,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    bits = iter([5, 5, 0, 7, 9, 11, 13, 15, 17, 19])  # a duplicate and a zero to be redrawn
    return Registry(clock=clock, rank_ttl_s=10.0, room_retention_s=100.0,
                    randbits=lambda n: next(bits))


def test_readiness_counts_unique_identities(registry: Registry) -> None:
    registry.register(reg(tp=0))
    _, replaced = registry.register(reg(tp=0, gen="g2"))  # same identity again
    assert replaced
    assert registry.stats.registrations == 1 and registry.stats.re_registrations == 1
    assert registry.missing() == [RankKey("p", 0, 0, 1, 0)]
    registry.register(reg(tp=1))
    assert registry.missing() == []
    assert registry.rank(RankKey("p", 0, 0, 0, 0)).generation == "g2"


def test_topology_conflict_names_each_size(registry: Registry) -> None:
    registry.register(reg(tp=0))
    with pytest.raises(BootstrapConflict) as ei:
        registry.register(reg(tp=1, topo=Topology(2, 4)))
    assert ei.value.diff == ["dp_size: registered=1 incoming=2",
                             "tp_size: registered=2 incoming=4"]
    assert registry.stats.conflicts == 1


def test_layout_conflict_carries_layout_diff(registry: Registry) -> None:
    registry.register(reg(tp=0))
    with pytest.raises(BootstrapConflict) as ei:
        registry.register(reg(tp=1, layout=LLAMA))
    assert ei.value.diff[0].startswith("layout_hash: registered=v1:")
    assert any(line.startswith("kv_dtype: registered=") for line in ei.value.diff)


def test_rank_outside_topology_is_a_config_error(registry: Registry) -> None:
    with pytest.raises(ConfigError, match="tp_rank"):
        registry.register(reg(tp=2))


def test_ttl_drops_rank_and_heartbeat_then_says_not_found(
        registry: Registry, clock: FakeClock) -> None:
    registry.register(reg(tp=0))
    registry.register(reg(tp=1))
    clock.advance(6)
    registry.heartbeat(RankKey("p", 0, 0, 0, 0), "g1")
    clock.advance(6)  # tp1 silent for 12 s > 10 s, tp0 for 6 s
    assert registry.missing() == [RankKey("p", 0, 0, 1, 0)]
    assert registry.stats.ranks_expired == 1
    with pytest.raises(BootstrapNotFound, match="register it again"):
        registry.heartbeat(RankKey("p", 0, 0, 1, 0))


def test_heartbeat_with_other_generation_conflicts(registry: Registry) -> None:
    registry.register(reg(tp=0, gen="new"))
    with pytest.raises(BootstrapConflict, match="generation"):
        registry.heartbeat(RankKey("p", 0, 0, 0, 0), "old")


def test_sglang_style_ranks_do_not_expire(registry: Registry, clock: FakeClock) -> None:
    registry.register(reg(tp=0, expires=False))
    clock.advance(10_000)
    assert registry.rank(RankKey("p", 0, 0, 0, 0)).expires is False


def test_engine_resets_when_no_rank_is_live(registry: Registry, clock: FakeClock) -> None:
    registry.register(reg(tp=0))
    clock.advance(11)
    rec, _ = registry.register(reg(tp=0, topo=Topology(1, 1), layout=LLAMA))
    assert registry.engine("p").topology == Topology(1, 1)
    assert rec.layout_hash == layout_hash(LLAMA)


def test_deregister_last_rank_forgets_engine(registry: Registry) -> None:
    registry.register(reg(tp=0))
    registry.deregister(RankKey("p", 0, 0, 0, 0))
    with pytest.raises(BootstrapNotFound):
        registry.engine("p")
    with pytest.raises(BootstrapNotFound):
        registry.deregister(RankKey("p", 0, 0, 0, 0))


def test_rooms_are_unique_nonzero_and_bounded(registry: Registry) -> None:
    assert registry.allocate_rooms(4) == [5, 7, 9, 11]  # 5 redrawn once, 0 skipped
    with pytest.raises(ConfigError, match="count"):
        registry.allocate_rooms(MAX_ROOMS_PER_CALL + 1)


def test_room_bind_abort_and_retention(registry: Registry, clock: FakeClock) -> None:
    registry.register(reg(tp=0))
    registry.register(reg("q", tp=0))
    (room,) = registry.allocate_rooms(1)
    assert registry.room(room).state is RoomAssignment.ALLOCATED
    registry.bind_room(room, "p", 0)
    registry.bind_room(room, "p", 0)  # idempotent
    with pytest.raises(BootstrapConflict) as ei:
        registry.bind_room(room, "q", 0)
    assert "engine_id: bound='p' incoming='q'" in ei.value.diff
    assert registry.bind_room(room, "q", 0, rebind=True).engine_id == "q"  # SGLang moves it
    rr = registry.abort_room(room, "decode gave up")
    assert rr.state is RoomAssignment.ABORTED and rr.abort_reason == "decode gave up"
    registry.abort_room(room, "second reason")
    assert registry.room(room).abort_reason == "decode gave up"
    with pytest.raises(BootstrapConflict, match="decode gave up"):
        registry.bind_room(room, "p", 0)
    clock.advance(101)
    with pytest.raises(BootstrapNotFound):
        registry.room(room)


def test_bind_checks_engine_and_dp_rank(registry: Registry) -> None:
    registry.register(reg(tp=0))
    with pytest.raises(BootstrapNotFound):
        registry.bind_room(3, "nope", 0)
    with pytest.raises(ConfigError, match="dp_rank"):
        registry.bind_room(3, "p", 1)


def test_route_by_room_waits_for_binding_and_ranks(registry: Registry) -> None:
    registry.register(reg(tp=0))
    (room,) = registry.allocate_rooms(1)
    with pytest.raises(BootstrapUnavailable, match="not bound"):
        registry.route(engine_id=None, room=room, dp_rank=None, tp_rank=0, tp_size=2)
    registry.bind_room(room, "p", 0)
    with pytest.raises(BootstrapUnavailable, match="tp1"):
        registry.route(engine_id=None, room=room, dp_rank=None, tp_rank=1, tp_size=2)
    registry.register(reg(tp=1))
    t = registry.route(engine_id=None, room=room, dp_rank=None, tp_rank=1, tp_size=2)
    assert [r.key.tp_rank for r in t.ranks] == [1]
    assert t.ranks[0].agent_address == "127.0.0.1:5001"


def test_route_needs_engine_when_ambiguous(registry: Registry) -> None:
    registry.register(reg("a", tp=0, topo=Topology(1, 1)))
    registry.register(reg("b", tp=0, topo=Topology(1, 1)))
    with pytest.raises(ConfigError, match="engine_id"):
        registry.route(engine_id=None, room=None, dp_rank=0, tp_rank=0, tp_size=1)
    assert registry.route(engine_id="b", room=None, dp_rank=0, tp_rank=0,
                          tp_size=1).engine_id == "b"


def test_route_fans_out_over_prefill_cp_and_pp(registry: Registry) -> None:
    topo = Topology(1, 1, cp_size=2, pp_size=2)
    for cp in range(2):
        for pp in range(2):
            registry.register(reg(cp=cp, pp=pp, topo=topo))
    t = registry.route(engine_id="p", room=None, dp_rank=0, tp_rank=0, tp_size=1)
    assert [(r.key.cp_rank, r.key.pp_rank) for r in t.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    t = registry.route(engine_id="p", room=None, dp_rank=0, tp_rank=0, tp_size=1,
                       pp_rank=1, pp_size=2)
    assert [(r.key.cp_rank, r.key.pp_rank) for r in t.ranks] == [(0, 1), (1, 1)]


def _sglang_like(tp: int, **attrs: object) -> RegistrationRequest:
    return RegistrationRequest(
        key=RankKey("s", 0, 0, tp, 0), role=Role.PREFILL, topology=Topology(1, 2),
        agent_address=f"127.0.0.1:{7000 + tp}", generation=f"g{tp}", layout_hash="",
        layout={}, transport="sglang",
        attributes={k: v for k, v in attrs.items() if k != "policy"},
        strict_attributes={"decode_allocation_policy": attrs.get("policy", "early")},
        expires=False,
    )


def test_attribute_left_out_is_no_disagreement_and_is_filled_later(registry: Registry) -> None:
    registry.register(_sglang_like(0, page_size=64, prefill_http_port=None))
    # rank 1 leaves page_size out and sends the port the engine lacks: accepted, port filled
    registry.register(_sglang_like(1, page_size=None, prefill_http_port=30000))
    eng = registry.engine("s")
    assert eng.attributes == {"page_size": 64, "prefill_http_port": 30000}
    # a value that differs is still a disagreement
    with pytest.raises(BootstrapConflict) as e:
        registry.register(_sglang_like(1, page_size=32))
    assert e.value.diff == ["page_size: registered=64 incoming=32"]


def test_strict_attribute_compared_exactly(registry: Registry) -> None:
    registry.register(_sglang_like(0))
    with pytest.raises(BootstrapConflict) as e:
        registry.register(_sglang_like(1, policy="late"))
    assert e.value.diff == ["decode_allocation_policy: registered='early' incoming='late'"]
    before = registry.rank_version
    registry.register(_sglang_like(1))
    assert registry.rank_version == before + 1


def test_every_way_of_adding_a_room_respects_the_cap(clock: FakeClock) -> None:
    registry = Registry(clock=clock, rank_ttl_s=10.0, room_retention_s=100.0, max_live_rooms=3)
    registry.register(reg(tp=0))
    registry.bind_room(101, "p", 0)  # a room SGLang's router chose: created by bind
    registry.abort_room(102, "gone")  # an unknown room's abort is recorded
    registry.allocate_rooms(1)
    assert registry.live_room_count() == 3
    for add in (lambda: registry.allocate_rooms(1),
                lambda: registry.bind_room(201, "p", 0),
                lambda: registry.bind_room(202, "sglang", 0, rebind=True),  # register_dp_rank
                lambda: registry.abort_room(203, "x")):
        with pytest.raises(BootstrapUnavailable, match="limit 3"):
            add()
    assert registry.live_room_count() == 3 and registry.stats.rooms_refused == 4
    # rooms already held still change: a bind moves, an abort ends
    registry.bind_room(101, "p", 0)
    assert registry.abort_room(101, "done").state is RoomAssignment.ABORTED
    clock.advance(101)  # forgotten after their retention: room again
    registry.abort_room(203, "x")
    assert registry.live_room_count() == 1


# -- bounds, engine expiry and the kept counts (issue 48) ----------------------------------------

def test_world_size_engines_and_ranks_are_bounded() -> None:
    r = Registry(clock=FakeClock(), rank_ttl_s=30, room_retention_s=60, max_world_size=64,
                 max_engines=2, max_live_ranks=3)
    with pytest.raises(ConfigError, match=r"= 65 exceeds max_world_size=64"):
        r.register(reg("p", topo=Topology(5, 13)))
    r.register(reg("a"))
    r.register(reg("b"))
    with pytest.raises(BootstrapConflict, match="engine_id: 'c'.*max_engines=2"):
        r.register(reg("c"))
    r.register(reg("a", tp=1))
    with pytest.raises(BootstrapConflict, match="max_live_ranks=3"):
        r.register(reg("b", tp=1))
    r.register(reg("a", tp=1, gen="g2"))  # a known identity again is no new rank
    assert r.stats.registrations_refused == 3 and r.engine_count() == 2


def test_engine_is_forgotten_with_its_last_rank_and_counts_follow() -> None:
    clock = FakeClock()
    r = Registry(clock=clock, rank_ttl_s=30, room_retention_s=60)
    r.register(reg("a", topo=Topology(1, 4)))
    r.register(reg("b", topo=Topology(2, 1)))
    r.register(reg("s", topo=Topology(1, 2), expires=False))
    assert (r.expected_count(), r.live_rank_count(), r.missing_count()) == (8, 3, 5)
    clock.advance(31)
    # the mortal engines left with their ranks; the SGLang-style one (no TTL) stays
    assert [e.engine_id for e in r.engines()] == ["s"]
    assert (r.expected_count(), r.missing_count(), r.stats.engines_forgotten) == (2, 1, 2)
    r.register(reg("a", topo=Topology(1, 1)))  # back with another topology: a fresh engine
    assert r.engine("a").topology == Topology(1, 1) and r.missing_count("a") == 0


def test_kept_counts_match_a_recount_through_any_history() -> None:
    import random

    rng = random.Random(48)
    clock = FakeClock()
    r = Registry(clock=clock, rank_ttl_s=10, room_retention_s=60)
    topos = {"a": Topology(2, 2), "b": Topology(1, 4, pp_size=2), "c": Topology(1, 1)}
    for _ in range(2000):
        eid = rng.choice(sorted(topos))
        t = topos[eid]
        key = RankKey(eid, rng.randrange(t.dp_size), 0, rng.randrange(t.tp_size),
                      rng.randrange(t.pp_size))
        op = rng.randrange(4)
        if op == 0:
            clock.advance(rng.choice((0.5, 3, 11)))
        elif op == 1:
            try:
                r.deregister(key)
            except BootstrapNotFound:
                pass
        else:
            base = reg(eid, dp=key.dp_rank, tp=key.tp_rank, pp=key.pp_rank, topo=t)
            r.register(RegistrationRequest(**{**{f: getattr(base, f) for f in (
                "key", "role", "topology", "agent_address", "generation", "layout_hash",
                "layout")}, "transport": rng.choice(("tcp", "inproc"))}))
        live = {e.engine_id: r.ranks_of(e.engine_id) for e in r.engines()}
        assert all(live.values())  # an engine is known only while it has a live rank
        assert r.expected_count() == sum(r.engine(e).topology.world_size for e in live)
        assert r.live_rank_count() == sum(map(len, live.values()))
        assert r.missing_count() == len(r.missing())
        for e, ranks in live.items():
            assert r.transports_of(e) == dict(Counter(x.transport for x in ranks))
        assert r.ranks_page(1, 5) == sorted(
            [x for v in live.values() for x in v], key=lambda x: x.key)[1:6]


def test_ready_walks_no_more_keys_as_ranks_are_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost of /ready, counted in topology keys walked: the same with 1 or 1,000 ranks."""
    walked = [0]
    keys = Topology.keys

    def counting(self: Topology, engine_id: str) -> Iterator[RankKey]:
        for k in keys(self, engine_id):
            walked[0] += 1
            yield k

    monkeypatch.setattr(Topology, "keys", counting)
    r = Registry(clock=FakeClock(), rank_ttl_s=30, room_retention_s=60)
    r.register(reg("big", topo=Topology(1, 1024)))
    ready_status(r, require_rdma=False)
    first = walked[0]
    for tp in range(1, 1000):  # 999 more ranks; tp 1..23 and 1023 stay missing
        r.register(reg("big", tp=1023 - tp, topo=Topology(1, 1024)))
    for i in range(40):
        r.register(reg(f"e{i}", topo=Topology(1, 1)))
    walked[0] = 0
    st = ready_status(r, require_rdma=False)
    assert st.missing_ranks == 24 and len(st.missing) == READY_LIST_MAX
    assert st.engine_count == 41 and len(st.engines) == READY_LIST_MAX
    assert first == walked[0] == READY_LIST_MAX + 1  # tp0 live, then 16 missing
    for tp in (*range(1, 24), 1023):
        r.register(reg("big", tp=tp, topo=Topology(1, 1024)))
    walked[0] = 0
    st = ready_status(r, require_rdma=False)
    assert st.ready and st.live_ranks == 1064 and walked[0] == 0  # complete: nothing walked


def test_ready_cache_follows_every_change_and_only_changes() -> None:
    clock = FakeClock()
    r = Registry(clock=clock, rank_ttl_s=30, room_retention_s=60)
    cache = ReadyCache()
    r.register(reg("a", topo=Topology(1, 2)))
    first = cache.get(r, require_rdma=False)
    clock.advance(20)
    r.heartbeat(RankKey("a", 0, 0, 0, 0))
    assert cache.get(r, require_rdma=False) is first  # a heartbeat changes nothing
    assert cache.get(r, require_rdma=True) is not first
    r.register(reg("a", tp=1, topo=Topology(1, 2)))
    ready = cache.get(r, require_rdma=False)
    assert ready.ready
    clock.advance(15)
    r.heartbeat(RankKey("a", 0, 0, 0, 0))
    assert cache.get(r, require_rdma=False) is ready
    clock.advance(20)  # tp1 expires (35 s silent): the cached "ready" must not survive it
    st = cache.get(r, require_rdma=False)
    assert not st.ready and st.missing_ranks == 1
