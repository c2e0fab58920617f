"""Peer death: a killed or frozen peer fails its rooms on the other side within 2 heartbeats,
with a reason, and the other side's pages go back to its pool; a frozen peer that wakes up
(SIGCONT) does not bring its rooms back.

One side is a real `kvhandoff.engine_sim` process (the one that is killed or frozen), the other an
in-process `Engine` of the test, so its rooms, timestamps and page pool can be read directly.
The data moves over each same-host lane in its default configuration (UCX, shm), the control
over ZMQ: a dying peer never takes the survivor down on either. A frozen peer does not freeze
the survivor either: its control thread goes on serving the rooms of a healthy peer (over shm,
cancelling a receive the frozen writer was told about returns at once; the pages are held until
the writer confirms it stopped, exits, or stall_timeout_s passes).

The last test kills the decode process mid-write on every lane (tcp, ucx, shm, nixl where its
extra is installed, and auto, the default) with both processes in their default configuration:
the prefill process survives, fails the room with a reason and frees its pages.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from relkit import WAIT_S, Engine, fast_settings, layers_of

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.engine_sim.process import EngineProcess, spawn
from kvhandoff.errors import FailureKind, PeerLost, TransportFailed
from kvhandoff.kv_layout import preset
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.faults import CRASH_EXIT_CODE

# 2 s: on 2 cores beside a busy loop each and the rest of the suite, a process can pause for
# over a second (at 0.5 s a live peer was lost: "silent for 1.48s"), which the control (the
# reference handoff) and a peer not yet killed must outlast; a death is found 2 beats later
HB_S = 2.0
SEQ = 128
LAYOUT = preset("glm-5.3", page_size_tokens=64)
LAYERS = layers_of(LAYOUT)
ROOMS = [101, 102, 103]
OTHER = 104  # a room with a healthy peer, served while the frozen one's rooms fail
PROC_SETTINGS: dict[str, Any] = {"transport": "ucx", "heartbeat_interval_s": HB_S,
                                 "lease_s": 5.0}
TRANSPORT = "ucx"


@pytest.fixture(params=["ucx", "shm"])
def lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kill / crash / stop tests run over each same-host lane."""
    monkeypatch.setitem(PROC_SETTINGS, "transport", request.param)
    monkeypatch.setattr(sys.modules[__name__], "TRANSPORT", request.param)
    return str(request.param)


def engine(role: str, **settings: Any) -> Engine:
    return Engine(role, LAYOUT, num_pages=len(ROOMS) * 2 + 2,
                  settings=fast_settings(transport=TRANSPORT, heartbeat_interval_s=HB_S,
                                         **settings),
                  pattern="sim")


def wait_stopped(p: EngineProcess) -> None:
    """Waits until every thread of the child `p` stopped (after SIGSTOP)."""
    _, status = os.waitpid(p.proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status


@contextmanager
def prefill_proc(layer_ms: float, env: dict[str, str] | None = None, *,
                 rooms: list[int] = ROOMS, **cfg: Any) -> Iterator[tuple[EngineProcess, str]]:
    module = "kvhandoff.testing.faults" if "faults" in cfg else "kvhandoff.engine_sim"
    with spawn("prefill", {"rooms": [{"room": r, "seq_len": SEQ} for r in rooms],
                           "settings": PROC_SETTINGS, "layer_ms": layer_ms, "timeout_s": WAIT_S,
                           "linger": True, **cfg}, env=env, module=module) as p:
        yield p, p.expect("ready", 60)["address"]


def assert_failed_in_time(eng: Engine, handles: list[Any], t_event: float, *,
                          words: str | tuple[str, ...], released: bool = True) -> float:
    """Every room Failed after `t_event` with a reason naming one of `words` (a silence names
    the 2-heartbeat bound it was found by); pages back in the pool (unless not `released`: the
    caller checks that later). Returns the slowest time to Failed, printed by the tests: how
    soon is the bound's business and the host's (`kvhandoff bench` times it), and a loaded
    host's pause can add to it, so it is not asserted."""
    alternatives = (words,) if isinstance(words, str) else words
    worst = 0.0
    for h in handles:
        assert h.wait(WAIT_S) is KVPoll.Failed, h
        f = h.failure or ""
        if "silent" in alternatives and re.fullmatch(
                rf"this agent was unresponsive for [0-9.]+s \(> 2 heartbeats of {HB_S:g}s\) "
                r"and peer \S+ did not say within [0-9.]+s that it still holds this agent: it "
                r"may have given its rooms up", f):
            # the same rule from the other side: this process paused past 2 beats, and the
            # peer it then asked whether it still held it did not answer (it is dead, or
            # stopped)
            pass
        else:
            assert any(w in f for w in alternatives), f
        if "silent" in f:
            assert re.search(rf"silent for [0-9.]+s \(> 2 heartbeats of {HB_S:g}s\)", f), f
        t_done = h.stats()["t_done"]
        assert t_done > t_event, (t_done, t_event)  # CLOCK_MONOTONIC is system-wide
        worst = max(worst, t_done - t_event)
    if released:
        assert eng.wait_all_released(ROOMS, WAIT_S)
        eng.assert_no_leak()
    return worst


@pytest.mark.usefixtures("lane")
def test_prefill_sigkill_at_random_layer_fails_decode_rooms(rng: random.Random) -> None:
    layer = rng.choice(LAYERS[1:-20])
    d = engine("decode")
    try:
        # the prefill hands over layers up to `layer`, then holds the rest until its rooms
        # ended: the kill lands mid-transfer however late its events reach this test
        with prefill_proc(layer_ms=0, hold_after_layer=layer) as (p, addr):
            rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
            p.expect("layer", WAIT_S, layer=layer)
            assert all(rv.wait_for_layer(LAYERS[0], WAIT_S) for rv in rvs)
            p.signal(signal.SIGKILL)
            t_kill = time.monotonic()
            worst = assert_failed_in_time(d, rvs, t_kill, words=("silent", "exited"))
            print(f"prefill SIGKILL at layer {layer}: decode rooms Failed after {worst:.3f}s")
    finally:
        d.close()


def test_prefill_crash_at_layer_fails_decode_rooms(lane: str) -> None:
    crash = LAYERS[10]
    d = engine("decode")
    try:
        # the prefill process exits (os._exit) as it is about to send layer `crash`
        with prefill_proc(layer_ms=30, faults={"crash_layer": crash}) as (p, addr):
            rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
            last = p.expect("layer", WAIT_S, layer=crash - 1)["t"]  # it exits at the next one
            assert p.proc.wait(WAIT_S) == CRASH_EXIT_CODE
            worst = assert_failed_in_time(d, rvs, last, words=("silent", "exited"))
            print(f"prefill crash at layer {crash}: decode rooms Failed {worst:.3f}s after "
                  "its last layer event")
            # layers up to the crash may have landed, the crashed one never did. The shm lane
            # watches the peer process itself and fails the decode's receives when it exits,
            # before its silence counts; with one-sided writes the decode has no op to fail
            # and the silence does
            exited = lane == "shm" and not rvs[0].stats()["one_sided"]
            exc, words, kind = ((TransportFailed, "exited", FailureKind.TRANSPORT) if exited
                                else (PeerLost, "silent|unresponsive", FailureKind.PEER_LOST))
            with pytest.raises(exc, match=words):
                rvs[0].wait_for_layer(crash, 0.1)
            assert rvs[0].failure_kind is kind
    finally:
        d.close()


@contextmanager
def decode_proc(addr: str, env: dict[str, str] | None = None, *,
                rooms: list[int] = ROOMS) -> Iterator[EngineProcess]:
    cfg = {"rooms": [{"room": r, "seq_len": SEQ} for r in rooms], "peer": addr,
           "settings": PROC_SETTINGS, "timeout_s": WAIT_S}
    with spawn("decode", cfg, env=env) as d:
        yield d


@pytest.mark.usefixtures("lane")
def test_decode_sigkill_fails_prefill_rooms_and_frees_source_pages() -> None:
    p = engine("prefill")
    try:
        half = len(LAYERS) // 2
        senders = [p.send(r, SEQ, ready=half) for r in ROOMS]
        with decode_proc(p.address) as d:
            d.expect("layer", 60, layer=LAYERS[half - 1])  # landed and verified in decode
            d.signal(signal.SIGKILL)
            t_kill = time.monotonic()
            for lid in LAYERS[half:]:  # the engine goes on computing: no error, no effect
                for s in senders:
                    s.layer_ready(lid)
            # with UCX peer error handling (the default, also on one host) a send into the
            # dead decode fails at once with UCX's reason; otherwise its silence fails the room
            worst = assert_failed_in_time(p, senders, t_kill, words=(
                "silent", "Connection reset by remote peer", "Endpoint timeout", "exited",
                "No such process"))
            print(f"decode SIGKILL: prefill rooms Failed after {worst:.3f}s")
    finally:
        p.close()


def test_prefill_sigstop_fails_decode_rooms_and_sigcont_does_not_resurrect(lane: str) -> None:
    d = engine("decode")
    try:
        with prefill_proc(layer_ms=0, rooms=[OTHER]) as (healthy, healthy_addr):
            with prefill_proc(layer_ms=0, hold_after_layer=LAYERS[5]) as (p, addr):
                rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
                p.expect("layer", WAIT_S, layer=LAYERS[5])
                assert all(rv.wait_for_layer(LAYERS[0], WAIT_S) for rv in rvs)  # in flight
                p.signal(signal.SIGSTOP)
                t_stop = time.monotonic()
                try:
                    wait_stopped(p)
                    # a new room with a healthy peer while this one is frozen: served
                    other = d.recv(OTHER, SEQ, healthy_addr)
                    worst = assert_failed_in_time(d, rvs, t_stop, words="silent",
                                                  released=False)
                    assert other.wait(WAIT_S) is KVPoll.Success, other.failure
                    assert d.bad_bytes(OTHER, SEQ) == 0
                    if lane == "shm":  # the frozen writer could still write: pages kept
                        assert not any(d.releases[r] for r in ROOMS), dict(d.releases)
                finally:
                    p.signal(signal.SIGCONT)
                print(f"prefill SIGSTOP: decode rooms Failed after {worst:.3f}s")
                # woken, the writer confirms it stopped writing (or the bound passes): the
                # pages go back
                assert d.wait_all_released([*ROOMS, OTHER], WAIT_S)
                d.assert_no_leak()
                # the prefill wakes up: it learns its rooms failed and ends them Failed too
                for r in ROOMS:
                    ev = p.expect("done", WAIT_S, room=r)
                    assert ev["state"] == "Failed" and ev["failure"], ev
                    assert ev["released"], ev
                pool = p.expect("pool", WAIT_S)
                assert pool["free"] == pool["total"], pool
                p.close()
                status = p.expect("status", WAIT_S)["status"]
                assert status["counters"]["rooms_success"] == 0, status
            assert healthy.expect("done", WAIT_S, room=OTHER)["state"] == "Success"
        # whatever arrived from the woken prefill, the decode rooms stay Failed
        assert all(rv.poll() is KVPoll.Failed for rv in rvs)
        counters = d.agent.status()["counters"]
        assert counters["rooms_success"] == 1 and counters["rooms_failed"] == len(ROOMS)
        d.assert_no_leak()
    finally:
        d.close()


@pytest.mark.parametrize("lane", ["shm"], indirect=True)
@pytest.mark.usefixtures("lane")
def test_prefill_stays_frozen_decode_pages_back_after_the_bound() -> None:
    """shm: the prefill stays frozen; the decode's rooms fail, and its pages come back
    once stall_timeout_s (here short) passed since the receives ended, with no word from the
    writer (one-sided writes: after write_quarantine_s)."""
    d = engine("decode", stall_timeout_s=2.0, write_quarantine_s=2.0)
    try:
        # the prefill's stall bound as short (its Hello says it: the decode's quarantine
        # outlasts the longer of the two)
        with prefill_proc(layer_ms=0, hold_after_layer=LAYERS[5],
                          settings={**PROC_SETTINGS, "stall_timeout_s": 2.0}) as (p, addr):
            rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
            p.expect("layer", WAIT_S, layer=LAYERS[5])
            # connected and in flight (frozen before the handshake ended, the decode finds it
            # by its connect timing out instead)
            assert all(rv.wait_for_layer(LAYERS[0], WAIT_S) for rv in rvs)
            p.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                wait_stopped(p)
                # found by its silence, or by the short stall bound (here the sooner) first
                assert_failed_in_time(d, rvs, t_stop, words=(  # and pages back
                    "silent", "transfer_stall deadline expired"))
            finally:
                p.signal(signal.SIGCONT)
    finally:
        d.close()


def test_decode_sigstop_fails_prefill_rooms_and_sigcont_does_not_resurrect(lane: str) -> None:
    # over shm the prefill writes into a frozen decode's memory as fast as into a running one:
    # had it all layers before the rooms failed, the whole rooms could land while the decode is
    # frozen (test_frozen_decode_written_whole_...). Here their last layers come only after
    # the rooms failed over shm; over UCX right after the stop (a frozen receiver stalls it)
    decode_sigstop(lane, whole_rooms=lane != "shm")


@pytest.mark.parametrize("lane", ["shm"], indirect=True)
def test_frozen_decode_written_whole_rooms_never_wrong_after_sigcont(lane: str) -> None:
    """shm: every layer is ready right after the decode froze, so the prefill writes the whole
    rooms into the frozen decode; its rooms still fail (silent) and free their pages. Woken,
    the decode finds every byte landed (and its LayerDones queued), but it knows it was
    unresponsive for more than 2 heartbeats, so its peer gave the rooms up: it fails them
    before reading anything, never a split outcome (decode Success, prefill Failed)."""
    decode_sigstop(lane, whole_rooms=True)


def decode_sigstop(lane: str, *, whole_rooms: bool) -> None:
    p = engine("prefill")
    try:
        senders = [p.send(r, SEQ, ready=4) for r in [*ROOMS, OTHER]]
        with decode_proc(p.address) as d, decode_proc(p.address, rooms=[OTHER]) as healthy:
            d.expect("layer", 60, layer=LAYERS[3])
            d.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                wait_stopped(d)
                for lid in LAYERS[4:]:  # the healthy room's layers go after the stop
                    for s in senders if whole_rooms else senders[-1:]:
                        s.layer_ready(lid)
                worst = assert_failed_in_time(p, senders[:-1], t_stop, words="silent",
                                              released=False)
                for lid in LAYERS[4:] if not whole_rooms else []:
                    for s in senders[:-1]:  # the engine goes on computing: no effect
                        s.layer_ready(lid)
                assert senders[-1].wait(WAIT_S) is KVPoll.Success, senders[-1].failure
                assert p.wait_all_released([*ROOMS, OTHER], WAIT_S)
                p.assert_no_leak()
            finally:
                d.signal(signal.SIGCONT)
            print(f"decode SIGSTOP: prefill rooms Failed after {worst:.3f}s")
            for r in ROOMS:
                ev = d.expect("done", WAIT_S, room=r)
                assert ev["released"], ev
                assert ev["state"] == "Failed" and ev["failure"], ev  # never a split outcome
            pool = d.expect("pool", WAIT_S)
            assert pool["free"] == pool["total"], pool
            status = d.expect("status", WAIT_S)["status"]
            assert status["counters"]["rooms_success"] == 0, status
            ev = healthy.expect("done", WAIT_S, room=OTHER)
            assert ev["state"] == "Success" and ev["verify"]["byte_exact"], ev
        assert all(s.poll() is KVPoll.Failed for s in senders[:-1])
        assert p.agent.status()["counters"]["rooms_success"] == 1
        p.assert_no_leak()
    finally:
        p.close()


@pytest.mark.usefixtures("lane")
@pytest.mark.parametrize("layer_ms", [0])
def test_reference_handoff_between_the_same_parts_succeeds(layer_ms: float) -> None:
    """Control for the death tests: the same processes and settings, nobody dies, Success."""
    d = engine("decode")
    try:
        with prefill_proc(layer_ms=layer_ms) as (p, addr):
            rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
            for rv in rvs:
                assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
            for r in ROOMS:
                assert p.expect("done", WAIT_S, room=r)["state"] == "Success"
                assert d.bad_bytes(r, SEQ) == 0
    finally:
        d.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx", "shm", "nixl", "auto"])
def test_decode_sigkill_mid_write_prefill_process_survives_every_lane(transport: str) -> None:
    """Both processes with every agent setting at its default but the transport; the decode
    process is killed while the prefill still has layers to write into it (the prefill hands
    over layers up to the sixth, then holds the rest until the room ended: an event, not a
    pace a loaded host can outrun). The prefill process stays alive, fails the room with a
    reason naming the lost peer or the transport's error, and frees its pages."""
    if transport == "nixl":  # (its module imports without the extra; making one needs it)
        pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
        pytest.importorskip("kvhandoff.transports.nixl.transport")
    with run_server() as url:
        client = BootstrapClient(url)
        room = client.allocate_rooms(1)[0]
        settings = {"transport": transport}
        with spawn("prefill", {"rooms": [{"room": room, "seq_len": 3000}], "numpy_buffers": True,
                               "settings": {**settings, "bootstrap_url": url},
                               "engine_id": "p", "hold_after_layer": LAYERS[5],
                               "timeout_s": WAIT_S, "linger": True}) as p, \
             spawn("decode", {"rooms": [{"room": room, "seq_len": 3000}], "numpy_buffers": True,
                              "settings": settings, "bootstrap_url": url,
                              "timeout_s": WAIT_S}) as d:
            p.expect("ready", 60)
            p.expect("registered", 60)
            client.bind_room(room, "p", 0)
            d.expect("layer", 60, layer=LAYERS[5])  # landed: the prefill writes the rest
            d.signal(signal.SIGKILL)
            assert d.proc.wait(WAIT_S) == -signal.SIGKILL
            done = p.expect("done", 2 * WAIT_S)
            print(f"{transport}: prefill room {done['state']}: {done['failure']}")
            assert done["state"] == "Failed", done
            # ("did not say": the prefill's own loop paused past 2 beats on a loaded host, and
            # the dead decode did not answer whether it still held the prefill; "lease": that
            # pause and the wait for the answer outlasted the room's lease, which the dead
            # decode no longer renewed, as once beside a busy loop per core)
            assert any(w in (done["failure"] or "") for w in (
                "silent", "exited", "No such process", "Connection reset",
                "Endpoint timeout", "REMOTE_DISCONNECT", "did not say within",
                "lease deadline expired")), done["failure"]
            assert done["released"] is True, done
            pool = p.expect("pool", WAIT_S)
            assert pool["free"] == pool["total"], pool
            assert p.proc.poll() is None  # alive, serving (linger)
