"""Events: what happens to the transfer session. Pure data, no I/O.

Engine threads, transport callbacks, hasher workers and the control socket each produce
events; one thread (the driver) feeds them to `session.TransferSession.handle(event, now)`.
`token` is the engine handle's opaque identity of a room (a room id can be reused after a
room ended; the token tells the two apart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Event:
    """Base of every event."""


@dataclass(frozen=True, slots=True)
class MessageReceived(Event):
    """A decoded control message arrived."""

    msg: Any  # a `protocol.Message`
    seal: Any = None  # its `wire.Seal` when it came sealed (the session checks it)


@dataclass(frozen=True, slots=True)
class HelloRefused(Event):
    """A handshake frame (Hello, HelloAck or HelloReject) refused before its body was decoded:
    with a shared secret, one that came unsealed (a Hello or HelloAck) or whose seal did not
    open (`wire.open_hello`); without one, a sealed one (this agent holds no key). What is
    known of it is what its clear envelope says (`wire.Envelope`; an unsealed frame's: its
    kind and sender only)."""

    kind: str  # "hello", "hello_ack" or "hello_reject"
    src: str  # the address it names (not authenticated)
    nonce: bytes = b""  # its handshake nonce (a refusal echoes it)
    echo: bytes = b""  # the nonce it echoes


@dataclass(frozen=True, slots=True)
class OpenSender(Event):
    """Prefill engine opened `room`: its page table (per region), length, decode ranks."""

    room: int
    token: object
    pages: dict[str, np.ndarray]
    seq_len: int
    expected: int | None  # decode ranks reading from this rank (None: the readers say)
    chunk_end: int = 0  # chunked prefill: the tokens `pages` cover so far (0: seq_len)
    prompt_tokens: np.ndarray | None = None  # the prompt token ids (prefix agreement)


@dataclass(frozen=True, slots=True)
class OpenReceiver(Event):
    """Decode engine opened `room`; `peers` are the prefill agents (address, generation), or
    None while the bootstrap lookup runs (`PeersResolved` follows)."""

    room: int
    token: object
    peers: tuple[tuple[str, int], ...] | None
    readers: int = 0  # decode ranks reading each of its prefill ranks (told them; 0: not said)


@dataclass(frozen=True, slots=True)
class PeersResolved(Event):
    """The bootstrap lookup of a receiver's room ended: its prefill agents, or `error`."""

    room: int
    token: object
    peers: tuple[tuple[str, int], ...]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LayerReady(Event):
    """Prefill engine: `layer`'s KV is written."""

    room: int
    token: object
    layer: int


@dataclass(frozen=True, slots=True)
class AddChunk(Event):
    """Prefill engine (chunked prefill): the pages of the next chunk, appended per region to
    the room's page table, which now covers `chunk_end` tokens (the room's seq_len: the last
    chunk). Every layer of the previous chunk was marked ready; this chunk's layers are marked
    ready again (`LayerReady`) as they are written."""

    room: int
    token: object
    pages: dict[str, np.ndarray]
    chunk_end: int


@dataclass(frozen=True, slots=True)
class ReceiverInit(Event):
    """Decode engine offered destination pages (per region, suffix-only regions from the
    page-aligned prefix on), the length and the page-aligned cached prefix."""

    room: int
    token: object
    pages: dict[str, np.ndarray]
    seq_len: int
    prefix: int
    # issue 17: digests of the prompt and of the cached prefix (kv_layout.PromptDigest), and
    # under allocation_policy=prefill_complete the free pages the decode has when it asks
    prompt: Any = None
    cached_prefix: Any = None
    free_pages: int | None = None
    # per region, a later token the region starts at (a sliding window: the decode holds no
    # page before it; its pages above start there); None: every region from `prefix`
    starts: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class AbortRoom(Event):
    """An engine aborted `room` (or the agent is closing)."""

    room: int
    token: object
    reason: str


@dataclass(frozen=True, slots=True)
class HoldRooms(Event):
    """Decode: the engine has requests of `rooms` queued, to be read from the prefill agent
    `peer`: ask it (at every heartbeat, while the handshake with it stands) to keep them
    `hold_s` past their bootstrap bound. Replaces the rooms held with `peer`; empty: none. A
    room the engine opens a receiver for stops being held."""

    peer: str
    rooms: tuple[int, ...]
    hold_s: float


@dataclass(frozen=True, slots=True)
class OpDone(Event):
    """A posted transport op completed (`error`: why it failed, None: it succeeded)."""

    op: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Written(Event):
    """A `PostWrite` ended: `error` why it failed (None: the bytes of every part landed),
    `digests` the xxh3-64 of each part's source stream (in part order) when the write was asked
    to hash them, `landed` each part's xxh3-64 of its destination pieces read back by the
    writer right after the write (None for a part, or empty: the transport cannot read the
    peer's memory, the decode verifies)."""

    op: int
    error: str | None
    digests: tuple[int | None, ...] = ()
    landed: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class Batch(Event):
    """Several events of one room that the driver feeds as one (the session handles each in
    order, paying its per-event work once): consecutive `LayerReady`s of a room it drained
    together, or the `Written`s of one write job of several layers. Nothing else."""

    events: tuple[LayerReady, ...] | tuple[Written, ...]


@dataclass(frozen=True, slots=True)
class RemoteRegistered(Event):
    """The answer to a `RegisterRemote` effect (`error`: why the descriptors were refused;
    the prefill then sends to that peer two-sided)."""

    peer: str
    error: str | None


@dataclass(frozen=True, slots=True)
class PeerExited(Event):
    """The transport knows that generation `gen` of `peer` has ended its process: nothing of
    it writes into our memory any more (one-sided legs' pages may go back at once)."""

    peer: str
    gen: int


@dataclass(frozen=True, slots=True)
class Hashed(Event):
    """A `HashSpans` job finished: one sum per span list, or `error`."""

    job: int
    sums: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Connected(Event):
    """The answer to a `Connect` effect for generation `gen` of `peer` (`error`: why the
    transport could not connect). It comes later, from the driver's transport worker: the
    session keeps working (heartbeats, other peers) while a connect waits on its peer."""

    peer: str
    error: str | None
    gen: int = 0


@dataclass(frozen=True, slots=True)
class Cancelled(Event):
    """The answer to a `Cancel` effect (`tag`) or a `DropPeer` (`tag` None): `error` None
    when the transport confirmed that nothing of those ops writes any more, else why it
    could not (a copy that did not stop): the session then keeps the pages held."""

    peer: str
    tag: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Time passed: heartbeats, liveness, deadlines, timers, collection. `read_at` is when the
    driver last read its control sockets, whatever it found there: a peer's silence is
    measured up to it from the peer's last authenticated message, by time alone (a driver that
    did not read for a while does not take its own backlog for a dead peer, and no flood of
    other messages makes it wait for a "drained" socket that never comes)."""

    read_at: float
