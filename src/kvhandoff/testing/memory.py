"""Two (or more) `TransferSession`s wired to each other in memory: no threads, no sockets, no
clock but a `FakeClock`. Tests drive them step by step.

`MemoryWire` executes the sessions' effects itself: control messages go through the real wire
format (`protocol.encode` / `decode`) into a FIFO per receiver; sends and receives posted on the
"transport" are matched by (sender, receiver, tag) and copy the bytes of their span lists
between the sides' buffers; hashing jobs run inline; room views are plain records. Nothing
happens until the test calls `run()` (deliver everything, to quiescence) or `step()` (one
message or completion); `tick(dt)` moves the clock and feeds every session a `Tick`. Hooks:
`drop(pred)` drops messages, `hold(pred)` keeps them until `release_held()`, and `corrupt_next`
flips a byte of the next landed span of a (layer, region).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvhandoff.buffers.bufferset import BufferSet, allocate
from kvhandoff.buffers.checksum import span_checksum
from kvhandoff.errors import Failure
from kvhandoff.kv_layout import LayoutSpec, layout_hash
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import (
    Cancel,
    Connect,
    DropPeer,
    Effect,
    HashSpans,
    Log,
    PostRecv,
    PostSend,
    PostWrite,
    RegisterRemote,
    Release,
    RoomUpdate,
    Send,
)
from kvhandoff.protocol.handshake import Identity, buffer_descs
from kvhandoff.protocol.session import TransferSession
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.clock import FakeClock


@dataclass
class View:
    """A room as the engine would see it (what `RoomUpdate` / `Release` said)."""

    room: int
    state: KVPoll = KVPoll.Bootstrapping
    failure: Failure | None = None
    landed: frozenset[int] = frozenset()
    done: bool = False
    releases: int = 0


@dataclass
class Side:
    """One agent: its session, buffers and the views of its rooms."""

    name: str
    session: TransferSession
    buffers: dict[str, np.ndarray]
    views: dict[int, View] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


def make_side(name: str, role: Role, layout: LayoutSpec, buffers: dict[str, Any], *,
              settings: Settings, writes: bool, generation: int, now: float) -> Side:
    """An agent called `name` (its control address) over `buffers` (`buffers.allocate`'s
    shape) with its session; `writes`: its "transport" takes one-sided writes (a decode
    offers its buffers, a prefill writes into decodes that do)."""
    bufs = BufferSet(layout, buffers)
    descs = buffer_descs(bufs.extents())
    if writes and role is Role.DECODE:
        descs = tuple(msgspec.structs.replace(d, descriptor=f"{name}:{d.region}".encode())
                      for d in descs)
    st = settings
    ident = Identity(address=name, generation=generation, agent_id=name, role=role,
                     transport_kind="memory", transport_address=name.encode(), layout=layout,
                     layout_hash=layout_hash(layout), buffers=descs, writes=writes,
                     hmac_secret=st.hmac_secret.get_secret_value().encode()
                     if st.hmac_secret else None)
    return Side(name, TransferSession(identity=ident, settings=st, now=now),
                dict(bufs.views()))


@dataclass
class _Op:
    side: Side
    op: int
    buffer: str
    offsets: np.ndarray
    nbytes: np.ndarray


class MemoryWire:
    """Sessions wired in memory (see the module doc)."""

    #: whether sides `add`ed without `writes=` take one-sided writes (tests flip it to run a
    #: protocol test over both data paths)
    writes = False

    def __init__(self, *, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.sides: dict[str, Side] = {}
        self.messages: deque[tuple[Side, Any]] = deque()  # (to, msg) in flight
        self.completions: deque[tuple[Side, ev.Event]] = deque()
        self.held: list[tuple[Side, Any]] = []
        self.sent: list[tuple[str, str, Any]] = []  # (from, to, msg) as delivered or dropped
        self.seals: dict[int, P.Seal] = {}  # id(msg) -> its seal (with a shared secret)
        self._sends: dict[tuple[str, str, int], deque[_Op]] = {}
        self._recvs: dict[tuple[str, str, int], deque[_Op]] = {}
        self._drop: list[Callable[[str, str, Any], bool]] = []
        self._hold: list[Callable[[str, str, Any], bool]] = []
        self._corrupt: list[tuple[int, str]] = []
        self.refuse_writes: str | None = None  # RegisterRemote answers this error when set
        # Connects to these peers are never answered (kept in `hung`), as a transport
        # connect that waits on a peer which never answers
        self.hang_connect: set[str] = set()
        self.hung: list[tuple[Side, ev.Event]] = []
        # Cancel answers this error when set (a copy that did not stop); the cancelled ops
        # still complete with an error, as the transports' do
        self.fail_cancel: str | None = None
        # writes complete only at `release_writes()` (in flight until then)
        self.hold_writes = False
        self._writes_held: list[tuple[Side, str, int, ev.Event]] = []
        self.exited: set[str] = set()  # sides whose "process" ended (Transport.peer_exited)

    # ------------------------------------------------------------------ building

    def add(self, name: str, role: Role, layout: LayoutSpec, *, num_pages: int = 16,
            settings: Settings | None = None, writes: bool | None = None) -> Side:
        """A side called `name` (its control address) with zeroed buffers of `num_pages`;
        `writes`: its "transport" takes one-sided writes (a decode offers its buffers, a
        prefill writes into decodes that do)."""
        st = settings or Settings(transport="inproc", heartbeat_interval_s=0.5)
        writes = self.writes if writes is None else writes
        side = make_side(name, role, layout, allocate(layout, num_pages), settings=st,
                         writes=writes, generation=len(self.sides) + 11, now=self.clock())
        self.sides[name] = side
        return side

    # ------------------------------------------------------------------ engine calls

    def feed(self, side: Side, event: ev.Event) -> None:
        """Feeds one event to `side` now and executes its effects."""
        for eff in side.session.handle(event, self.clock()):
            self._execute(side, eff)

    def tick(self, dt: float = 0.0) -> None:
        """Moves the clock `dt` seconds and ticks every side."""
        self.clock.advance(dt)
        for side in list(self.sides.values()):
            self.feed(side, ev.Tick(read_at=self.clock()))

    # ------------------------------------------------------------------ delivery

    def step(self) -> bool:
        """Delivers one completion, else one message; False when nothing was pending."""
        if self.completions:
            side, event = self.completions.popleft()
            self.feed(side, event)
            return True
        if self.messages:
            to, msg = self.messages.popleft()
            self.feed(to, ev.MessageReceived(msg, self.seals.get(id(msg))))
            return True
        return False

    def run(self, max_steps: int = 100_000) -> int:
        """Delivers until quiescent, ticking (without moving the clock) whenever it is, so
        batched announcements go out; returns the steps taken."""
        n = 0
        while n < max_steps:
            if not self.step():
                self.tick(0.0)
                if not (self.messages or self.completions):
                    return n
            n += 1
        raise AssertionError(f"no quiescence after {max_steps} steps")

    def drop(self, pred: Callable[[str, str, Any], bool]) -> None:
        """Drops every message (from, to, msg) for which `pred` holds."""
        self._drop.append(pred)

    def hold(self, pred: Callable[[str, str, Any], bool]) -> None:
        """Holds every message for which `pred` holds until `release_held()`."""
        self._hold.append(pred)

    def release_held(self) -> None:
        self._hold.clear()
        for item in self.held:
            self.messages.append(item)
        self.held.clear()

    def corrupt_next(self, layer: int, region: str) -> None:
        """Flips one byte of the next receive of (`layer`, `region`) that lands."""
        self._corrupt.append((layer, region))

    # ------------------------------------------------------------------ effects

    def _execute(self, side: Side, eff: Effect) -> None:
        if isinstance(eff, Send):
            self._send(side, eff.addr, eff.msg)
        elif isinstance(eff, PostSend | PostRecv):
            key = (side.name, eff.peer, eff.tag) if isinstance(eff, PostSend) else \
                (eff.peer, side.name, eff.tag)
            mine = self._sends if isinstance(eff, PostSend) else self._recvs
            mine.setdefault(key, deque()).append(_Op(side, eff.op, eff.buffer, eff.offsets,
                                                     eff.nbytes))
            self._match(key)
        elif isinstance(eff, PostWrite):
            self._write(side, eff)
        elif isinstance(eff, RegisterRemote):
            error = self.refuse_writes or (None if eff.peer in self.sides else
                                           f"no such peer {eff.peer}")
            self.completions.append((side, ev.RemoteRegistered(eff.peer, error)))
        elif isinstance(eff, Cancel):
            self._cancel(lambda k, s: s.side is side and eff.peer in k[:2] and k[2] == eff.tag)
            self._cancel_writes(side, eff.peer, eff.tag)
            self.completions.append((side, ev.Cancelled(eff.peer, eff.tag, self.fail_cancel)))
        elif isinstance(eff, DropPeer):
            if eff.peer in self.exited:
                self.completions.append((side, ev.PeerExited(eff.peer, eff.gen)))
            self._cancel(lambda k, s: s.side is side and eff.peer in k[:2])
            self._cancel_writes(side, eff.peer, None)
            self.completions.append((side, ev.Cancelled(eff.peer, None, None)))
        elif isinstance(eff, Connect):
            answer = ev.Connected(eff.peer, None if eff.peer in self.sides else
                                  f"no such peer {eff.peer}", eff.gen)
            if eff.peer in self.hang_connect:  # a peer whose transport never answers
                self.hung.append((side, answer))
            else:
                self.completions.append((side, answer))
        elif isinstance(eff, HashSpans):
            sums = tuple(span_checksum(side.buffers[b], o, n) for b, o, n in eff.spans)
            self.completions.append((side, ev.Hashed(eff.job, sums)))
        elif isinstance(eff, RoomUpdate):
            v = self._view(side, eff.token)
            v.state, v.failure, v.landed, v.done = eff.state, eff.failure, eff.landed, eff.done
        elif isinstance(eff, Release):
            self._view(side, eff.token).releases += 1
        elif isinstance(eff, Log):
            side.log.append(eff.message)

    def _view(self, side: Side, token: object) -> View:
        assert isinstance(token, int), "MemoryWire tokens are room ids"
        return side.views.setdefault(token, View(token))

    def _send(self, side: Side, to: str, msg: Any) -> None:
        # through the real wire format, sealed as the agent's driver seals it
        wire, seal = P.decode_sealed(side.session.peers.frames(to, msg), max_bytes=1 << 24)
        if seal is not None:
            self.seals[id(wire)] = seal  # (the message stays in `sent`: its id is not reused)
        dest = self.sides.get(to)
        if dest is None or any(p(side.name, to, wire) for p in self._drop):
            self.sent.append((side.name, to, ("dropped", wire)))
            return
        self.sent.append((side.name, to, wire))
        if any(p(side.name, to, wire) for p in self._hold):
            self.held.append((dest, wire))
        else:
            self.messages.append((dest, wire))

    def _match(self, key: tuple[str, str, int]) -> None:
        sends, recvs = self._sends.get(key), self._recvs.get(key)
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            data = np.concatenate([s.side.buffers[s.buffer][o:o + n] for o, n in
                                   zip(s.offsets.tolist(), s.nbytes.tolist(), strict=True)])
            pos = 0
            dst = r.side.buffers[r.buffer]
            for o, n in zip(r.offsets.tolist(), r.nbytes.tolist(), strict=True):
                dst[o:o + n] = data[pos:pos + n]
                pos += n
            _, layer, _, _ = P.split_tag(key[2])
            region = r.buffer.rsplit("/", 1)[0]
            if (layer, region) in self._corrupt:
                self._corrupt.remove((layer, region))
                dst[int(r.offsets[0])] ^= 0xFF
            self.completions.append((s.side, ev.OpDone(s.op, None)))
            self.completions.append((r.side, ev.OpDone(r.op, None)))

    def _write(self, side: Side, eff: PostWrite) -> None:
        """A one-sided write job lands at once (each part into the peer's buffer of the same
        name), with one digest per part when hashed."""
        dest = self.sides.get(eff.peer)
        if dest is None or eff.peer in self.exited:
            self.completions.append((side, ev.Written(eff.op, f"peer {eff.peer} is gone")))
            return
        digests: list[int | None] = []
        for part in eff.parts:
            src, dst = side.buffers[part.buffer], dest.buffers[part.buffer]
            plan = part.plan
            for so, do, n in plan:
                dst[do:do + n] = src[so:so + n]
            _, layer, _, _ = P.split_tag(part.tag)
            region = part.buffer.rsplit("/", 1)[0]
            if (layer, region) in self._corrupt and len(plan):
                self._corrupt.remove((layer, region))
                dst[int(plan.dst_offsets[0])] ^= 0xFF
            if eff.checksum:
                digests.append(span_checksum(src, plan.src_offsets, plan.nbytes))
        done = ev.Written(eff.op, None, tuple(digests))
        if self.hold_writes:
            self._writes_held.append((side, eff.peer, eff.parts[0].tag, done))
        else:
            self.completions.append((side, done))

    def release_writes(self) -> None:
        """Completes the writes `hold_writes` kept in flight."""
        self.hold_writes = False
        for side, _, _, done in self._writes_held:
            self.completions.append((side, done))
        self._writes_held.clear()

    def _cancel_writes(self, side: Side, peer: str, tag: int | None) -> None:
        """Held writes of (peer, tag) complete with an error (the cancel's on_done)."""
        for item in [w for w in self._writes_held
                     if w[0] is side and w[1] == peer and tag in (None, w[2])]:
            self._writes_held.remove(item)
            assert isinstance(item[3], ev.Written)
            self.completions.append((side, ev.Written(item[3].op, "cancelled")))

    def _cancel(self, which: Callable[[tuple[str, str, int], _Op], bool]) -> None:
        for table in (self._sends, self._recvs):
            for key, ops in table.items():
                for op in [o for o in ops if which(key, o)]:
                    ops.remove(op)
                    self.completions.append((op.side, ev.OpDone(op.op, "cancelled")))
