"""The one error tree of kvhandoff.

Rules: every error kvhandoff raises derives from `KVHandoffError`; each class carries an
`http_status` hint so one FastAPI handler can map any of them to a response. Messages say what
was expected, what came, and what to do. Raise (chained with ``from``), never log-and-return.
"""

from __future__ import annotations


class KVHandoffError(Exception):
    """Root of every kvhandoff error."""

    http_status: int = 500


class ConfigError(KVHandoffError):
    """A setting or argument is invalid."""

    http_status = 400


class LayoutMismatch(KVHandoffError):
    """Two layouts differ; `diff` lists each differing field with both values."""

    http_status = 409

    def __init__(self, message: str, diff: list[str] | None = None) -> None:
        self.diff = list(diff or [])
        super().__init__(message if not self.diff else f"{message}: {'; '.join(self.diff)}")


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
    """A bounded wait ran out (the caller set the bound)."""

    http_status = 504


class ChecksumMismatch(KVHandoffError):
    """Bytes that landed do not hash to what the sender computed."""

    http_status = 500


class RoomFailed(KVHandoffError):
    """A room ended Failed; the message is the room's failure reason."""

    http_status = 409
