"""`TransferSession`: the transfer protocol of one agent, sans-IO.

In the spirit of h11's `Connection`: the session owns the rooms (`rooms.Group`, one per room)
and their legs (`rooms.Leg`, one per peer), the peers and their handshake
(`handshake.Peer`), and nothing else. Its one entry point is `handle(event, now)`: an event
(`events.*`: a control message arrived, the engine marked a layer ready, a transport op or a
checksum job completed, time passed, ...) goes in, a list of effects (`effects.*`: send this
message, post that transfer, hash these spans, wake that room's waiters, release its pages)
comes out. It imports no zmq, no transport, no threading and no clock: `now` is an argument,
and one driver thread (`control.ControlLoop`) feeds it and executes what it asks, in order.

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
import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.kv_layout import LayoutSpec, SendFrom, page_aligned
from kvhandoff.settings import Settings
from kvhandoff.state_machine import (
    Aborted,
    DeadlineConfig,
    DeadlineExpired,
    FailureEvent,
    KVPoll,
    LayoutMismatch,
    LeaseRenewed,
    RemoteFailed,
    Role,
    RoomMachine,
)
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.effects import (
    INFO,
    WARNING,
    Cancel,
    Effect,
    Log,
    Notify,
    Release,
    RoomUpdate,
    Send,
)
from kvhandoff.transfer.failures import failure_of, remote_failure
from kvhandoff.transfer.handshake import MEMORY_KINDS, Identity, Peer, PeerState
from kvhandoff.transfer.rooms import Group, Leg
from kvhandoff.transfer.session_chunks import unit_of
from kvhandoff.transfer.session_data import DataPath
from kvhandoff.transfer.session_peers import NO_HANDSHAKE, PeerHandling
from kvhandoff.transfer.session_reports import TAIL_BUCKETS_S, ReadOuts

EARLY_LIMIT = 4096  # messages kept for rooms the engine has not opened yet
FORGOTTEN_KEEP_S = 60.0  # how long a lost peer is remembered, to tell it so if it talks on
COUNTERS = ("messages_in", "rejected_messages", "stale_messages", "retransmits",
            "checksum_failures", "checksums_verified", "bytes_sent", "bytes_received",
            "rooms_success", "rooms_failed", "peers_lost", "early_dropped", "rooms_one_sided",
            "write_quarantines")


class TransferSession(PeerHandling, DataPath, ReadOuts):
    """The protocol state of one agent (see the module doc). Single-threaded by contract: only
    its driver calls it. Args are keyword-only: `identity` (what this agent says in a Hello),
    `settings` (heartbeats, deadlines, checksums, retention), `now` (the clock at creation)."""

    def __init__(self, *, identity: Identity, settings: Settings, now: float) -> None:
        self.me = identity
        self.role = identity.role
        self.layout: LayoutSpec = identity.layout
        self.settings = settings
        self.hb = settings.heartbeat_interval_s
        self.layers = tuple(sorted({lid for r in self.layout.regions for lid in r.layer_ids}))
        self.layer_order = {lid: i for i, lid in enumerate(self.layers)}
        self.region_index = {r.name: i for i, r in enumerate(self.layout.regions)}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # labelled counters for the metrics: (direction, region) -> bytes / descriptors, and
        # the tail (last layer_ready -> Success, prefill side) as cumulative histogram buckets
        self.region_bytes: dict[tuple[str, str], int] = {}
        self.region_descriptors: dict[tuple[str, str], int] = {}
        self.tail_buckets: list[int] = [0] * (len(TAIL_BUCKETS_S) + 1)
        self.tail_sum_s = 0.0
        self.groups: dict[int, Group] = {}
        self.legs: dict[tuple[int, str], Leg] = {}
        self.peers: dict[str, Peer] = {}
        self._early: dict[int, list[Any]] = {}  # room -> messages before the engine opened it
        self._early_t: dict[int, float] = {}
        self._forgotten: dict[str, float] = {}  # peers declared lost -> when
        self._forgotten_told: dict[str, float] = {}
        self._xfer = itertools.count(1)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._next_heartbeat = now
        self._now = now
        self._out: list[Effect] = []
        self._dirty: dict[int, Group] = {}
        self._aborts_ahead: dict[object, str] = {}  # token -> reason, before its open came
        self._deadlines = DeadlineConfig(
            bootstrap_s=settings.bootstrap_timeout_s,
            waiting_for_input_s=settings.waiting_timeout_s,
            transfer_stall_s=settings.stall_timeout_s, lease_s=settings.lease_s)
        DataPath.__init__(self)
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.MessageReceived: self._on_message, ev.OpenSender: self._on_open_sender,
            ev.OpenReceiver: self._on_open_receiver, ev.PeersResolved: self._on_resolved,
            ev.LayerReady: self._on_layer_ready, ev.ReceiverInit: self._on_receiver_init,
            ev.AbortRoom: self._on_abort, ev.OpDone: self._on_op_done,
            ev.Hashed: self._on_hashed, ev.Connected: self._on_connected,
            ev.Tick: self._on_tick, ev.ForgetPeer: self._on_forget_peer,
            ev.AddChunk: self._on_add_chunk, ev.Written: self._on_written,
            ev.RemoteRegistered: self._on_remote_registered,
            ev.PeerExited: self._on_peer_exited,
        }

    # ------------------------------------------------------------------ the entry point

    def set_memory(self, kind: str) -> None:
        """Where this agent's KV buffers live ("host" or "cuda"), said in its Hello and used
        for the rooms' checksum algorithm (`handshake.checksum_alg`). Its driver calls it
        before the first event (the driver holds the buffers; the session never looks at
        them)."""
        if kind not in MEMORY_KINDS:
            raise ValueError(f"memory: {kind!r} is not one of {', '.join(MEMORY_KINDS)}")
        self.me = dataclasses.replace(self.me, memory=kind)

    def handle(self, event: ev.Event, now: float) -> list[Effect]:
        """Feeds one event that happened at `now`; returns the effects to execute, in order."""
        gap, self._now = now - self._now, now
        self._out = []
        try:
            if gap > 2 * self.hb:
                self._woke(gap)
            self._handlers[type(event)](event)
        finally:
            self._publish()
        out, self._out = self._out, []
        return out

    def next_wakeup(self) -> float:
        """When the driver must send the next `Tick` at the latest."""
        if self._pending_done:
            return self._now
        when = self._next_heartbeat
        if self._timers:
            when = min(when, self._timers[0][0])
        return when

    def _emit(self, effect: Effect) -> None:
        self._out.append(effect)

    def _send(self, addr: str, msg: P.Message) -> None:
        self._out.append(Send(addr, msg))

    def _later(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self._now + delay_s, next(self._timer_seq), fn))

    # ------------------------------------------------------------------ engine events

    def _group(self, room: int, token: object) -> Group | None:
        g = self.groups.get(room)
        return g if g is not None and g.token is token else None

    def _new_group(self, room: int, token: object, expected: int | None) -> Group:
        old = self.groups.get(room)
        if old is not None:  # a finished room with the same id: forget it
            for leg in old.legs:
                self.legs.pop((room, leg.peer), None)
        g = Group(room=room, role=self.role, layers=self.layers, expected=expected, token=token,
                  t_created=self._now)
        self.groups[room] = g
        self._dirty[id(g)] = g
        return g

    def _new_leg(self, g: Group, peer: str) -> Leg:
        r = Leg(room=g.room, role=self.role, layers=g.layers, group=g, peer=peer,
                machine=RoomMachine(self.role, now=self._now, deadlines=self._deadlines,
                                    layers=g.layers))
        g.legs.append(r)
        self.legs[(g.room, peer)] = r
        return r

    def _on_open_sender(self, e: ev.OpenSender) -> None:
        g = self._new_group(e.room, e.token, e.expected)
        g.seq_len, g.pages = e.seq_len, e.pages
        g.prompt_tokens = e.prompt_tokens
        g.chunk_end = e.chunk_end or e.seq_len
        self._early_t.pop(e.room, None)
        for msg in self._early.pop(e.room, []):
            self._room_msg(msg)
        self._group_update(g)
        self._abort_if_asked(g)

    def _on_open_receiver(self, e: ev.OpenReceiver) -> None:
        g = self._new_group(e.room, e.token, None)
        if e.peers is not None:
            self._attach_peers(g, list(e.peers))
        self._abort_if_asked(g)

    def _on_resolved(self, e: ev.PeersResolved) -> None:
        g = self._group(e.room, e.token)
        if g is None:
            return
        if e.error is not None:
            self._fail_group(g, Failure(FailureKind.BOOTSTRAP,
                                        f"bootstrap lookup failed: {e.error}"))
            return
        self._attach_peers(g, list(e.peers))

    def _on_layer_ready(self, e: ev.LayerReady) -> None:
        g = self._group(e.room, e.token)
        if g is None or e.layer in g.ready:
            return
        g.ready.append(e.layer)
        g.t_last_ready = self._now
        for r in g.legs:
            if r.accepted and not r.machine.is_terminal:
                self._post_ready(r, e.layer)

    def _on_receiver_init(self, e: ev.ReceiverInit) -> None:
        g = self._group(e.room, e.token)
        if g is None:
            return
        g.seq_len = e.seq_len
        g.pages = (e.pages, e.prefix)
        g.prompt, g.cached_prefix, g.free_pages = e.prompt, e.cached_prefix, e.free_pages
        for r in g.legs:
            self._init_leg(r)

    def _init_leg(self, r: Leg) -> None:
        """Decode: give a leg the engine's pages once both exist; maybe request."""
        g = r.group
        if g.pages is None or r.inited:
            return
        table, prefix = g.pages
        r.seq_len, r.prefix_len, r.pages = g.seq_len, prefix, table
        r.page_size = self.layout.page_size_tokens
        r.inited = True
        self._maybe_request(r)

    def _on_abort(self, e: ev.AbortRoom) -> None:
        g = self._group(e.room, e.token)
        if g is None:
            # the driver feeds aborts ahead of the queue: the room's open may still be queued
            if len(self._aborts_ahead) < EARLY_LIMIT:
                self._aborts_ahead.setdefault(e.token, e.reason)
            return
        self._abort(g, e.reason)

    def _abort_if_asked(self, g: Group) -> None:
        reason = self._aborts_ahead.pop(g.token, None)
        if reason is not None:
            self._abort(g, reason)

    def _abort(self, g: Group, reason: str) -> None:
        for r in g.legs:
            self._fail(r, Aborted(reason=reason, by=self.role), notify=Notify.ABORT)
        self._fail_group(g, Failure(FailureKind.ABORTED,
                                    f"aborted by {self.role.value}: {reason}"))

    # ------------------------------------------------------------------ message handling

    def _on_message(self, e: ev.MessageReceived) -> None:
        msg = e.msg
        self.counters["messages_in"] += 1
        if isinstance(msg, P.Hello):  # Hello and HelloAck
            self._on_hello(msg)
            return
        p = self.peers.get(msg.src)
        if (self.me.hmac_secret and (p is None or not p.authenticated)
                and not isinstance(msg, P.HelloReject)):
            # with a shared secret, only a peer whose Hello verified may touch rooms (an
            # unknown process must not fail or abort a room it could not join)
            self.counters["stale_messages"] += 1
            return
        if p is None or (p.gen and msg.gen != p.gen):
            # no handshake with this sender (or an older generation of it)
            self.counters["stale_messages"] += 1
            if isinstance(msg, P.Failed | P.Abort) and p is None:
                self._room_msg(msg)  # a failure for a room may precede any handshake
            elif p is None and not isinstance(msg, P.Reject | P.AbortAck):
                self._tell_forgotten(msg.src)
            return
        p.last_seen = self._now
        if isinstance(msg, P.HelloReject):
            lm = LayoutMismatch(diff=tuple(msg.diff or [msg.reason]))
            p.state, p.rejected = PeerState.REJECTED, failure_of(lm)
            self._fail_waiting(p, lm)
        elif isinstance(msg, P.Heartbeat):
            for room in msg.rooms:
                r = self.legs.get((room, p.addr))
                if r is not None and not r.machine.is_terminal:
                    r.machine.apply(LeaseRenewed(), self._now)
        elif isinstance(msg, P.Reject):
            self._emit(Log(WARNING, f"peer {msg.src} rejected a message: {msg.reason}"))
            if msg.reason.startswith(NO_HANDSHAKE):
                # It dropped us (took us for dead): rooms it had accepted are gone on its
                # side; requests it never accepted are handshaken and sent again.
                retry = frozenset(r for r in self.legs.values()
                                  if r.peer == p.addr and not r.machine.is_terminal
                                  and not r.accepted and r.role is Role.DECODE)
                self._peer_lost(p, f"peer {p.addr} dropped its handshake with this agent "
                                   "(it took this agent for dead)", keep=retry)
                for r in retry:
                    r.request_sent, r.planes = False, None
                    self._attach_peer(r, p.addr)
        else:
            self._room_msg(msg)

    def _room_msg(self, msg: Any) -> None:
        """Routes a room message to its leg (creating a prefill leg on request)."""
        r = self.legs.get((msg.room, msg.src))
        g = self.groups.get(msg.room)
        if r is None and g is not None and self.role is Role.PREFILL:
            if isinstance(msg, P.TransferRequest):
                refusal = self._refuse_request(g)
                if refusal is not None:
                    self._send(msg.src, P.Failed(
                        src=self.me.address, gen=self.me.generation, room=g.room,
                        reason=refusal.reason, failure_kind=refusal.kind.value))
                    return
                r = self._new_leg(g, msg.src)
                r.seq_len, r.pages, r.page_size = g.seq_len, g.pages, self.layout.page_size_tokens
                r.inited = True
            elif isinstance(msg, P.Failed | P.Abort):
                told = msg.failure_kind or ("aborted" if isinstance(msg, P.Abort) else "")
                self._fail_group(g, remote_failure(told, f"peer failed the room: {msg.reason}"))
                return
        if r is None:
            if g is None and (msg.room in self._early or len(self._early) < EARLY_LIMIT):
                self._early.setdefault(msg.room, []).append(msg)
                self._early_t.setdefault(msg.room, self._now)
            elif g is None:
                self._early_full(msg)
            return
        self._dispatch_room_msg(r, msg)

    def _early_full(self, msg: Any) -> None:
        """A message for a room the engine has not opened, with EARLY_LIMIT such rooms already
        held: never dropped silently. Counted, logged, and a transfer request is refused at once
        (the decode fails with the reason instead of waiting out its deadline)."""
        self.counters["early_dropped"] += 1
        self._emit(Log(WARNING, f"room {msg.room}: {type(msg).__name__} from {msg.src} dropped: "
                                f"{EARLY_LIMIT} rooms not yet opened by this engine are held"))
        if isinstance(msg, P.TransferRequest):
            self._send(msg.src, P.Failed(
                src=self.me.address, gen=self.me.generation, room=msg.room,
                reason=f"the {self.role.value} agent holds {EARLY_LIMIT} requests for rooms its "
                       "engine has not opened yet; this one was refused (retry later)",
                failure_kind=FailureKind.ADMISSION.value))

    def _refuse_request(self, g: Group) -> Failure | None:
        if g.failure is not None:
            return g.failure
        if g.expected is not None and len(g.legs) >= g.expected:
            return Failure(FailureKind.INVALID_REQUEST,
                           f"room {g.room} already has its {g.expected} decode rank(s) on this "
                           "prefill rank")
        return None

    def _dispatch_room_msg(self, r: Leg, msg: Any) -> None:
        if isinstance(msg, P.Failed | P.Abort | P.AbortAck) and r.remote_writes:
            # one-sided decode: the prefill sends these only after its writes into this
            # leg's pages stopped (it cancels them first), so the pages may be reused
            r.remote_writes = False
            if r.machine.is_terminal:
                self._maybe_release(r)
        if isinstance(msg, P.Failed):
            reason = f"peer failed the room: {msg.reason}"
            self._fail(r, RemoteFailed(reason=reason), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind, reason))
            if r.one_sided and r.role is Role.PREFILL:  # our writes were cancelled: say so
                self._send(msg.src, P.AbortAck(src=self.me.address, gen=self.me.generation,
                                               room=r.room))
        elif isinstance(msg, P.Abort):
            other = Role.DECODE if self.role is Role.PREFILL else Role.PREFILL
            self._fail(r, Aborted(reason=msg.reason, by=other), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind or "aborted", msg.reason))
            self._send(msg.src, P.AbortAck(src=self.me.address, gen=self.me.generation,
                                           room=r.room))
        elif isinstance(msg, P.AbortAck):
            pass
        elif r.machine.is_terminal:
            if isinstance(msg, P.TransferRequest) and r.machine.state is KVPoll.Failed:
                f = r.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
                self._send(msg.src, P.Failed(src=self.me.address, gen=self.me.generation,
                                             room=r.room, reason=f.reason,
                                             failure_kind=f.kind.value))
        elif isinstance(msg, P.TransferRequest):
            self._on_request(r, msg)
        elif isinstance(msg, P.TransferAccepted):
            self._on_accepted(r, msg)
        elif isinstance(msg, P.LayerDone):
            for info in msg.layers:
                unit = unit_of(info.chunk, info.layer)
                r.sums[(unit, info.attempt)] = {x.region: x.checksum for x in info.regions}
                self._try_verify(r, unit, info.attempt)
        elif isinstance(msg, P.LayerNack):
            unit = unit_of(msg.chunk, msg.layer)
            if msg.attempt + 1 < 1 << P.ATTEMPT_BITS and r.posted.get(unit) == msg.attempt:
                self.counters["retransmits"] += 1
                r.retransmits += 1
                self._post_layer(r, unit, msg.attempt + 1)
        elif isinstance(msg, P.ChunkAdded):
            if r.role is Role.DECODE:
                self._on_chunk_added(r, msg)
        elif isinstance(msg, P.ChunkAccepted):
            if r.role is Role.PREFILL:
                self._on_chunk_accepted(r, msg)
        elif isinstance(msg, P.RoomAck):
            if r.role is Role.PREFILL:
                r.acked = True
                self._maybe_acked(r)

    # ------------------------------------------------------------------ failure / release

    def _apply(self, r: Leg, event: Any) -> None:
        """Feeds a progress event; reacts to terminal states."""
        r.machine.apply(event, self._now)
        self._dirty[id(r.group)] = r.group
        if r.machine.is_terminal:
            self._terminal(r)

    def _fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
              kind: FailureKind | None = None, failure: Failure | None = None) -> None:
        """Fails the leg (first failure wins) and tells the peer. Its `Failure` is `failure`,
        else the event's (with `kind` when given)."""
        if r.machine.is_terminal:
            return
        r.machine.apply(fe, self._now)
        r.failure = failure or failure_of(fe, kind)
        self._emit(Log(INFO, f"room {r.room} ({self.role.value}) failed: {r.failure.reason}"))
        if notify is not Notify.NONE:
            f = r.failure
            cls = P.Abort if notify is Notify.ABORT else P.Failed
            self._send(r.peer, cls(src=self.me.address, gen=self.me.generation, room=r.room,
                                   reason=f.reason, failure_kind=f.kind.value))
        self._terminal(r)

    def _terminal(self, r: Leg) -> None:
        ok = r.machine.state is KVPoll.Success
        self.counters["rooms_success" if ok else "rooms_failed"] += 1
        if not ok:
            for tag in list(r.inflight_tags):
                self._emit(Cancel(r.peer, tag))
            if r.remote_writes:  # the prefill may still write into our pages: see quarantine
                self._later(self.settings.write_quarantine_s, lambda: self._quarantined(r))
        g = r.group
        if not ok and g.failure is None:
            g.failure = r.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
            for other in g.legs:
                if other is not r and not other.machine.is_terminal:
                    why = f"another rank of the room failed: {g.failure.reason}"
                    self._fail(other, RemoteFailed(reason=why), notify=Notify.FAILED,
                               failure=Failure(g.failure.kind, why))
        self._maybe_release(r)

    def _fail_group(self, g: Group, failure: Failure) -> None:
        """Fails a room that may have no legs yet (abort, failed lookup)."""
        if g.failure is None and not g.done:
            g.failure = failure
            self._emit(Log(INFO, f"room {g.room} ({self.role.value}) failed: {failure.reason}"))
            for r in g.legs:
                self._fail(r, RemoteFailed(reason=failure.reason), notify=Notify.FAILED,
                           failure=failure)
        self._group_update(g)

    def _group_update(self, g: Group) -> None:
        """Marks the room done / released once its legs allow."""
        self._dirty[id(g)] = g
        if g.state.is_terminal and not g.done:
            g.t_done = self._now
            g.done = True
            if g.state is KVPoll.Success and g.t_last_ready is not None:
                tail = max(0.0, g.t_done - g.t_last_ready)
                self.tail_sum_s += tail
                i = next((i for i, b in enumerate(TAIL_BUCKETS_S) if tail <= b),
                         len(TAIL_BUCKETS_S))
                self.tail_buckets[i] += 1
        if g.done and not g.released and all(leg.released for leg in g.legs):
            g.released = True
            self._emit(Release(g.token, g.room))

    def _maybe_release(self, r: Leg) -> None:
        if not r.inflight_tags and not r.remote_writes and not r.released:
            r.released = True
        self._group_update(r.group)

    def _quarantined(self, r: Leg) -> None:
        """Decode, one-sided: a failed leg's prefill never confirmed that its writes stopped
        (it died, or is stopped or cut off): after `write_quarantine_s` the pages go back."""
        if not r.remote_writes:
            return
        r.remote_writes = False
        self.counters["write_quarantines"] += 1
        self._emit(Log(WARNING, f"room {r.room}: prefill {r.peer} never confirmed that its "
                                f"writes into this room's pages stopped; releasing them after "
                                f"write_quarantine_s={self.settings.write_quarantine_s:g}s"))
        self._maybe_release(r)

    def _publish(self) -> None:
        """One `RoomUpdate` per room whose engine-visible state changed."""
        dirty, self._dirty = self._dirty, {}
        for g in dirty.values():
            view = (g.state, g.failure, len(g.landed), g.done)
            if view != g.published:
                g.published = view
                self._out.append(RoomUpdate(g.token, g.state, g.failure, frozenset(g.landed),
                                            g.done))

    # ------------------------------------------------------------------ time

    def _woke(self, gap: float) -> None:
        """Nothing reached this session for `gap` > 2 heartbeats: its driver sent no heartbeat
        either (the process was stopped, or its control thread starved), so every peer has
        declared this agent lost and given up our rooms with it. Say so before anything else
        is read, so that a room a peer already failed never ends Success here from messages
        queued before (the peer's Failed may come after them, or never)."""
        for p in [p for p in self.peers.values() if p.talking or p.waiting]:
            self._peer_lost(p, f"this agent was unresponsive for {gap:.2f}s (> 2 heartbeats "
                               f"of {self.hb:g}s): peer {p.addr} has given its rooms up")

    def _on_tick(self, e: ev.Tick) -> None:
        now = self._now
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
        self._flush_done()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.hb
            self._heartbeats(now, e.drained_at)

    def _heartbeats(self, now: float, drained_at: float) -> None:
        """Heartbeats out, dead peers and expired deadlines in."""
        by_peer: dict[str, list[int]] = {}
        for r in self.legs.values():
            if not r.machine.is_terminal:
                by_peer.setdefault(r.peer, []).append(r.room)
        for g in list(self.groups.values()):
            waited = now - g.t_created
            if (not g.done and (g.expected is None or len(g.legs) < g.expected)
                    and waited > self.settings.bootstrap_timeout_s):
                self._fail_group(g, Failure(FailureKind.DEADLINE, "bootstrap deadline expired: "
                                            f"no peer after {waited:.1f}s", deadline="bootstrap"))
        for p in list(self.peers.values()):
            if p.talking:
                self._send(p.addr, P.Heartbeat(src=self.me.address, gen=self.me.generation,
                                               rooms=by_peer.get(p.addr, [])))
            # silence is measured up to the last moment the driver had read every message it
            # was sent: a busy control loop must not take its own backlog for a dead peer
            silent = min(now, drained_at) - p.last_seen
            if (p.matched or p.waiting) and silent > 2 * self.hb:
                self._peer_lost(p, f"peer {p.addr} silent for {silent:.2f}s "
                                   f"(> 2 heartbeats of {self.hb:g}s)")
        for r in list(self.legs.values()):
            if not r.machine.is_terminal:
                for which in r.machine.expired(now):
                    self._fail(r, DeadlineExpired(which=which), notify=Notify.FAILED)
                    break
        self.collect(now)

    def collect(self, now: float) -> None:
        """Forgets what is kept only for a while: early messages of rooms never opened, peers
        declared lost, finished and released rooms after `room_retention_s`."""
        for room in [k for k, t in self._early_t.items()
                     if now - t > self.settings.bootstrap_timeout_s]:
            self._early.pop(room, None)
            self._early_t.pop(room, None)
        for addr in [a for a, t in self._forgotten.items() if now - t > FORGOTTEN_KEEP_S]:
            self._forgotten.pop(addr, None)
            self._forgotten_told.pop(addr, None)
        keep = self.settings.room_retention_s
        for room in [k for k, g in self.groups.items()
                     if g.released and g.t_done is not None and now - g.t_done > keep]:
            for r in self.groups.pop(room).legs:
                self.legs.pop((room, r.peer), None)

    def suffix_pages(self, r: Leg) -> dict[str, np.ndarray]:
        """Prefill: the leg's pages per region, suffix-only regions from the page-aligned
        decode prefix on."""
        return {reg.name: r.pages[reg.name][
            page_aligned(r.prefix_len, r.page_size) // r.page_size
            if reg.send_from is SendFrom.DECODE_PREFIX else 0:]
            for reg in self.layout.regions}
