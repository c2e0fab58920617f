"""Effects: what the transfer session asks its driver to do. Pure data, no I/O.

The session (`session.TransferSession`) returns a list of these from every event; the driver
(`runtime.loop.ControlLoop`, one thread) executes them in order: control messages go out on ZMQ,
transfers are posted on the transport, hashing jobs go to the hasher pool, room views are
updated and their waiters woken. `EffectFilter` is the one seam tests use to drop, hold or
rewrite effects before the driver executes them (`kvhandoff.testing.faults.MessageFaults`): the
runtime puts it in front of the session (`runtime.seam.Filtered`), outside the driver's loop;
production installs none, and no effect exists for tests alone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvhandoff.buffers.checksum import ChecksumAlg
from kvhandoff.errors import Failure
from kvhandoff.kv_layout import SpanPlan
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll


class Notify(enum.Enum):
    """Whom a failing room tells, and how."""

    NONE = "none"  # the peer already knows (it told us) or is gone
    FAILED = "failed"  # a `Failed` message with the reason
    DROPPED = "dropped"  # a `Failed` saying this agent dropped its handshake with the peer
    ABORT = "abort"  # an `Abort` message (answered by `AbortAck`)


@dataclass(frozen=True, slots=True)
class Effect:
    """Base of every effect."""


INFO, WARNING, ERROR = 20, 30, 40  # the `logging` levels, without importing logging here


@dataclass(frozen=True, slots=True)
class Log(Effect):
    """Log `message` at `level` (the session does no I/O, logging included)."""

    level: int
    message: str
    exc: BaseException | None = None  # logged with its traceback


@dataclass(frozen=True, slots=True)
class Send(Effect):
    """Send control message `msg` to the agent at control address `addr`."""

    addr: str
    msg: P.Message


@dataclass(frozen=True, slots=True)
class Connect(Effect):
    """Connect the transport to generation `gen` of `peer` at its transport `address`, off
    the driver's thread (a connect may wait on the peer); answered by `events.Connected`."""

    peer: str
    address: bytes
    gen: int = 0
    #: the session key with the peer (b"": none), to bind the data plane to (bind_session)
    key: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class DropPeer(Effect):
    """Forget `peer`: disconnect the transport from it (off the driver's thread; answered by
    `events.Cancelled` with tag None) and close its control socket. When the transport knows
    that the peer's process has ended (`Transport.peer_exited`), the driver says so first
    (`events.PeerExited` with `gen`, the generation forgotten)."""

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
class WritePart:
    """One region of a `PostWrite`: its data `tag`, its local buffer `buffer` (written into
    the peer's buffer of the same name) and its `plan` (the region's `SpanPlan` as
    `build_spans` paired it)."""

    tag: int
    buffer: str
    plan: SpanPlan


@dataclass(frozen=True, slots=True)
class PostWrite(Effect):
    """One-sided: write the pieces of every part's plan (src offsets into local buffer
    `part.buffer`, dst offsets into `peer`'s buffer of the same name, installed by
    `RegisterRemote`) as they are, as one job (a layer's regions: one completion), hashing
    each part's source stream while copying when `checksum`, with the room's algorithm `alg`
    (`checksums.checksum_alg`); completion comes back as
    `events.Written(op)` once the bytes of every part landed, with one sum per part.

    `room`: the writes of one room to one peer may leave in one transport job with that room's
    other writes posted in the same pass of the driver (several short layers that were ready
    together: one job, one completion, still one `Written` per op); None: always alone."""

    op: int
    peer: str
    parts: tuple[WritePart, ...]
    checksum: bool
    alg: ChecksumAlg = ChecksumAlg.XXH3
    room: int | None = None


@dataclass(frozen=True, slots=True)
class RegisterRemote(Effect):
    """Install a connected peer's buffer descriptors (transport buffer name -> descriptor)
    for one-sided writes, off the driver's thread; answered by `events.RemoteRegistered`."""

    peer: str
    descriptors: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Cancel(Effect):
    """Cancel this side's pending ops of (`peer`, `tag`), off the driver's thread (a cancel may
    wait for a copy to stop); they still complete (with an error), and the outcome comes back
    as `events.Cancelled`."""

    peer: str
    tag: int


@dataclass(frozen=True, slots=True)
class HashSpans(Effect):
    """The checksum of each (buffer, offsets, nbytes) span list with the room's algorithm
    `alg` (`checksums.checksum_alg`: xxh3-64 over host bytes, or the device checksum computed
    where the buffer lives), off the control thread; the sums come back as
    `events.Hashed(job)` in the same order."""

    job: int
    spans: tuple[tuple[str, np.ndarray, np.ndarray], ...]
    alg: ChecksumAlg = ChecksumAlg.XXH3


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


class EffectFilter(Protocol):
    """What every effect of the session passes through before the driver executes it (tests
    only; `runtime.seam.Filtered` applies it). A filter may hold an effect back and hand it out
    later: it is asked for those at every tick, and the driver wakes up in time for the next
    one."""

    def __call__(self, effect: Effect, now: float) -> Iterable[Effect]:
        """The effects to execute now instead of `effect` (none: dropped or held)."""
        ...

    def due(self, now: float) -> Iterable[Effect]:
        """The effects held earlier whose time came by `now`, in order."""
        ...

    def next_due(self) -> float | None:
        """When the next held effect is due (None: none is held)."""
        ...
