# The one small interface every data transport implements (tcp, ucx, shm, nixl, auto, inproc).
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
# - One-sided writes are an optional capability, a type: `OneSidedTransport` (shm, nixl, auto
#   implement it; `isinstance(t, OneSidedTransport)` is the check, never hasattr): the receiver
#   publishes a
#   descriptor of a registered buffer (`describe`), the writer installs it (`register_remote`)
#   and writes span plans straight into it without the receiver posting anything. The write
#   API is ONE method, `post_writes`: a job of one or more writes (a layer's regions: (tag,
#   name, remote, plan) each; a single write is a job of one) with one completion,
#   on_done(WriteResult): the error, one digest per write in order (the xxh3-64 of that
#   write's own source stream, with `checksum`), and the landed sums where the writer read
#   what it wrote (below). There is no fence: the agent waits on each job, never on a peer's
#   writes as a group. Each plan is a kv_layout.SpanPlan, paired (src offset, dst offset,
#   nbytes) pieces, built once by build_spans and taken as is: a transport checks its bounds
#   and copies its pieces, it never re-pairs them. Without the capability the agent uses
#   post_send / post_recv. Whether writes to one connected peer are possible is asked, never
#   learnt from an error: `can_write(peer)` (auto: whether that peer's route is a one-sided
#   part). One query goes with it: `write_digest_alg(name)` (the algorithm of the digests:
#   whether the transport's hash while copying is the room's).
# - A transport that copies a job as one (shm's host lanes) keeps it under the first write's
#   tag, and cancel of any of the tags ends it (the others' cancels find nothing); one that
#   cannot copy a job as one posts each write as a job of its own under its own tag and
#   completes once the last one did (`_split_writes`, private to the transports), carrying
#   each write's digest and landed sum on. A transport that can read the peer's memory
#   (shm's map lane, with `checksum`) fills WriteResult.landed itself: one sum per write of its
#   destination pieces as the writer read them right after copying them (the writer's
#   verification; None for a write it could not read; () when it read none). There is no
#   second call to read what landed: the result is the one place it comes from.
from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.settings import TransportKind as TransportKind  # one enum (settings, Hello)

if TYPE_CHECKING:
    from kvhandoff.kv_layout.spans import SpanPlan
    from kvhandoff.settings import Settings

OnDone = Callable[[BaseException | None], None]


@dataclass(frozen=True, slots=True)
class WriteResult:
    """How a `post_writes` job ended: its on_done's one argument.

    Attributes:
        error: None when every write landed, else the job's (first) error.
        digests: on success one per write, in order: the xxh3-64 of that write's source
            stream (the src pieces in plan order) when the job was posted with `checksum`,
            else None; () when the job failed.
        landed: one per write, the xxh3-64 of its destination pieces in plan order as the
            writer read them right after copying each (shm's map lane, with `checksum`: the
            writer's verification, a job split across lanes included), None for a write it
            did not read; () where the transport read nothing back (every other lane, or a
            failed job).
    """

    error: BaseException | None
    digests: tuple[int | None, ...] = ()
    landed: tuple[int | None, ...] = ()

    def writes(self, start: int, stop: int) -> WriteResult:
        """The result of writes start..stop-1 of the job (a caller that posted several
        callers' writes as one job hands each its own)."""
        return WriteResult(self.error, self.digests[start:stop], self.landed[start:stop])


#: Completion of a `post_writes` job: called once with its WriteResult.
OnWritten = Callable[[WriteResult], None]


#: One write of a `post_writes` job: (tag, local buffer name, remote buffer name, plan).
WriteSpec = tuple[int, str, str, "SpanPlan"]

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
    #: what the transport refused, by name (tcp: chunks of unproven connections, ...)
    counters: dict[str, int] = field(default_factory=dict)


class Transport(ABC):
    """A two-sided, tagged data transport between agents (see module comment)."""

    kind: ClassVar[TransportKind]

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

    def bind_session(self, peer: str, key: bytes) -> None:
        """Binds the data connections with `peer` to the control session whose key is `key`
        (the HKDF session key of `protocol.wire.session_key`; b"" without a secret); called
        before each `connect` of that session. A transport whose data plane proves itself
        under that key takes it (tcp); the default ignores it (see docs/SECURITY.md)."""
        return None

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

    def peer_exited(self, peer: str) -> bool:
        """True only when this transport knows that `peer`'s process has ended (a same-host
        peer's pidfd), so nothing of it can write into this process's memory any more.
        False when it cannot tell (the default; peers on other hosts)."""
        return False

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OneSidedTransport(Transport):
    """A transport with one-sided writes (see module comment)."""

    @abstractmethod
    def describe(self, name: str) -> bytes:
        """Descriptor of registered buffer `name` for a peer's `register_remote`."""

    def can_write(self, peer: str) -> bool:
        """Whether one-sided writes to connected `peer` are possible (its buffers can be
        installed with register_remote and written). True here: every peer; a transport
        whose capability depends on the peer (auto: the peer's route) answers per peer."""
        return True

    @abstractmethod
    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        """Installs a connected peer's buffer descriptor under `name` (for post_writes);
        only for a peer that `can_write` says yes to (else TransportError)."""

    @abstractmethod
    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """Writes the pieces of each plan (`writes`: (tag, name, remote, plan) each, distinct
        tags; src_offsets into local buffer `name`, dst_offsets into the peer's buffer
        `remote`, see register_remote) as they are, as one job: `on_done(WriteResult)` once
        all landed (or with the first error once every one ended; see WriteResult for its
        digests, per write of the source stream when `checksum`, and landed sums).
        cancel(peer, tag) of any of the tags ends it. A single write is a job of one."""

    def write_digest_alg(self, name: str) -> str | None:
        """The algorithm of post_writes(checksum=True)'s digest for local buffer `name`; None
        when the transport does not say (the caller then takes it for xxh3 of host memory)."""
        return None


class _PostsWrites(Protocol):
    """Whatever has the `post_writes` of a one-sided transport (the transport, or the part
    of it that writes: shm's writer)."""

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None: ...


def _split_writes(transport: _PostsWrites, peer: str, writes: Sequence[WriteSpec],
                 on_done: OnWritten, *, checksum: bool = False) -> None:
    """`post_writes` as one job per write, each under its own tag (`_post_in_groups`); the
    transport's `post_writes` of a single write must not come back here."""
    if not callable(on_done):
        raise TransportError("post_writes: on_done must be callable")

    def post(idx: Sequence[int], done: OnWritten) -> None:
        transport.post_writes(peer, [writes[idx[0]]], done, checksum=checksum)

    _post_in_groups(post, [[i] for i in range(len(writes))], on_done)


def _post_in_groups(post: Callable[[Sequence[int], OnWritten], None],
                    groups: Sequence[Sequence[int]], on_done: OnWritten) -> None:
    """A `post_writes` job of writes 0..n-1 posted as several jobs, `post(indices, done)` for
    each group of write indices (every index in one group): `on_done` once the last group's
    completion came, with the first error, else the digests in write order and the landed
    sums each group's result carried (None for the writes of a group that read nothing back;
    () when none did). Groups already posted when a later one is refused are waited for, and
    the refusal is the job's error; a refusal of the first raises."""
    n = sum(len(g) for g in groups)
    if not n:
        raise TransportError("post_writes: writes must name at least one write")
    digests: list[int | None] = [None] * n
    landed: list[int | None] = [None] * n
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(groups), "error": None}

    def group(idx: Sequence[int]) -> OnWritten:
        def done(got: WriteResult) -> None:
            with lock:
                if got.error is None:
                    whole = len(got.digests) == len(idx)  # else: no digests (unhashed)
                    sums = got.landed if whole and len(got.landed) == len(idx) else ()
                    for k, i in enumerate(idx):
                        digests[i] = got.digests[k] if whole else None
                        if sums:
                            landed[i] = sums[k]
                elif state["error"] is None:
                    state["error"] = got.error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                err = state["error"]
                on_done(WriteResult(err) if err is not None else
                        WriteResult(None, tuple(digests),
                                    tuple(landed) if any(x is not None for x in landed)
                                    else ()))
        return done

    for k, idx in enumerate(groups):
        try:
            post(idx, group(idx))
        except TransportError as e:
            if k == 0:
                raise
            for rest in groups[k:]:  # never posted: they end now, with the refusal
                group(rest)(WriteResult(e))
            return


_BACKENDS = {
    TransportKind.UCX: "kvhandoff.transports.ucx.transport:UcxTransport",
    TransportKind.TCP: "kvhandoff.transports.tcp:TcpTransport",
    TransportKind.SHM: "kvhandoff.transports.shm.transport:ShmTransport",
    TransportKind.AUTO: "kvhandoff.transports.auto:AutoTransport",
    TransportKind.NIXL: "kvhandoff.transports.nixl.transport:NixlTransport",
    TransportKind.INPROC: "kvhandoff.transports.inproc:InprocTransport",
}


def load_transport(kind: str, settings: Settings) -> Transport:
    """Builds the transport `kind` (a TransportKind, or its value: "tcp", "ucx", "shm",
    "nixl", "auto", "inproc"), importing its module on first use.

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
