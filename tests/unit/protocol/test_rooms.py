"""A leg's phase moves only along `LEG_PHASES` and is RELEASED only once its `Fence` holds
nothing; a room's phase moves only along `ROOM_PHASES` and is RELEASED only once every leg is;
a chunk of a layer is its own `Unit`."""

from __future__ import annotations

import pytest

from kvhandoff.errors import InvalidTransition
from kvhandoff.protocol.rooms import (
    LEG_PHASES,
    ROOM_PHASES,
    Fence,
    Group,
    Leg,
    LegPhase,
    RoomPhase,
    Unit,
)
from kvhandoff.state_machine import PeerWasLost, Role, RoomMachine

LAYERS = (0, 1, 2)


def leg(role: Role = Role.DECODE) -> Leg:
    g = Group(room=1, role=role, layers=LAYERS, expected=1)
    return Leg(room=1, role=role, layers=LAYERS, group=g, peer="p:1",
               machine=RoomMachine(role, now=0.0, layers=LAYERS))


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
    r.machine.apply(PeerWasLost(reason="gone"), 1.0)
    r.advance(LegPhase.RELEASED)
    assert r.released and not r.accepted
    with pytest.raises(InvalidTransition):
        r.advance(LegPhase.RELEASED)


HOLDS = {"an op in flight": lambda f: f.tags.update({7: 1}),
         "a cancel unanswered": lambda f: f.cancelling.add(7),
         "a cancel that failed": lambda f: setattr(f, "stop_failed", True),
         "a one-sided writer not yet stopped": lambda f: setattr(f, "remote_writes", True)}


@pytest.mark.parametrize("why", list(HOLDS))
def test_a_terminal_leg_is_not_released_while_its_fence_holds(why: str) -> None:
    r = leg()
    r.machine.apply(PeerWasLost(reason="gone"), 1.0)
    HOLDS[why](r.fence)
    assert r.fence.holds
    with pytest.raises(InvalidTransition):
        r.advance(LegPhase.RELEASED)
    assert not r.released
    r.fence = Fence()  # the hold went away
    r.advance(LegPhase.RELEASED)
    assert r.released


def test_an_abort_ack_owed_is_not_a_hold() -> None:
    f = Fence(ack_when_stopped=True)
    assert not f.holds and not f.own_writes
    f.remote_writes = True  # the peer's writes are not this side's
    assert f.holds and not f.own_writes


def test_a_room_walks_open_done_released_once_its_legs_are_released() -> None:
    r = leg()
    g = r.group
    g.legs.append(r)
    assert not g.done and not g.released
    with pytest.raises(InvalidTransition, match="open -> released"):
        g.advance(RoomPhase.RELEASED)
    g.advance(RoomPhase.DONE)
    assert g.done and not g.released
    with pytest.raises(InvalidTransition, match="done -> released"):
        g.advance(RoomPhase.RELEASED)  # its leg is not released yet
    r.machine.apply(PeerWasLost(reason="gone"), 1.0)
    r.advance(LegPhase.RELEASED)
    g.advance(RoomPhase.RELEASED)
    assert g.done and g.released
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
        g = leg().group
        g.phase = frm
        with pytest.raises(InvalidTransition, match=f"{frm.value} -> {to.value}"):
            g.advance(to)
        assert g.phase is frm


def test_a_layer_is_done_once_its_unit_of_every_chunk_is() -> None:
    r = leg(Role.PREFILL)
    r.seq_len = 100
    r.chunk_ends = [40, 100]  # two chunks, the last one known
    assert r.unit_done(Unit(1, chunk=1)) is None  # chunk 0 of layer 1 not yet
    assert r.unit_done(Unit(2, chunk=0)) is None
    assert r.unit_done(Unit(1, chunk=0)) == 1
    assert Unit(1) == Unit(1, 0) != Unit(0, 1)  # (layer, chunk), never packed in one int
