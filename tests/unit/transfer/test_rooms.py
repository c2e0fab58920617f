"""A leg's phase moves only along `LEG_PHASES`, and a chunk of a layer is its own `Unit`."""

from __future__ import annotations

import pytest

from kvhandoff.errors import InvalidTransition
from kvhandoff.protocol.rooms import LEG_PHASES, Group, Leg, LegPhase, Unit
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


def test_a_layer_is_done_once_its_unit_of_every_chunk_is() -> None:
    r = leg(Role.PREFILL)
    r.seq_len = 100
    r.chunk_ends = [40, 100]  # two chunks, the last one known
    assert r.unit_done(Unit(1, chunk=1)) is None  # chunk 0 of layer 1 not yet
    assert r.unit_done(Unit(2, chunk=0)) is None
    assert r.unit_done(Unit(1, chunk=0)) == 1
    assert Unit(1) == Unit(1, 0) != Unit(0, 1)  # (layer, chunk), never packed in one int
