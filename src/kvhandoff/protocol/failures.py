"""From the state machine's failure events to the typed `Failure` a room carries.

Pure: the room machine speaks in events (`PeerWasLost`, `ChecksumsDiffered`, ...); engines get a
`Failure` (kind + reason + details) and, from a blocking call, its `RoomFailed` subclass.
"""

from __future__ import annotations

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.state_machine import (
    ChecksumsDiffered,
    DeadlinePassed,
    FailureEvent,
    LayoutsDiffered,
    PeerWasLost,
    RoomAborted,
)


def failure_of(ev: FailureEvent, kind: FailureKind | None = None) -> Failure:
    """The `Failure` of a state-machine failure event (`kind` overrides the event's own)."""
    if isinstance(ev, ChecksumsDiffered):
        return Failure(kind or FailureKind.CHECKSUM, ev.reason, layer=ev.layer, region=ev.region)
    if isinstance(ev, LayoutsDiffered):
        return Failure(kind or FailureKind.LAYOUT_MISMATCH, ev.reason, diff=ev.diff)
    if isinstance(ev, DeadlinePassed):
        return Failure(kind or FailureKind.DEADLINE, ev.reason, deadline=str(ev.which))
    if isinstance(ev, RoomAborted):
        return Failure(kind or FailureKind.ABORTED, ev.reason)
    if isinstance(ev, PeerWasLost):
        return Failure(kind or FailureKind.PEER_LOST, ev.reason)
    return Failure(kind or FailureKind.REMOTE_FAILED, ev.reason)


def remote_failure(kind: str, reason: str) -> Failure:
    """The `Failure` of a peer's `Failed`/`Abort` message: its kind when it named a known one
    (older peers send none), else REMOTE_FAILED; `remote` is set."""
    try:
        k = FailureKind(kind)
    except ValueError:
        k = FailureKind.REMOTE_FAILED
    return Failure(k, reason, remote=True)
