"""The agent's driver (its control thread) with real agents: it never waits on a peer, a cancel
it cannot confirm keeps the pages held, a room whose event raised is failed on both sides, and
route lookups share one thread.

- A transport connect that never answers (`FaultyTransport(hang_connect=...)`) runs on the
  peer-call pool: the decode keeps heartbeating its other prefill, whose room ends Success.
- A cancel that raises (`fail_cancel`: what shm raises when a copy did not stop) is counted;
  the prefill tells the decode its writes are not known stopped, so the decode holds its pages
  until write_quarantine_s (before: the failure was swallowed and the decode freed pages that
  could still be written).
- 1,000 receivers looked up through a real bootstrap server at once add a bounded number of
  threads (before: one per room).
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.pool import PagePool
from kvhandoff.errors import FailureKind
from kvhandoff.protocol.session import TransferSession
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.faults import FaultyTransport
from kvhandoff.transfer import TransferAgent
from kvhandoff.transports.base import load_transport

from .conftest import WAIT_S, Pair, Releases, Side, layers_of, tiny_layout
from .test_agent_inproc import PREFIX, SEQ, finish, run_layers

HB = 0.2
# the tests that are not about heartbeats: on 2 loaded cores a 0.2 s heartbeat can miss two
# beats while both sides compute, and a room then fails as a lost peer, not as the test means
CALM_HB = 1.0


def wait_until(pred: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Waits for `pred` (re-checked every 10 ms), at most `timeout` seconds."""
    end = time.monotonic() + timeout
    tick = threading.Event()
    while not pred():
        if time.monotonic() > end:
            return False
        tick.wait(0.01)
    return True


def counters(agent: TransferAgent) -> dict[str, int]:
    c: dict[str, int] = agent.status()["counters"]
    return c


def side(role: str, settings: Settings, seed: int, **faults: object) -> Side:
    layout = tiny_layout()
    tr = load_transport(settings.transport, settings)
    if faults:
        tr = FaultyTransport(tr, **faults)  # type: ignore[arg-type]
    pool = PagePool(32, seed=seed)
    agent = TransferAgent(role, layout, allocate(layout, 32), settings,
                          engine_id=f"driver-{role}-{seed}", transport=tr)
    return Side(agent=agent, pool=pool, releases=Releases(pool))


def test_a_connect_that_never_answers_does_not_stall_heartbeats_to_other_peers() -> None:
    """The decode's transport connect to prefill B hangs; meanwhile its room with prefill A
    handshakes, stays alive over many heartbeats and ends Success on both sides."""
    st = Settings(transport="inproc", heartbeat_interval_s=HB)
    d = side("decode", st, 2, hang_connect=())
    a = side("prefill", st, 1)
    b = side("prefill", st, 3)
    tr = d.agent.transport
    assert isinstance(tr, FaultyTransport)
    tr.hang_connect.add(b.agent.address)
    try:
        b_src = b.pool.alloc(-(-SEQ // 16))
        b.agent.sender(2, pages=b_src, seq_len=SEQ)
        stuck = d.agent.receiver(2, peer=b.agent.address)
        stuck.init(d.pool.alloc(-(-SEQ // 16)), SEQ, 0)
        assert wait_until(lambda: tr.log.hung_connects == 1)  # the connect to B waits now

        pr = Pair(a, d)
        sender, receiver, _, dst = pr.open(1, SEQ, PREFIX)
        assert wait_until(lambda: receiver.poll() >= KVPoll.WaitingForInput)
        seen = counters(a.agent)["messages_in"]
        # six heartbeats of the decode reach A while its connect to B still waits (a driver
        # blocked in that connect would send none, and A would drop it after two)
        assert wait_until(lambda: counters(a.agent)["messages_in"] >= seen + 6)
        assert tr.log.hung_connects == 1 and stuck.poll() < KVPoll.WaitingForInput
        run_layers(pr, sender, receiver)
        assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
        bad, touched = pr.verify(dst, SEQ, PREFIX)
        assert bad == 0 and touched == 0
        assert counters(a.agent)["peers_lost"] == 0
        assert counters(d.agent)["peers_lost"] == 0
        tr.release_connects()  # the hung connect fails now: B's room fails, naming it
        assert stuck.wait(WAIT_S) is KVPoll.Failed
        assert stuck.failure_kind is FailureKind.TRANSPORT
        assert stuck.failure is not None and "never answered" in stuck.failure
    finally:
        for s in (d, a, b):
            s.agent.close()


def test_a_failed_cancel_keeps_the_pages_held_until_the_quarantine() -> None:
    """One-sided over shm: a layer's write is in flight (stalled) when the prefill's engine
    aborts; the cancel raises. The prefill counts and logs it and tells the decode that its
    writes are not known stopped; the decode fails the room at once but frees its pages only
    after its write quarantine (counted as one: write_quarantine_s, at least stall_timeout_s
    + 2 heartbeats, here 3 s), the prefill after its write_quarantine_s. The prefill's bound
    is the longer one: its AbortAck, sent once its own bound passed, must not race the
    decode's quarantine (with equal bounds a decode slow to read the Abort got the AbortAck
    first under load and, rightly, released without a quarantine)."""
    lid = layers_of(tiny_layout())[1]
    st = Settings(transport="shm", heartbeat_interval_s=CALM_HB, write_quarantine_s=1.0,
                  stall_timeout_s=1.0)
    p = side("prefill", st.model_copy(update={"write_quarantine_s": 4.0}), 1,
             stall_layers=[lid], fail_cancel="the copy did not stop")
    d = side("decode", st, 2)
    try:
        pr = Pair(p, d)
        sender, receiver, _, _ = pr.open(5, SEQ, PREFIX)
        assert wait_until(lambda: receiver.poll() >= KVPoll.WaitingForInput)
        sender.layer_ready(layers_of(tiny_layout())[0])
        sender.layer_ready(lid)  # its write stalls: in flight until cancelled
        assert wait_until(lambda: p.agent.transport.log.stalled >= 1)  # type: ignore[attr-defined]
        sender.abort("engine gave up")
        assert receiver.wait(WAIT_S) is KVPoll.Failed
        # the decode holds its pages for the quarantine, never less
        assert wait_until(lambda: counters(d.agent)["write_quarantines"] == 1)
        assert counters(p.agent).get("cancel_failures", 0) >= 1  # one per tag in flight
        assert receiver.wait_released(WAIT_S) and sender.wait_released(WAIT_S)
        assert d.releases.calls == {5: 1} and p.releases.calls == {5: 1}
    finally:
        d.agent.close()
        p.agent.close()


def test_an_event_that_raises_fails_its_room_on_both_sides(monkeypatch: object) -> None:
    """A bug met while the prefill handles a layer of room 7: room 7 fails on both sides at
    once (kind internal, the reason names it) instead of waiting for a deadline; room 8 of the
    same pair is untouched and ends Success."""
    st = Settings(transport="inproc", heartbeat_interval_s=CALM_HB, stall_timeout_s=60.0)
    p, d = side("prefill", st, 1), side("decode", st, 2)
    try:
        pr = Pair(p, d)
        s7, r7, _, _ = pr.open(7, SEQ, PREFIX)
        s8, r8, _, _ = pr.open(8, SEQ, PREFIX)
        assert wait_until(lambda: r7.poll() >= KVPoll.WaitingForInput)
        session = p.agent._session
        real = TransferSession._on_layer_ready

        def buggy(self: TransferSession, e: object) -> None:
            if getattr(e, "room", None) == 7:
                raise ZeroDivisionError("a bug")
            real(self, e)  # type: ignore[arg-type]

        session._handlers[next(k for k in session._handlers if k.__name__ == "LayerReady")] = \
            buggy.__get__(session)
        s7.layer_ready(layers_of(tiny_layout())[0])
        assert r7.wait(WAIT_S) is KVPoll.Failed and s7.wait(WAIT_S) is KVPoll.Failed
        assert s7.failure_kind is FailureKind.INTERNAL
        assert s7.failure is not None and "ZeroDivisionError: a bug" in s7.failure
        assert r7.failure is not None and "ZeroDivisionError" in r7.failure
        assert counters(p.agent)["internal_errors"] == 1
        run_layers(pr, s8, r8)
        assert finish(s8, r8) == (KVPoll.Success, KVPoll.Success)
    finally:
        d.agent.close()
        p.agent.close()


def test_a_thousand_receivers_looked_up_at_once_use_a_bounded_number_of_threads(
        caplog: pytest.LogCaptureFixture) -> None:
    """1,000 rooms allocated at the bootstrap server but not bound to a prefill yet: every
    lookup waits there (503, the client retries), all on the one lookup thread. (Rooms never
    allocated would be a 404 and fail as soon as their lookup is answered, which made the
    states below depend on how far the lookups got.) Closing the agent cancels them all
    within its bound: before, the HTTP pool's thousand queued requests kept the lookup thread
    busy and the close waited out its 5 s bound (logged), then 5 s more for the thread."""
    with run_server(Settings()) as url, BootstrapClient(url) as client:
        rooms = client.allocate_rooms(1000)
        st = Settings(transport="inproc", heartbeat_interval_s=CALM_HB,
                      bootstrap_timeout_s=60.0)
        layout = tiny_layout()
        before = threading.active_count()
        agent = TransferAgent("decode", layout, allocate(layout, 32), st, engine_id="many")
        try:
            started = threading.active_count()
            dst = np.arange(2, dtype=np.int64)
            receivers = []
            for room in rooms:
                r = agent.receiver(room, bootstrap_addr=url)
                r.init(dst, 20, 0)
                receivers.append(r)
            during = threading.active_count()
            assert during - started <= 4, (before, started, during)
            states = collections.Counter(r.poll().name for r in receivers)
            assert states == {"Bootstrapping": 1000}, (  # the failures say why
                states, sorted({str(r.failure) for r in receivers if r.failure})[:3])
        finally:
            with caplog.at_level(logging.WARNING, logger="kvhandoff.agent"):
                agent.close()
        assert all(r.poll() is KVPoll.Failed for r in receivers)
        assert not [r for r in caplog.records if "route lookups: closing" in r.getMessage()]


def test_a_pass_that_runs_over_a_heartbeat_is_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """A pass of the control loop held past a heartbeat (here a query that keeps the control
    thread for 2.5 heartbeats: what a busy host or a GIL held elsewhere does to it) is counted
    in `loop_stalls` and logged with how long it took: two of them without a heartbeat and the
    peers give this agent's rooms up, so an operator must be able to see them."""
    st = Settings(transport="inproc", heartbeat_interval_s=HB)
    layout = tiny_layout()
    agent = TransferAgent("decode", layout, allocate(layout, 4), st, engine_id="stall")
    try:
        with caplog.at_level(logging.WARNING, logger="kvhandoff.agent"):
            agent._loop.query(lambda _s: threading.Event().wait(2.5 * HB))  # the stall itself
            assert wait_until(lambda: counters(agent)["loop_stalls"] >= 1)
        said = [r.getMessage() for r in caplog.records if "control loop stalled" in r.getMessage()]
        took = [float(m.split("its pass took ")[1].split("s")[0]) for m in said]
        assert took and max(took) >= 2.5 * HB * 0.9, said  # the pass held is among them
        # and whether the process was reading its pages back from disk meanwhile
        assert all(re.search(r"\), \d+ major page faults in the process", m) for m in said), said
    finally:
        agent.close()
