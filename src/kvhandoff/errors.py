"""The one error tree of kvhandoff.

Rules: every error kvhandoff raises derives from `KVHandoffError`; each class carries an
`http_status` hint so one FastAPI handler can map any of them to a response. Messages say what
was expected, what came, and what to do. Raise (chained with ``from``), never log-and-return.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass


class KVHandoffError(Exception):
    """Root of every kvhandoff error."""

    http_status: int = 500


class ConfigError(KVHandoffError):
    """A setting or argument is invalid."""

    http_status = 400


class InvalidTransition(KVHandoffError):
    """An event is not allowed in the current state of a room."""

    http_status = 409


class ProtocolError(KVHandoffError):
    """A control message is malformed, of an unknown kind, or of another protocol version."""

    http_status = 400

    def __init__(self, message: str, *, remote: bool = False) -> None:
        self.remote = remote
        super().__init__(message)


class BootstrapError(KVHandoffError):
    """The bootstrap server refused a request or could not be reached."""

    http_status = 502


class BootstrapNotFound(BootstrapError):
    """Unknown rank, engine or room. For a heartbeat it means: the rank was dropped (TTL, server
    restart); register again."""

    http_status = 404


class BootstrapConflict(BootstrapError):
    """The request disagrees with what is registered (topology, layout, generation, an aborted
    room); `diff` lists each differing field with both values."""

    http_status = 409

    def __init__(self, message: str, diff: list[str] | None = None) -> None:
        self.diff = list(diff or [])
        super().__init__(message if not self.diff else f"{message}: {'; '.join(self.diff)}")


class BootstrapUnavailable(BootstrapError):
    """Not ready yet (ranks missing, room not bound yet) or unreachable; retry later."""

    http_status = 503


class BootstrapUnauthorized(BootstrapError):
    """A write without the right bearer token."""

    http_status = 401


class BootstrapBadRequest(BootstrapError):
    """The server rejected the request as malformed (400, 413, 422)."""

    http_status = 400


class TransportError(KVHandoffError):
    """The data transport failed (connect, send, receive, registration)."""

    http_status = 502


class TransferTimeout(KVHandoffError):
    """A bounded wait ran out (the caller set the bound); the room itself did not fail."""

    http_status = 504


# --- room failures ---------------------------------------------------------------------------


class FailureKind(str, enum.Enum):
    """Why a room failed: every failure carries one (and its reason text)."""

    LAYOUT_MISMATCH = "layout_mismatch"
    """The handshake refused the peer: layouts differ (or its Hello did not authenticate)."""
    CHECKSUM = "checksum"
    """Landed bytes did not verify, twice (the one retransmit did not help)."""
    PEER_LOST = "peer_lost"
    """The peer went silent (missed heartbeats), restarted, or dropped this agent."""
    ABORTED = "aborted"
    """An engine (this side or the other) aborted the room, or its agent closed."""
    DEADLINE = "deadline"
    """A deadline of the room passed unmet (bootstrap, waiting for input, stall, lease)."""
    REMOTE_FAILED = "remote_failed"
    """The peer failed the room without saying why in a known kind, or another rank of the
    room failed."""
    INVALID_REQUEST = "invalid_request"
    """The transfer request or its answer does not fit this side (lengths, pages, planes)."""
    TRANSPORT = "transport"
    """A data-transport operation failed (send or receive of a layer)."""
    BOOTSTRAP = "bootstrap"
    """The bootstrap server could not name a prefill rank for the room."""
    ADMISSION = "admission"
    """The prefill refused the transfer request before any byte moved: the allocation
    policies differ, the prompts (or the decode's cached prefix) differ, or it does not fit."""
    INTERNAL = "internal"
    """This agent met a bug while handling the room (logged with its traceback)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """One room failure: its kind and reason, and what the kind knows more (the layer and
    region of a checksum mismatch, the diff of a layout mismatch, the deadline that expired).
    `remote` is True when the peer reported it."""

    kind: FailureKind
    reason: str
    _: KW_ONLY
    remote: bool = False
    layer: int | None = None
    region: str | None = None
    diff: tuple[str, ...] = ()
    deadline: str | None = None

    def error(self, room: int | None = None) -> RoomFailed:
        """The typed error a blocking call raises for this failure."""
        return _ERROR_OF_KIND[self.kind](self, room=room)

    def __str__(self) -> str:
        return self.reason


class RoomFailed(KVHandoffError):
    """A room ended Failed. `failure` holds the kind and the reason (the message), `room` the
    room id. Each `FailureKind` has its own subclass; catch this one for all of them."""

    http_status = 409

    def __init__(self, failure: Failure | str, *, room: int | None = None) -> None:
        if isinstance(failure, str):
            failure = Failure(FailureKind.REMOTE_FAILED, failure)
        self.failure = failure
        self.room = room
        self.kind = failure.kind
        self.reason = failure.reason
        where = f"room {room}: " if room is not None else ""
        super().__init__(f"{where}{failure.reason}")


class LayoutMismatch(RoomFailed):
    """The two sides' layouts differ; `diff` lists each differing field with both values."""

    @property
    def diff(self) -> list[str]:
        return list(self.failure.diff)


class ChecksumMismatch(RoomFailed):
    """Bytes that landed do not hash to what the sender computed, again after the retransmit:
    `layer` and `region` name where."""

    http_status = 500

    @property
    def layer(self) -> int | None:
        return self.failure.layer

    @property
    def region(self) -> str | None:
        return self.failure.region


class PeerLost(RoomFailed):
    """The peer stopped answering, restarted, or dropped this agent."""

    http_status = 502


class Aborted(RoomFailed):
    """The room was aborted (by an engine or a closing agent); the reason says by whom."""


class DeadlineExpired(RoomFailed, TransferTimeout):
    """A deadline of the room passed unmet; `deadline` names it (also a `TransferTimeout`)."""

    http_status = 504

    @property
    def deadline(self) -> str | None:
        return self.failure.deadline


class RemoteFailed(RoomFailed):
    """The peer failed the room (or another rank of the room did), with its reason."""


class InvalidRequest(RoomFailed):
    """The transfer request or its answer does not fit this side."""

    http_status = 400


class TransportFailed(RoomFailed, TransportError):
    """A data-transport operation of the room failed."""

    http_status = 502


class BootstrapFailed(RoomFailed, BootstrapError):
    """The bootstrap server named no prefill rank for the room (or could not be reached)."""

    http_status = 502


class AdmissionRefused(RoomFailed):
    """The transfer request was refused at the handshake, before any byte moved (policy,
    prompt/prefix or capacity; the reason says which, with both values)."""


_ERROR_OF_KIND: dict[FailureKind, type[RoomFailed]] = {
    FailureKind.LAYOUT_MISMATCH: LayoutMismatch,
    FailureKind.CHECKSUM: ChecksumMismatch,
    FailureKind.PEER_LOST: PeerLost,
    FailureKind.ABORTED: Aborted,
    FailureKind.DEADLINE: DeadlineExpired,
    FailureKind.REMOTE_FAILED: RemoteFailed,
    FailureKind.INVALID_REQUEST: InvalidRequest,
    FailureKind.TRANSPORT: TransportFailed,
    FailureKind.BOOTSTRAP: BootstrapFailed,
    FailureKind.ADMISSION: AdmissionRefused,
    FailureKind.INTERNAL: RoomFailed,
}
