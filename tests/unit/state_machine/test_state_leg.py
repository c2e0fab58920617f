"""LegMachine: the life of a room on each side, its guards, and its deadlines on a fake clock."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError, InvalidTransition
from kvhandoff.state_machine import (
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    Deadline,
    DeadlineConfig,
    DeadlinePassed,
    KVPoll,
    LayerLanded,
    LayerSent,
    LeaseRenewed,
    LegEvent,
    LegMachine,
    PeerFailedRoom,
    PeerMatched,
    PeerWasLost,
    RequestAccepted,
    Role,
    RoomAborted,
)

# Durations and times are exact binary fractions, so due times compare exactly.
CONFIG = DeadlineConfig(bootstrap_s=4.0, waiting_for_input_s=2.0, transfer_stall_s=1.5, lease_s=8.0)
EPS = 1 / 1024


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


def layer_event(role: Role, layer: int) -> LayerSent | LayerLanded:
    return LayerSent(layer) if role is Role.PREFILL else LayerLanded(layer)


def done_event(role: Role) -> AllLayersAcked | AllLayersLanded:
    return AllLayersAcked() if role is Role.PREFILL else AllLayersLanded()


def to_state(machine: LegMachine, target: KVPoll, now: float) -> None:
    """Drive a machine along the happy path from where it is up to `target`."""
    while machine.state is not target:
        if machine.state is KVPoll.Bootstrapping:
            event: LegEvent = RequestAccepted() if machine.peer_matched else PeerMatched()
        elif machine.state is KVPoll.WaitingForInput:
            event = layer_event(machine.role, 0)
        elif machine.state is KVPoll.Transferring:
            event = done_event(machine.role)
        else:
            raise AssertionError(f"cannot reach {target.name} from {machine.state.name}")
        assert machine.apply(event, now)


# --- life -------------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_happy_life_of_a_room(role: Role) -> None:
    clock = FakeClock()
    m = LegMachine(role, now=clock(), deadlines=CONFIG, layers=[0, 5, 9])
    assert m.state is KVPoll.Bootstrapping and not m.is_terminal
    assert m.apply(PeerMatched(), clock.advance(0.5))
    assert m.state is KVPoll.Bootstrapping and m.peer_matched
    assert m.apply(RequestAccepted(), clock.advance(0.5))
    assert m.state is KVPoll.WaitingForInput
    for layer in (0, 5, 9):
        assert m.apply(layer_event(role, layer), clock.advance(0.25))
        assert m.state is KVPoll.Transferring
    assert m.layers == {0, 5, 9}
    assert m.apply(done_event(role), clock.advance(0.25))
    assert m.state is KVPoll.Success and m.is_terminal
    assert m.failure is None and m.next_deadline() is None
    assert "Success" in repr(m) and str(role) in repr(m)


def test_repeated_peer_matched_changes_nothing() -> None:
    m = LegMachine(Role.DECODE, now=0.0)
    assert m.apply(PeerMatched(), 0.0) is True
    assert m.apply(PeerMatched(), 1.0) is False
    assert m.state is KVPoll.Bootstrapping


def test_transfer_accepted_needs_peer_matched_first() -> None:
    m = LegMachine(Role.PREFILL, now=0.0)
    with pytest.raises(InvalidTransition, match="before PeerMatched"):
        m.apply(RequestAccepted(), 0.0)
    assert m.state is KVPoll.Bootstrapping


@pytest.mark.parametrize("role", list(Role))
def test_a_layer_moves_once(role: Role) -> None:
    m = LegMachine(role, now=0.0)
    to_state(m, KVPoll.Transferring, 0.0)  # layer 0 moved
    with pytest.raises(InvalidTransition, match="layer 0 already"):
        m.apply(layer_event(role, 0), 1.0)
    assert m.layers == {0}


@pytest.mark.parametrize("role", list(Role))
def test_expected_layers_guard_unknown_layers_and_early_completion(role: Role) -> None:
    m = LegMachine(role, now=0.0, layers=(0, 2))
    to_state(m, KVPoll.Transferring, 0.0)
    with pytest.raises(InvalidTransition, match="not one of this room's layers"):
        m.apply(layer_event(role, 1), 0.0)
    with pytest.raises(InvalidTransition, match=r"layers \[2\] not yet"):
        m.apply(done_event(role), 0.0)
    assert m.state is KVPoll.Transferring and m.layers == {0}
    assert m.apply(layer_event(role, 2), 0.0)
    assert m.apply(done_event(role), 0.0)
    assert m.state is KVPoll.Success


def test_events_of_the_other_side_are_refused() -> None:
    m = LegMachine(Role.DECODE, now=0.0)
    to_state(m, KVPoll.WaitingForInput, 0.0)
    with pytest.raises(InvalidTransition, match="decode side"):
        m.apply(LayerSent(0), 0.0)
    assert m.state is KVPoll.WaitingForInput and m.layers == frozenset()


# --- failure ----------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize(
    "state", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]
)
def test_failure_keeps_the_reason_and_the_first_failure_wins(role: Role, state: KVPoll) -> None:
    m = LegMachine(role, now=0.0, deadlines=CONFIG)
    to_state(m, state, 0.0)
    first = ChecksumsDiffered(7, "indexer_k")
    assert m.apply(first, 1.0)
    assert m.state is KVPoll.Failed
    assert m.failure == "checksum mismatch on layer 7, region 'indexer_k'"
    assert m.failure_event == first
    assert m.next_deadline() is None
    assert m.apply(PeerWasLost("gone"), 2.0) is False
    assert m.apply(RoomAborted("late", Role.DECODE), 3.0) is False
    assert m.failure == first.reason and m.failure_event is first
    assert "checksum mismatch" in repr(m)


@pytest.mark.parametrize("terminal", [KVPoll.Success, KVPoll.Failed])
def test_terminal_rooms_ignore_everything_and_never_resurrect(terminal: KVPoll) -> None:
    m = LegMachine(Role.DECODE, now=0.0, deadlines=CONFIG)
    if terminal is KVPoll.Success:
        to_state(m, KVPoll.Success, 0.0)
    else:
        assert m.apply(PeerFailedRoom("prefill rank died"), 0.0)
    failure = m.failure
    late = [
        PeerMatched(),
        RequestAccepted(),
        LayerLanded(1),
        LayerSent(1),
        AllLayersLanded(),
        LeaseRenewed(),
        DeadlinePassed(Deadline.LEASE),
        RoomAborted("late", Role.PREFILL),
    ]
    for event in late:
        assert m.apply(event, 50.0) is False
        assert m.state is terminal and m.failure == failure


def test_aborted_keeps_its_reason_and_who() -> None:
    m = LegMachine(Role.PREFILL, now=0.0)
    event = RoomAborted("client went away", Role.DECODE)
    assert m.apply(event, 0.0)
    assert m.failure == "client went away"
    assert isinstance(m.failure_event, RoomAborted) and m.failure_event.by is Role.DECODE


# --- deadlines --------------------------------------------------------------------------


def test_deadline_config_rejects_bad_durations_naming_the_field() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="transfer_stall_s"):
            DeadlineConfig(transfer_stall_s=bad)


def test_no_durations_means_no_deadlines() -> None:
    m = LegMachine(Role.DECODE, now=0.0)
    to_state(m, KVPoll.Transferring, 0.0)
    assert m.next_deadline() is None and m.expired(1e12) == []
    assert m.apply(LeaseRenewed(), 1.0) is False


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize(
    ("which", "state"),
    [
        (Deadline.BOOTSTRAP, KVPoll.Bootstrapping),
        (Deadline.WAITING_FOR_INPUT, KVPoll.WaitingForInput),
        (Deadline.TRANSFER_STALL, KVPoll.Transferring),
        (Deadline.LEASE, KVPoll.Bootstrapping),
    ],
)
def test_each_deadline_fires_exactly_when_due(role: Role, which: Deadline, state: KVPoll) -> None:
    clock = FakeClock()
    only = {f"{which.value}_s": getattr(CONFIG, f"{which.value}_s")}
    m = LegMachine(role, now=clock(), deadlines=DeadlineConfig(**only))
    clock.advance(0.5)
    to_state(m, state, clock())
    nxt = m.next_deadline()
    assert nxt is not None and nxt[0] is which
    due = nxt[1]
    expected_due = (100.0 if which in (Deadline.BOOTSTRAP, Deadline.LEASE) else 100.5) + (
        CONFIG.duration_s(which) or 0.0
    )
    assert due == expected_due
    assert m.expired(due - EPS) == []
    # A timer that fires early is stale: ignored.
    assert m.apply(DeadlinePassed(which), due - EPS) is False
    assert m.state is state
    assert m.expired(due) == [which]
    assert m.apply(DeadlinePassed(which), due)
    assert m.state is KVPoll.Failed
    assert m.failure == f"{which.value} deadline expired"
    assert m.next_deadline() is None and m.expired(due + 100) == []


def test_state_deadlines_are_cleared_on_leaving_their_state() -> None:
    clock = FakeClock()
    m = LegMachine(Role.DECODE, now=clock(), deadlines=CONFIG)
    assert m.deadline(Deadline.BOOTSTRAP) == 104.0 and m.deadline(Deadline.LEASE) == 108.0
    assert m.deadline(Deadline.WAITING_FOR_INPUT) is None
    m.apply(PeerMatched(), clock.advance(1.0))
    m.apply(RequestAccepted(), clock.advance(1.0))
    assert m.deadline(Deadline.BOOTSTRAP) is None
    assert m.deadline(Deadline.WAITING_FOR_INPUT) == 104.0
    # The bootstrap timer the caller had set now fires: stale, the room lives on.
    assert m.apply(DeadlinePassed(Deadline.BOOTSTRAP), clock.advance(2.0)) is False
    assert m.state is KVPoll.WaitingForInput
    m.apply(LayerLanded(0), clock.advance(0.5))
    assert m.deadline(Deadline.WAITING_FOR_INPUT) is None
    assert m.deadline(Deadline.TRANSFER_STALL) == 106.0


@pytest.mark.parametrize("role", list(Role))
def test_progress_rearms_the_stall_deadline(role: Role) -> None:
    clock = FakeClock(0.0)
    m = LegMachine(role, now=clock(), deadlines=DeadlineConfig(transfer_stall_s=1.5))
    to_state(m, KVPoll.Transferring, clock())  # layer 0 at t=0: due 1.5
    assert m.next_deadline() == (Deadline.TRANSFER_STALL, 1.5)
    assert m.apply(layer_event(role, 1), clock.advance(1.0))  # due 2.5
    assert m.expired(1.5) == []
    assert m.apply(DeadlinePassed(Deadline.TRANSFER_STALL), 1.5) is False
    assert m.next_deadline() == (Deadline.TRANSFER_STALL, 2.5)
    assert m.expired(2.5) == [Deadline.TRANSFER_STALL]
    assert m.apply(DeadlinePassed(Deadline.TRANSFER_STALL), 2.5)
    assert m.state is KVPoll.Failed


def test_lease_renewal_rearms_the_lease_in_every_non_terminal_state() -> None:
    clock = FakeClock(0.0)
    m = LegMachine(Role.DECODE, now=clock(), deadlines=DeadlineConfig(lease_s=8.0))
    for state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
        to_state(m, state, clock())
        assert m.apply(LeaseRenewed(), clock.advance(6.0))
        assert m.state is state
        assert m.deadline(Deadline.LEASE) == clock() + 8.0
        assert m.expired(clock() + 8.0 - EPS) == []
    assert m.expired(clock() + 8.0) == [Deadline.LEASE]


def test_expired_lists_every_due_deadline_earliest_first() -> None:
    m = LegMachine(Role.PREFILL, now=0.0, deadlines=DeadlineConfig(bootstrap_s=3.0, lease_s=2.0))
    assert m.next_deadline() == (Deadline.LEASE, 2.0)
    assert m.expired(2.0) == [Deadline.LEASE]
    assert m.expired(10.0) == [Deadline.LEASE, Deadline.BOOTSTRAP]
    assert m.apply(DeadlinePassed(Deadline.LEASE), 10.0)
    assert m.failure == "lease deadline expired"
    # The second due deadline arrives after the room failed: ignored.
    assert m.apply(DeadlinePassed(Deadline.BOOTSTRAP), 10.0) is False
    assert m.failure == "lease deadline expired"


def test_started_arms_the_stall_deadline_before_the_first_layer_moves() -> None:
    """`started` (the prefill posted its first write) bounds a room whose first layer never
    moves by the stall deadline, beside WaitingForInput's; a second call does not push it."""
    clock = FakeClock(0.0)
    m = LegMachine(Role.PREFILL, now=clock(), deadlines=DeadlineConfig(
        waiting_for_input_s=300.0, transfer_stall_s=2.0))
    to_state(m, KVPoll.WaitingForInput, clock())
    assert m.deadline(Deadline.TRANSFER_STALL) is None
    m.started(clock.advance(1.0))
    m.started(clock.advance(1.0))  # already armed: still due at 3.0
    assert m.next_deadline() == (Deadline.TRANSFER_STALL, 3.0)
    assert m.apply(DeadlinePassed(Deadline.TRANSFER_STALL), 3.0)
    assert m.state is KVPoll.Failed and m.failure == "transfer_stall deadline expired"


# --- layers that moved together: one step ------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("state", [KVPoll.WaitingForInput, KVPoll.Transferring])
def test_layers_applied_together_equal_one_event_each(role: Role, state: KVPoll) -> None:
    """`apply_layers` ends where feeding the side's layer event for each layer in order ends:
    the same state, layers and deadlines."""
    clock = FakeClock()
    one, many = (LegMachine(role, now=clock(), deadlines=CONFIG, layers=range(6))
                 for _ in range(2))
    for m in (one, many):
        to_state(m, KVPoll.WaitingForInput, clock())
        if state is KVPoll.Transferring:
            m.apply(layer_event(role, 5), clock())
    now = clock.advance(0.5)
    for layer in (0, 2, 1):
        one.apply(layer_event(role, layer), now)
    assert many.apply_layers([0, 2, 1], now)
    assert many.state is one.state is KVPoll.Transferring
    assert many.layers == one.layers >= {0, 1, 2}
    assert all(many.deadline(d) == one.deadline(d) for d in Deadline)
    assert many.deadline(Deadline.TRANSFER_STALL) == now + 1.5
    assert many.deadline(Deadline.WAITING_FOR_INPUT) is None


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize(("layers", "why"), [
    ([3, 4, 3], "twice in one step"),
    ([2, 0], "already"),
    ([3, 9], "not one of this room's layers"),
])
def test_a_refused_layer_refuses_the_whole_step(role: Role, layers: list[int], why: str) -> None:
    """Every layer of the step is guarded: one refused (named twice, already moved, not one
    of the room's) refuses the step and leaves the machine as it was."""
    clock = FakeClock()
    m = LegMachine(role, now=clock(), deadlines=CONFIG, layers=range(6))
    to_state(m, KVPoll.Transferring, clock())  # layer 0 moved
    before = (m.state, m.layers, {d: m.deadline(d) for d in Deadline})
    with pytest.raises(InvalidTransition, match=why):
        m.apply_layers(layers, clock.advance(1.0))
    assert (m.state, m.layers, {d: m.deadline(d) for d in Deadline}) == before


@pytest.mark.parametrize("role", list(Role))
def test_layers_together_follow_the_table(role: Role) -> None:
    """Before the transfer is accepted no layer may move, together or not; a terminal room
    takes nothing; no layers is no step."""
    m = LegMachine(role, now=0.0, deadlines=CONFIG, layers=range(4))
    with pytest.raises(InvalidTransition, match="not allowed in state Bootstrapping"):
        m.apply_layers([0, 1], 0.0)
    assert m.layers == frozenset()
    to_state(m, KVPoll.WaitingForInput, 0.0)
    assert not m.apply_layers([], 0.0) and m.state is KVPoll.WaitingForInput
    assert m.apply_layers([0, 1, 2, 3], 0.0)
    assert m.apply(done_event(role), 0.0) and m.state is KVPoll.Success
    assert not m.apply_layers([0], 0.0)
