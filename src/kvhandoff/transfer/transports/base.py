# The one small interface every data transport implements (ucx, tcp, inproc).
#
# Rules:
# - A "span list" (offsets, nbytes: int64 arrays of equal length into one registered buffer)
#   describes the bytes of one message stream. A send with span list S and a receive with span
#   list D of the same (peer, tag) move concat(S) into concat(D); the lists may cut the stream
#   at different places, only their totals must agree.
# - post_send / post_recv validate their arguments synchronously (bad input raises
#   TransportError naming the field) and never block on the network; completion is reported
#   once per op through on_done, always from the transport's own thread, never while holding a
#   lock the caller might need.
# - After cancel() / disconnect() / close() return, no op they ended writes into memory.
# - Backends are imported by name on first use (load_transport), so a missing optional
#   dependency only matters when that backend is chosen.
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvhandoff.errors import TransportError

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

OnDone = Callable[[BaseException | None], None]

#: Tags the agent passes must be below this; the bits above belong to the transport.
TAG_LIMIT = 1 << 40


@dataclass(frozen=True)
class TransportStatus:
    """What a transport reports for readiness and metrics."""

    kind: str
    lanes: tuple[str, ...]
    degraded: bool
    reason: str
    bytes_sent: int
    bytes_received: int


class Transport(ABC):
    """A two-sided, tagged data transport between agents (see module comment)."""

    kind: ClassVar[str]

    @abstractmethod
    def __init__(self, settings: Settings) -> None: ...

    @property
    @abstractmethod
    def address(self) -> bytes:
        """Opaque address of this transport; peers pass it to `connect`."""

    @abstractmethod
    def register(self, name: str, buf: np.ndarray) -> None:
        """Registers a 1-D uint8 buffer under a unique name."""

    @abstractmethod
    def connect(self, peer: str, address: bytes) -> None:
        """Connects to a peer agent (idempotent for the same address)."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forgets a peer; its pending ops complete with a TransportError."""

    @abstractmethod
    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        """Sends the bytes of a span list of buffer `name` to `peer` under `tag`."""

    @abstractmethod
    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        """Receives the bytes `peer` sends under `tag` into a span list of buffer `name`."""

    @abstractmethod
    def cancel(self, peer: str, tag: int) -> None:
        """Cancels this side's pending ops of (peer, tag); their on_done gets an error."""

    @abstractmethod
    def status(self) -> TransportStatus:
        """Current status (kind, lanes, degraded, counters)."""

    @abstractmethod
    def close(self) -> None:
        """Fails pending ops, joins threads, releases resources. Safe to call twice."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BACKENDS = {
    "ucx": "kvhandoff.transfer.transports.ucx:UcxTransport",
    "tcp": "kvhandoff.transfer.transports.tcp:TcpTransport",
    "inproc": "kvhandoff.transfer.transports.inproc:InprocTransport",
}


def load_transport(kind: str, settings: Settings) -> Transport:
    """Builds the transport `kind` ("ucx", "tcp" or "inproc"), importing its module on first use.

    Raises:
        TransportError: unknown kind, or the backend's dependency cannot be imported.
    """
    target = _BACKENDS.get(kind)
    if target is None:
        raise TransportError(f"transport: unknown kind {kind!r}; expected one of "
                             f"{', '.join(sorted(_BACKENDS))}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TransportError(f"transport {kind!r} cannot be loaded: {e}; install its dependency "
                             "or choose another transport") from e
    cls: type[Transport] = getattr(module, cls_name)
    return cls(settings)
