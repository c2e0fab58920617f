"""Two-process loopback handoff (issue 4): a real bootstrap server in the test process, a
simulated prefill engine and a simulated decode engine as real processes (`kvhandoff.engine_sim`),
on 127.0.0.1 with ports 0, over every real transport. The happy path and the layout mismatch run
over IPv6 loopback too: bootstrap server, agents' control sockets and data addresses on
``[::1]`` (skipped, saying why, where the machine has no ``::1``).

GLM-5.3 layout, a few thousand tokens with a cached prefix, source and destination pages in
random order (each side's PagePool is shuffled with its own seed). The decode process checks
every landed byte against the deterministic pattern and that its cached-prefix indexer pages
kept their marker. Every wait is bounded (`expect(..., timeout)`); nothing sleeps to
synchronise.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from ipv6_loopback import needs_ipv6_loopback

from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.engine_sim.process import EngineProcess, spawn

TRANSPORTS = ["ucx", "tcp", "shm", "auto",
              pytest.param("nixl", marks=pytest.mark.skipif(
                  importlib.util.find_spec("nixl_cu12") is None,
                  reason="nixl_cu12 is not installed (the nixl extra)"))]
START_S = 60.0  # process start (imports torch, ucxx) on a loaded 2-core machine
DONE_S = 60.0
PAGE = 64
SEQ = 3000  # 47 pages, the last one partial
PREFIX = 1000  # page-aligned down to 960: 15 cached indexer pages
HB_S = 1.0  # the dead-prefill test's heartbeat: found dead by 2 beats of silence (at 0.5 s a
# loaded host's own pauses lost the live decode before the kill); nixl's write quarantine is
# then stall_timeout_s + 2 beats = 4 s, within the engine's 5 s wait for the release
# Elsewhere a calmer heartbeat: these tests are not about peer death, and on 2 loaded cores
# one engine process can go seconds without running its control loop while its peer runs (the
# peer then rightly gives it up: "peer [::1]:36953 silent for 5.61s (> 2 heartbeats of 2s)",
# the GLM handoff over ::1 beside a busy loop per core and the rest of the suite). Where both
# stall together the woken agent asks its peer first and the rooms go on; a stall of one
# side alone is a loss by the rule, so the heartbeat here is longer than the stalls seen.
CALM_HB_S = 4.0
# the loopback address both engines and the bootstrap server use (`handoff` is parametrized
# with it indirectly; 127.0.0.1 where a test is not)
FAMILIES = ["127.0.0.1", pytest.param("::1", marks=needs_ipv6_loopback, id="ipv6")]
# the failure paths over ::1 go under `long` (make test's time): they share the happy path's
# addressing, and the mismatch fails at the handshake, after every address was used once
FAMILIES_LONG = ["127.0.0.1", pytest.param("::1", marks=[needs_ipv6_loopback, pytest.mark.long],
                                           id="ipv6")]
# the mismatch is refused at the Hello, before any lane connects (a refused Hello emits no
# Connect; both sides only compare the transport's name), the same on every transport: the
# default one (auto) in make test, the others under `long` (each is two engine processes)
MISMATCH_TRANSPORTS = [
    t if t == "auto" else pytest.param(*getattr(t, "values", (t,)),
                                       marks=[*getattr(t, "marks", ()), pytest.mark.long])
    for t in TRANSPORTS]


@dataclass
class Handoff:
    url: str
    client: BootstrapClient
    stack: ExitStack
    host: str  # agent_host of both engines

    def rooms(self, n: int) -> list[int]:
        return self.client.allocate_rooms(n)

    def start(self, rooms: list[dict[str, Any]], settings: dict[str, Any], *,
              decode_settings: dict[str, Any] | None = None, prefill_cfg: dict[str, Any] | None
              = None, decode_cfg: dict[str, Any] | None = None
              ) -> tuple[EngineProcess, EngineProcess]:
        """Starts both engines at once (the decode's route lookup retries until the room is
        bound), waits until the prefill registered, then binds the rooms to it."""
        settings = {"agent_host": self.host, **settings}
        p = self.stack.enter_context(spawn("prefill", {
            "rooms": [{"room": r["room"], "seq_len": r["seq_len"]} for r in rooms],
            "settings": {"bootstrap_url": self.url, **settings}, "engine_id": "p",
            "timeout_s": DONE_S, **(prefill_cfg or {})},
            module="kvhandoff.testing.faults" if "faults" in (prefill_cfg or {}) else
            "kvhandoff.engine_sim"))
        # a decode with faults runs under kvhandoff.testing.faults (the sim, faults added)
        faulty = "faults" in (decode_cfg or {})
        d = self.stack.enter_context(spawn("decode", {
            "rooms": rooms, "settings": {**settings, **(decode_settings or {})},
            "bootstrap_url": self.url, "timeout_s": DONE_S, **(decode_cfg or {})},
            module="kvhandoff.testing.faults" if faulty else "kvhandoff.engine_sim"))
        p.expect("ready", START_S)
        assert p.expect("registered", START_S)["ok"]
        for r in rooms:
            self.client.bind_room(r["room"], "p", 0)
        return p, d


@pytest.fixture
def handoff(bootstrap_server: Callable[..., str], request: pytest.FixtureRequest
            ) -> Iterator[Handoff]:
    host = getattr(request, "param", "127.0.0.1")
    url = bootstrap_server(host=host)
    with ExitStack() as stack:
        client = BootstrapClient(url)
        stack.callback(client.close)
        yield Handoff(url=url, client=client, stack=stack, host=host)


def settings(transport: str, **extra: Any) -> dict[str, Any]:
    return {"transport": transport, "heartbeat_interval_s": CALM_HB_S, **extra}


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PAGE)


def assert_pool_full(proc: EngineProcess) -> None:
    pool = proc.expect("pool", DONE_S)
    assert pool["free"] == pool["total"], f"{proc.role} leaked pages: {pool}"


# ---------------------------------------------------------------------------- happy path


@pytest.mark.parametrize("handoff", FAMILIES, indirect=True)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_glm_handoff_byte_exact(handoff: Handoff, transport: str) -> None:
    (room,) = handoff.rooms(1)
    st = settings(transport)
    p, d = handoff.start([{"room": room, "seq_len": SEQ, "prefix": PREFIX}], st)
    # the prefill registered its control address in the host's form ([::1]:port for IPv6),
    # and that is where the decode found it
    at = "[::1]:" if handoff.host == "::1" else "127.0.0.1:"
    (rank,) = handoff.client.lookup_route(engine_id="p", dp_rank=0)
    assert rank.agent_address.startswith(at), rank.agent_address
    dd = d.expect("done", DONE_S, room=room)
    pd = p.expect("done", DONE_S, room=room)
    assert (pd["state"], dd["state"]) == ("Success", "Success"), (
        pd["failure"], dd["failure"], p.stalls(), d.stalls())
    v = dd["verify"]
    assert v["bad_bytes"] == 0, "main KV / indexer suffix not byte-exact"
    assert v["prefix_touched_bytes"] == 0, "decode's cached-prefix indexer pages were written"
    assert v["byte_exact"] is True
    cached = PREFIX // PAGE * PAGE
    want = {"main_kv": (SEQ - cached) * 656 * 78, "indexer_k": (SEQ - cached) * 132 * 21}
    assert dd["stats"]["bytes_per_region"] == want
    assert dd["stats"]["bytes"] == sum(want.values()) == pd["stats"]["bytes"]
    # random page order on both sides: almost no two neighbouring pages coalesce
    assert dd["stats"]["descriptors"]["main_kv"] > pages(SEQ) // 2
    assert pd["released"] and dd["released"]
    assert_pool_full(p)
    assert_pool_full(d)
    status = d.expect("status", DONE_S)["status"]
    assert status["transport"]["kind"] == transport
    assert status["address"].startswith(at), status["address"]
    # two processes of one host: the decode's Hello, TransferRequest and RoomAck took the
    # same-host lane (a heartbeat after the prefill exited finds nobody there: ZMQ)
    c = status["counters"]
    assert 3 <= c["messages_out_local"] <= c["messages_out"], c
    # same-host UCX keeps peer error handling on by default (a dying peer must not abort this
    # process), so UCX offers TCP lanes only: degraded, and said so; shm is the fast safe lane
    # nixl: degraded where its UCX finds no RDMA device (this host), with the reason
    degraded = status["transport"]["degraded"]
    if transport == "nixl":
        assert not degraded or "RDMA" in status["transport"]["reason"]
    else:
        # ucx: a status read after the prefill left has no peer's lanes to judge, only its
        # resources (shared memory among them: not degraded), and says so
        gone = transport == "ucx" and "no peer connected yet" in status["transport"]["reason"]
        assert degraded is (transport in ("tcp", "ucx")) or gone, status["transport"]


# ---------------------------------------------------------------------------- layout mismatch


@pytest.mark.parametrize("handoff", FAMILIES_LONG, indirect=True)
@pytest.mark.parametrize("transport", MISMATCH_TRANSPORTS)
def test_layout_mismatch_fails_both_with_the_diff(handoff: Handoff, transport: str) -> None:
    # page sizes may differ between the sides; a different model may not
    (room,) = handoff.rooms(1)
    st = settings(transport)
    p, d = handoff.start([{"room": room, "seq_len": 512}], st,
                         decode_cfg={"model": "deepseek-v3.2"})
    dd = d.expect("done", DONE_S, room=room)
    pd = p.expect("done", DONE_S, room=room)
    assert (pd["state"], dd["state"]) == ("Failed", "Failed")
    for failure in (pd["failure"], dd["failure"]):
        assert "layout mismatch" in failure
        assert "num_layers: prefill=78 decode=61" in failure
        assert "model: prefill='glm-5.3' decode='deepseek-v3.2'" in failure
    assert pd["released"] and dd["released"]
    assert_pool_full(p)


# ---------------------------------------------------------------------------- dead prefill


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_mid_transfer_fails_decode_quickly(handoff: Handoff, transport: str
                                                          ) -> None:
    (room,) = handoff.rooms(1)
    st = settings(transport, heartbeat_interval_s=HB_S)
    if transport == "nixl":  # no pidfd across hosts: a lost prefill's pages wait the write
        # quarantine, at least stall_timeout_s + 2 heartbeats: 10 s here. The stall bound
        # counts from the last layer that landed, before the kill (the prefill holds after
        # layer 10): at 2 s it could end the room before the silence did (beside a busy loop
        # per core: "transfer_stall deadline expired"), so it is well past 2 heartbeats
        st.update(write_quarantine_s=2.0, stall_timeout_s=8.0)
    # the prefill hands over layers 0..10, then waits for the room to end: the kill always
    # lands mid-transfer, however late the decode's events reach this test
    # the decode waits for its pages as long as for the room's end: over nixl they come back
    # at the quarantine, after the failure (a loaded host's decode once reported them past a
    # 5 s wait: `released` False, beside a busy loop per core)
    p, d = handoff.start([{"room": room, "seq_len": SEQ, "prefix": PREFIX}], st,
                         prefill_cfg={"hold_after_layer": 10},
                         decode_cfg={"release_wait_s": DONE_S})
    d.expect("layer", DONE_S, layer=5, ok=True)  # layers 0..5 landed and verified
    t_kill = time.monotonic()
    p.signal(signal.SIGKILL)
    dd = d.expect("done", DONE_S, room=room)
    assert dd["state"] == "Failed"
    assert dd["failure"], "a failed room must say why"
    # found dead by its silence (the heartbeat bound), not by a later deadline: how soon is
    # the bound's business and a loaded host's (`kvhandoff bench` times it), not this test's
    # (or, where this loaded host paused the decode itself past 2 beats after the kill, by
    # the other side of the same rule: on waking it asks the peer whether it still holds it,
    # and the dead peer does not answer)
    assert re.fullmatch(rf"peer \S+ silent for [0-9.]+s \(> 2 heartbeats of {HB_S:g}s\)"
                        rf"|this agent was unresponsive for [0-9.]+s \(> 2 heartbeats of "
                        rf"{HB_S:g}s\) and peer \S+ did not say within [0-9.]+s that it still "
                        r"holds this agent: it may have given its rooms up",
                        dd["failure"]), dd["failure"]
    assert dd["stats"]["t_done"] > t_kill  # CLOCK_MONOTONIC is system-wide
    assert dd["released"]
    assert_pool_full(d)
    landed = [e["layer"] for e in d.all_events("layer") if e.get("ok")]
    assert 77 not in landed  # it really was mid-transfer (layer 5 was consumed above)


# ---------------------------------------------------------------------------- decode abort


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_abort_mid_transfer_fails_prefill_and_frees(handoff: Handoff, transport: str
                                                           ) -> None:
    (room,) = handoff.rooms(1)
    # the calm heartbeat: the decode's abort, not its silence on a loaded host, ends the room
    st = settings(transport)
    # the prefill hands over layers 0..10, then waits until the room ended: the decode's abort
    # at layer 8 always comes mid-transfer, however the host schedules the two processes
    p, d = handoff.start([{"room": room, "seq_len": SEQ, "prefix": PREFIX, "abort_at_layer": 8}],
                         st, prefill_cfg={"hold_after_layer": 10})
    pd = p.expect("done", DONE_S, room=room)
    dd = d.expect("done", DONE_S, room=room)
    assert (pd["state"], dd["state"]) == ("Failed", "Failed")
    assert "decode aborted the request" in pd["failure"]
    assert "decode aborted the request" in dd["failure"]
    assert pd["released"] and dd["released"]
    assert_pool_full(p)
    assert_pool_full(d)
    landed = [e["layer"] for e in d.all_events("layer") if e.get("ok")]
    assert 8 in landed and 77 not in landed


# ---------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("times", "layer"), [(1, 12), (2, 77)])
def test_injected_corruption_is_caught(handoff: Handoff, transport: str, times: int, layer: int
                                       ) -> None:
    # times=2 corrupts the last layer, so nothing else is in flight when the room fails: a ucx
    # peer process that exits while the other side's cma writes are still in flight aborts
    # that side (a transport bug, reported with issue 4's tests, not what this test checks)
    # shm, auto (same host: shm) and nixl write one-sided, the decode posts no receives: the
    # writer corrupts what lands
    one_sided = transport in ("shm", "auto", "nixl")
    (room,) = handoff.rooms(1)
    st = settings(transport)
    cfg = {"faults": {"corrupt": [{"layer": layer, "times": times}]}}
    p, d = handoff.start([{"room": room, "seq_len": 1024, "prefix": 256}], st,
                         **{"prefill_cfg" if one_sided else "decode_cfg": cfg})
    dd = d.expect("done", DONE_S, room=room)
    pd = p.expect("done", DONE_S, room=room)
    assert dd["stats"]["one_sided"] is one_sided is pd["stats"]["one_sided"]
    if times == 1:  # caught, retransmitted once, then byte-exact
        assert (pd["state"], dd["state"]) == ("Success", "Success")
        assert dd["stats"]["retransmits"] == 1 == pd["stats"]["retransmits"]
        assert dd["verify"]["byte_exact"] is True
    else:  # the retransmit is corrupted too: the room fails naming layer and region
        assert (pd["state"], dd["state"]) == ("Failed", "Failed")
        want = f"checksum mismatch on layer {layer}, region 'main_kv'"
        assert want in dd["failure"] and want in pd["failure"]
    assert pd["released"] and dd["released"]
    assert_pool_full(p)
    assert_pool_full(d)


# ---------------------------------------------------------------------------- many rooms


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_rooms_between_the_same_two_agents(handoff: Handoff, transport: str) -> None:
    n = 20
    ids = handoff.rooms(n)
    rooms = [{"room": r, "seq_len": 64 + 23 * i, "prefix": (16 * i) % (64 + 23 * i)}
             for i, r in enumerate(ids)]
    st = settings(transport)
    p, d = handoff.start(rooms, st)
    for r in rooms:
        dd = d.expect("done", DONE_S, room=r["room"])
        assert dd["state"] == "Success", (r, dd["failure"], p.stalls(), d.stalls())
        assert dd["verify"]["byte_exact"] is True, (r, dd["verify"])
    for r in rooms:
        pd = p.expect("done", DONE_S, room=r["room"])
        assert pd["state"] == "Success" and pd["released"], (r, pd["failure"])
    assert_pool_full(p)
    assert_pool_full(d)
    status = p.expect("status", DONE_S)["status"]
    assert len(status["peers"]) == 1  # one decode agent, one handshake, 20 rooms
    assert status["rooms"].get("Success") == n
