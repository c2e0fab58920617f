"""The transition table of a room, as data.

Rule 1: everything that decides whether an event may move a room, and where to, lives in
`TRANSITIONS` (plus the per-side event sets in `ROLE_EVENTS`). `LegMachine` only adds guards
that need memory the table cannot hold (which layers came, whether the peer was matched) and
the deadlines.

The life of a room, decided here (see docs/STATE_MACHINE.md for the diagram):

    decode:   Bootstrapping --PeerMatched--> Bootstrapping      (Hello exchanged; it now sends
                                                                 the TransferRequest)
              Bootstrapping --RequestAccepted--> WaitingForInput (prefill accepted it)
              WaitingForInput --LayerLanded--> Transferring --LayerLanded--> Transferring
              Transferring --AllLayersLanded--> Success        (it then sends RoomAck)
    prefill:  Bootstrapping --PeerMatched--> Bootstrapping      (decode's Hello came)
              Bootstrapping --RequestAccepted--> WaitingForInput (we accepted its request)
              WaitingForInput --LayerSent--> Transferring --LayerSent--> Transferring
              Transferring --AllLayersAcked--> Success          (RoomAck came: free the pages)
    both:     any non-terminal --LeaseRenewed--> itself
              any non-terminal --any failure event--> Failed   (the one failure rule)
              Success, Failed: terminal, no row leaves them.

A room reaches Success only from Transferring: at least one layer moved first.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from kvhandoff.errors import InvalidTransition
from kvhandoff.state_machine.vocabulary import (
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    DeadlinePassed,
    FailureEvent,
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
)

INITIAL: Final = KVPoll.Bootstrapping
TERMINAL: Final = frozenset({KVPoll.Success, KVPoll.Failed})
NON_TERMINAL: Final = tuple(s for s in KVPoll if s not in TERMINAL)

FAILURE_EVENTS: Final[tuple[type[FailureEvent], ...]] = (
    RoomAborted,
    DeadlinePassed,
    PeerWasLost,
    ChecksumsDiffered,
    LayoutsDiffered,
    PeerFailedRoom,
)

_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring

_PROGRESS: dict[tuple[KVPoll, type[LegEvent]], KVPoll] = {
    (_B, PeerMatched): _B,
    (_B, RequestAccepted): _W,
    (_W, LayerSent): _T,
    (_T, LayerSent): _T,
    (_W, LayerLanded): _T,
    (_T, LayerLanded): _T,
    (_T, AllLayersAcked): KVPoll.Success,
    (_T, AllLayersLanded): KVPoll.Success,
}

TRANSITIONS: Final[MappingProxyType[tuple[KVPoll, type[LegEvent]], KVPoll]] = MappingProxyType(
    {
        **_PROGRESS,
        **{(s, LeaseRenewed): s for s in NON_TERMINAL},
        # The one failure rule: any non-terminal state + any failure event -> Failed.
        **{(s, f): KVPoll.Failed for s in NON_TERMINAL for f in FAILURE_EVENTS},
    }
)
"""(state, event type) -> next state. A pair that is absent is not allowed."""

_COMMON: Final[frozenset[type[LegEvent]]] = frozenset(
    {PeerMatched, RequestAccepted, LeaseRenewed, *FAILURE_EVENTS}
)

ROLE_EVENTS: Final[MappingProxyType[Role, frozenset[type[LegEvent]]]] = MappingProxyType(
    {
        Role.PREFILL: _COMMON | {LayerSent, AllLayersAcked},
        Role.DECODE: _COMMON | {LayerLanded, AllLayersLanded},
    }
)
"""The event types each side may receive: only prefill sends layers, only decode lands them."""


def next_state(state: KVPoll, event: LegEvent, *, role: Role | None = None) -> KVPoll:
    """The state a room in `state` moves to on `event`.

    Args:
        state: the room's current state.
        event: the event that happened.
        role: when given, also refuse an event that only the other side receives.

    Raises:
        InvalidTransition: the event is not allowed in `state` (every event in a terminal
            state), or not on `role`'s side.
    """
    kind = type(event)
    if role is not None and kind not in ROLE_EVENTS[role]:
        raise InvalidTransition(
            f"{kind.__name__} is not an event of the {role} side; "
            f"it takes {', '.join(sorted(k.__name__ for k in ROLE_EVENTS[role]))}"
        )
    try:
        return TRANSITIONS[(state, kind)]
    except KeyError:
        allowed = sorted(k.__name__ for (s, k) in TRANSITIONS if s == state)
        raise InvalidTransition(
            f"{kind.__name__} is not allowed in state {state.name}; "
            + (f"allowed: {', '.join(allowed)}" if allowed else "the state is terminal")
        ) from None
