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
# - cancel() / disconnect() never wait on the peer. An op's on_done comes only once nothing of
#   it writes into memory any more (a send or write: its local copy stopped; a receive the
#   peer was writing into: the peer confirmed it stopped, or its process is gone, or a bound
#   passed): until then the caller keeps the op's memory. When cancel() of a one-sided write
#   returns, nothing more of it lands in the peer. close() calls every pending on_done.
# - Backends are imported by name on first use (load_transport), so a missing optional
#   dependency only matters when that backend is chosen.
# - One-sided writes are an optional capability (`supports_write`): the receiver publishes a
#   descriptor of a registered buffer (`describe`), the writer installs it (`register_remote`)
#   and writes span lists straight into it (`post_write`) without the receiver posting
#   anything; `fence` completes once every write posted to that peer before it has landed.
#   The same span-list rule holds: source and destination lists may cut the stream
#   differently, only their totals must agree. A transport without the capability raises
#   TransportError from these methods; the agent then uses post_send / post_recv.
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.settings import TransportKind as TransportKind  # one enum (settings, Hello)

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

OnDone = Callable[[BaseException | None], None]
#: Completion of a one-sided write: (error or None, xxh3-64 of the source stream or None).
OnWritten = Callable[[BaseException | None, int | None], None]

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

    kind: ClassVar[TransportKind]
    #: Whether describe / register_remote / post_write / fence are implemented.
    supports_write: ClassVar[bool] = False

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

    # ---- one-sided writes (optional capability, see module comment) ------------------------

    def describe(self, name: str) -> bytes:
        """Descriptor of registered buffer `name` for a peer's `register_remote`."""
        raise self._no_write("describe")

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        """Installs a connected peer's buffer descriptor under `name` (for post_write)."""
        raise self._no_write("register_remote")

    def post_write(self, peer: str, tag: int, name: str, offsets: np.ndarray,
                   nbytes: np.ndarray, remote: str, remote_offsets: np.ndarray,
                   remote_nbytes: np.ndarray, on_done: OnWritten, *,
                   checksum: bool = False) -> None:
        """Writes the bytes of a span list of local buffer `name` into a span list of the
        peer's buffer `remote` (see register_remote); `on_done(err, digest)` once they landed,
        `digest` the xxh3-64 of the source stream when `checksum`. cancel(peer, tag) ends it."""
        raise self._no_write("post_write")

    def fence(self, peer: str, on_done: OnDone) -> None:
        """on_done once every write posted to `peer` before this call has ended."""
        raise self._no_write("fence")

    def peer_exited(self, peer: str) -> bool:
        """True only when this transport knows that `peer`'s process has ended (a same-host
        peer's pidfd), so nothing of it can write into this process's memory any more.
        False when it cannot tell (the default; peers on other hosts)."""
        return False

    def _no_write(self, what: str) -> TransportError:
        return TransportError(f"{what}: the {self.kind} transport has no one-sided writes "
                              "(supports_write is False); use post_send / post_recv")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BACKENDS = {
    TransportKind.UCX: "kvhandoff.transfer.transports.ucx:UcxTransport",
    TransportKind.TCP: "kvhandoff.transfer.transports.tcp:TcpTransport",
    TransportKind.SHM: "kvhandoff.transfer.transports.shm:ShmTransport",
    TransportKind.AUTO: "kvhandoff.transfer.transports.auto:AutoTransport",
    TransportKind.NIXL: "kvhandoff.transfer.transports.nixl:NixlTransport",
    TransportKind.INPROC: "kvhandoff.transfer.transports.inproc:InprocTransport",
}


def load_transport(kind: str, settings: Settings) -> Transport:
    """Builds the transport `kind` ("ucx", "tcp", "shm" or "inproc"; a TransportKind is a str
    too), importing its module on first use.

    Raises:
        TransportError: unknown kind, or the backend's dependency cannot be imported.
    """
    target = _BACKENDS.get(kind)  # type: ignore[call-overload,unused-ignore]
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
