"""Effects: what the transfer session asks its driver to do. Pure data, no I/O.

The session (`session.TransferSession`) returns a list of these from every event; the driver
(`control.ControlLoop`, one thread) executes them in order: control messages go out on ZMQ,
transfers are posted on the transport, hashing jobs go to the hasher pool, room views are
updated and their waiters woken. `EffectFilter` is the one seam tests use to drop, delay or
rewrite effects before the driver executes them (`kvhandoff.testing.faults`); production
installs none.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.errors import Failure
from kvhandoff.state_machine import KVPoll


class Notify(enum.Enum):
    """Whom a failing room tells, and how."""

    NONE = "none"  # the peer already knows (it told us) or is gone
    FAILED = "failed"  # a `Failed` message with the reason
    ABORT = "abort"  # an `Abort` message (answered by `AbortAck`)


@dataclass(frozen=True, slots=True)
class Effect:
    """Base of every effect."""


INFO, WARNING = 20, 30  # the `logging` levels, without importing logging here


@dataclass(frozen=True, slots=True)
class Log(Effect):
    """Log `message` at `level` (the session does no I/O, logging included)."""

    level: int
    message: str


@dataclass(frozen=True, slots=True)
class Send(Effect):
    """Send control message `msg` to the agent at control address `addr`."""

    addr: str
    msg: Any  # a `protocol.Message`


@dataclass(frozen=True, slots=True)
class Delayed(Effect):
    """Execute `effect` `after_s` seconds from now (only effect filters produce this)."""

    after_s: float
    effect: Effect


@dataclass(frozen=True, slots=True)
class Connect(Effect):
    """Connect the transport to `peer` at its transport `address`; the driver answers with
    `events.Connected` before anything else happens."""

    peer: str
    address: bytes


@dataclass(frozen=True, slots=True)
class DropPeer(Effect):
    """Forget `peer`: disconnect the transport from it and close its control socket. When
    the transport knows that the peer's process has ended (`Transport.peer_exited`), the
    driver says so first (`events.PeerExited` with `gen`, the generation forgotten)."""

    peer: str
    gen: int = 0


@dataclass(frozen=True, slots=True)
class PostSend(Effect):
    """Post a send of span list (offsets, nbytes) of buffer `buffer` to `peer` under `tag`;
    its completion comes back as `events.OpDone(op)`."""

    op: int
    peer: str
    tag: int
    buffer: str
    offsets: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True, slots=True)
class PostRecv(Effect):
    """Post a receive from `peer` under `tag` into a span list of buffer `buffer`;
    its completion comes back as `events.OpDone(op)`."""

    op: int
    peer: str
    tag: int
    buffer: str
    offsets: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True, slots=True)
class PostWrite(Effect):
    """One-sided: write span list (offsets, nbytes) of local buffer `buffer` into span list
    (remote_offsets, nbytes) of `peer`'s buffer of the same name (installed by
    `RegisterRemote`), hashing the source stream while copying when `checksum`, with the
    room's algorithm `alg` ("xxh3" or "devsum", `handshake.checksum_alg`); completion comes
    back as `events.Written(op)` once the bytes landed."""

    op: int
    peer: str
    tag: int
    buffer: str
    offsets: np.ndarray
    nbytes: np.ndarray
    remote_offsets: np.ndarray
    checksum: bool
    alg: str = "xxh3"


@dataclass(frozen=True, slots=True)
class RegisterRemote(Effect):
    """Install a connected peer's buffer descriptors (transport buffer name -> descriptor)
    for one-sided writes; the driver answers with `events.RemoteRegistered` at once."""

    peer: str
    descriptors: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Cancel(Effect):
    """Cancel this side's pending ops of (`peer`, `tag`); they still complete (with an error)."""

    peer: str
    tag: int


@dataclass(frozen=True, slots=True)
class HashSpans(Effect):
    """The checksum of each (buffer, offsets, nbytes) span list with the room's algorithm
    `alg` ("xxh3": xxh3-64 over host bytes; "devsum": the device checksum, computed where the
    buffer lives), off the control thread; the sums come back as `events.Hashed(job)` in the
    same order."""

    job: int
    spans: tuple[tuple[str, np.ndarray, np.ndarray], ...]
    alg: str = "xxh3"


@dataclass(frozen=True, slots=True)
class RoomUpdate(Effect):
    """A room's state as the engine sees it changed: update its view, wake its waiters.
    `landed` holds the layers that landed (and verified) on every leg."""

    token: object
    state: KVPoll
    failure: Failure | None
    landed: frozenset[int]
    done: bool


@dataclass(frozen=True, slots=True)
class Release(Effect):
    """The room is terminal and nothing of it is in flight: its pages may be reused (mark the
    view released, call the engine's `on_release`)."""

    token: object
    room: int


EffectFilter = Callable[[Effect], Iterable[Effect]]
"""Takes one effect, returns the effects to execute instead (none: dropped)."""
