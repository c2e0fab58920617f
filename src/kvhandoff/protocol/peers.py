"""`PeerTable`: the peers of one session and the handshake with each, sans-IO.

It owns the peer records (`peerstate.Peer`, by control address; where each handshake stands is
its `peerstate.PeerState`, moved only by its methods) and the peers declared lost.
Decode legs start the handshake (`attach`: a `Hello`); a peer's Hello or HelloAck is checked
(`handshake.Identity.check_hello`), the transport connects (the `Connect` effect, answered by
the `Connected` event) and, for a prefill writing one-sided, the peer's buffers are installed
(`RegisterRemote` / `RemoteRegistered`); then the peer is matched: the legs waiting for it are
handed to `on_matched` (the data path sends their `TransferRequest`) and the room messages it
sent meanwhile to `replay`. A peer declared lost (silent, restarted, or it told us it dropped
us) fails its open legs and is remembered for a while, so that if it keeps talking it is told
once per heartbeat to say Hello again.

An agent that woke from a stall (it sent no heartbeat for more than 2 heartbeats, so a peer
may have declared it lost) rechecks its matched peers (`woke`) before it reads any of their
room messages: a heartbeat with a `probe` that a peer answers (`answer`) only while it still
holds the handshake it matched; a peer that dropped us says so (`P.Reject`, `NO_HANDSHAKE`) or
says nothing. The room messages a rechecked peer sends wait in its backlog until its answer
(`rechecked`: read then, in order, so a room it failed before it answered ends Failed here
too); no answer within 2 of its heartbeats (from its own question, where it asked the same:
it stalled too) declares it lost, its rooms Failed as before the recheck existed, each
`Failed` saying that this agent dropped it (`dropped_gen`). Every other peer (a handshake under
way) is declared lost at the wake.

With a shared secret (``hmac_secret``) the table also owns each peer's session (`_Keys`, see
`wire`'s module doc): nothing a sender says is acted on before it is authenticated.
- A Hello whose MAC does not verify changes nothing here (no record, no generation change);
  it is answered with a HelloReject (at most REFUSALS_PER_HEARTBEAT per heartbeat). So is one
  the control loop refused undecoded (its seal did not open, `wire.open_hello`, or it came
  unsealed to an agent with a secret, or sealed to one without: `on_refused`), answered from
  its clear envelope; that HelloReject goes unsealed (the sender may hold no key, or
  another). Without a secret, an unsealed HelloReject that echoes nothing and names BAD_HMAC
  fails the attempt under way (an agent with a secret refused our Hello undecoded).
- A HelloAck is taken only when it echoes the nonce of the Hello we have out (a replayed one
  does not); a HelloReject likewise. A HelloReject whose MAC verifies rejects the peer for
  REJECTED_KEEP_S; one that does not (the peer's secret differs, or whoever saw our Hello made
  it up) fails only the rooms waiting on that attempt.
- A verified Hello from a peer whose record is in use (matched, connecting, or with open
  rooms) may be a replay, of this generation or an older one: it is answered (HelloAck) but
  acted on (a changed generation declares the old one lost) only once a message sealed under
  the new session key proves the sender holds it (`admit`). Such pending Hellos are kept by
  their nonce (at most PENDING_PER_PEER per peer, none evicted by another): a copy of a Hello
  already taken or pending is dropped as a replay, never answered with a new key, so a replay
  cannot replace the handshake its sender is completing.
- A Hello's MAC covers its recipient (`wire.sign_hello`): one said to another agent does not
  verify here.
- Every other message must come sealed under the session with its sender, with a sequence
  number above the last one taken (`admit`); what does not is counted and dropped.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.buffers.bufferset import buffer_name
from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import INFO, WARNING, Connect, DropPeer, Notify, RegisterRemote
from kvhandoff.protocol.failures import failure_of
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peerstate import Peer, PeerPhase, Recheck
from kvhandoff.protocol.rooms import Leg
from kvhandoff.state_machine import FailureEvent, LayoutsDiffered, PeerWasLost, Role

NO_HANDSHAKE = "no handshake"
FORGOTTEN_KEEP_S = 60.0  # how long a lost peer is remembered, to tell it so if it talks on
REJECTED_KEEP_S = 10.0  # how long a rejected peer's rejection fails new rooms at once
PENDING_KEEP_S = 60.0  # how long a Hello waiting for its confirmation is kept
# pending Hellos kept per peer at most; one beyond is dropped (never one kept: a stranger
# replaying recorded Hellos must not evict the one its real sender is confirming)
PENDING_PER_PEER = 8
# the longest heartbeat a peer's Hello may say it beats at (s): beyond it, its silence is
# still measured against this (its rooms fail on their stall and lease bounds anyway)
PEER_HEARTBEAT_MAX_S = 60.0
# the longest stall bound a peer's Hello may say (s): a decode's quarantine after a failed room
# with it is at most this + 2 of its heartbeats
PEER_STALL_MAX_S = 600.0


def _said(value: float, most: float) -> float:
    """A duration a peer's Hello said, within [0, most] (0: not said, or not a number)."""
    return min(max(value, 0.0), most) if math.isfinite(value) else 0.0
# refused Hellos answered per heartbeat at most: each answer goes to the address the Hello
# names, so an outsider could otherwise make this agent send one message per Hello it sends
REFUSALS_PER_HEARTBEAT = 64
BAD_HMAC = "hello: HMAC does not verify (wrong or missing shared secret)"


@dataclass(eq=False, slots=True)
class _Pending:
    """A verified Hello from a peer whose record is in use, not acted on yet."""

    hello: P.Hello
    key: bytes  # the session key its HelloAck's nonce gave
    nonce: bytes  # that HelloAck's nonce
    t: float


@dataclass(eq=False, slots=True)
class _Keys:
    """The handshake nonces and, with a shared secret, the session with one peer."""

    gen: int = 0  # the peer generation `key` is for
    key: bytes = b""  # the session key (b"": none)
    sent: int = 0  # the last sequence number sealed under `key`
    seen: int = 0  # the last sequence number taken under `key`
    nonce: bytes = b""  # of our Hello / HelloAck a reply must echo (b"": none out)
    their_nonce: bytes = b""  # of the peer's last Hello taken (our HelloReject echoes it)
    #: verified Hellos of a peer in use, not acted on yet, by their nonce
    pending: dict[bytes, _Pending] = field(default_factory=dict)


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
        self._keys: dict[str, _Keys] = {}
        self._forgotten_keys: dict[str, _Keys] = {}  # of peers declared lost (to tell them)
        self._rejected_at: dict[str, float] = {}
        self._refusals = (0.0, 0)  # (start of this heartbeat's window, answers sent in it)
        #: where handshake nonces come from (a simulator may give a seeded source)
        self.new_nonce: Callable[[], bytes] = functools.partial(secrets.token_bytes,
                                                                P.NONCE_BYTES)
        # a recheck's probe only has to differ from this session's earlier ones: its answer
        # comes sealed under the session with a secret, and can be forged like anything else
        # without one
        self._probes = itertools.count(1)

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
        """Forgets the peers declared lost more than FORGOTTEN_KEEP_S ago, and rejections
        older than REJECTED_KEEP_S (the next room says Hello again)."""
        for addr in [a for a, t in self._forgotten.items() if now - t > FORGOTTEN_KEEP_S]:
            self._forgotten.pop(addr, None)
            self._forgotten_told.pop(addr, None)
            self._forgotten_keys.pop(addr, None)
        for k in self._keys.values():
            for nonce in [n for n, pend in k.pending.items() if now - pend.t > PENDING_KEEP_S]:
                del k.pending[nonce]
        for addr in [a for a, t in self._rejected_at.items() if now - t > REJECTED_KEEP_S]:
            del self._rejected_at[addr]
            p = self._peers.get(addr)
            if p is not None and p.state.phase is PeerPhase.REJECTED and not p.waiting:
                del self._peers[addr]
                self._keys.pop(addr, None)

    def _rejected(self, p: Peer, failure: Any) -> None:
        p.state.refused(failure)
        self._rejected_at[p.addr] = self.ctx.now

    # ------------------------------------------------------------------ authentication

    def frames(self, addr: str, msg: P.Message) -> list[bytes]:
        """The frames of `msg` to `addr`: sealed under the session with it when a shared
        secret is set (a Hello and a HelloReject carry their own MAC; a message to a peer
        with no session yet goes unsealed, and the peer refuses it)."""
        if not self.ctx.me.hmac_secret or isinstance(msg, P.Hello | P.HelloReject):
            return P.encode(msg)
        k = self._keys.get(addr)
        if k is None or not k.key:
            k = self._forgotten_keys.get(addr)
        if k is None or not k.key:
            return P.encode(msg)
        k.sent += 1
        return P.seal(msg, key=k.key, recipient=addr, seq=k.sent)

    def admit(self, msg: Any, seal: P.Seal | None) -> bool:
        """(with a shared secret) Whether `msg` (not a Hello or HelloReject) is sealed under
        the session with its sender for its generation, with a sequence number above the last
        one taken. A seal under a pending handshake's key confirms it first."""
        ctx = self.ctx
        me = ctx.me.address
        k = self._keys.get(msg.src) if seal is not None else None
        if k is not None and seal is not None:
            if k.key and msg.gen == k.gen and P.verify_seal(seal, key=k.key, recipient=me):
                return self._take(k, seal)
            for pend in list(k.pending.values()):
                if msg.gen == pend.hello.gen and P.verify_seal(seal, key=pend.key,
                                                               recipient=me):
                    self._confirm(msg.src, pend)
                    return self._take(self._keys[msg.src], seal)
        f = self._forgotten_keys.get(msg.src) if seal is not None else None
        if (f is not None and seal is not None and msg.gen == f.gen
                and P.verify_seal(seal, key=f.key, recipient=me)):
            return self._take(f, seal)
        ctx.counters["unauthenticated_messages"] += 1
        ctx.counters["stale_messages"] += 1
        return False

    def screen(self, opened: P.Opened) -> bool:
        """(with a shared secret) Whether a frame set opened but not decoded
        (`wire.open_frames`) may be decoded: an unsealed HelloReject of at most
        `wire.UNSEALED_REJECT_MAX_BYTES` (its MAC is checked once decoded), or a message whose
        seal verifies under a key `admit` would try for its sender and generation (a sealed
        handshake message is opened by the control loop, `wire.open_hello`, before this).
        Checked over the raw bytes, so a frame that proves nothing costs one MAC pass at
        most, never a decode. What is refused
        here is counted as the session counts a message `admit` refuses (in, stale,
        unauthenticated: the control loop's "read a batch none of which was taken" depends on
        it); nothing else changes (`admit` takes the seal)."""
        if opened.kind == "hello_reject" and opened.seal is None and opened.hello is None:
            # the refusal of a handshake that did not authenticate comes unsealed (its sender
            # may hold no key, or another): decoded when small, checked once decoded
            if len(opened.body) <= P.UNSEALED_REJECT_MAX_BYTES:
                return True
        s = opened.seal
        if s is not None:
            me = self.ctx.me.address
            k = self._keys.get(opened.src)
            f = self._forgotten_keys.get(opened.src)
            tries = [(k.key, k.gen)] if k is not None else []
            if k is not None:  # every pending handshake's key (kept by nonce, a few a peer)
                tries += [(pend.key, pend.hello.gen) for pend in k.pending.values()]
            if f is not None:
                tries.append((f.key, f.gen))
            for key, gen in tries:
                if key and gen == opened.gen and P.verify_seal(s, key=key, recipient=me):
                    return True
        self.ctx.counters["messages_in"] += 1
        self.ctx.counters["unauthenticated_messages"] += 1
        self.ctx.counters["stale_messages"] += 1
        return False

    def _take(self, k: _Keys, seal: P.Seal) -> bool:
        if seal.seq <= k.seen:
            self.ctx.counters["replayed_messages"] += 1
            self.ctx.counters["stale_messages"] += 1
            return False
        k.seen = seal.seq
        return True

    def _confirm(self, addr: str, pend: _Pending) -> None:
        """The sender of a pending Hello holds its session key: act on that Hello now."""
        self.ctx.log(INFO, f"peer {addr}: new handshake (generation {pend.hello.gen}) "
                           "confirmed by a sealed message")
        self._accept(pend.hello, pend.key, pend.nonce, acked=True)

    def _in_use(self, p: Peer) -> bool:
        return (p.state.connecting or p.state.matched or bool(p.waiting)
                or any(r.peer == p.addr for r in self.rooms.open_legs()))

    def _reject(self, addr: str, reason: str, *, echo: bytes, diff: list[str] | None = None
                ) -> None:
        ctx = self.ctx
        msg = P.HelloReject(src=ctx.me.address, gen=ctx.me.generation, reason=reason,
                            diff=diff or [], echo=echo)
        if ctx.me.hmac_secret:
            msg = P.sign_hello_reject(msg, ctx.me.hmac_secret)
        ctx.send(addr, msg)

    # ------------------------------------------------------------------ the handshake

    def attach(self, r: Leg, addr: str) -> None:
        """Ties a decode leg to its prefill peer; starts the handshake."""
        if r.state.terminal:
            return
        p = self.peer(addr)
        rejected = p.state.rejected
        if rejected is not None:
            self.rooms.fail(r, PeerWasLost(reason=rejected.reason), notify=Notify.FAILED,
                            failure=rejected)
            return
        if p.matched:
            self._matched(r, p)
            return
        if not p.waiting and p.state.phase is PeerPhase.HELLO_SENT:
            # greeted with no leg waiting (`greet`): its silence is measured from now, not
            # from the greeting (the Hello stands: a peer that starts late still reads it)
            p.last_seen = self.ctx.now
        p.waiting.append(r)
        self._hello(p)

    def greet(self, addr: str) -> None:
        """Starts the handshake with `addr` where none stands or is under way, with no leg to
        wait for it: a decode that holds rooms queued for a prefill it has not read from yet
        (its `P.Hold` goes out once the handshake stands). A peer that never answers is
        declared lost 2 heartbeats after a leg began waiting for it (`attach`)."""
        self._hello(self.peer(addr))

    def _hello(self, p: Peer) -> None:
        if p.state.phase is PeerPhase.NEW:
            p.state.hello_sent()
            p.last_seen = self.ctx.now  # a peer that never answers dies in 2 heartbeats
            k = self._keys.setdefault(p.addr, _Keys())
            k.nonce = self.new_nonce()
            self.ctx.send(p.addr, self.ctx.me.hello(P.Hello, p.addr, nonce=k.nonce))

    def _matched(self, r: Leg, p: Peer) -> None:
        r.peer_gen = p.gen
        r.state.match(self.ctx.now)
        self._on_matched(r)

    def on_hello(self, msg: P.Hello) -> None:
        """A Hello or HelloAck (see the module doc for what is checked before it counts)."""
        ctx = self.ctx
        me = ctx.me
        secret = me.hmac_secret
        k = self._keys.get(msg.src)
        if secret and not me.verifies(msg):
            self.on_refused("hello_ack" if isinstance(msg, P.HelloAck) else "hello", msg.src,
                            nonce=msg.nonce, echo=msg.echo)
            return
        if isinstance(msg, P.HelloAck):
            if secret and (k is None or not k.nonce or msg.echo != k.nonce):
                # not the answer to a Hello we have out (a replay, or one we gave up on)
                ctx.counters["replayed_messages"] += 1
                ctx.counters["stale_messages"] += 1
                return
            key = None if not secret or k is None else P.session_key(
                secret, initiator=(me.address, me.generation, k.nonce),
                responder=(msg.src, msg.gen, msg.nonce))
            self._accept(msg, key, b"")
            return
        nonce = self.new_nonce()
        key = None if not secret else P.session_key(
            secret, initiator=(msg.src, msg.gen, msg.nonce),
            responder=(me.address, me.generation, nonce))
        p = self._peers.get(msg.src)
        if key is not None and p is not None and self._in_use(p):
            # perhaps a replay: answered, acted on once a sealed message confirms it
            k = self._keys.setdefault(msg.src, _Keys())
            if ((msg.gen == k.gen and msg.nonce == k.their_nonce) or msg.nonce in k.pending
                    or len(k.pending) >= PENDING_PER_PEER):
                # a copy of the Hello this session came from or of one answered already (a
                # new key for it would fail the handshake its sender is completing), or
                # more than a real peer has out: dropped, nothing kept is replaced
                ctx.counters["replayed_messages"] += 1
                ctx.counters["stale_messages"] += 1
                return
            k.pending[msg.nonce] = _Pending(hello=msg, key=key, nonce=nonce, t=ctx.now)
            ctx.send(msg.src, me.hello(P.HelloAck, msg.src, nonce=nonce, echo=msg.nonce))
            return
        self._accept(msg, key, nonce)

    def on_refused(self, kind: str, src: str, *, nonce: bytes = b"", echo: bytes = b"") -> None:
        """A handshake message that did not authenticate: its MAC did not verify, or (the
        frame never decoded, `ev.HelloRefused`) it came unsealed to an agent with a secret,
        its seal did not open, or it came sealed to one without. Nothing here changes but the
        attempt it answers: a HelloAck or HelloReject that echoes the nonce of our Hello out
        fails the rooms waiting on it (a peer keyed otherwise), naming the reason. A Hello or
        HelloAck is answered (unsealed: the sender may hold no key, or another) with a
        HelloReject echoing its nonce, at most REFUSALS_PER_HEARTBEAT per heartbeat."""
        ctx = self.ctx
        ctx.counters["unauthenticated_messages"] += 1
        k, p = self._keys.get(src), self._peers.get(src)
        if (kind != "hello" and p is not None and k is not None and k.nonce
                and echo == k.nonce and p.waiting):
            # the answer to our Hello from a peer keyed otherwise: this attempt failed
            k.nonce = b""
            p.state.attempt_failed()
            self.fail_waiting(p, LayoutsDiffered(diff=(BAD_HMAC,)))
        if kind == "hello_reject":
            return  # a refusal is never answered
        start, sent = self._refusals
        if ctx.now - start > ctx.hb:
            start, sent = ctx.now, 0
        if sent < REFUSALS_PER_HEARTBEAT:
            self._reject(src, BAD_HMAC, echo=nonce)
            sent += 1
        self._refusals = (start, sent)

    def _accept(self, msg: P.Hello, key: bytes | None, nonce: bytes, *,
                acked: bool = False) -> None:
        """Acts on an authenticated (or, without a secret, any) Hello / HelloAck: `key` its
        session key, `nonce` the one of our HelloAck (b"" for a HelloAck); `acked`: that
        HelloAck went out already."""
        ctx = self.ctx
        self._forgotten.pop(msg.src, None)
        self._forgotten_keys.pop(msg.src, None)
        self._rejected_at.pop(msg.src, None)
        p = self.peer(msg.src)
        if p.gen and p.gen != msg.gen:
            self.lost(p, f"peer {msg.src} restarted (generation changed)")
            p = self.peer(msg.src)
        self._keys[msg.src] = _Keys(gen=msg.gen, key=key or b"", nonce=nonce,
                                    their_nonce=msg.nonce)
        problems, layout = ctx.me.check_hello(msg)
        p.gen, p.agent_id, p.last_seen = msg.gen, msg.agent_id, ctx.now
        if problems:
            lm = LayoutsDiffered(diff=tuple(problems))
            self._rejected(p, failure_of(lm))
            if not isinstance(msg, P.HelloAck):
                self._reject(msg.src, lm.reason, echo=msg.nonce, diff=problems)
            self.fail_waiting(p, lm)
            return
        p.state.hello_taken(answer=not isinstance(msg, P.HelloAck) and not acked)
        p.layout = layout
        p.transport_address = msg.transport_address
        p.memory = msg.memory
        # what a peer says of its beat and stall bound is bounded: a Hello cannot make its
        # silence go unseen for more than 2 x 60 s, nor hold a decode's pages after a failure
        # for more than 600 s + 2 x 60 s
        p.heartbeat_s = _said(msg.heartbeat_s, PEER_HEARTBEAT_MAX_S)
        p.stall_s = _said(msg.stall_s, PEER_STALL_MAX_S)
        p.descriptors = {buffer_name(b.region, b.layer): b.descriptor for b in msg.buffers
                         if b.descriptor}
        # answered by Connected, later: room messages from the peer wait in its backlog
        ctx.emit(Connect(msg.src, msg.transport_address, p.gen, key or b""))

    def on_hello_reject(self, msg: P.HelloReject) -> None:
        """Taken only when it echoes the nonce of our Hello / HelloAck out; rejects the peer
        for a while when its MAC verifies (or no secret is set), else fails only the rooms
        waiting on this attempt."""
        ctx = self.ctx
        k, p = self._keys.get(msg.src), self._peers.get(msg.src)
        secret = ctx.me.hmac_secret
        if (not secret and not msg.echo and msg.reason == BAD_HMAC and p is not None
                and k is not None and k.nonce and p.waiting):
            # an agent with a secret refusing our unsealed Hello without decoding it (so it
            # cannot echo its nonce): this attempt failed, naming why; nothing more
            k.nonce = b""
            p.last_seen = ctx.now
            p.state.attempt_failed()
            self.fail_waiting(p, LayoutsDiffered(diff=(BAD_HMAC,)))
            return
        if p is None or k is None or not k.nonce or msg.echo != k.nonce:
            ctx.counters["stale_messages"] += 1
            return
        k.nonce = b""
        p.last_seen = ctx.now
        lm = LayoutsDiffered(diff=tuple(msg.diff or [msg.reason]))
        if secret and not P.verify_hello_reject(msg, secret):
            ctx.counters["unauthenticated_messages"] += 1
            p.state.attempt_failed()
            self.fail_waiting(p, lm)
            return
        self._rejected(p, failure_of(lm))
        self.fail_waiting(p, lm)

    def on_connected(self, e: ev.Connected) -> None:
        ctx = self.ctx
        p = self._peers.get(e.peer)
        if p is None or p.state.phase is not PeerPhase.CONNECTING or p.gen != e.gen:
            return  # an answer for a generation forgotten since
        if e.error is not None:
            lost = PeerWasLost(reason=f"transport connect to {e.peer} failed: {e.error}")
            self._rejected(p, failure_of(lost, FailureKind.TRANSPORT))
            k = self._keys.get(e.peer)
            self._reject(e.peer, lost.reason, echo=k.their_nonce if k is not None else b"")
            self.fail_waiting(p, lost, FailureKind.TRANSPORT)
            return
        if ctx.me.writes and ctx.role is Role.PREFILL and p.descriptors:
            # answered by RemoteRegistered; the peer is matched (and its HelloAck sent, its
            # backlog read) only then, so its first request finds the writes decided
            p.state.connected(register=True)
            ctx.emit(RegisterRemote(p.addr, tuple(sorted(p.descriptors.items()))))
            return
        p.state.connected(register=False)
        self._ready(p)

    def _ready(self, p: Peer) -> None:
        """The peer is matched (the transport connected and the writes decided): answer its
        Hello, hand over the legs and the room messages that waited."""
        if p.state.answer_hello():
            k = self._keys.get(p.addr)
            self.ctx.send(p.addr, self.ctx.me.hello(
                P.HelloAck, p.addr, nonce=k.nonce if k is not None else b"",
                echo=k.their_nonce if k is not None else b""))
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._matched(r, p)
        if p.state.recheck is None:  # else read once the peer answers (`rechecked`)
            self._replay_backlog(p)

    def _replay_backlog(self, p: Peer) -> None:
        backlog, p.backlog = p.backlog, []
        for msg in backlog:
            self._replay(msg)

    def on_remote_registered(self, e: ev.RemoteRegistered) -> None:
        """Prefill: the decode's buffers are installed (one-sided writes from now on), or
        refused (its rooms are sent two-sided; said once, as a warning)."""
        p = self._peers.get(e.peer)
        if p is None or p.state.phase is not PeerPhase.REGISTERING:
            return  # an answer for a handshake replaced since
        p.state.registered(writes=e.error is None)
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
            if r.peer == e.peer and r.peer_gen == e.gen and r.state.fence.writer_stopped():
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
                self.rooms.fail(r, PeerWasLost(reason=reason), notify=Notify.DROPPED)
        for r in p.waiting:  # waiting for this handshake; those in `keep` wait for the next
            if r not in keep:
                self.rooms.fail(r, PeerWasLost(reason=reason), notify=Notify.NONE)
        p.waiting = []
        self._peers.pop(p.addr, None)
        self._rejected_at.pop(p.addr, None)
        k = self._keys.pop(p.addr, None)
        if k is not None and k.key:
            self._forgotten_keys[p.addr] = k  # to tell it, sealed, that we dropped it
        self._forgotten[p.addr] = self.ctx.now
        self.ctx.emit(DropPeer(p.addr, p.gen))
        if p.state.recheck is not None:
            # what it said while rechecked, of its writes into our legs' pages, still counts
            # (as it does from a peer declared lost: see the session's message handling)
            for msg in p.backlog:
                if isinstance(msg, P.Failed | P.Abort | P.AbortAck):
                    self._replay(msg)
        p.backlog = []

    def heartbeats(self, now: float, read_at: float, rooms_by_peer: dict[str, list[int]]
                   ) -> None:
        """Heartbeats out (naming the open rooms with each peer), silent peers declared
        lost."""
        ctx, hb = self.ctx, self.ctx.hb
        for p in list(self._peers.values()):
            if p.state.talking:
                ctx.send(p.addr, P.Heartbeat(src=ctx.me.address, gen=ctx.me.generation,
                                             rooms=rooms_by_peer.get(p.addr, [])))
            # silence is measured by time, up to when the driver last read its sockets
            # (`Tick.read_at`): a stalled driver must not take its own backlog for a dead peer
            # against the longer of the two heartbeats: a peer set to beat less often than
            # this agent is not dead between two of its beats
            silent = min(now, read_at) - p.last_seen
            beat = max(hb, p.heartbeat_s)
            rc = p.state.recheck
            if rc is not None:
                # rechecked: its silence while this agent stalled proves nothing; its answer
                # not coming does
                waited = min(now, read_at) - rc.waiting_since
                if waited > 2 * beat:
                    self.lost(p, f"this agent was unresponsive for {rc.gap:.2f}s (> 2 "
                                 f"heartbeats of {hb:g}s) and peer {p.addr} did not say "
                                 f"within {waited:.2f}s that it still holds this agent: it "
                                 "may have given its rooms up")
            elif (p.matched or p.waiting) and silent > 2 * beat:
                self.lost(p, f"peer {p.addr} silent for {silent:.2f}s "
                             f"(> 2 heartbeats of {beat:g}s)")

    def bounds_of(self, addr: str) -> tuple[float, float]:
        """(stall_timeout_s, heartbeat) the peer at `addr` said in its Hello; 0 for what it
        did not say, or a peer no longer known (the caller then uses its own)."""
        p = self._peers.get(addr)
        return (0.0, 0.0) if p is None else (p.stall_s, p.heartbeat_s)

    # ------------------------------------------------------------------ waking from a stall

    def woke(self, gap: float, rooms_by_peer: dict[str, list[int]]) -> None:
        """This session sent no heartbeat for `gap` > 2 heartbeats (see `TransferSession`):
        each matched peer is rechecked (its room messages wait for its answer); a peer whose
        handshake was under way is declared lost (it may have given up the rooms waiting for
        it, and has nothing else with us to keep)."""
        ctx = self.ctx
        for p in [p for p in self._peers.values() if p.state.talking or p.waiting]:
            if not p.matched:
                self.lost(p, f"this agent was unresponsive for {gap:.2f}s (> 2 heartbeats "
                             f"of {ctx.hb:g}s) while its handshake with peer {p.addr} was "
                             "under way: the peer may have given it up")
                continue
            rc = Recheck(probe=next(self._probes), sent_at=ctx.now, gap=gap)
            p.state.recheck_sent(rc)
            ctx.counters["rechecks"] += 1
            ctx.log(INFO, f"this agent was unresponsive for {gap:.2f}s (> 2 heartbeats of "
                          f"{ctx.hb:g}s): asking peer {p.addr} whether it still holds this "
                          "agent before reading its room messages")
            ctx.send(p.addr, P.Heartbeat(src=ctx.me.address, gen=ctx.me.generation,
                                         rooms=rooms_by_peer.get(p.addr, []), probe=rc.probe))

    def answer(self, p: Peer, probe: int, rooms: list[int]) -> None:
        """The peer woke from a stall and asks whether this agent still holds it: yes while
        its handshake is matched (a peer we dropped is told so as any forgotten peer is; one
        whose new handshake is under way gets no answer, and gives its old rooms up when its
        recheck times out). One answer per probe message, to the peer's own address. A peer
        asking while this agent's own recheck of it is out woke from a stall too: the wait for
        its answer counts from here (`PeerState.recheck_peer_asked`)."""
        if p.matched:
            ctx = self.ctx
            if p.state.recheck is not None:
                p.state.recheck_peer_asked(ctx.now)
                ctx.log(INFO, f"peer {p.addr} woke from a stall too and asks whether this agent "
                              "still holds it: told yes, its answer to this agent's own question "
                              f"is waited for {2 * max(ctx.hb, p.heartbeat_s):g}s from now")
            ctx.send(p.addr, P.Heartbeat(src=ctx.me.address, gen=ctx.me.generation,
                                         rooms=rooms, answers=probe))

    def rechecked(self, p: Peer, probe: int) -> bool:
        """The peer answered a recheck: when it is the one out (True), the peer still holds
        this agent, and the room messages it sent meanwhile are read now, in order (the
        caller then ends the legs that were held at Success: `ReceivePath.finish`)."""
        if not p.state.recheck_answered(probe):
            return False  # an older recheck's answer, or none out: it proves nothing now
        self.ctx.counters["rechecks_passed"] += 1
        self.ctx.log(INFO, f"peer {p.addr} still holds this agent: its {len(p.backlog)} room "
                           "messages held during the recheck are read now")
        if not p.state.connecting:
            self._replay_backlog(p)
        return True
