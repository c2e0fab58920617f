"""`PeerTable`: the peers of one session and the handshake with each, sans-IO.

It owns the peer records (`handshake.Peer`, by control address) and the peers declared lost.
Decode legs start the handshake (`attach`: a `Hello`); a peer's Hello or HelloAck is checked
(`handshake.Identity.check_hello`), the transport connects (the `Connect` effect, answered by
the `Connected` event) and, for a prefill writing one-sided, the peer's buffers are installed
(`RegisterRemote` / `RemoteRegistered`); then the peer is matched: the legs waiting for it are
handed to `on_matched` (the data path sends their `TransferRequest`) and the room messages it
sent meanwhile to `replay`. A peer declared lost (silent, restarted, or it told us it dropped
us) fails its open legs and is remembered for a while, so that if it keeps talking it is told
once per heartbeat to say Hello again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import INFO, WARNING, Connect, DropPeer, Notify, RegisterRemote
from kvhandoff.protocol.failures import failure_of
from kvhandoff.protocol.handshake import Peer, PeerState, buffer_name
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.rooms import Leg
from kvhandoff.state_machine import FailureEvent, LayoutsDiffered, PeerMatched, PeerWasLost, Role

NO_HANDSHAKE = "no handshake"
FORGOTTEN_KEEP_S = 60.0  # how long a lost peer is remembered, to tell it so if it talks on


class PeerTable:
    """The peers of one session (see the module doc). Keyword-only arguments: `on_matched`
    gets each leg whose peer is matched, `replay` each room message a peer sent while its
    transport connected."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, on_matched: Callable[[Leg], None],
                 replay: Callable[[Any], None]) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self._on_matched = on_matched
        self._replay = replay
        self._peers: dict[str, Peer] = {}
        self._forgotten: dict[str, float] = {}  # peers declared lost -> when
        self._forgotten_told: dict[str, float] = {}

    # ------------------------------------------------------------------ the table

    def get(self, addr: str) -> Peer | None:
        return self._peers.get(addr)

    def __getitem__(self, addr: str) -> Peer:
        return self._peers[addr]

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))

    def peer(self, addr: str) -> Peer:
        """The record of `addr`, a new one when it has none."""
        p = self._peers.get(addr)
        if p is None:
            p = self._peers[addr] = Peer(addr=addr, last_seen=self.ctx.now)
        return p

    def collect(self, now: float) -> None:
        """Forgets the peers declared lost more than FORGOTTEN_KEEP_S ago."""
        for addr in [a for a, t in self._forgotten.items() if now - t > FORGOTTEN_KEEP_S]:
            self._forgotten.pop(addr, None)
            self._forgotten_told.pop(addr, None)

    # ------------------------------------------------------------------ the handshake

    def attach(self, r: Leg, addr: str) -> None:
        """Ties a decode leg to its prefill peer; starts the handshake."""
        if r.machine.is_terminal:
            return
        p = self.peer(addr)
        if p.state is PeerState.REJECTED and p.rejected is not None:
            self.rooms.fail(r, PeerWasLost(reason=p.rejected.reason), notify=Notify.FAILED,
                            failure=p.rejected)
            return
        if p.matched:
            self._matched(r, p)
            return
        p.waiting.append(r)
        if p.state is PeerState.NEW:
            p.state, p.initiated = PeerState.HELLO_SENT, True
            p.last_seen = self.ctx.now  # a peer that never answers dies in 2 heartbeats
            self.ctx.send(addr, self.ctx.me.hello(P.Hello))

    def _matched(self, r: Leg, p: Peer) -> None:
        r.peer_gen = p.gen
        if not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), self.ctx.now)
        self._on_matched(r)

    def on_hello(self, msg: P.Hello) -> None:
        ctx = self.ctx
        self._forgotten.pop(msg.src, None)
        p = self.peer(msg.src)
        if p.gen and p.gen != msg.gen:
            self.lost(p, f"peer {msg.src} restarted (generation changed)")
            p = self.peer(msg.src)
        problems, layout = ctx.me.check_hello(msg)
        p.gen, p.agent_id, p.last_seen = msg.gen, msg.agent_id, ctx.now
        p.authenticated = ctx.me.verifies(msg)
        if problems:
            lm = LayoutsDiffered(diff=tuple(problems))
            p.state, p.rejected = PeerState.REJECTED, failure_of(lm)
            if not isinstance(msg, P.HelloAck):
                ctx.send(msg.src, P.HelloReject(src=ctx.me.address, gen=ctx.me.generation,
                                                reason=lm.reason, diff=problems))
            self.fail_waiting(p, lm)
            return
        p.layout = layout
        p.state = PeerState.CONNECTING
        p.transport_address = msg.transport_address
        p.memory = msg.memory
        p.descriptors = {buffer_name(b.region, b.layer): b.descriptor for b in msg.buffers
                         if b.descriptor}
        p.ack_hello = not isinstance(msg, P.HelloAck)
        # answered by Connected, later: room messages from the peer wait in its backlog
        ctx.emit(Connect(msg.src, msg.transport_address, p.gen))

    def on_hello_reject(self, p: Peer, msg: P.HelloReject) -> None:
        lm = LayoutsDiffered(diff=tuple(msg.diff or [msg.reason]))
        p.state, p.rejected = PeerState.REJECTED, failure_of(lm)
        self.fail_waiting(p, lm)

    def on_connected(self, e: ev.Connected) -> None:
        ctx = self.ctx
        p = self._peers.get(e.peer)
        if p is None or p.state is not PeerState.CONNECTING or p.gen != e.gen or p.registering:
            return  # an answer for a generation forgotten since
        if e.error is not None:
            lost = PeerWasLost(reason=f"transport connect to {e.peer} failed: {e.error}")
            p.state, p.rejected = PeerState.REJECTED, failure_of(lost, FailureKind.TRANSPORT)
            ctx.send(e.peer, P.HelloReject(src=ctx.me.address, gen=ctx.me.generation,
                                           reason=lost.reason))
            self.fail_waiting(p, lost, FailureKind.TRANSPORT)
            return
        if ctx.me.writes and ctx.role is Role.PREFILL and p.descriptors:
            # answered by RemoteRegistered; the peer is matched (and its HelloAck sent, its
            # backlog read) only then, so its first request finds the writes decided
            p.registering = True
            ctx.emit(RegisterRemote(p.addr, tuple(sorted(p.descriptors.items()))))
            return
        self._ready(p)

    def _ready(self, p: Peer) -> None:
        """The transport is connected (and the writes decided): the peer is matched."""
        p.state, p.rejected = PeerState.MATCHED, None
        if p.ack_hello:
            p.ack_hello = False
            self.ctx.send(p.addr, self.ctx.me.hello(P.HelloAck))
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._matched(r, p)
        backlog, p.backlog = p.backlog, []
        for msg in backlog:
            self._replay(msg)

    def on_remote_registered(self, e: ev.RemoteRegistered) -> None:
        """Prefill: the decode's buffers are installed (one-sided writes from now on), or
        refused (its rooms are sent two-sided; said once, as a warning)."""
        p = self._peers.get(e.peer)
        if p is None or not p.registering:
            return
        p.registering = False
        p.writes = e.error is None
        if e.error is None:
            self.ctx.log(INFO, f"peer {e.peer}: one-sided writes into its "
                               f"{len(p.descriptors)} buffers")
        else:
            self.ctx.log(WARNING, f"peer {e.peer}: one-sided writes refused ({e.error}); "
                                  "its rooms are sent two-sided")
        self._ready(p)

    def on_peer_exited(self, e: ev.PeerExited) -> None:
        """Decode: a lost prefill's process is gone: its one-sided legs' pages go back now
        instead of after `write_quarantine_s`."""
        for r in list(self.rooms.legs.values()):
            if r.peer == e.peer and r.peer_gen == e.gen and r.remote_writes:
                r.remote_writes = False
                self.rooms.maybe_release(r)

    # ------------------------------------------------------------------ losing peers

    def tell_forgotten(self, addr: str) -> None:
        """A peer this agent declared lost still talks to it (it did not see us die): tell it
        once per heartbeat, so it drops the handshake too and says Hello again, instead of
        waiting two heartbeats of silence. Only for peers we knew: never reply to an arbitrary
        sender address."""
        ctx = self.ctx
        since = self._forgotten.get(addr)
        if since is None or ctx.now - self._forgotten_told.get(addr, -1e18) < ctx.hb:
            return
        self._forgotten_told[addr] = ctx.now
        ctx.send(addr, P.Reject(src=ctx.me.address, gen=ctx.me.generation,
                                reason=f"{NO_HANDSHAKE}: {ctx.me.address} declared this "
                                       "peer lost; say Hello again"))

    def fail_waiting(self, p: Peer, fe: FailureEvent, kind: FailureKind | None = None) -> None:
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self.rooms.fail(r, fe, notify=Notify.FAILED, kind=kind)

    def lost(self, p: Peer, reason: str, *, keep: Collection[Leg] = ()) -> None:
        """Declares `p` lost: fails every open room with it (but `keep`), forgets the
        handshake, and drops the transport's connection to it."""
        self.ctx.counters["peers_lost"] += 1
        for r in self.rooms.open_legs():
            if r.peer == p.addr and r not in keep:
                self.rooms.fail(r, PeerWasLost(reason=reason), notify=Notify.FAILED)
        for r in p.waiting:
            self.rooms.fail(r, PeerWasLost(reason=reason), notify=Notify.NONE)
        p.waiting = []
        self._peers.pop(p.addr, None)
        self._forgotten[p.addr] = self.ctx.now
        self.ctx.emit(DropPeer(p.addr, p.gen))

    def heartbeats(self, now: float, drained_at: float, rooms_by_peer: dict[str, list[int]]
                   ) -> None:
        """Heartbeats out (naming the open rooms with each peer), silent peers declared
        lost."""
        ctx, hb = self.ctx, self.ctx.hb
        for p in list(self._peers.values()):
            if p.talking:
                ctx.send(p.addr, P.Heartbeat(src=ctx.me.address, gen=ctx.me.generation,
                                             rooms=rooms_by_peer.get(p.addr, [])))
            # silence is measured up to the last moment the driver had read every message it
            # was sent: a busy control loop must not take its own backlog for a dead peer
            silent = min(now, drained_at) - p.last_seen
            if (p.matched or p.waiting) and silent > 2 * hb:
                self.lost(p, f"peer {p.addr} silent for {silent:.2f}s "
                             f"(> 2 heartbeats of {hb:g}s)")

    def woke(self, gap: float) -> None:
        """Nothing reached this session for `gap` > 2 heartbeats: see `TransferSession`."""
        for p in [p for p in self._peers.values() if p.talking or p.waiting]:
            self.lost(p, f"this agent was unresponsive for {gap:.2f}s (> 2 heartbeats "
                         f"of {self.ctx.hb:g}s): peer {p.addr} has given its rooms up")
