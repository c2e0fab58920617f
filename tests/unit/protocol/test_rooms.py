"""A room's state in one place (`roomstate`): a leg's phase moves only along `LEG_PHASES` and
is RELEASED only once it is terminal and its `Fence` holds nothing; a room's phase moves only
along `ROOM_PHASES`, DONE once its KVPoll is terminal and RELEASED only once every leg is; the
first failure wins; a chunk of a layer is its own `Unit`."""

from __future__ import annotations

import pytest

from kvhandoff.errors import Failure, FailureKind, InvalidTransition
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.rooms import Leg, LegPlan, Room, Unit
from kvhandoff.protocol.roomstate import (
    LEG_PHASES,
    ROOM_PHASES,
    Fence,
    LegPhase,
    LegState,
    RoomPhase,
    RoomState,
)
from kvhandoff.state_machine import (
    AllLayersLanded,
    KVPoll,
    LayerLanded,
    LegMachine,
    PeerWasLost,
    RequestAccepted,
    Role,
)

LAYERS = (0, 1, 2)
GONE = Failure(FailureKind.PEER_LOST, "gone")


def leg(role: Role = Role.DECODE, peer: str = "p:1") -> LegState:
    return LegState(room=1, peer=peer, machine=LegMachine(role, now=0.0, layers=LAYERS))


def room(*legs: LegState, expected: int | None = 1) -> RoomState:
    s = RoomState(room=1, expected=expected)
    for x in legs:
        s.add(x)
    return s


def landed(r: LegState) -> None:
    """Walks a decode leg to Success."""
    r.match(0.0)
    r.apply(RequestAccepted(), 0.0)
    for layer in LAYERS:
        r.apply(LayerLanded(layer=layer), 0.0)
    r.apply(AllLayersLanded(), 0.0)


def test_a_decode_leg_walks_new_ready_requested_accepted() -> None:
    r = leg()
    assert r.phase is LegPhase.NEW and not r.requested and not r.accepted
    for to in (LegPhase.READY, LegPhase.REQUESTED, LegPhase.ACCEPTED):
        r.advance(to)
    assert r.phase is LegPhase.ACCEPTED and r.requested and r.accepted


def test_a_withdrawn_request_goes_back_to_ready() -> None:
    r = leg()
    r.advance(LegPhase.READY)
    r.advance(LegPhase.REQUESTED)
    r.advance(LegPhase.READY)  # the peer dropped our handshake before it accepted
    assert not r.requested


@pytest.mark.parametrize("frm", list(LegPhase))
def test_every_transition_outside_the_table_is_refused(frm: LegPhase) -> None:
    for to in LegPhase:
        if to is LegPhase.RELEASED or to in LEG_PHASES[frm]:
            continue
        r = leg()
        r.phase = frm
        with pytest.raises(InvalidTransition, match=f"{frm.value} -> {to.value}"):
            r.advance(to)
        assert r.phase is frm


def test_a_leg_is_released_only_once_and_only_when_terminal() -> None:
    r = leg()
    with pytest.raises(InvalidTransition):
        r.advance(LegPhase.RELEASED)  # still Bootstrapping
    assert not r.release()
    assert r.fail(PeerWasLost(reason="gone"), GONE, 1.0)
    assert r.release()
    assert r.released and not r.accepted
    assert not r.release()
    with pytest.raises(InvalidTransition):
        r.advance(LegPhase.RELEASED)


def test_the_first_failure_of_a_leg_wins() -> None:
    r = leg()
    assert r.fail(PeerWasLost(reason="gone"), GONE, 1.0)
    later = Failure(FailureKind.DEADLINE, "late")
    assert not r.fail(PeerWasLost(reason="late"), later, 2.0)
    assert r.failure is GONE and r.poll is KVPoll.Failed and r.terminal


HOLDS = {"an op in flight": lambda f: f.posted((7,)),
         "a cancel unanswered": lambda f: f.cancelling.add(7),
         "a cancel that failed": lambda f: setattr(f, "stop_failed", True),
         "a one-sided writer not yet stopped": lambda f: setattr(f, "remote_writes", True)}


@pytest.mark.parametrize("why", list(HOLDS))
def test_a_terminal_leg_is_not_released_while_its_fence_holds(why: str) -> None:
    r = leg()
    r.fail(PeerWasLost(reason="gone"), GONE, 1.0)
    HOLDS[why](r.fence)
    assert r.fence.holds
    with pytest.raises(InvalidTransition):
        r.advance(LegPhase.RELEASED)
    assert not r.release() and not r.released
    r.fence = Fence()  # the hold went away
    assert r.release() and r.released


def test_an_op_holds_the_fence_until_each_of_its_posts_completed() -> None:
    f = Fence()
    f.posted((7, 8))
    f.posted((7,))
    f.completed((7, 8))
    assert f.holds and f.tags == {7: 1}
    f.completed((7,))
    assert not f.holds and not f.tags


def test_an_abort_ack_owed_is_not_a_hold() -> None:
    f = Fence(ack_when_stopped=True)
    assert not f.holds and not f.own_writes
    f.remote_writes = True  # the peer's writes are not this side's
    assert f.holds and not f.own_writes


def test_a_room_walks_open_done_released_once_its_legs_are_released() -> None:
    r = leg()
    g = room(r)
    assert not g.done and not g.released
    assert not g.finish(1.0)  # its leg is not terminal
    with pytest.raises(InvalidTransition, match="open -> released"):
        g.advance(RoomPhase.RELEASED)
    r.fail(PeerWasLost(reason="gone"), GONE, 1.0)
    assert g.poll is KVPoll.Failed
    assert g.finish(2.0) and g.done and g.t_done == 2.0 and not g.released
    assert not g.finish(3.0) and g.t_done == 2.0  # once
    r.fence.remote_writes = True
    assert not r.release()
    assert not g.release()  # its leg is not released yet
    with pytest.raises(InvalidTransition, match="done -> released"):
        g.advance(RoomPhase.RELEASED)
    r.fence.remote_writes = False
    assert r.release() and g.release()
    assert g.done and g.released and not g.release()
    for to in RoomPhase:
        with pytest.raises(InvalidTransition):
            g.advance(to)
    with pytest.raises(AttributeError):
        g.done = False  # type: ignore[misc]  # derived from the phase, never set


@pytest.mark.parametrize("frm", list(RoomPhase))
def test_every_room_transition_outside_the_table_is_refused(frm: RoomPhase) -> None:
    for to in RoomPhase:
        if to in ROOM_PHASES[frm]:
            continue
        g = room(leg())
        g.phase = frm
        with pytest.raises(InvalidTransition, match=f"{frm.value} -> {to.value}"):
            g.advance(to)
        assert g.phase is frm


def test_a_room_polls_its_least_advanced_leg_and_bootstraps_while_legs_are_missing() -> None:
    a, b = leg(peer="a:1"), leg(peer="b:1")
    g = room(a, expected=None)
    assert g.poll is KVPoll.Bootstrapping  # its prefill ranks are not known yet
    landed(a)
    assert g.poll is KVPoll.Bootstrapping and not g.finish(1.0)
    g.expect(2)
    assert g.poll is KVPoll.Bootstrapping  # one leg of two
    g.add(b)
    b.match(0.0)
    b.apply(RequestAccepted(), 0.0)
    assert g.poll is KVPoll.WaitingForInput
    landed_b = leg()
    landed(landed_b)
    g2 = room(a, landed_b, expected=2)
    assert g2.poll is KVPoll.Success and g2.finish(1.0)
    assert room(expected=0).poll is KVPoll.Success  # nothing to read


def test_the_first_failure_of_a_room_wins_and_fails_its_poll() -> None:
    r = leg()
    landed(r)
    g = room(r)
    assert g.poll is KVPoll.Success
    assert g.fail(GONE) and not g.fail(Failure(FailureKind.DEADLINE, "late"))
    assert g.failure is GONE and g.poll is KVPoll.Failed


def test_a_reader_told_count_is_remembered() -> None:
    g = room(expected=None)
    g.expect(2, told_by_reader=True)
    assert g.expected == 2 and g.readers_told


def test_a_layer_is_done_once_its_unit_of_every_chunk_is() -> None:
    g = Room(room=1, role=Role.PREFILL, layers=LAYERS, state=room(expected=1))
    r = Leg(room=1, role=Role.PREFILL, layers=LAYERS, parent=g, peer="p:1",
            state=leg(Role.PREFILL))
    r.plan.seq_len = 100
    r.plan.chunk_ends = [40, 100]  # two chunks, the last one known
    done = r.progress.unit_done
    assert done(Unit(1, chunk=1), r.plan) is None  # chunk 0 of layer 1 not yet
    assert done(Unit(2, chunk=0), r.plan) is None
    assert done(Unit(1, chunk=0), r.plan) == 1
    assert Unit(1) == Unit(1, 0) != Unit(0, 1)  # (layer, chunk), never packed in one int


def test_a_later_chunk_is_accepted_once_and_its_units_are_tagged_by_its_transfer() -> None:
    plan = LegPlan()
    assert plan.plans_of(Unit(0)) == {}  # nothing planned before the transfer is accepted
    plan.first_chunk(40, 7, {})
    assert plan.add_chunk(100, None, {}) == 1  # offered; the decode has not accepted it
    assert not plan.chunk_accepted(0, 9)  # chunk 0 is the request's own
    assert not plan.chunk_accepted(2, 9)  # never offered
    assert plan.chunk_accepted(1, 9)
    assert not plan.chunk_accepted(1, 10)  # once
    assert plan.chunk_xfers == [7, 9]
    assert P.split_tag(plan.tag(Unit(3, 0), 2, 1)) == (7, 3, 2, 1)
    assert P.split_tag(plan.tag(Unit(3, 1), 2, 0)) == (9, 3, 2, 0)
