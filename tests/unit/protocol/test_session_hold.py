"""A decode's hold on the prefill rooms it has queued (`ev.HoldRooms` -> `P.Hold`), on the fake
clock of the in-memory wire: a prefill room no decode has asked for fails at its bootstrap
bound; the same room held by a decode that has the request queued outlives the bound as long
as the decode renews the hold (at its heartbeats), then moves byte-exact once the decode opens
its receiver; a hold the decode stops renewing lapses and the room fails naming it, counted in
``holds_expired``. Without `P.Hold` (the code before), every room of a decode queued longer
than ``bootstrap_timeout_s`` failed."""

from __future__ import annotations

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side

from .test_session_memory import HB, SEQ, bad_bytes, layers, layout, open_room, pages, settings

BOUND = 4 * HB  # bootstrap_timeout_s of both sides


def _pair() -> tuple[MemoryWire, Side, Side]:
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    # a first room: the two agents' handshake stands (a decode holds rooms with a prefill it
    # has talked to: under a backlog, the one whose earlier requests it is decoding)
    open_room(w, p, d, 1)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert p.views[1].state is KVPoll.Success
    return w, p, d


def _open_prefill(w: MemoryWire, p: Side, room: int) -> None:
    lay = p.session.layout
    n = -(-SEQ // 16)
    from kvhandoff.engine_sim.pattern import write_tokens

    for ri, reg in enumerate(lay.regions):
        for lid in reg.layer_ids:
            write_tokens(p.buffers[f"{reg.name}/{lid}"], lay, ri, lid, pages(n), 0, SEQ, 7)
    w.feed(p, ev.OpenSender(room, room, {r.name: pages(n) for r in lay.regions}, SEQ, 1))
    w.run()


def _ticks(w: MemoryWire, n: int) -> None:
    for _ in range(n):
        w.tick(HB)
        w.run()


def test_an_unheld_room_fails_at_its_bound() -> None:
    w, p, _d = _pair()
    _open_prefill(w, p, 2)
    _ticks(w, int(BOUND / HB) + 2)
    v = p.views[2]
    assert v.state is KVPoll.Failed and v.failure is not None
    assert v.failure.kind is FailureKind.DEADLINE
    assert "no peer after" in v.failure.reason and "hold" not in v.failure.reason
    assert p.session.ctx.counters["holds_expired"] == 0


def test_a_held_room_outlives_its_bound_and_moves_once_the_decode_opens_it() -> None:
    w, p, d = _pair()
    _open_prefill(w, p, 2)
    w.feed(d, ev.HoldRooms("prefill:1", (2,), 2 * HB))
    w.run()
    _ticks(w, 5 * int(BOUND / HB))  # five bounds of queueing on the decode
    assert p.views[2].state is KVPoll.Bootstrapping
    holds = [m for f, _t, m in w.sent if f == "decode:1" and isinstance(m, P.Hold)]
    assert len(holds) >= 5 * int(BOUND / HB) and holds[-1].rooms == [2]
    assert p.session.ctx.counters["holds_renewed"] >= len(holds) - 1
    # the decode schedules the request: opens its receiver (the hold ends), the room moves
    open_room_decode_only(w, d, 2)
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(2, 2, lid))
    w.run()
    assert (p.views[2].state, d.views[2].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    sent = len(w.sent)
    _ticks(w, 3)
    assert not [m for f, _t, m in w.sent[sent:] if f == "decode:1" and isinstance(m, P.Hold)]


def open_room_decode_only(w: MemoryWire, d: Side, room: int) -> None:
    lay = d.session.layout
    w.feed(d, ev.OpenReceiver(room, room, (("prefill:1", 0),)))
    dst = pages(-(-SEQ // 16), offset=5)
    w.feed(d, ev.ReceiverInit(room, room, {r.name: dst for r in lay.regions}, SEQ, 0))
    w.run()


def test_a_hold_not_renewed_lapses_and_is_counted() -> None:
    w, p, d = _pair()
    _open_prefill(w, p, 2)
    w.feed(d, ev.HoldRooms("prefill:1", (2,), 2 * HB))
    w.run()
    _ticks(w, 2 * int(BOUND / HB))
    assert p.views[2].state is KVPoll.Bootstrapping
    w.feed(d, ev.HoldRooms("prefill:1", (), 2 * HB))  # the decode stops holding it
    w.run()
    _ticks(w, 4)
    v = p.views[2]
    assert v.state is KVPoll.Failed and v.failure is not None
    assert v.failure.kind is FailureKind.DEADLINE
    assert "its hold lapsed" in v.failure.reason, v.failure.reason
    assert p.session.ctx.counters["holds_expired"] == 1


def test_a_prefill_ignores_holds_of_a_peer_without_handshake() -> None:
    w, p, _d = _pair()
    _open_prefill(w, p, 3)
    stranger = P.Hold(src="decode:9", gen=1, rooms=[3], hold_s=100.0)
    w.feed(p, ev.MessageReceived(stranger, None))
    w.run()
    _ticks(w, int(BOUND / HB) + 2)
    assert p.views[3].state is KVPoll.Failed
    assert p.session.ctx.counters["holds_renewed"] == 0


def test_a_decode_holds_rooms_of_a_prefill_it_never_read_from() -> None:
    """Under a backlog a decode may queue the first requests of a prefill it has no handshake
    with (a prefill just started or restarted). The hold starts that handshake: the room
    outlives its bound and moves once the decode opens it. Before, a hold went only to a
    prefill the decode had already read a room from, and this room failed at its bound."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    _open_prefill(w, p, 2)
    w.feed(d, ev.HoldRooms("prefill:1", (2,), 2 * HB))
    w.run()
    _ticks(w, 3 * int(BOUND / HB))
    assert p.views[2].state is KVPoll.Bootstrapping
    assert p.session.ctx.counters["holds_renewed"] > 0
    open_room_decode_only(w, d, 2)
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(2, 2, lid))
    w.run()
    assert p.views[2].state is KVPoll.Success and d.views[2].state is KVPoll.Success
    assert bad_bytes(d) == 0


def test_a_room_of_a_greeted_prefill_that_answers_late_is_not_failed_for_the_wait() -> None:
    """A decode greets a prefill it holds rooms with (its Hello goes out, nobody waits for
    it); the prefill answers only much later (it was starting: ZMQ delivers the Hello once it
    listens). A room the decode opens with it meanwhile gets the full silence bound from when
    it started waiting. Before: the bound ran from the greeting, so the room failed `silent` at
    the next heartbeat although the prefill answered within it."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings(bootstrap_timeout_s=BOUND))
    w.hold(lambda f, t, m: f == "decode:1")  # the prefill does not read yet
    w.feed(d, ev.HoldRooms("prefill:1", (2,), 2 * HB))
    w.run()
    _ticks(w, 10)  # five silence bounds since the greeting
    _open_prefill(w, p, 2)
    open_room_decode_only(w, d, 2)
    _ticks(w, 1)  # within the bound of the room's wait
    assert d.views[2].state is not KVPoll.Failed, d.views[2].failure
    w.release_held()  # the prefill reads what was queued for it, and answers
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(2, 2, lid))
    w.run()
    assert p.views[2].state is KVPoll.Success and d.views[2].state is KVPoll.Success
    assert bad_bytes(d) == 0
