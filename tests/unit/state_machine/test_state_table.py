"""The transition table as a graph: reachability, terminals, the one failure rule, purity."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest

import kvhandoff.state_machine as sm
from kvhandoff.errors import InvalidTransition
from kvhandoff.state_machine import (
    FAILURE_EVENTS,
    INITIAL,
    NON_TERMINAL,
    ROLE_EVENTS,
    TERMINAL,
    TRANSITIONS,
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    Deadline,
    DeadlinePassed,
    KVPoll,
    LayerLanded,
    LayerSent,
    LayoutsDiffered,
    LeaseRenewed,
    LegEvent,
    PeerFailedRoom,
    PeerMatched,
    PeerWasLost,
    RequestAccepted,
    Role,
    RoomAborted,
    next_state,
)

# One instance of every event type, to feed next_state.
SAMPLES: dict[type[LegEvent], LegEvent] = {
    PeerMatched: PeerMatched(),
    RequestAccepted: RequestAccepted(),
    LayerSent: LayerSent(0),
    LayerLanded: LayerLanded(0),
    AllLayersAcked: AllLayersAcked(),
    AllLayersLanded: AllLayersLanded(),
    LeaseRenewed: LeaseRenewed(),
    RoomAborted: RoomAborted("operator said so", Role.DECODE),
    DeadlinePassed: DeadlinePassed(Deadline.BOOTSTRAP),
    PeerWasLost: PeerWasLost("3 heartbeats missed"),
    ChecksumsDiffered: ChecksumsDiffered(3, "main_kv"),
    LayoutsDiffered: LayoutsDiffered(("page_size_tokens: prefill=64 decode=32",)),
    PeerFailedRoom: PeerFailedRoom("decode ran out of pages"),
}


def reachable(start: KVPoll, kinds: Iterable[type[LegEvent]]) -> set[KVPoll]:
    allowed = set(kinds)
    seen, todo = {start}, deque([start])
    while todo:
        state = todo.popleft()
        for (src, kind), dst in TRANSITIONS.items():
            if src == state and kind in allowed and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


def test_kvpoll_numbers_match_sglang_and_min_is_the_worst_rank() -> None:
    assert [(s.name, int(s)) for s in sorted(KVPoll)] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]
    assert min([KVPoll.Success, KVPoll.Transferring, KVPoll.Failed]) is KVPoll.Failed
    assert min([KVPoll.Success, KVPoll.WaitingForInput]) is KVPoll.WaitingForInput


def test_samples_cover_every_event_type() -> None:
    every = set().union(*ROLE_EVENTS.values())
    assert set(SAMPLES) == every
    assert {kind for (_, kind) in TRANSITIONS} == every


@pytest.mark.parametrize("role", list(Role))
def test_every_state_is_reachable_from_bootstrapping(role: Role) -> None:
    assert INITIAL is KVPoll.Bootstrapping
    assert reachable(INITIAL, ROLE_EVENTS[role]) == set(KVPoll)


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("state", NON_TERMINAL)
def test_every_non_terminal_state_can_reach_both_terminals(role: Role, state: KVPoll) -> None:
    assert TERMINAL <= reachable(state, ROLE_EVENTS[role])


def test_terminal_states_have_no_exit() -> None:
    assert TERMINAL == {KVPoll.Success, KVPoll.Failed}
    assert [key for key in TRANSITIONS if key[0] in TERMINAL] == []
    for state in TERMINAL:
        for event in SAMPLES.values():
            with pytest.raises(InvalidTransition, match="terminal"):
                next_state(state, event)


@pytest.mark.parametrize("state", NON_TERMINAL)
@pytest.mark.parametrize("kind", FAILURE_EVENTS)
def test_one_failure_rule_every_non_terminal_state_fails_on_every_failure(
    state: KVPoll, kind: type[LegEvent]
) -> None:
    assert next_state(state, SAMPLES[kind]) is KVPoll.Failed


def test_only_failure_events_lead_to_failed_and_every_failure_has_a_reason() -> None:
    into_failed = {kind for (_, kind), dst in TRANSITIONS.items() if dst is KVPoll.Failed}
    assert into_failed == set(FAILURE_EVENTS)
    for kind in FAILURE_EVENTS:
        reason = getattr(SAMPLES[kind], "reason", None)
        assert isinstance(reason, str) and reason.strip(), kind


@pytest.mark.parametrize("state", NON_TERMINAL)
def test_lease_renewed_is_allowed_everywhere_and_changes_nothing(state: KVPoll) -> None:
    assert next_state(state, LeaseRenewed()) is state


def test_the_decided_life_of_a_room() -> None:
    b, w, t = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
    assert next_state(b, PeerMatched()) is b
    assert next_state(b, RequestAccepted()) is w
    assert next_state(w, LayerSent(0), role=Role.PREFILL) is t
    assert next_state(w, LayerLanded(0), role=Role.DECODE) is t
    assert next_state(t, AllLayersAcked(), role=Role.PREFILL) is KVPoll.Success
    assert next_state(t, AllLayersLanded(), role=Role.DECODE) is KVPoll.Success
    # Success only after a layer moved.
    for state in (b, w):
        with pytest.raises(InvalidTransition, match="not allowed in state"):
            next_state(state, AllLayersLanded())


def test_invalid_transition_names_the_event_the_state_and_what_is_allowed() -> None:
    with pytest.raises(InvalidTransition) as info:
        next_state(KVPoll.Bootstrapping, LayerLanded(0))
    text = str(info.value)
    assert "LayerLanded" in text and "Bootstrapping" in text and "RequestAccepted" in text


@pytest.mark.parametrize(
    ("role", "event"),
    [
        (Role.DECODE, LayerSent(0)),
        (Role.DECODE, AllLayersAcked()),
        (Role.PREFILL, LayerLanded(0)),
        (Role.PREFILL, AllLayersLanded()),
    ],
)
def test_an_event_of_the_other_side_is_refused(role: Role, event: LegEvent) -> None:
    with pytest.raises(InvalidTransition, match=f"not an event of the {role} side"):
        next_state(KVPoll.Transferring, event, role=role)


def test_the_package_is_pure_stdlib_only() -> None:
    allowed = {"__future__", "enum", "dataclasses", "typing", "types", "math", "collections"}
    package = Path(sm.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ok = (
                    name.split(".")[0] in allowed
                    or name == "kvhandoff.errors"
                    or (name.startswith("kvhandoff.state_machine"))
                )
                assert ok, f"{path.name} imports {name}"


def test_public_names_are_exported() -> None:
    assert sorted(sm.__all__) == sorted(set(sm.__all__))
    for name in sm.__all__:
        assert hasattr(sm, name), name
