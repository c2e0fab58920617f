"""Peer death: a killed or frozen peer fails its rooms on the other side within 2 heartbeats,
with a reason, and the other side's pages go back to its pool; a frozen peer that wakes up
(SIGCONT) does not bring its rooms back.

One side is a real `kvhandoff.sim` process (the one that is killed or frozen), the other an
in-process `Engine` of the test, so its rooms, timestamps and page pool can be read directly.
The data moves over each same-host lane in its default configuration (UCX, shm), the control
over ZMQ: a dying peer never takes the survivor down on either.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from relkit import WAIT_S, Engine, fast_settings, layers_of

from kvhandoff.errors import FailureKind, PeerLost, TransportFailed
from kvhandoff.kv_layout import preset
from kvhandoff.sim import SimProcess, spawn
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.faults import CRASH_EXIT_CODE

HB_S = 0.2
# "within 2 heartbeats": detection runs on the heartbeat tick, so a silence is seen between 2
# and 3 intervals after the last message; the slack covers that tick, process scheduling on a
# loaded 2-core CI runner, and the decode's extra hop of the Failed message.
FAIL_BOUND_S = 2 * HB_S + 1.5
SEQ = 128
LAYOUT = preset("glm-5.3", page_size_tokens=64)
LAYERS = layers_of(LAYOUT)
ROOMS = [101, 102, 103]
PROC_SETTINGS: dict[str, Any] = {"transport": "ucx", "heartbeat_interval_s": HB_S,
                                 "lease_s": 5.0}
TRANSPORT = "ucx"


@pytest.fixture(params=["ucx", "shm"])
def lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kill / crash tests run over each same-host lane. The SIGSTOP tests run over UCX only:
    over shm, cancelling a receive that a frozen writer may still write into blocks the
    decode's control thread until the writer confirms or the stall bound passes (an open
    finding, docs/RELIABILITY.md)."""
    monkeypatch.setitem(PROC_SETTINGS, "transport", request.param)
    monkeypatch.setattr(sys.modules[__name__], "TRANSPORT", request.param)
    return str(request.param)


def engine(role: str) -> Engine:
    return Engine(role, LAYOUT, num_pages=len(ROOMS) * 2 + 2,
                  settings=fast_settings(transport=TRANSPORT, heartbeat_interval_s=HB_S),
                  pattern="sim")


@contextmanager
def prefill_proc(layer_ms: float, env: dict[str, str] | None = None, **cfg: Any
                 ) -> Iterator[tuple[SimProcess, str]]:
    module = "kvhandoff.testing.faults" if "faults" in cfg else "kvhandoff.sim"
    with spawn("prefill", {"rooms": [{"room": r, "seq_len": SEQ} for r in ROOMS],
                           "settings": PROC_SETTINGS, "layer_ms": layer_ms, "timeout_s": WAIT_S,
                           "linger": True, **cfg}, env=env, module=module) as p:
        yield p, p.expect("ready", 60)["address"]


def assert_failed_in_time(eng: Engine, handles: list[Any], t_event: float, *,
                          words: str | tuple[str, ...]) -> float:
    """Every room Failed with a reason naming one of `words`, within FAIL_BOUND_S of
    `t_event`; pages back in the pool. Returns the slowest time to Failed."""
    alternatives = (words,) if isinstance(words, str) else words
    worst = 0.0
    for h in handles:
        assert h.wait(WAIT_S) is KVPoll.Failed, h
        assert any(w in (h.failure or "") for w in alternatives), h.failure
        t_done = h.stats()["t_done"]
        worst = max(worst, t_done - t_event)
    assert worst <= FAIL_BOUND_S, f"rooms failed {worst:.2f}s after the event (> {FAIL_BOUND_S}s)"
    assert eng.wait_all_released(ROOMS, WAIT_S)
    eng.assert_no_leak()
    return worst


@pytest.mark.usefixtures("lane")
def test_prefill_sigkill_at_random_layer_fails_decode_rooms(rng: random.Random) -> None:
    layer = rng.choice(LAYERS[1:-20])
    d = engine("decode")
    try:
        with prefill_proc(layer_ms=30) as (p, addr):
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
            # layers up to the crash may have landed, the crashed one never did; the shm lane
            # watches the peer process itself and reports its exit before its silence counts
            exc, words, kind = ((TransportFailed, "exited", FailureKind.TRANSPORT)
                                if lane == "shm" else (PeerLost, "silent", FailureKind.PEER_LOST))
            with pytest.raises(exc, match=words):
                rvs[0].wait_for_layer(crash, 0.1)
            assert rvs[0].failure_kind is kind
    finally:
        d.close()


@contextmanager
def decode_proc(addr: str, env: dict[str, str] | None = None) -> Iterator[SimProcess]:
    cfg = {"rooms": [{"room": r, "seq_len": SEQ} for r in ROOMS], "peer": addr,
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


def test_prefill_sigstop_fails_decode_rooms_and_sigcont_does_not_resurrect() -> None:
    d = engine("decode")
    try:
        with prefill_proc(layer_ms=30) as (p, addr):
            rvs = [d.recv(r, SEQ, addr) for r in ROOMS]
            p.expect("layer", WAIT_S, layer=LAYERS[5])
            p.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                worst = assert_failed_in_time(d, rvs, t_stop, words="silent")
            finally:
                p.signal(signal.SIGCONT)
            print(f"prefill SIGSTOP: decode rooms Failed after {worst:.3f}s")
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
        # whatever arrived from the woken prefill, the decode rooms stay Failed
        assert all(rv.poll() is KVPoll.Failed for rv in rvs)
        counters = d.agent.status()["counters"]
        assert counters["rooms_success"] == 0 and counters["rooms_failed"] == len(ROOMS)
        d.assert_no_leak()
    finally:
        d.close()


def test_decode_sigstop_fails_prefill_rooms_and_sigcont_does_not_resurrect() -> None:
    p = engine("prefill")
    try:
        senders = [p.send(r, SEQ, ready=4) for r in ROOMS]
        with decode_proc(p.address) as d:
            d.expect("layer", 60, layer=LAYERS[3])
            d.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                for lid in LAYERS[4:]:
                    for s in senders:
                        s.layer_ready(lid)
                worst = assert_failed_in_time(p, senders, t_stop, words="silent")
            finally:
                d.signal(signal.SIGCONT)
            print(f"decode SIGSTOP: prefill rooms Failed after {worst:.3f}s")
            for r in ROOMS:
                ev = d.expect("done", WAIT_S, room=r)
                assert ev["state"] == "Failed" and ev["failure"], ev
                assert ev["released"], ev
            pool = d.expect("pool", WAIT_S)
            assert pool["free"] == pool["total"], pool
            status = d.expect("status", WAIT_S)["status"]
            assert status["counters"]["rooms_success"] == 0, status
        assert all(s.poll() is KVPoll.Failed for s in senders)
        assert p.agent.status()["counters"]["rooms_success"] == 0
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
