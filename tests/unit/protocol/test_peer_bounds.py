"""Two agents set differently: each says its heartbeat and stall bound in its Hello, and the
other measures its silence, and outlasts its writes, by the longer of its own and what it said
(on the in-memory wire's clock: no sleeps)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.lifecycle import write_quarantine
from kvhandoff.protocol.peers import PEER_HEARTBEAT_MAX_S
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire

from .test_session_memory import HB, layers, layout, open_room


def settings(**kw: object) -> Settings:
    return Settings(**{"transport": "inproc", "heartbeat_interval_s": HB, "lease_s": 5.0, **kw})

SLOW = 4 * HB  # the prefill's heartbeat: it beats a quarter as often as the decode


def test_a_peer_that_beats_less_often_is_not_lost_between_its_beats() -> None:
    """The prefill beats every 2 s, the decode every 0.5 s: the decode waits 2 of the
    prefill's beats, not 2 of its own (before, it failed the room after 1 s of the prefill's
    ordinary quiet). A prefill that goes silent is still found, by the longer bound, named."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(heartbeat_interval_s=SLOW))
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    open_room(w, p, d, 9)
    w.run()
    w.feed(p, ev.LayerReady(9, 9, layers(p.session.layout)[0]))
    w.run()
    for _ in range(12):  # 6 s: three of the prefill's beats, twelve of the decode's
        w.tick(HB)
        w.run()
    assert d.views[9].state is KVPoll.Transferring, d.views[9].failure
    assert d.session.counters["peers_lost"] == 0
    w.drop(lambda f, t, m: f == "prefill:1")  # the prefill froze
    for _ in range(int(2 * SLOW / HB)):  # 2 of its beats: not yet
        w.tick(HB)
        w.run()
        if d.views[9].state is KVPoll.Failed:
            break
    for _ in range(4):
        w.tick(HB)
        w.run()
    f = d.views[9].failure
    assert f is not None and f.kind is FailureKind.PEER_LOST, f
    assert f"(> 2 heartbeats of {SLOW:g}s)" in f.reason, f.reason


def test_the_quarantine_outlasts_the_writers_own_bound_as_it_said() -> None:
    """One-sided: the prefill's stall_timeout_s (20 s) and heartbeat (2 s) are longer than the
    decode's (2 s, 0.5 s): a frozen prefill could go on copying until 20 + 2 x 2 s after the
    failure, so the decode holds the pages that long, not its own 2 + 2 x 0.5 s."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(),
              settings=settings(heartbeat_interval_s=SLOW, stall_timeout_s=20.0), writes=True)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=settings(write_quarantine_s=1.0, stall_timeout_s=2.0), writes=True)
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.drop(lambda frm, to, m: frm == "prefill:1")  # frozen
    for _ in range(int(2 * SLOW / HB) + 2):
        w.tick(HB)
        w.run()
    assert d.views[1].state is KVPoll.Failed and d.views[1].releases == 0
    own = write_quarantine(d.session.settings)
    said = write_quarantine(d.session.settings, 20.0, SLOW)
    assert (own, said) == (2.0 + 2 * HB, 20.0 + 2 * SLOW)
    w.tick(own + 1.0)  # past this side's own bound, not the writer's
    w.run()
    assert d.views[1].releases == 0
    w.tick(said)
    w.run()
    assert d.views[1].releases == 1
    assert any(f"write quarantine ({said:g}s" in m for m in d.log), d.log[-3:]


@pytest.mark.parametrize("said", [float("nan"), float("inf"), -1.0, 1e12])
def test_what_a_hello_says_of_its_beat_is_bounded(said: float) -> None:
    """A Hello saying a heartbeat that is no number, negative or huge cannot make its sender's
    silence go unseen: it counts as not said (the receiver's own) or as the most allowed."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings())
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    # the prefill's Hello says `said` (what its settings could never hold: a peer's own code)
    p.session.ctx.me = dataclasses.replace(p.session.ctx.me, heartbeat_s=said)
    open_room(w, p, d, 3)
    w.run()
    assert d.session.peers.bounds_of("prefill:1")[1] == (
        PEER_HEARTBEAT_MAX_S if math.isfinite(said) and said > PEER_HEARTBEAT_MAX_S else 0.0)
