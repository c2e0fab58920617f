"""`RoomTable`: the rooms of one session and their life cycle, sans-IO.

It owns the rooms (`rooms.Room`) and their legs (`rooms.Leg`), and every rule about how a room
ends: progress events go through `apply`, failures through `fail` (first failure wins, the peer
is told), and a room's pages go back (`effects.Release`) exactly once, after it is terminal and
nothing can write them any more: no op of it in flight, no cancel unanswered, no one-sided
writer that has not confirmed it stopped (or `write_quarantine_s` after it failed to). The
table decides when a room or leg moves and what is sent, cancelled or released with it; the
move itself is a method of the room's `roomstate.RoomState` / the leg's `LegState`, which
checks it. The engine sees a room through `publish`: one `RoomUpdate` per room whose view
changed (a copy of its state, never a second owner).

Rules:
- One leg failing fails its room: every other leg of the room is failed with the reason.
- A failed cancel (a copy that did not stop) keeps the leg's pages held until
  `write_quarantine_s`, counted and logged; so does a decode whose one-sided prefill never
  confirmed its writes stopped (`write_quarantine`: never shorter than the writer's own bound
  on stopping a copy, stall_timeout_s, plus two heartbeats). A decode leg counts as written
  into from the TransferRequest that offered its buffers on (`Fence.remote_writes`).
- A room id is opened again only once its previous use is released (`refuse_reopen`).
- A prefill's messages about a leg name the request they answer (`xfer`); a decode drops
  those of another request (a late word about an earlier use of the id) and lets a stop
  (`Failed`/`Abort` with writes_stopped, `AbortAck`) unfence its pages only when it names the
  leg's request (`session.TransferSession._dispatch_room_msg`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import INFO, WARNING, Cancel, Notify, Release, RoomUpdate
from kvhandoff.protocol.failures import failure_of
from kvhandoff.protocol.reports import ReadOuts
from kvhandoff.protocol.rooms import Leg, Room
from kvhandoff.protocol.roomstate import LegState, RoomState
from kvhandoff.settings import Settings
from kvhandoff.state_machine import (
    DeadlineConfig,
    FailureEvent,
    KVPoll,
    LegMachine,
    PeerFailedRoom,
    Role,
)


def write_quarantine(st: Settings, peer_stall_s: float = 0.0, peer_heartbeat_s: float = 0.0
                     ) -> float:
    """How long a decode holds a failed one-sided room's pages when its prefill never says
    its writes stopped: `write_quarantine_s`, but never shorter than the writer's own bound on
    stopping a copy (its transport waits `stall_timeout_s` for a cancelled copy to stop
    before it calls it failed) plus two heartbeats (its word that it gave up, or its loss,
    takes that long to be seen). Each of the two is the longer of this side's setting and what
    the writer said in its Hello (`peer_stall_s`, `peer_heartbeat_s`; 0: not said), so two
    sides set differently still hold the pages past the writer's bound."""
    return max(st.write_quarantine_s,
               max(st.stall_timeout_s, peer_stall_s)
               + 2 * max(st.heartbeat_interval_s, peer_heartbeat_s))


class RoomTable:
    """The rooms of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, readouts: ReadOuts) -> None:
        self.ctx = ctx
        self.readouts = readouts
        self.by_id: dict[int, Room] = {}
        self.legs: dict[tuple[int, str], Leg] = {}
        self._dirty: dict[int, Room] = {}
        self._cancelling: dict[tuple[str, int], Leg] = {}  # (peer, tag) -> leg, until answered
        #: (stall_timeout_s, heartbeat) a peer said in its Hello, by its address (set by the
        #: session to `PeerTable.bounds_of`; the quarantines outlast the longer of each)
        self.peer_bounds: Callable[[str], tuple[float, float]] = lambda addr: (0.0, 0.0)
        st = ctx.settings
        self.deadlines = DeadlineConfig(
            bootstrap_s=st.bootstrap_timeout_s, waiting_for_input_s=st.waiting_timeout_s,
            transfer_stall_s=st.stall_timeout_s, lease_s=st.lease_s)

    # ------------------------------------------------------------------ rooms and legs

    def find(self, room: int, token: object) -> Room | None:
        """The room `room` opened under `token` (None: another one, or forgotten)."""
        g = self.by_id.get(room)
        return g if g is not None and g.token is token else None

    def refuse_reopen(self, room: int, token: object) -> bool:
        """A room id is reopened only once its previous use released its pages: until then
        late messages of that use (an AbortAck, a Failed) would reach the new room, and a
        one-sided writer may still write into the old pages. Such an open fails at once (its
        token is told Failed and released: it holds nothing); the old room is left as it is."""
        old = self.by_id.get(room)
        if old is None or old.state.released:
            return False
        state = "terminal, its pages not yet released" if old.state.done else "still open"
        failure = Failure(FailureKind.INVALID_REQUEST,
                          f"room {room}: opened again while its previous use is {state}; "
                          "open it again once that one is released")
        self.ctx.log(WARNING, failure.reason)
        self.ctx.emit(RoomUpdate(token, KVPoll.Failed, failure, frozenset(), True))
        self.ctx.emit(Release(token, room))
        return True

    def new_room(self, room: int, token: object, expected: int | None) -> Room:
        old = self.by_id.get(room)
        if old is not None:  # a released room with the same id: forget it
            for leg in old.legs:
                self.legs.pop((room, leg.peer), None)
        g = Room(room=room, role=self.ctx.role, layers=self.ctx.layers, token=token,
                  state=RoomState(room=room, expected=expected), t_created=self.ctx.now)
        self.by_id[room] = g
        self.changed(g)
        return g

    def new_leg(self, g: Room, peer: str) -> Leg:
        machine = LegMachine(self.ctx.role, now=self.ctx.now, deadlines=self.deadlines,
                              layers=g.layers)
        r = Leg(room=g.room, role=self.ctx.role, layers=g.layers, parent=g, peer=peer,
                state=LegState(room=g.room, peer=peer, machine=machine))
        g.add_leg(r)
        self.legs[(g.room, peer)] = r
        return r

    def open_legs(self) -> list[Leg]:
        return [r for r in self.legs.values() if not r.state.terminal]

    def changed(self, g: Room) -> None:
        """The engine-visible view of `g` may have changed (`publish` compares)."""
        self._dirty[id(g)] = g

    # ------------------------------------------------------------------ progress / failure

    def apply(self, r: Leg, event: Any) -> None:
        """Feeds a progress event; reacts to terminal states."""
        r.state.apply(event, self.ctx.now)
        self.changed(r.parent)
        if r.state.terminal:
            self._terminal(r)

    def apply_layers(self, r: Leg, layers: list[int]) -> None:
        """Feeds the layers of `r` that moved together (sent, or landed) as one step."""
        r.state.apply_layers(layers, self.ctx.now)
        self.changed(r.parent)
        if r.state.terminal:
            self._terminal(r)

    def fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
             kind: FailureKind | None = None, failure: Failure | None = None) -> None:
        """Fails the leg (first failure wins) and tells the peer. Its `Failure` is `failure`,
        else the event's (with `kind` when given)."""
        ctx = self.ctx
        f = failure or failure_of(fe, kind)
        if not r.state.fail(fe, f, ctx.now):
            return
        ctx.log(INFO, f"room {r.room} ({ctx.role.value}) failed: {f.reason}")
        if notify is not Notify.NONE:
            stopped = not self.writes_in_flight(r)
            cls = P.Abort if notify is Notify.ABORT else functools.partial(
                P.Failed, dropped_gen=r.peer_gen if notify is Notify.DROPPED else 0)
            ctx.send(r.peer, cls(src=ctx.me.address, gen=ctx.me.generation, room=r.room,
                                 reason=f.reason, failure_kind=f.kind.value,
                                 writes_stopped=stopped, xfer=r.xfer))
            if not stopped:
                r.state.fence.owe_ack()  # the AbortAck follows once cancels confirm
        self._terminal(r)

    def _terminal(self, r: Leg) -> None:
        ok = r.state.poll is KVPoll.Success
        fence = r.state.fence
        self.ctx.counters["rooms_success" if ok else "rooms_failed"] += 1
        if not ok:
            for tag in list(fence.tags):
                if (r.peer, tag) not in self._cancelling:
                    self._cancelling[(r.peer, tag)] = r
                    fence.cancel_sent(tag)
                    self.ctx.emit(Cancel(r.peer, tag))
            if fence.remote_writes:  # the prefill may still write into our pages: see quarantine
                bound = self._quarantine(r)
                self.ctx.later(bound, lambda: self._quarantined(r, bound))
        g = r.parent
        if not ok and g.state.fail(r.state.failure
                                   or Failure(FailureKind.REMOTE_FAILED, "failed")):
            gf = g.state.failure
            assert gf is not None
            for other in g.legs:
                if other is not r and not other.state.terminal:
                    why = f"another rank of the room failed: {gf.reason}"
                    self.fail(other, PeerFailedRoom(reason=why), notify=Notify.FAILED,
                              failure=Failure(gf.kind, why))
        self.maybe_release(r)

    def fail_room(self, g: Room, failure: Failure) -> None:
        """Fails a room that may have no legs yet (abort, failed lookup)."""
        if not g.state.done and g.state.fail(failure):
            self.ctx.log(INFO, f"room {g.room} ({self.ctx.role.value}) failed: "
                               f"{failure.reason}")
            for r in g.legs:
                self.fail(r, PeerFailedRoom(reason=failure.reason), notify=Notify.FAILED,
                          failure=failure)
        self.room_update(g)

    def room_update(self, g: Room) -> None:
        """Marks the room done / released once its legs allow."""
        self.changed(g)
        s = g.state
        if s.finish(self.ctx.now):
            assert s.t_done is not None
            if s.poll is KVPoll.Success and g.given.t_last_ready is not None:
                self.readouts.tail(max(0.0, s.t_done - g.given.t_last_ready))
        if s.release():
            self.ctx.emit(Release(g.token, g.room))

    def maybe_release(self, r: Leg) -> None:
        if r.state.fence.ack_when_stopped and not self.writes_in_flight(r):
            self.ack_stopped(r)  # its last write ended or its last cancel confirmed
        r.state.release()
        self.room_update(r.parent)

    # ------------------------------------------------------------------ stopping writes

    def writes_in_flight(self, r: Leg) -> bool:
        """Prefill, one-sided: writes of this leg may still land in the decode's pages (posted
        and not completed, a cancel not yet confirmed, or one that failed)."""
        return r.role is Role.PREFILL and r.one_sided and r.state.fence.own_writes

    def ack_stopped(self, r: Leg) -> None:
        """Tells the peer that this side writes nothing more into the room (`AbortAck`): now,
        or once the leg's cancels confirmed (never, when one failed: the decode's
        write_quarantine_s bounds its wait)."""
        if self.writes_in_flight(r):
            r.state.fence.owe_ack()
            return
        r.state.fence.ack_sent()
        me = self.ctx.me
        self.ctx.send(r.peer, P.AbortAck(src=me.address, gen=me.generation, room=r.room,
                                         xfer=r.xfer))

    def writes_stopped(self, r: Leg) -> None:
        """Decode, one-sided: the prefill says its writes into this leg's pages stopped."""
        r.state.fence.writer_stopped()
        if r.state.terminal:
            self.maybe_release(r)

    def on_cancelled(self, e: ev.Cancelled) -> None:
        """A `Cancel` (tag) or `DropPeer` (tag None) was executed. A failure (a copy that did
        not stop) keeps the legs' pages held for `write_quarantine`: counted and logged."""
        if e.tag is None:
            legs = [r for r in self.legs.values() if r.peer == e.peer and not r.state.released]
        else:
            r0 = self._cancelling.pop((e.peer, e.tag), None)
            legs = [] if r0 is None else [r0]
            if r0 is not None:
                r0.state.fence.cancel_answered(e.tag)
        for r in legs:
            if e.error is not None:
                self._stop_failed(r, e)
            self.maybe_release(r)
        if e.error is not None and not legs:
            self.ctx.counters["cancel_failures"] += 1
            what = "disconnect" if e.tag is None else "cancel"
            self.ctx.log(WARNING, f"peer {e.peer}: {what} failed: {e.error}")

    def _stop_failed(self, r: Leg, e: ev.Cancelled) -> None:
        # the copy that did not stop may go on until its writer's bound (the same reasoning
        # as the decode's quarantine: `write_quarantine`); its op already completed
        what = "disconnect" if e.tag is None else f"cancel of tag {e.tag}"
        self.ctx.counters["cancel_failures"] += 1
        bound = self._quarantine(r)
        self.ctx.log(WARNING, f"room {r.room}: {what} with {r.peer} failed ({e.error}); its "
                              f"pages stay held for {bound:g}s (write_quarantine_s, at least "
                              "stall_timeout_s + 2 heartbeats)")
        if r.state.fence.stop_failed_now():
            self.ctx.later(bound, lambda: self._stop_bound(r))

    def _quarantine(self, r: Leg) -> float:
        """`write_quarantine` for leg `r`: this side's settings and what its peer said."""
        return write_quarantine(self.ctx.settings, *self.peer_bounds(r.peer))

    def _stop_bound(self, r: Leg) -> None:
        """write_quarantine_s after a failed cancel: the pages go back (what the decode does
        to a prefill that never confirmed)."""
        r.state.fence.stop_bound_passed()
        self.ctx.log(WARNING, f"room {r.room}: releasing its pages write_quarantine_s after "
                              f"a failed cancel with {r.peer}")
        self.maybe_release(r)

    def _quarantined(self, r: Leg, bound: float) -> None:
        """Decode, one-sided: a failed leg's prefill never confirmed that its writes stopped
        (it died, or is stopped or cut off): after `write_quarantine` the pages go back."""
        if not r.state.fence.writer_stopped():
            return
        self.ctx.counters["write_quarantines"] += 1
        self.ctx.log(WARNING, f"room {r.room}: prefill {r.peer} never confirmed that its "
                              f"writes into this room's pages stopped; releasing them after "
                              f"the write quarantine ({bound:g}s: "
                              "write_quarantine_s, at least stall_timeout_s + 2 heartbeats)")
        self.maybe_release(r)

    # ------------------------------------------------------------------ views and collection

    def publish(self) -> None:
        """One `RoomUpdate` per room whose engine-visible state changed."""
        dirty, self._dirty = self._dirty, {}
        for g in dirty.values():
            s = g.state
            view = (s.poll, s.failure, len(g.landed), s.done)
            if view != g.published:
                g.published = view
                self.ctx.emit(RoomUpdate(g.token, s.poll, s.failure, frozenset(g.landed),
                                         s.done))

    def collect(self, now: float) -> None:
        """Forgets finished and released rooms after `room_retention_s`."""
        keep = self.ctx.settings.room_retention_s
        for room in [k for k, g in self.by_id.items()
                     if g.state.released and g.state.t_done is not None
                     and now - g.state.t_done > keep]:
            for r in self.by_id.pop(room).legs:
                self.legs.pop((room, r.peer), None)
