"""What the session asks of its driver, in memory (`MemoryWire`, fake clock, no threads): a
transport call that may wait on a peer (connect, register_remote, cancel, disconnect) is
answered by an event, later, while everything else goes on; a cancel that fails keeps the
pages held; an event that raises fails its room on both sides."""

from __future__ import annotations

import numpy as np

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire

from .test_session_memory import HB, SEQ, bad_bytes, layers, layout, open_room, settings

QUARANTINE = 4.0


def test_a_connect_that_never_answers_does_not_delay_heartbeats_to_other_peers() -> None:
    """The decode's connect to prefill B is never answered; over ten heartbeats of the fake
    clock the decode heartbeats A and B on time, its room with A ends Success, nobody is
    declared lost, and B's room fails by its bootstrap deadline, naming it."""
    w = MemoryWire()
    a = w.add("prefill:a", Role.PREFILL, layout(), settings=settings())
    b = w.add("prefill:b", Role.PREFILL, layout(), settings=settings())
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=settings(bootstrap_timeout_s=10 * HB))
    w.hang_connect.add("prefill:b")
    n = -(-SEQ // 16)
    w.feed(b, ev.OpenSender(2, 2, {r.name: np.arange(n) for r in layout().regions}, SEQ, 1))
    w.feed(d, ev.OpenReceiver(2, 2, (("prefill:b", 0),)))
    w.feed(d, ev.ReceiverInit(2, 2, {r.name: np.arange(n) + 20 for r in layout().regions},
                              SEQ, 0))
    w.run()
    assert len(w.hung) == 1  # the decode's connect to B waits
    open_room(w, a, d, 1, peer="prefill:a")
    w.run()
    for _ in range(9):
        w.tick(HB)
        w.run()
        beats = [(f, t) for f, t, m in w.sent[-20:] if isinstance(m, P.Heartbeat)]
        assert ("decode:1", "prefill:a") in beats and ("decode:1", "prefill:b") in beats
    for lid in layers(a.session.layout):
        w.feed(a, ev.LayerReady(1, 1, lid))
    w.run()
    assert (a.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    assert d.views[2].state is KVPoll.Bootstrapping
    w.tick(2 * HB)
    w.run()
    assert d.views[2].state is KVPoll.Failed
    assert d.views[2].failure is not None and d.views[2].failure.kind is FailureKind.DEADLINE
    assert all(s.session.counters["peers_lost"] == 0 for s in (a, b, d))


def test_a_late_connect_answer_reads_the_messages_that_came_meanwhile() -> None:
    """The prefill's connect to the decode is answered only after the decode's messages
    arrived: they wait in the peer's backlog and the room proceeds once connected."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings())
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    w.hang_connect.add("decode:1")
    open_room(w, p, d, 1)
    w.run()
    assert len(w.hung) == 1 and p.session.peers["decode:1"].state.phase.value == "connecting"
    w.hang_connect.clear()
    for side, answer in w.hung:
        w.completions.append((side, answer))
    w.hung.clear()
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0


def test_a_failed_cancel_keeps_both_sides_pages_until_the_quarantine() -> None:
    # (stall_timeout_s + 2 heartbeats under write_quarantine_s: the decode's quarantine is
    # write_quarantine_s itself)
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(),
              settings=settings(write_quarantine_s=QUARANTINE, stall_timeout_s=1.0),
              writes=True)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=settings(write_quarantine_s=QUARANTINE, stall_timeout_s=1.0),
              writes=True)
    open_room(w, p, d, 1)
    w.run()
    w.hold_writes = True  # the first layer's write stays in flight
    w.fail_cancel = "the copy did not stop"
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.feed(p, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    aborts = [m for f, _, m in w.sent if f == "prefill:1" and isinstance(m, P.Abort)]
    assert [m.writes_stopped for m in aborts] == [False]
    assert not [m for f, _, m in w.sent if f == "prefill:1" and isinstance(m, P.AbortAck)]
    assert p.views[1].state is KVPoll.Failed and d.views[1].state is KVPoll.Failed
    assert p.session.counters["cancel_failures"] == 1
    assert any("failed (the copy did not stop)" in m for m in p.log)
    assert p.views[1].releases == 0 and d.views[1].releases == 0
    w.tick(QUARANTINE / 2)
    w.run()
    assert p.views[1].releases == 0 and d.views[1].releases == 0
    w.tick(QUARANTINE / 2 + HB)
    w.run()
    assert p.views[1].releases == 1 and d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 1


def test_a_confirmed_cancel_is_said_with_an_abort_ack() -> None:
    """The same abort with a cancel that works: the Abort says the writes may still land,
    the AbortAck follows the confirmation and the decode's pages go back then."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(), writes=True)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=settings(write_quarantine_s=QUARANTINE), writes=True)
    open_room(w, p, d, 1)
    w.run()
    w.hold_writes = True
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.feed(p, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    sent = [type(m).__name__ for f, _, m in w.sent if f == "prefill:1"]
    assert sent[-2:] == ["Abort", "AbortAck"]
    assert p.views[1].releases == 1 and d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0
    assert p.session.counters["cancel_failures"] == 0


def test_an_event_that_raises_fails_its_room_on_both_sides() -> None:
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings())
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    open_room(w, p, d, 1)
    w.run()

    def buggy(e: ev.LayerReady) -> None:
        raise KeyError("a bug")

    p.session._handlers[ev.LayerReady] = buggy  # type: ignore[assignment]
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    assert p.views[1].state is KVPoll.Failed and d.views[1].state is KVPoll.Failed
    f = p.views[1].failure
    assert f is not None and f.kind is FailureKind.INTERNAL and "KeyError" in f.reason
    assert p.session.counters["internal_errors"] == 1
    assert p.views[1].releases == 1 and d.views[1].releases == 1
