"""The life cycle of a room (`KVPoll`), sans-IO: states, events, the transition table, deadlines.

Pure: standard library only, no I/O, no clock (the caller passes `now`). Start with
`transitions.py` (the table and the decided life of a room), then `leg.py` (`LegMachine`, one
per leg: guards and deadlines); docs/STATE_MACHINE.md has the diagram and the rules.
"""

from kvhandoff.state_machine.diagram import diagram_edges, render_dot, render_mermaid
from kvhandoff.state_machine.leg import DeadlineConfig, LegMachine
from kvhandoff.state_machine.transitions import (
    FAILURE_EVENTS,
    INITIAL,
    NON_TERMINAL,
    ROLE_EVENTS,
    TERMINAL,
    TRANSITIONS,
    next_state,
)
from kvhandoff.state_machine.vocabulary import (
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    Deadline,
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

__all__ = [
    "FAILURE_EVENTS",
    "INITIAL",
    "NON_TERMINAL",
    "ROLE_EVENTS",
    "TERMINAL",
    "TRANSITIONS",
    "RoomAborted",
    "AllLayersAcked",
    "AllLayersLanded",
    "ChecksumsDiffered",
    "Deadline",
    "DeadlineConfig",
    "DeadlinePassed",
    "LegEvent",
    "FailureEvent",
    "KVPoll",
    "LayerLanded",
    "LayerSent",
    "LayoutsDiffered",
    "LeaseRenewed",
    "PeerWasLost",
    "PeerMatched",
    "PeerFailedRoom",
    "Role",
    "LegMachine",
    "RequestAccepted",
    "diagram_edges",
    "next_state",
    "render_dot",
    "render_mermaid",
]
