"""Random event sequences (hypothesis): a room never reaches an illegal state, never leaves a
terminal one, keeps its first failure reason, and its deadlines always match its state."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import InvalidTransition
from kvhandoff.state_machine import (
    TRANSITIONS,
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    Deadline,
    DeadlineConfig,
    DeadlinePassed,
    FailureEvent,
    KVPoll,
    LayerLanded,
    LayerSent,
    LayoutsDiffered,
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

LAYERS = st.integers(min_value=0, max_value=5)
REASONS = st.text(min_size=1, max_size=12)
EVENTS: st.SearchStrategy[LegEvent] = st.one_of(
    st.just(PeerMatched()),
    st.just(RequestAccepted()),
    st.builds(LayerSent, LAYERS),
    st.builds(LayerLanded, LAYERS),
    st.just(AllLayersAcked()),
    st.just(AllLayersLanded()),
    st.just(LeaseRenewed()),
    st.builds(RoomAborted, REASONS, st.sampled_from(Role)),
    st.builds(DeadlinePassed, st.sampled_from(Deadline)),
    st.builds(PeerWasLost, REASONS),
    st.builds(ChecksumsDiffered, LAYERS, st.sampled_from(["main_kv", "indexer_k"])),
    st.builds(LayoutsDiffered, st.lists(REASONS, max_size=2).map(tuple)),
    st.builds(PeerFailedRoom, REASONS),
)
DURATIONS = st.one_of(st.none(), st.floats(min_value=0.1, max_value=5.0))
CONFIGS = st.builds(
    DeadlineConfig,
    bootstrap_s=DURATIONS,
    waiting_for_input_s=DURATIONS,
    transfer_stall_s=DURATIONS,
    lease_s=DURATIONS,
)


@dataclass(frozen=True)
class Step:
    dt: float
    event: LegEvent | None  # None: feed whatever `expired(now)` reports, as a real caller does


STEPS = st.builds(
    Step,
    dt=st.floats(min_value=0.0, max_value=3.0),
    event=st.one_of(st.none(), EVENTS),
)

# The deadline each state may hold besides the lease.
OWN_DEADLINE = {
    KVPoll.Bootstrapping: Deadline.BOOTSTRAP,
    KVPoll.WaitingForInput: Deadline.WAITING_FOR_INPUT,
    KVPoll.Transferring: Deadline.TRANSFER_STALL,
}


def snapshot(m: LegMachine) -> tuple[object, ...]:
    return (
        m.state,
        m.failure,
        m.failure_event,
        m.layers,
        m.peer_matched,
        tuple(m.deadline(d) for d in Deadline),
    )


def check_invariants(m: LegMachine, expected: frozenset[int] | None) -> None:
    assert isinstance(m.state, KVPoll)
    assert (m.failure is not None) == (m.state is KVPoll.Failed)
    assert (m.failure_event is not None) == (m.state is KVPoll.Failed)
    armed = {d for d in Deadline if m.deadline(d) is not None}
    if m.state.is_terminal:
        assert armed == set()
    else:
        assert armed <= {OWN_DEADLINE[m.state], Deadline.LEASE}
    if m.state in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success):
        assert m.peer_matched
    if m.state is KVPoll.Success:
        assert m.layers
        if expected is not None:
            assert m.layers == expected
    if expected is not None:
        assert m.layers <= expected


@settings(max_examples=300, deadline=None)
@given(
    role=st.sampled_from(Role),
    config=CONFIGS,
    expected=st.one_of(st.none(), st.frozensets(LAYERS, min_size=1)),
    steps=st.lists(STEPS, max_size=40),
)
def test_random_sequences_keep_the_room_legal(
    role: Role,
    config: DeadlineConfig,
    expected: frozenset[int] | None,
    steps: list[Step],
) -> None:
    now = 0.0
    m = LegMachine(role, now=now, deadlines=config, layers=expected)
    first_failure: FailureEvent | None = None
    check_invariants(m, expected)
    for step in steps:
        now += step.dt
        events = (
            [DeadlinePassed(d) for d in m.expired(now)] if step.event is None else [step.event]
        )
        for event in events:
            before = snapshot(m)
            old = m.state
            try:
                changed = m.apply(event, now)
            except InvalidTransition:
                assert snapshot(m) == before, "a refused event changed the machine"
                assert not old.is_terminal
                continue
            if old.is_terminal:
                assert changed is False and snapshot(m) == before, "a terminal room moved"
            if not changed:
                assert snapshot(m) == before
            if snapshot(m) != before:
                assert changed
            if m.state is not old:
                assert TRANSITIONS[(old, type(event))] is m.state
            if m.state is KVPoll.Failed and first_failure is None:
                assert isinstance(event, FailureEvent)
                first_failure = event
            check_invariants(m, expected)
            if first_failure is not None:
                assert m.failure == first_failure.reason and m.failure_event is first_failure


@settings(max_examples=100, deadline=None)
@given(role=st.sampled_from(Role), config=CONFIGS, dts=st.lists(st.floats(0.0, 3.0), max_size=30))
def test_a_room_that_only_waits_fails_by_a_deadline_iff_one_is_armed(
    role: Role, config: DeadlineConfig, dts: list[float]
) -> None:
    now = 0.0
    m = LegMachine(role, now=now, deadlines=config)
    for dt in dts:
        now += dt
        for which in m.expired(now):
            m.apply(DeadlinePassed(which), now)
    nxt = m.next_deadline()
    if m.state is KVPoll.Failed:
        assert isinstance(m.failure_event, DeadlinePassed)
    else:
        assert m.state is KVPoll.Bootstrapping
        assert nxt is None or nxt[1] > now
