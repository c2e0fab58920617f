"""Peers and the handshake of `session.TransferSession` (a mixin of it, split out for size).

Decode legs start the handshake (`Hello`); a peer's Hello or HelloAck is checked
(`handshake.Identity.check_hello`), the transport connects (the `Connect` effect, answered by
the `Connected` event), and the legs waiting for that peer are matched and send their
`TransferRequest`. A peer declared lost (silent, restarted, or it told us it dropped us) fails
its open legs and is remembered for a while, so that if it keeps talking it is told once per
heartbeat to say Hello again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvhandoff.errors import Failure, FailureKind, KVHandoffError
from kvhandoff.kv_layout.admission import AllocationPolicy
from kvhandoff.state_machine import (
    FailureEvent,
    LayoutMismatch,
    PeerLost,
    PeerMatched,
    RemoteFailed,
    Role,
)
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.effects import (
    INFO,
    WARNING,
    Connect,
    DropPeer,
    Effect,
    Log,
    Notify,
    RegisterRemote,
)
from kvhandoff.transfer.failures import failure_of
from kvhandoff.transfer.handshake import (
    Identity,
    Peer,
    PeerState,
    digest_to_wire,
    reserved_pages,
)
from kvhandoff.transfer.rooms import Group, Leg
from kvhandoff.transfer.session_data import buffer_name

if TYPE_CHECKING:
    from kvhandoff.kv_layout import LayoutSpec
    from kvhandoff.settings import Settings

NO_HANDSHAKE = "no handshake"


class PeerHandling:
    """Mixin of `TransferSession` (see the module doc)."""

    if TYPE_CHECKING:  # what the session provides
        me: Identity
        role: Role
        layout: LayoutSpec
        settings: Settings
        peers: dict[str, Peer]
        legs: dict[tuple[int, str], Leg]
        counters: dict[str, int]
        region_index: dict[str, int]
        hb: float
        _now: float
        _xfer: Any
        _forgotten: dict[str, float]
        _forgotten_told: dict[str, float]
        _pending_ack: dict[str, bool]

        def _send(self, addr: str, msg: P.Message) -> None: ...
        def _emit(self, effect: Effect) -> None: ...
        def _new_leg(self, g: Group, peer: str) -> Leg: ...
        def _init_leg(self, r: Leg) -> None: ...
        def _fail_group(self, g: Group, failure: Failure) -> None: ...
        def _group_update(self, g: Group) -> None: ...
        def _maybe_release(self, r: Leg) -> None: ...
        def _fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
                  kind: FailureKind | None = None, failure: Failure | None = None) -> None: ...

    # ------------------------------------------------------------------ peers and handshake

    def _attach_peers(self, g: Group, sources: list[tuple[str, int]]) -> None:
        """Decode: one leg per prefill rank to read from; starts the handshakes."""
        if g.failure is not None:
            return
        if not sources:
            self._fail_group(g, Failure(FailureKind.BOOTSTRAP,
                                        "no prefill rank to read this room from"))
            return
        g.expected = len(sources)
        for addr, _gen in sources:
            r = self._new_leg(g, addr)
            self._attach_peer(r, addr)
            self._init_leg(r)
        self._group_update(g)

    def _attach_peer(self, r: Leg, addr: str) -> None:
        """Ties a decode leg to its prefill peer; starts the handshake."""
        if r.machine.is_terminal:
            return
        p = self._peer(addr)
        if p.state is PeerState.REJECTED and p.rejected is not None:
            self._fail(r, PeerLost(reason=p.rejected.reason), notify=Notify.FAILED,
                       failure=p.rejected)
            return
        if p.matched:
            self._matched(r, p)
            return
        p.waiting.append(r)
        if p.state is PeerState.NEW:
            p.state, p.initiated = PeerState.HELLO_SENT, True
            p.last_seen = self._now  # a peer that never answers dies in 2 heartbeats
            self._send(addr, self.me.hello(P.Hello))

    def _peer(self, addr: str) -> Peer:
        p = self.peers.get(addr)
        if p is None:
            p = self.peers[addr] = Peer(addr=addr, last_seen=self._now)
        return p

    def _matched(self, r: Leg, p: Peer) -> None:
        r.peer_gen = p.gen
        if not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), self._now)
        self._maybe_request(r)

    def _maybe_request(self, r: Leg) -> None:
        """Decode: send the TransferRequest once matched and initialised."""
        if (r.role is not Role.DECODE or r.request_sent or not r.inited
                or not r.machine.peer_matched or r.machine.is_terminal):
            return
        p = self.peers.get(r.peer)
        if p is None or p.layout is None:
            return
        # Claim the planes this leg brings: those the source holds that no other leg of the
        # room claimed yet (replicated regions: the first leg takes all; head slices: by name).
        g = r.group
        claimed: dict[str, set[str]] = {name: set() for name in self.region_index}
        for other in g.legs:
            if other is not r and other.planes:
                for name, pl in other.planes.items():
                    claimed[name].update(pl)
        planes: dict[str, list[str]] = {}
        for reg in self.layout.regions:
            try:
                theirs = {pl.name for pl in p.layout.region(reg.name).planes}
            except KVHandoffError:
                theirs = set()
            planes[reg.name] = [pl.name for pl in reg.planes
                                if pl.name in theirs and pl.name not in claimed[reg.name]]
        r.planes = planes
        r.request_sent = True
        r.xfer = next(self._xfer)
        # admission (issue 17): the policy, and what was reserved (early) or is free
        policy = self.settings.allocation_policy
        early = policy is AllocationPolicy.EARLY
        self._send(r.peer, P.TransferRequest(
            src=self.me.address, gen=self.me.generation, room=r.room, xfer=r.xfer,
            peer_gen=r.peer_gen, seq_len=r.seq_len, decode_prefix_len=r.prefix_len,
            page_size=r.page_size, dst_pages={k: v.tolist() for k, v in r.pages.items()},
            lease_s=self.settings.lease_s, planes=planes, allocation_policy=policy.value,
            reserved_pages=reserved_pages(self.layout, r.pages, r.prefix_len, r.page_size)
            if early else None, free_pages=None if early else g.free_pages,
            prompt=digest_to_wire(g.prompt), cached_prefix=digest_to_wire(g.cached_prefix)))
        if g.expected is not None and len(g.legs) == g.expected and all(
                leg.request_sent for leg in g.legs):
            for reg in self.layout.regions:
                have = set().union(*(set((leg.planes or {}).get(reg.name, [])) for leg in g.legs))
                missing = [pl.name for pl in reg.planes if pl.name not in have]
                if missing:
                    self._fail(r, RemoteFailed(
                        reason=f"{reg.name}: no prefill rank of this room holds planes "
                               f"{missing}"), notify=Notify.FAILED,
                               kind=FailureKind.INVALID_REQUEST)
                    return

    def _on_hello(self, msg: P.Hello) -> None:
        self._forgotten.pop(msg.src, None)
        p = self._peer(msg.src)
        if p.gen and p.gen != msg.gen:
            self._peer_lost(p, f"peer {msg.src} restarted (generation changed)")
            p = self._peer(msg.src)
        problems, layout = self.me.check_hello(msg)
        p.gen, p.agent_id, p.last_seen = msg.gen, msg.agent_id, self._now
        p.authenticated = self.me.verifies(msg)
        if problems:
            lm = LayoutMismatch(diff=tuple(problems))
            p.state, p.rejected = PeerState.REJECTED, failure_of(lm)
            if not isinstance(msg, P.HelloAck):
                self._send(msg.src, P.HelloReject(src=self.me.address, gen=self.me.generation,
                                                  reason=lm.reason, diff=problems))
            self._fail_waiting(p, lm)
            return
        p.layout = layout
        p.state = PeerState.CONNECTING
        p.transport_address = msg.transport_address
        p.memory = msg.memory
        p.descriptors = {buffer_name(b.region, b.layer): b.descriptor for b in msg.buffers
                         if b.descriptor}
        self._pending_ack[p.addr] = not isinstance(msg, P.HelloAck)
        self._emit(Connect(msg.src, msg.transport_address))  # answered by Connected at once

    def _on_connected(self, e: ev.Connected) -> None:
        p = self.peers.get(e.peer)
        reply_ack = self._pending_ack.pop(e.peer, False)
        if p is None or p.state is not PeerState.CONNECTING:
            return
        if e.error is not None:
            lost = PeerLost(reason=f"transport connect to {e.peer} failed: {e.error}")
            p.state, p.rejected = PeerState.REJECTED, failure_of(lost, FailureKind.TRANSPORT)
            self._send(e.peer, P.HelloReject(src=self.me.address, gen=self.me.generation,
                                             reason=lost.reason))
            self._fail_waiting(p, lost, FailureKind.TRANSPORT)
            return
        p.state, p.rejected = PeerState.MATCHED, None
        if self.me.writes and self.me.role is Role.PREFILL and p.descriptors:
            # answered by RemoteRegistered at once, before any transfer request is read
            self._emit(RegisterRemote(p.addr, tuple(sorted(p.descriptors.items()))))
        if reply_ack:
            self._send(e.peer, self.me.hello(P.HelloAck))
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._matched(r, p)

    def _on_remote_registered(self, e: ev.RemoteRegistered) -> None:
        """Prefill: the decode's buffers are installed (one-sided writes from now on), or
        refused (its rooms are sent two-sided; said once, as a warning)."""
        p = self.peers.get(e.peer)
        if p is None:
            return
        p.writes = e.error is None
        if e.error is None:
            self._emit(Log(INFO, f"peer {e.peer}: one-sided writes into its "
                                 f"{len(p.descriptors)} buffers"))
        else:
            self._emit(Log(WARNING, f"peer {e.peer}: one-sided writes refused ({e.error}); "
                                    "its rooms are sent two-sided"))

    def _on_peer_exited(self, e: ev.PeerExited) -> None:
        """Decode: a lost prefill's process is gone: its one-sided legs' pages go back now
        instead of after `write_quarantine_s`."""
        for r in list(self.legs.values()):
            if r.peer == e.peer and r.peer_gen == e.gen and r.remote_writes:
                r.remote_writes = False
                self._maybe_release(r)

    def _tell_forgotten(self, addr: str) -> None:
        """A peer this agent declared lost still talks to it (it did not see us die): tell it
        once per heartbeat, so it drops the handshake too and says Hello again, instead of
        waiting two heartbeats of silence. Only for peers we knew: never reply to an arbitrary
        sender address."""
        since = self._forgotten.get(addr)
        if since is None or self._now - self._forgotten_told.get(addr, -1e18) < self.hb:
            return
        self._forgotten_told[addr] = self._now
        self._send(addr, P.Reject(src=self.me.address, gen=self.me.generation,
                                  reason=f"{NO_HANDSHAKE}: {self.me.address} declared this "
                                         "peer lost; say Hello again"))

    def _fail_waiting(self, p: Peer, fe: FailureEvent, kind: FailureKind | None = None
                      ) -> None:
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._fail(r, fe, notify=Notify.FAILED, kind=kind)

    def _on_forget_peer(self, e: ev.ForgetPeer) -> None:
        p = self.peers.get(e.peer)
        if p is not None:
            self._peer_lost(p, e.reason)

    def _peer_lost(self, p: Peer, reason: str, *, keep: frozenset[Leg] = frozenset()) -> None:
        """Fails every open room with this peer (but `keep`) and forgets the handshake."""
        self.counters["peers_lost"] += 1
        for r in list(self.legs.values()):
            if r.peer == p.addr and not r.machine.is_terminal and r not in keep:
                self._fail(r, PeerLost(reason=reason), notify=Notify.FAILED)
        for r in p.waiting:
            self._fail(r, PeerLost(reason=reason), notify=Notify.NONE)
        p.waiting = []
        self.peers.pop(p.addr, None)
        self._pending_ack.pop(p.addr, None)
        self._forgotten[p.addr] = self._now
        self._emit(DropPeer(p.addr, p.gen))
