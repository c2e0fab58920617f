"""`TransferSession`: the transfer protocol of one agent, sans-IO.

In the spirit of h11's `Connection` (and of aioquic's, which keeps its loss recovery and
streams as objects it owns): the session's one entry point is `handle(event, now)`: an event
(`events.*`: a control message arrived, the engine marked a layer ready, a transport op or a
checksum job completed, time passed, ...) goes in, a list of effects (`effects.*`: send this
message, post that transfer, hash these spans, wake that room's waiters, release its pages)
comes out. It imports no zmq, no transport, no threading and no clock: `now` is an argument,
and one driver thread (`runtime.loop.ControlLoop`) feeds it and executes what it asks, in order.

The session holds its parts, each owning its state and given what it needs at construction:
- `ctx` (`context.Context`): identity, settings, the time of the call, the effects out, the
  timers, the counters;
- `rooms` (`lifecycle.RoomTable`): the rooms and legs and how a room ends (fail, terminal,
  release once nothing can write its pages);
- `peers` (`peers.PeerTable`): the peers and the handshake, liveness, peers declared lost;
- `inflight` (`inflight.InFlight`): the transport ops and hashing jobs in flight;
- `send_path` (`send.SendPath`): the prefill's data path (accept, post, announce, resend);
- `receive_path` (`receive.ReceivePath`): the decode's (request, post receives, verify, ack);
- `chunks` (`chunks.ChunkedPrefill`): rooms whose pages come in chunks;
- `readouts` (`reports.ReadOuts`): the figures behind `status` and the metrics.
The session itself routes: engine events to the rooms, control messages to their leg (or to
the peer table), completions to the role that posted the op (looked up in `inflight`), and
time to all of them.

Protocol, per room: decode says `TransferRequest` (its pages) once the handshake with the
prefill agent is done (`Hello` / `HelloAck`, layouts compatible); prefill answers
`TransferAccepted` (its pages); both compute the same span plan; decode posts every receive at
once, prefill posts a layer's sends as soon as the engine marks it ready and announces it with
`LayerDone` (checksums); decode verifies, asks once for a retransmit on a mismatch
(`LayerNack`), and ends with `RoomAck`. A failure reaches the peer as `Failed` / `Abort`, a dead
peer is found by heartbeats, and a room's pages are released once it is terminal and none of
its transport ops is in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.chunks import ChunkedPrefill
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.early import EARLY_ROOMS, EarlyMessages
from kvhandoff.protocol.effects import ERROR, WARNING, Effect, Notify
from kvhandoff.protocol.failures import remote_failure
from kvhandoff.protocol.handshake import Identity
from kvhandoff.protocol.inflight import InFlight
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import NO_HANDSHAKE, PeerTable
from kvhandoff.protocol.peerstate import Peer
from kvhandoff.protocol.receive import ReceivePath
from kvhandoff.protocol.reports import ReadOuts, room_stats
from kvhandoff.protocol.rooms import EngineInput, Leg, Room
from kvhandoff.protocol.roomstate import LegPhase
from kvhandoff.protocol.send import SendPath
from kvhandoff.settings import Settings
from kvhandoff.state_machine import (
    DeadlinePassed,
    KVPoll,
    LeaseRenewed,
    PeerFailedRoom,
    Role,
    RoomAborted,
)

MAX_READERS = 1 << 16  # decode ranks per room and prefill rank (a TP size)
# the messages a prefill sends about a leg, each naming its request's transfer id (`xfer`)
_FROM_PREFILL = (P.TransferAccepted, P.Failed, P.Abort, P.AbortAck, P.LayerDone, P.ChunkAdded)


class TransferSession:
    """The protocol state of one agent (see the module doc). Single-threaded by contract: only
    its driver calls it. Args are keyword-only: `identity` (what this agent says in a Hello),
    `settings` (heartbeats, deadlines, checksums, retention), `now` (the clock at creation)."""

    def __init__(self, *, identity: Identity, settings: Settings, now: float) -> None:
        # the Hello says this side's checksum mode (the peers compare them), heartbeat (the
        # peers measure its silence by it) and stall bound (a decode's quarantine outlasts it)
        identity = dataclasses.replace(identity, checksum=settings.checksum.value,
                                       heartbeat_s=settings.heartbeat_interval_s,
                                       stall_s=settings.stall_timeout_s)
        self.ctx = ctx = Context(identity=identity, settings=settings, now=now)
        self.readouts = ReadOuts()
        self.rooms = RoomTable(ctx=ctx, readouts=self.readouts)
        self.peers = PeerTable(ctx=ctx, rooms=self.rooms, on_matched=self._matched,
                               replay=self._room_msg)
        self.rooms.peer_bounds = self.peers.bounds_of
        self.inflight = InFlight(ctx=ctx, rooms=self.rooms, peers=self.peers,
                                 readouts=self.readouts)
        self.send_path = SendPath(ctx=ctx, rooms=self.rooms, peers=self.peers,
                                  ops=self.inflight)
        self.receive_path = ReceivePath(ctx=ctx, rooms=self.rooms, peers=self.peers,
                                        ops=self.inflight)
        self.chunks = ChunkedPrefill(ctx=ctx, rooms=self.rooms, peers=self.peers,
                                     send_path=self.send_path, receive_path=self.receive_path)
        self._early = EarlyMessages()  # messages for rooms before the engine opened them
        self._aborts_ahead: dict[object, str] = {}  # token -> reason, before its open came
        # prefill: room -> until when a decode holds it past its bootstrap bound (`P.Hold`)
        self._holds: dict[int, float] = {}
        # decode: prefill peer -> (rooms held with it, hold_s) (`ev.HoldRooms`)
        self._held: dict[str, tuple[tuple[int, ...], float]] = {}
        self._next_heartbeat = now
        self._heartbeat_at = now  # when this session last sent its peers heartbeats
        self._woke_at = -1.0  # the _heartbeat_at of the silence _woke was last told of
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.MessageReceived: self._on_message, ev.OpenSender: self._on_open_sender,
            ev.HelloRefused: self._on_hello_refused,
            ev.OpenReceiver: self._on_open_receiver, ev.PeersResolved: self._on_resolved,
            ev.LayerReady: self._on_layer_ready, ev.ReceiverInit: self._on_receiver_init,
            ev.AbortRoom: self._on_abort, ev.OpDone: self._on_op_done,
            ev.Hashed: self._on_hashed, ev.Connected: self.peers.on_connected,
            ev.Tick: self._on_tick, ev.AddChunk: self.chunks.on_add_chunk,
            ev.Written: self.send_path.on_written,
            ev.RemoteRegistered: self.peers.on_remote_registered,
            ev.PeerExited: self.peers.on_peer_exited, ev.Cancelled: self.rooms.on_cancelled,
            ev.Batch: self._on_batch, ev.HoldRooms: self._on_hold_rooms,
        }

    # ------------------------------------------------------------------ what others read

    @property
    def me(self) -> Identity:
        return self.ctx.me

    @property
    def role(self) -> Role:
        return self.ctx.role

    @property
    def layout(self) -> LayoutSpec:
        return self.ctx.layout

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @property
    def counters(self) -> dict[str, int]:
        return self.ctx.counters

    @property
    def legs(self) -> dict[tuple[int, str], Leg]:
        return self.rooms.legs

    def status(self) -> dict[str, Any]:
        """Room states by name, peers and counters."""
        return self.readouts.status(rooms=self.rooms.by_id.values(), peers=self.peers,
                                    counters=self.ctx.counters)

    def room_stats(self, room: int, token: object) -> dict[str, Any] | None:
        """Byte and timing figures of a room (None when it is forgotten)."""
        g = self.rooms.find(room, token)
        return None if g is None else room_stats(g, self.ctx.layout)

    # ------------------------------------------------------------------ the entry point

    def set_memory(self, kind: str) -> None:
        """Where this agent's KV buffers live ("host" or "cuda"), said in its Hello and used
        for the rooms' checksum algorithm (`checksums.checksum_alg`). Its driver calls it
        before the first event (the driver holds the buffers; the session never looks at
        them)."""
        self.ctx.set_memory(kind)

    def handle(self, event: ev.Event, now: float) -> list[Effect]:
        """Feeds one event that happened at `now`; returns the effects to execute, in order."""
        self.ctx.now = now
        room = self._room_of(event)
        try:
            # measured from the last heartbeats sent, not the last event handled: a peer
            # measures our silence from the last message it got, which may be a heartbeat
            # older than our last event (a gap of 0.26 s after an event, 0.45 s after the
            # heartbeat, was a split outcome with a 0.2 s heartbeat)
            silent = now - self._heartbeat_at
            if silent > 2 * self.ctx.hb and self._woke_at != self._heartbeat_at:
                self._woke_at = self._heartbeat_at
                self._woke(silent)
            self._handlers[type(event)](event)
        except Exception as e:
            # a bug met while handling a room's event must not leave that room half-updated
            # and waiting for its deadline: fail it on both sides, say why; an event of no
            # room goes to the driver, which logs it
            if room is None:
                self.ctx.take()
                raise
            self._internal_error(room, event, e)
        finally:
            self.rooms.publish()
        return self.ctx.take()

    def next_wakeup(self) -> float:
        """When the driver must send the next `Tick` at the latest."""
        if self.send_path.done_pending:
            return self.ctx.now
        timer = self.ctx.next_timer()
        return self._next_heartbeat if timer is None else min(self._next_heartbeat, timer)

    def _room_of(self, event: ev.Event) -> int | None:
        """The room an event is about, when it is about one (before it is handled: a
        completion's op is forgotten while it is)."""
        if isinstance(event, ev.Batch):
            return self._room_of(event.events[0]) if event.events else None
        room = getattr(event, "room", None)
        if isinstance(event, ev.MessageReceived):
            room = getattr(event.msg, "room", None)
        elif isinstance(event, ev.OpDone | ev.Written | ev.Hashed):
            leg = self.inflight.leg_of(event)
            room = leg.room if leg is not None else None
        return room if isinstance(room, int) else None

    def _internal_error(self, room: int, event: ev.Event, exc: Exception) -> None:
        self.ctx.counters["internal_errors"] += 1
        why = (f"internal error handling {type(event).__name__}: "
               f"{type(exc).__name__}: {exc}")
        self.ctx.log(ERROR, f"room {room} ({self.role.value}): {why}", exc=exc)
        g = self.rooms.by_id.get(room)
        if g is None:
            return
        failure = Failure(FailureKind.INTERNAL, why)
        for r in g.legs:  # every leg's peer is told, whatever state the bug left it in
            if not r.state.terminal:
                self.rooms.fail(r, PeerFailedRoom(reason=why), notify=Notify.FAILED,
                                failure=failure)
        self.rooms.fail_room(g, failure)

    def _matched(self, r: Leg) -> None:
        """A leg's peer is matched: a decode leg may now send its request (or, for a room the
        engine aborted before its prefill ranks were known, the abort)."""
        reason = r.parent.tell_abort
        if reason is not None:
            if not r.state.terminal:
                self.rooms.fail(r, RoomAborted(reason=reason, by=self.role),
                                notify=Notify.ABORT)
            return
        self.receive_path.maybe_request(r)

    # ------------------------------------------------------------------ engine events

    def _on_open_sender(self, e: ev.OpenSender) -> None:
        if self.rooms.refuse_reopen(e.room, e.token):
            return
        g = self.rooms.new_room(e.room, e.token, e.expected)
        g.given = EngineInput(seq_len=e.seq_len, pages=e.pages, prompt_tokens=e.prompt_tokens,
                              chunk_end=e.chunk_end or e.seq_len)
        for msg in self._early.pop(e.room):
            self._room_msg(msg)
        self.rooms.room_update(g)
        self._abort_if_asked(g)

    def _on_open_receiver(self, e: ev.OpenReceiver) -> None:
        self._unhold(e.room)  # no longer queued: its request follows
        if self.rooms.refuse_reopen(e.room, e.token):
            return
        g = self.rooms.new_room(e.room, e.token, None)
        g.given.readers = e.readers
        if e.peers is not None:
            self._attach_peers(g, list(e.peers))
        self._abort_if_asked(g)

    # ------------------------------------------------------------------ holds (queued decodes)

    def _on_hold_rooms(self, e: ev.HoldRooms) -> None:
        """Decode: the rooms the engine has queued with prefill `e.peer` (see `ev.HoldRooms`);
        told at once when the handshake with it stands, then at every heartbeat."""
        if self.role is not Role.DECODE:
            return
        if not e.rooms:
            self._held.pop(e.peer, None)
            return
        self._held[e.peer] = (tuple(e.rooms), float(e.hold_s))
        p = self.peers.get(e.peer)
        if p is None or not p.matched:  # a prefill not read from yet: the Hold follows the
            self.peers.greet(e.peer)     # handshake (at the next heartbeat)
        self._send_holds(only=e.peer)

    def _unhold(self, room: int) -> None:
        for peer, (rooms, hold_s) in list(self._held.items()):
            if room in rooms:
                rest = tuple(r for r in rooms if r != room)
                if rest:
                    self._held[peer] = (rest, hold_s)
                else:
                    del self._held[peer]

    def _send_holds(self, only: str | None = None) -> None:
        """Decode: a `P.Hold` to each prefill peer it holds rooms with whose handshake stands
        (a peer not matched yet, greeted by `_on_hold_rooms`, is told once it is: at the next
        heartbeat)."""
        ctx = self.ctx
        for peer, (rooms, hold_s) in self._held.items():
            if only is not None and peer != only:
                continue
            p = self.peers.get(peer)
            if p is not None and p.matched:
                ctx.send(peer, P.Hold(src=ctx.me.address, gen=ctx.me.generation,
                                      rooms=list(rooms), hold_s=hold_s))

    def _on_hold(self, msg: P.Hold) -> None:
        """Prefill: a decode holds these rooms (it has their requests queued): each waits for
        it `hold_s` more past its bootstrap bound, from now."""
        if self.role is not Role.PREFILL:
            return
        ctx = self.ctx
        until = ctx.now + max(0.0, float(msg.hold_s))
        for room in msg.rooms[:EARLY_ROOMS]:
            if until > self._holds.get(room, -1.0):
                self._holds[room] = until
            ctx.counters["holds_renewed"] += 1

    def _on_resolved(self, e: ev.PeersResolved) -> None:
        g = self.rooms.find(e.room, e.token)
        if g is None:
            return
        if e.error is not None:
            self.rooms.fail_room(g, Failure(FailureKind.BOOTSTRAP,
                                             f"bootstrap lookup failed: {e.error}"))
            return
        self._attach_peers(g, list(e.peers))

    def _attach_peers(self, g: Room, sources: list[tuple[str, int]]) -> None:
        """Decode: one leg per prefill rank to read from; starts the handshakes."""
        if g.state.failure is not None:
            if g.tell_abort is not None:  # each prefill rank hears of the abort once matched
                for addr, _gen in sources:
                    self.peers.attach(self.rooms.new_leg(g, addr), addr)
            return
        if not sources:
            self.rooms.fail_room(g, Failure(FailureKind.BOOTSTRAP,
                                             "no prefill rank to read this room from"))
            return
        g.state.expect(len(sources))
        # every leg first: one whose peer is known to refuse us fails at its attach, and
        # fails the room with its other legs (a leg added after that would join a room
        # already released, and later request writes into pages its engine got back)
        legs = [self.rooms.new_leg(g, addr) for addr, _gen in sources]
        for r in legs:
            if r.state.terminal:
                continue
            self.peers.attach(r, r.peer)
            self.receive_path.init_leg(r)
        self.rooms.room_update(g)

    def _on_op_done(self, e: ev.OpDone) -> None:
        """A send or receive completed: to the role that posted it."""
        op = self.inflight.take_op(e.op)
        if op is not None:
            done = self.send_path.on_send_done if op.send else self.receive_path.on_recv_done
            done(op, e.error)

    def _on_hashed(self, e: ev.Hashed) -> None:
        """A hashing job's sums are in: verify (decode) or announce (prefill)."""
        job = self.inflight.take_job(e)
        if job is not None:
            (self.receive_path.on_verify_hashed if job.verify
             else self.send_path.on_source_hashed)(job, e.sums)

    def _on_batch(self, e: ev.Batch) -> None:
        """The events of one room the driver fed as one (`events.Batch`: LayerReady or
        Written only), each checked and handled in order, with one posting pass (the
        LayerReadys) or one completion pass (the Writtens) and one state-machine step per
        leg for them all."""
        written = [one for one in e.events if isinstance(one, ev.Written)]
        if len(written) == len(e.events):
            self.send_path.on_written_many(written)
            return
        ready = [one for one in e.events if isinstance(one, ev.LayerReady)]
        if len(ready) != len(e.events):
            bad = next(one for one in e.events if not isinstance(one, ev.LayerReady))
            raise TypeError(f"a Batch holds LayerReady or Written events, not {bad!r}")
        i = 0
        while i < len(ready):  # each room's consecutive LayerReadys together
            first = ready[i]
            j = i + 1
            while j < len(ready) and ready[j].room == first.room \
                    and ready[j].token is first.token:
                j += 1
            self._layers_ready(first.room, first.token, [one.layer for one in ready[i:j]])
            i = j

    def _on_layer_ready(self, e: ev.LayerReady) -> None:
        self._layers_ready(e.room, e.token, [e.layer])

    def _layers_ready(self, room: int, token: object, layers: list[int]) -> None:
        """Prefill: the engine marked `layers` of a room ready (a layer marked again is
        ignored); each accepted leg posts them together."""
        g = self.rooms.find(room, token)
        if g is None:
            return
        ready = g.given.ready
        new: list[int] = []
        for layer in layers:
            if layer not in ready and layer not in new:
                new.append(layer)
        if not new:
            return
        ready.extend(new)
        g.given.t_last_ready = self.ctx.now
        for r in g.legs:
            if r.state.accepted and not r.state.terminal:
                self.chunks.post_ready(r, new)

    def _on_receiver_init(self, e: ev.ReceiverInit) -> None:
        g = self.rooms.find(e.room, e.token)
        if g is None:
            return
        given = g.given
        given.seq_len, given.pages = e.seq_len, (e.pages, e.prefix, dict(e.starts or {}))
        given.prompt, given.cached_prefix, given.free_pages = (e.prompt, e.cached_prefix,
                                                               e.free_pages)
        for r in g.legs:
            self.receive_path.init_leg(r)

    def _on_abort(self, e: ev.AbortRoom) -> None:
        g = self.rooms.find(e.room, e.token)
        if g is None:
            # the driver feeds aborts ahead of the queue: the room's open may still be queued
            if len(self._aborts_ahead) < EARLY_ROOMS:
                self._aborts_ahead.setdefault(e.token, e.reason)
            return
        self._abort(g, e.reason)

    def _abort_if_asked(self, g: Room) -> None:
        reason = self._aborts_ahead.pop(g.token, None)
        if reason is not None:
            self._abort(g, reason)

    def _abort(self, g: Room, reason: str) -> None:
        if self.role is Role.DECODE and g.state.expected is None and g.state.failure is None:
            g.tell_abort = reason  # its prefill ranks are not known yet (`_attach_peers`)
        for r in g.legs:
            self.rooms.fail(r, RoomAborted(reason=reason, by=self.role), notify=Notify.ABORT)
        self.rooms.fail_room(g, Failure(FailureKind.ABORTED,
                                         f"aborted by {self.role.value}: {reason}"))

    # ------------------------------------------------------------------ message handling

    def _on_hello_refused(self, e: ev.HelloRefused) -> None:
        self.ctx.counters["messages_in"] += 1
        self.peers.on_refused(e.kind, e.src, nonce=e.nonce, echo=e.echo)

    def _on_message(self, e: ev.MessageReceived) -> None:
        msg = e.msg
        ctx = self.ctx
        ctx.counters["messages_in"] += 1
        if isinstance(msg, P.Hello):  # Hello and HelloAck
            self.peers.on_hello(msg)
            return
        if isinstance(msg, P.HelloReject):
            self.peers.on_hello_reject(msg)
            return
        if ctx.me.hmac_secret and not self.peers.admit(msg, e.seal):
            # with a shared secret, a message counts only sealed under the session with its
            # sender (`peers`: an unknown process must not fail or abort a room, nor renew a
            # dead peer's leases; a replay is refused)
            return
        p = self.peers.get(msg.src)
        if p is None or (p.gen and msg.gen != p.gen):
            # no handshake with this sender (or an older generation of it)
            ctx.counters["stale_messages"] += 1
            if isinstance(msg, P.Failed | P.Abort | P.AbortAck) and p is None:
                # a failure for a room may precede any handshake; and a peer this agent
                # declared lost (a prefill stopped, then woken) still says when its writes
                # into a leg's pages stopped (an AbortAck naming the leg's request)
                self._room_msg(msg)
            elif p is None and not isinstance(msg, P.Reject | P.AbortAck):
                self.peers.tell_forgotten(msg.src)
            return
        p.last_seen = ctx.now
        if isinstance(msg, P.Hold):
            self._on_hold(msg)
        elif isinstance(msg, P.Heartbeat):
            for room in msg.rooms:
                r = self.rooms.legs.get((room, p.addr))
                if r is not None and not r.state.terminal:
                    r.state.apply(LeaseRenewed(), ctx.now)
            if msg.probe:
                self.peers.answer(p, msg.probe, self._rooms_by_peer().get(p.addr, []))
            if msg.answers and self.peers.rechecked(p, msg.answers):
                self.receive_path.finish_rechecked(p.addr)
        elif isinstance(msg, P.Reject):
            ctx.log(WARNING, f"peer {msg.src} rejected a message: {msg.reason}")
            if msg.reason.startswith(NO_HANDSHAKE):
                self._dropped_by(p)
        elif p.state.connecting or p.state.recheck is not None:
            # its transport connects off the driver's thread, or this agent woke from a stall
            # and asked whether the peer still holds it: read once matched and answered, in
            # order
            p.backlog.append(msg)
        else:
            self._room_msg(msg)

    def _dropped_by(self, p: Peer) -> None:
        """`p` dropped its handshake with this agent (it took this agent for dead): rooms it
        had accepted are gone on its side; requests it never accepted are handshaken and sent
        again."""
        # a list in the rooms' own order (a set of legs iterates by object address, so a
        # replay in another process would re-handshake them in another order)
        retry = [r for r in self.rooms.open_legs()
                 if r.peer == p.addr and not r.state.accepted and r.role is Role.DECODE]
        self.peers.lost(p, f"peer {p.addr} dropped its handshake with this agent (it took "
                           "this agent for dead)", keep=retry)
        for r in retry:
            if r.state.requested:
                r.state.advance(LegPhase.READY)
            r.plan.planes = None
            self.peers.attach(r, p.addr)

    def _room_msg(self, msg: Any) -> None:
        """Routes a room message to its leg (creating a prefill leg on request). A `Failed`
        saying its sender dropped this agent (`dropped_gen`: this process) fails every other
        room with it too, at once: a decode that read on would end Success rooms its prefill
        already gave up, their own `Failed` still on the way."""
        self._routed(msg)
        if isinstance(msg, P.Failed) and msg.dropped_gen == self.ctx.me.generation:
            p = self.peers.get(msg.src)
            if p is not None and p.gen == msg.gen and p.matched:
                self._dropped_by(p)

    def _routed(self, msg: Any) -> None:
        """`_room_msg`'s routing of one message to its leg."""
        ctx = self.ctx
        r = self.rooms.legs.get((msg.room, msg.src))
        g = self.rooms.by_id.get(msg.room)
        if r is None and g is not None and self.role is Role.PREFILL:
            if isinstance(msg, P.TransferRequest):
                refusal = self._refuse_request(g, msg.readers)
                if refusal is not None:
                    ctx.send(msg.src, P.Failed(
                        src=ctx.me.address, gen=ctx.me.generation, room=g.room,
                        reason=refusal.reason, failure_kind=refusal.kind.value, xfer=msg.xfer))
                    return
                r = self.rooms.new_leg(g, msg.src)
                r.plan.seq_len, r.plan.pages = g.given.seq_len, g.given.pages
                r.plan.page_size = self.layout.page_size_tokens
                r.state.advance(LegPhase.READY)
            elif isinstance(msg, P.Failed | P.Abort):
                told = msg.failure_kind or ("aborted" if isinstance(msg, P.Abort) else "")
                self.rooms.fail_room(g, remote_failure(told, "peer failed the room: "
                                                              f"{msg.reason}"))
                self._ack_unwritten(msg)
                return
        if r is None:
            if g is None and isinstance(msg, P.Failed | P.Abort):
                self._ack_unwritten(msg)
            if g is None and not self._early.add(msg.room, msg, ctx.now):
                self._early_full(msg)
            return
        self._dispatch_room_msg(r, msg)

    def _ack_unwritten(self, msg: P.Failed | P.Abort) -> None:
        """Prefill: a decode failed or aborted a room this side holds no leg of (the engine
        has not opened it, or never took that decode's request): nothing was or will be
        written into its pages, so say so now (`AbortAck`) instead of leaving the decode to
        wait out its write quarantine. A request of that decode for the room still held
        for the engine is dropped, so it is never accepted later. Only to a peer whose
        Hello we took (never to an arbitrary sender address)."""
        if self.role is not Role.PREFILL or self.peers.get(msg.src) is None:
            return
        self._early.drop_requests(msg.room, msg.src)
        me = self.ctx.me
        self.ctx.send(msg.src, P.AbortAck(src=me.address, gen=me.generation, room=msg.room,
                                          xfer=msg.xfer))

    def _early_full(self, msg: Any) -> None:
        """A message for a room the engine has not opened that the early store cannot take
        (`EarlyMessages`: its rooms, its messages per room or its bytes are at their bound):
        never dropped silently. Counted, logged, and a transfer request is refused at once
        (the decode fails with the reason instead of waiting out its deadline)."""
        ctx, e = self.ctx, self._early
        ctx.counters["early_dropped"] += 1
        why = (f"{len(e)} rooms not yet opened by this engine are held (at most {e.max_rooms}), "
               f"{len(e.held(msg.room))} messages for this one (at most {e.per_room}), "
               f"{e.nbytes:,} bytes in all (at most {e.max_bytes:,})")
        ctx.log(WARNING, f"room {msg.room}: {type(msg).__name__} from {msg.src} dropped: {why}")
        if isinstance(msg, P.TransferRequest):
            ctx.send(msg.src, P.Failed(
                src=ctx.me.address, gen=ctx.me.generation, room=msg.room,
                reason=f"the {self.role.value} agent cannot hold another request for a room "
                       f"its engine has not opened yet ({why}); this one was refused (retry "
                       "later)",
                failure_kind=FailureKind.ADMISSION.value, xfer=msg.xfer))

    def _refuse_request(self, g: Room, readers: int) -> Failure | None:
        s = g.state
        if s.failure is not None:
            return s.failure
        if s.expected is None or s.readers_told:
            # the engine left the count to the readers: the first one's stands, and every
            # other must say the same
            if not 1 <= readers <= MAX_READERS:
                return Failure(FailureKind.INVALID_REQUEST,
                               f"room {g.room}: the prefill expects the decode ranks to say "
                               f"how many read it from this rank (readers 1..{MAX_READERS}), "
                               f"this request says {readers}")
            if s.expected is None:
                s.expect(readers, told_by_reader=True)
            elif readers != s.expected:
                return Failure(FailureKind.INVALID_REQUEST,
                               f"room {g.room}: a decode rank said {s.expected} read it from "
                               f"this prefill rank, this one says {readers}")
        elif readers and readers != s.expected:
            return Failure(FailureKind.INVALID_REQUEST,
                           f"room {g.room}: the prefill opened it for {s.expected} decode "
                           f"rank(s) on this prefill rank, the decode says {readers}")
        if s.all_legs:
            return Failure(FailureKind.INVALID_REQUEST,
                           f"room {g.room} already has its {s.expected} decode rank(s) on this "
                           "prefill rank")
        return None

    def _stale_for_decode(self, r: Leg, msg: Any) -> bool:
        """Decode: whether a prefill's message is about another use of this room id than
        this leg (issue 35: room messages name the id; `xfer` names the use). It is when it
        names another transfer id than the leg's current request (0: the sender named none),
        and for a `LayerDone` also when the leg is not accepted yet: on one connection a
        `LayerDone` of this use never precedes its `TransferAccepted`."""
        if not isinstance(msg, _FROM_PREFILL):
            return False
        if msg.xfer and msg.xfer != r.xfer:
            return True
        return isinstance(msg, P.LayerDone) and not r.state.accepted

    def _dispatch_room_msg(self, r: Leg, msg: Any) -> None:
        rooms, ctx = self.rooms, self.ctx
        if r.role is Role.DECODE and self._stale_for_decode(r, msg):
            ctx.counters["stale_messages"] += 1
            return
        if (isinstance(msg, P.AbortAck) and r.state.terminal
                or isinstance(msg, P.Failed | P.Abort) and msg.writes_stopped) \
                and r.state.fence.remote_writes and msg.xfer:
            # (an AbortAck answers this leg's end: one for a leg still open is stale)
            # one-sided decode: the prefill says its writes into this leg's pages stopped
            # (writes_stopped: its cancels confirmed; else an AbortAck follows once they do),
            # so the pages may be reused. Only when it names this leg's request (`xfer`, equal
            # once past the check above): one that names none (an older prefill) may be a late
            # word about an earlier use of the id, so the pages stay fenced until one that
            # names it comes, or the write quarantine.
            rooms.writes_stopped(r)
        if isinstance(msg, P.Failed):
            reason = f"peer failed the room: {msg.reason}"
            rooms.fail(r, PeerFailedRoom(reason=reason), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind, reason))
            if r.one_sided and r.role is Role.PREFILL:  # our writes were cancelled: say so
                rooms.ack_stopped(r)
        elif isinstance(msg, P.Abort):
            other = Role.DECODE if self.role is Role.PREFILL else Role.PREFILL
            rooms.fail(r, RoomAborted(reason=msg.reason, by=other), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind or "aborted", msg.reason))
            rooms.ack_stopped(r)
        elif isinstance(msg, P.AbortAck):
            pass
        elif r.state.terminal:
            if isinstance(msg, P.TransferRequest) and r.state.poll is KVPoll.Failed:
                # (a request sent again after a Reject names the same pages as the one this
                # leg took: its writes into them may not have stopped yet)
                f = r.state.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
                ctx.send(msg.src, P.Failed(src=ctx.me.address, gen=ctx.me.generation,
                                           room=r.room, reason=f.reason,
                                           failure_kind=f.kind.value, xfer=msg.xfer,
                                           writes_stopped=not rooms.writes_in_flight(r)))
        elif isinstance(msg, P.TransferRequest):
            self.send_path.on_request(r, msg)
        elif isinstance(msg, P.TransferAccepted):
            self.receive_path.on_accepted(r, msg)
        elif isinstance(msg, P.LayerDone):
            self.receive_path.on_layer_done(r, msg)
        elif isinstance(msg, P.LayerNack):
            self.send_path.on_nack(r, msg)
        elif isinstance(msg, P.ChunkAdded):
            if r.role is Role.DECODE:
                self.chunks.on_chunk_added(r, msg)
        elif isinstance(msg, P.ChunkAccepted):
            if r.role is Role.PREFILL:
                self.chunks.on_chunk_accepted(r, msg)
        elif isinstance(msg, P.RoomAck):
            if r.role is Role.PREFILL:
                self.send_path.acked(r)

    # ------------------------------------------------------------------ time

    def _woke(self, gap: float) -> None:
        """This session sent its peers no heartbeat for `gap` > 2 heartbeats (the process was
        stopped, or its control thread starved), so a peer may have declared this agent lost
        and given up our rooms with it (each peer measures from the last message it got from
        us). Say so before anything else is read, so that a room a peer already failed never
        ends Success here from messages queued before (the peer's Failed may come after them,
        or never): each matched peer is asked whether it still holds this agent, and its room
        messages wait for the answer (`PeerTable.woke`)."""
        self.peers.woke(gap, self._rooms_by_peer())

    def _rooms_by_peer(self) -> dict[str, list[int]]:
        """The open rooms with each peer, as a heartbeat names them."""
        by_peer: dict[str, list[int]] = {}
        for r in self.rooms.open_legs():
            by_peer.setdefault(r.peer, []).append(r.room)
        return by_peer

    def _on_tick(self, e: ev.Tick) -> None:
        now = self.ctx.now
        self.ctx.run_due_timers()
        self.send_path.flush_done()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.ctx.hb
            self._heartbeat_at = now
            self._heartbeats(now, e.read_at)

    def _heartbeats(self, now: float, read_at: float) -> None:
        """Heartbeats out, dead peers and expired deadlines in."""
        by_peer = self._rooms_by_peer()
        for g in list(self.rooms.by_id.values()):
            waited = now - g.t_created
            if (not g.state.done and not g.state.all_legs
                    and waited > self.settings.bootstrap_timeout_s):
                held = self._holds.get(g.room)
                if held is not None and now < held:
                    continue  # a decode has its request queued and holds it
                why = f"bootstrap deadline expired: no peer after {waited:.1f}s"
                if held is not None:
                    self.ctx.counters["holds_expired"] += 1
                    bound = self.settings.bootstrap_timeout_s
                    why += (f" (a decode held the room past the {bound:g}s bound until "
                            f"{waited - (now - held):.1f}s, then its hold lapsed: not renewed)")
                    self.ctx.log(WARNING, f"room {g.room}: {why}")
                self.rooms.fail_room(g, Failure(FailureKind.DEADLINE, why,
                                                 deadline="bootstrap"))
        self._send_holds()
        self.peers.heartbeats(now, read_at, by_peer)
        for r in list(self.rooms.legs.values()):
            if not r.state.terminal:
                for which in r.state.expired(now):
                    self.rooms.fail(r, DeadlinePassed(which=which), notify=Notify.FAILED)
                    break
        self.collect(now)

    def _open_unpeered(self, room: int) -> bool:
        g = self.rooms.by_id.get(room)
        return g is not None and not g.state.done and not g.state.all_legs

    def collect(self, now: float) -> None:
        """Forgets what is kept only for a while: early messages of rooms never opened, peers
        declared lost, finished and released rooms after `room_retention_s`."""
        self._early.collect(now, self.settings.bootstrap_timeout_s)
        for room in [k for k, t in self._holds.items()
                     if now - t > self.settings.bootstrap_timeout_s
                     and not self._open_unpeered(k)]:
            del self._holds[room]
        self.peers.collect(now)
        self.rooms.collect(now)
