"""`RoomTable`: the rooms of one session and their life cycle, sans-IO.

It owns the rooms (`rooms.Group`) and their legs (`rooms.Leg`), and every rule about how a room
ends: progress events go through `apply`, failures through `fail` (first failure wins, the peer
is told), and a room's pages go back (`effects.Release`) exactly once, after it is terminal and
nothing can write them any more: no op of it in flight, no cancel unanswered, no one-sided
writer that has not confirmed it stopped (or `write_quarantine_s` after it failed to). The
engine sees a room through `publish`: one `RoomUpdate` per room whose view changed.

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

from typing import Any

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import INFO, WARNING, Cancel, Notify, Release, RoomUpdate
from kvhandoff.protocol.failures import failure_of
from kvhandoff.protocol.reports import ReadOuts
from kvhandoff.protocol.rooms import Group, Leg, LegPhase, RoomPhase
from kvhandoff.settings import Settings
from kvhandoff.state_machine import (
    DeadlineConfig,
    FailureEvent,
    KVPoll,
    PeerFailedRoom,
    Role,
    RoomMachine,
)


def write_quarantine(st: Settings) -> float:
    """How long a decode holds a failed one-sided room's pages when its prefill never says
    its writes stopped: `write_quarantine_s`, but never shorter than the writer's own bound on
    stopping a copy (its transport waits `stall_timeout_s` for a cancelled copy to stop
    before it calls it failed) plus two heartbeats (its word that it gave up, or its loss,
    takes that long to be seen). Derived from this side's settings: both sides are expected
    to run the same `stall_timeout_s` (docs/RELIABILITY.md)."""
    return max(st.write_quarantine_s, st.stall_timeout_s + 2 * st.heartbeat_interval_s)


class RoomTable:
    """The rooms of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, readouts: ReadOuts) -> None:
        self.ctx = ctx
        self.readouts = readouts
        self.groups: dict[int, Group] = {}
        self.legs: dict[tuple[int, str], Leg] = {}
        self._dirty: dict[int, Group] = {}
        self._cancelling: dict[tuple[str, int], Leg] = {}  # (peer, tag) -> leg, until answered
        st = ctx.settings
        self.deadlines = DeadlineConfig(
            bootstrap_s=st.bootstrap_timeout_s, waiting_for_input_s=st.waiting_timeout_s,
            transfer_stall_s=st.stall_timeout_s, lease_s=st.lease_s)

    # ------------------------------------------------------------------ rooms and legs

    def group(self, room: int, token: object) -> Group | None:
        """The room `room` opened under `token` (None: another one, or forgotten)."""
        g = self.groups.get(room)
        return g if g is not None and g.token is token else None

    def refuse_reopen(self, room: int, token: object) -> bool:
        """A room id is reopened only once its previous use released its pages: until then
        late messages of that use (an AbortAck, a Failed) would reach the new room, and a
        one-sided writer may still write into the old pages. Such an open fails at once (its
        token is told Failed and released: it holds nothing); the old room is left as it is."""
        old = self.groups.get(room)
        if old is None or old.released:
            return False
        state = "terminal, its pages not yet released" if old.done else "still open"
        failure = Failure(FailureKind.INVALID_REQUEST,
                          f"room {room}: opened again while its previous use is {state}; "
                          "open it again once that one is released")
        self.ctx.log(WARNING, failure.reason)
        self.ctx.emit(RoomUpdate(token, KVPoll.Failed, failure, frozenset(), True))
        self.ctx.emit(Release(token, room))
        return True

    def new_group(self, room: int, token: object, expected: int | None) -> Group:
        old = self.groups.get(room)
        if old is not None:  # a released room with the same id: forget it
            for leg in old.legs:
                self.legs.pop((room, leg.peer), None)
        g = Group(room=room, role=self.ctx.role, layers=self.ctx.layers, expected=expected,
                  token=token, t_created=self.ctx.now)
        self.groups[room] = g
        self.changed(g)
        return g

    def new_leg(self, g: Group, peer: str) -> Leg:
        r = Leg(room=g.room, role=self.ctx.role, layers=g.layers, group=g, peer=peer,
                machine=RoomMachine(self.ctx.role, now=self.ctx.now, deadlines=self.deadlines,
                                    layers=g.layers))
        g.legs.append(r)
        self.legs[(g.room, peer)] = r
        return r

    def open_legs(self) -> list[Leg]:
        return [r for r in self.legs.values() if not r.machine.is_terminal]

    def changed(self, g: Group) -> None:
        """The engine-visible view of `g` may have changed (`publish` compares)."""
        self._dirty[id(g)] = g

    # ------------------------------------------------------------------ progress / failure

    def apply(self, r: Leg, event: Any) -> None:
        """Feeds a progress event; reacts to terminal states."""
        r.machine.apply(event, self.ctx.now)
        self.changed(r.group)
        if r.machine.is_terminal:
            self._terminal(r)

    def fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
             kind: FailureKind | None = None, failure: Failure | None = None) -> None:
        """Fails the leg (first failure wins) and tells the peer. Its `Failure` is `failure`,
        else the event's (with `kind` when given)."""
        if r.machine.is_terminal:
            return
        ctx = self.ctx
        r.machine.apply(fe, ctx.now)
        r.failure = failure or failure_of(fe, kind)
        ctx.log(INFO, f"room {r.room} ({ctx.role.value}) failed: {r.failure.reason}")
        if notify is not Notify.NONE:
            f = r.failure
            cls = P.Abort if notify is Notify.ABORT else P.Failed
            stopped = not self.writes_in_flight(r)
            ctx.send(r.peer, cls(src=ctx.me.address, gen=ctx.me.generation, room=r.room,
                                 reason=f.reason, failure_kind=f.kind.value,
                                 writes_stopped=stopped, xfer=r.xfer))
            if not stopped:
                r.fence.ack_when_stopped = True  # the AbortAck follows once the cancels confirm
        self._terminal(r)

    def _terminal(self, r: Leg) -> None:
        ok = r.machine.state is KVPoll.Success
        self.ctx.counters["rooms_success" if ok else "rooms_failed"] += 1
        if not ok:
            for tag in list(r.fence.tags):
                if (r.peer, tag) not in self._cancelling:
                    self._cancelling[(r.peer, tag)] = r
                    r.fence.cancelling.add(tag)
                    self.ctx.emit(Cancel(r.peer, tag))
            if r.fence.remote_writes:  # the prefill may still write into our pages: see quarantine
                self.ctx.later(write_quarantine(self.ctx.settings),
                               lambda: self._quarantined(r))
        g = r.group
        if not ok and g.failure is None:
            g.failure = r.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
            for other in g.legs:
                if other is not r and not other.machine.is_terminal:
                    why = f"another rank of the room failed: {g.failure.reason}"
                    self.fail(other, PeerFailedRoom(reason=why), notify=Notify.FAILED,
                              failure=Failure(g.failure.kind, why))
        self.maybe_release(r)

    def fail_group(self, g: Group, failure: Failure) -> None:
        """Fails a room that may have no legs yet (abort, failed lookup)."""
        if g.failure is None and not g.done:
            g.failure = failure
            self.ctx.log(INFO, f"room {g.room} ({self.ctx.role.value}) failed: "
                               f"{failure.reason}")
            for r in g.legs:
                self.fail(r, PeerFailedRoom(reason=failure.reason), notify=Notify.FAILED,
                          failure=failure)
        self.group_update(g)

    def group_update(self, g: Group) -> None:
        """Marks the room done / released once its legs allow."""
        self.changed(g)
        if g.state.is_terminal and not g.done:
            g.t_done = self.ctx.now
            g.advance(RoomPhase.DONE)
            if g.state is KVPoll.Success and g.t_last_ready is not None:
                self.readouts.tail(max(0.0, g.t_done - g.t_last_ready))
        if g.done and not g.released and all(leg.released for leg in g.legs):
            g.advance(RoomPhase.RELEASED)
            self.ctx.emit(Release(g.token, g.room))

    def maybe_release(self, r: Leg) -> None:
        if r.fence.ack_when_stopped and not self.writes_in_flight(r):
            self.ack_stopped(r)  # its last write ended or its last cancel confirmed
        if r.machine.is_terminal and not r.released and not r.fence.holds:
            r.advance(LegPhase.RELEASED)
        self.group_update(r.group)

    # ------------------------------------------------------------------ stopping writes

    def writes_in_flight(self, r: Leg) -> bool:
        """Prefill, one-sided: writes of this leg may still land in the decode's pages (posted
        and not completed, a cancel not yet confirmed, or one that failed)."""
        return r.role is Role.PREFILL and r.one_sided and r.fence.own_writes

    def ack_stopped(self, r: Leg) -> None:
        """Tells the peer that this side writes nothing more into the room (`AbortAck`): now,
        or once the leg's cancels confirmed (never, when one failed: the decode's
        write_quarantine_s bounds its wait)."""
        if self.writes_in_flight(r):
            r.fence.ack_when_stopped = True
            return
        r.fence.ack_when_stopped = False
        me = self.ctx.me
        self.ctx.send(r.peer, P.AbortAck(src=me.address, gen=me.generation, room=r.room,
                                         xfer=r.xfer))

    def writes_stopped(self, r: Leg) -> None:
        """Decode, one-sided: the prefill says its writes into this leg's pages stopped."""
        r.fence.remote_writes = False
        if r.machine.is_terminal:
            self.maybe_release(r)

    def on_cancelled(self, e: ev.Cancelled) -> None:
        """A `Cancel` (tag) or `DropPeer` (tag None) was executed. A failure (a copy that did
        not stop) keeps the legs' pages held until write_quarantine_s: counted and logged."""
        if e.tag is None:
            legs = [r for r in self.legs.values() if r.peer == e.peer and not r.released]
        else:
            r0 = self._cancelling.pop((e.peer, e.tag), None)
            legs = [] if r0 is None else [r0]
            if r0 is not None:
                r0.fence.cancelling.discard(e.tag)
        for r in legs:
            if e.error is not None:
                self._stop_failed(r, e)
            self.maybe_release(r)
        if e.error is not None and not legs:
            self.ctx.counters["cancel_failures"] += 1
            what = "disconnect" if e.tag is None else "cancel"
            self.ctx.log(WARNING, f"peer {e.peer}: {what} failed: {e.error}")

    def _stop_failed(self, r: Leg, e: ev.Cancelled) -> None:
        what = "disconnect" if e.tag is None else f"cancel of tag {e.tag}"
        self.ctx.counters["cancel_failures"] += 1
        bound = self.ctx.settings.write_quarantine_s
        self.ctx.log(WARNING, f"room {r.room}: {what} with {r.peer} failed ({e.error}); its "
                              f"pages stay held for write_quarantine_s={bound:g}s")
        if not r.fence.stop_failed:
            r.fence.stop_failed = True
            self.ctx.later(bound, lambda: self._stop_bound(r))

    def _stop_bound(self, r: Leg) -> None:
        """write_quarantine_s after a failed cancel: the pages go back (what the decode does
        to a prefill that never confirmed)."""
        r.fence.stop_failed = False
        self.ctx.log(WARNING, f"room {r.room}: releasing its pages write_quarantine_s after "
                              f"a failed cancel with {r.peer}")
        self.maybe_release(r)

    def _quarantined(self, r: Leg) -> None:
        """Decode, one-sided: a failed leg's prefill never confirmed that its writes stopped
        (it died, or is stopped or cut off): after `write_quarantine` the pages go back."""
        if not r.fence.remote_writes:
            return
        r.fence.remote_writes = False
        self.ctx.counters["write_quarantines"] += 1
        self.ctx.log(WARNING, f"room {r.room}: prefill {r.peer} never confirmed that its "
                              f"writes into this room's pages stopped; releasing them after "
                              f"the write quarantine ({write_quarantine(self.ctx.settings):g}s: "
                              "write_quarantine_s, at least stall_timeout_s + 2 heartbeats)")
        self.maybe_release(r)

    # ------------------------------------------------------------------ views and collection

    def publish(self) -> None:
        """One `RoomUpdate` per room whose engine-visible state changed."""
        dirty, self._dirty = self._dirty, {}
        for g in dirty.values():
            view = (g.state, g.failure, len(g.landed), g.done)
            if view != g.published:
                g.published = view
                self.ctx.emit(RoomUpdate(g.token, g.state, g.failure, frozenset(g.landed),
                                         g.done))

    def collect(self, now: float) -> None:
        """Forgets finished and released rooms after `room_retention_s`."""
        keep = self.ctx.settings.room_retention_s
        for room in [k for k, g in self.groups.items()
                     if g.released and g.t_done is not None and now - g.t_done > keep]:
            for r in self.groups.pop(room).legs:
                self.legs.pop((room, r.peer), None)
