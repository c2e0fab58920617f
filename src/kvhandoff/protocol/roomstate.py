"""A room's state on one agent, in one place: `RoomState` for the room, `LegState` per leg.
Pure data with its transitions (no threads, no clock: the time is an argument).

Rules:
- Everything that decides where a room stands lives here and moves only through a method of
  these objects, which checks the transition against its table and its invariants
  (`InvalidTransition` otherwise): no other module assigns a phase or a failure or feeds a
  `LegMachine` (`tests/unit/protocol/test_room_state_owner.py` reads every module for it).
- A `LegState` is a leg's `LegMachine` (`kvhandoff.state_machine`: the KVPoll state, the
  layers moved, the deadlines), its `LegPhase` (how far its exchange with its peer got,
  moved only by `advance` along `LEG_PHASES`, never by an ad-hoc flag), its `Fence` (what the
  release of its pages still waits for: ops in flight, cancels unanswered, a failed cancel, a
  one-sided writer not yet stopped; each flag moved only by the `Fence` method named for the
  event that moves it) and its `Failure`. `release` moves it to RELEASED only once its machine
  is terminal and its fence holds nothing.
- A `RoomState` is the room's `RoomPhase` (OPEN -> DONE -> RELEASED), its `Failure` (the
  first one wins), the legs it expects and its legs' states. `poll` derives the room's KVPoll
  from them; `finish` moves it to DONE once that is terminal, `release` to RELEASED once every
  leg is released: each exactly once.
- These are owned by the session's room table (`lifecycle.RoomTable`), which decides WHEN a
  transition happens (and what is sent or released with it); these objects decide WHETHER it
  may. The engine sees a room through a copy the table publishes (`effects.RoomUpdate` ->
  `runtime.handles.RoomView`), never through these.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvhandoff.errors import Failure, InvalidTransition
from kvhandoff.state_machine import (
    Deadline,
    FailureEvent,
    KVPoll,
    LegEvent,
    LegMachine,
    PeerMatched,
)


class LegPhase(enum.Enum):
    """How far a leg's exchange with its peer got (its room state is its `LegMachine`)."""

    NEW = "new"  # decode: the engine has not given its pages yet
    READY = "ready"  # pages known (prefill: the request came); decode: not requested yet
    REQUESTED = "requested"  # decode: its TransferRequest is sent
    ACCEPTED = "accepted"  # the transfer is accepted on this side: data moves
    ACKED = "acked"  # prefill: the decode's RoomAck came (it may overtake send completions)
    RELEASED = "released"  # terminal and nothing of it in flight: its pages may go back


#: the phase transitions a leg may take (RELEASED: from any phase, once it is terminal and
#: its `Fence` holds nothing)
LEG_PHASES: dict[LegPhase, frozenset[LegPhase]] = {
    LegPhase.NEW: frozenset({LegPhase.READY}),
    # decode sends its request; a prefill leg is created READY and accepts
    LegPhase.READY: frozenset({LegPhase.REQUESTED, LegPhase.ACCEPTED}),
    # the prefill accepted; or it dropped our handshake before it did: request again
    LegPhase.REQUESTED: frozenset({LegPhase.ACCEPTED, LegPhase.READY}),
    LegPhase.ACCEPTED: frozenset({LegPhase.ACKED}),
    LegPhase.ACKED: frozenset(),
    LegPhase.RELEASED: frozenset(),
}


class RoomPhase(enum.Enum):
    """How far a room on this agent got: the engine sees DONE as its view's `done` and
    RELEASED as its pages going back (`effects.Release`, exactly once)."""

    OPEN = "open"
    DONE = "done"  # terminal: every leg is, or one failed (the others are failed with it)
    RELEASED = "released"  # done and every leg released: its pages may go back


#: the phase transitions a room may take, each once
ROOM_PHASES: dict[RoomPhase, frozenset[RoomPhase]] = {
    RoomPhase.OPEN: frozenset({RoomPhase.DONE}),
    RoomPhase.DONE: frozenset({RoomPhase.RELEASED}),
    RoomPhase.RELEASED: frozenset(),
}


@dataclass(eq=False, slots=True)
class Fence:
    """What the release of one leg's pages still waits for, besides the leg being terminal:
    anything that may still write into them. `holds` is the one rule (`LegState.release`)."""

    #: this side's ops in flight per data tag (tag -> ops not yet completed)
    tags: dict[int, int] = field(default_factory=dict)
    #: this side's cancels of the leg's ops not yet answered (tags)
    cancelling: set[int] = field(default_factory=set)
    #: a cancel or disconnect failed (a copy that did not stop): held until
    #: write_quarantine_s
    stop_failed: bool = False
    #: decode, one-sided: the prefill may still write into this leg's pages (until every
    #: layer landed, or the prefill confirmed it stopped, or the write quarantine after a
    #: failure)
    remote_writes: bool = False
    #: prefill: an AbortAck is owed to the peer once this side's writes are known stopped
    #: (an obligation, not a hold)
    ack_when_stopped: bool = False

    # Every flag moves through one of these methods (`tests/unit/protocol/
    # test_room_state_owner.py`): each names the event of the protocol that moves it.

    def buffers_offered(self, writable: bool) -> None:
        """Decode: a TransferRequest offered this leg's buffers for one-sided writes
        (`writable`): the prefill may write into its pages from the moment it accepts, which
        can be before its TransferAccepted reaches us."""
        self.remote_writes = self.remote_writes or writable

    def accepted(self, one_sided: bool) -> None:
        """Decode: the prefill accepted, writing one-sided (its writes may land) or sending
        two-sided (it never writes into our pages)."""
        self.remote_writes = one_sided

    def writer_stopped(self) -> bool:
        """Decode: the prefill writes nothing more into the leg's pages (every layer landed,
        it said so, its process is gone, or the write quarantine passed). True when it
        still counted as writing until now."""
        was, self.remote_writes = self.remote_writes, False
        return was

    def cancel_sent(self, tag: int) -> None:
        """A cancel of this side's op of data tag `tag` went out (held until answered)."""
        self.cancelling.add(tag)

    def cancel_answered(self, tag: int) -> None:
        self.cancelling.discard(tag)

    def stop_failed_now(self) -> bool:
        """A cancel or disconnect failed: held until the bound passes (`stop_bound_passed`).
        True when this is the first such failure (the caller starts the bound)."""
        first, self.stop_failed = not self.stop_failed, True
        return first

    def stop_bound_passed(self) -> None:
        self.stop_failed = False

    def owe_ack(self) -> None:
        """Prefill: an AbortAck is owed once this side's writes are known stopped."""
        self.ack_when_stopped = True

    def ack_sent(self) -> None:
        self.ack_when_stopped = False

    def posted(self, tags: Iterable[int]) -> None:
        """An op of these data tags is in flight."""
        for tag in tags:
            self.tags[tag] = self.tags.get(tag, 0) + 1

    def completed(self, tags: Iterable[int]) -> None:
        """An op of these data tags completed (or was cancelled and said so)."""
        for tag in tags:
            left = self.tags.get(tag, 1) - 1
            if left:
                self.tags[tag] = left
            else:
                self.tags.pop(tag, None)

    @property
    def own_writes(self) -> bool:
        """This side's ops may still move bytes (in flight, a cancel unanswered, or one that
        failed)."""
        return bool(self.tags or self.cancelling or self.stop_failed)

    @property
    def holds(self) -> bool:
        """The leg's pages may still be written into (by this side or by the peer)."""
        return self.own_writes or self.remote_writes


@dataclass(eq=False, kw_only=True, slots=True)
class LegState:
    """Where one leg stands (see the module doc): its machine, phase, fence and failure."""

    room: int
    peer: str  # control address of the other side (named in errors)
    machine: LegMachine
    phase: LegPhase = LegPhase.NEW
    fence: Fence = field(default_factory=Fence)
    failure: Failure | None = None

    # ------------------------------------------------------------------ reads

    @property
    def poll(self) -> KVPoll:
        """The leg's KVPoll state (its machine's)."""
        return self.machine.state

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal

    @property
    def matched(self) -> bool:
        """Its peer's handshake completed (`PeerMatched` was applied)."""
        return self.machine.peer_matched

    def has_layers(self, layers: Iterable[int]) -> bool:
        """Every layer of `layers` was sent (prefill) or landed (decode)."""
        return self.machine.has_layers(layers)

    def expired(self, now: float) -> list[Deadline]:
        """The leg's deadlines due at `now`, earliest first."""
        return self.machine.expired(now)

    @property
    def requested(self) -> bool:
        """Decode: its TransferRequest went out (and has not been withdrawn)."""
        return self.phase in (LegPhase.REQUESTED, LegPhase.ACCEPTED, LegPhase.ACKED)

    @property
    def accepted(self) -> bool:
        """The transfer is accepted on this side: data moves (or moved)."""
        return self.phase in (LegPhase.ACCEPTED, LegPhase.ACKED)

    @property
    def released(self) -> bool:
        return self.phase is LegPhase.RELEASED

    # ------------------------------------------------------------------ transitions

    def apply(self, event: LegEvent, now: float) -> None:
        """Feeds a progress event at `now` to the machine (ignored once terminal).

        Raises:
            InvalidTransition: the machine refuses `event` in its state.
        """
        self.machine.apply(event, now)

    def apply_layers(self, layers: list[int], now: float) -> None:
        """Feeds the layers that moved together at `now` as one step of the machine
        (`LegMachine.apply_layers`: each layer guarded, all or nothing).

        Raises:
            InvalidTransition: the machine refuses the step.
        """
        self.machine.apply_layers(layers, now)

    def match(self, now: float) -> None:
        """The peer's handshake completed (once; a repeat is a no-op)."""
        if not self.machine.peer_matched:
            self.machine.apply(PeerMatched(), now)

    def progressed(self, now: float) -> None:
        """Part of a layer moved (a chunk): the stall deadline counts from `now`."""
        self.machine.progressed(now)

    def started(self, now: float) -> None:
        """The leg's first write was posted: the stall deadline runs from `now` if not yet."""
        self.machine.started(now)

    def fail(self, event: FailureEvent, failure: Failure, now: float) -> bool:
        """Fails the leg with `failure` (the first failure wins: False when it is terminal
        already, and nothing changes)."""
        if self.machine.is_terminal:
            return False
        self.machine.apply(event, now)
        self.failure = failure
        return True

    def advance(self, to: LegPhase) -> None:
        """Moves the leg to phase `to` (`LEG_PHASES`; RELEASED only once it is terminal and
        nothing can write its pages any more: its `fence` holds nothing).

        Raises:
            InvalidTransition: `to` is not reachable from the leg's phase.
        """
        ok = (self.machine.is_terminal and self.phase is not LegPhase.RELEASED
              and not self.fence.holds
              if to is LegPhase.RELEASED else to in LEG_PHASES[self.phase])
        if not ok:
            raise InvalidTransition(f"room {self.room}, leg with {self.peer}: phase "
                                    f"{self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    def release(self) -> bool:
        """RELEASED when it may be (terminal, not yet released, its fence holding nothing);
        whether it moved."""
        if self.machine.is_terminal and not self.released and not self.fence.holds:
            self.phase = LegPhase.RELEASED
            return True
        return False


@dataclass(eq=False, kw_only=True, slots=True)
class RoomState:
    """Where one room stands on this agent (see the module doc): its phase, failure, the
    legs it expects and its legs' states."""

    room: int
    #: the legs this room needs (None: not known yet, a decode before its prefill ranks are)
    expected: int | None
    #: prefill: `expected` came from the first reader (the engine opened the room without a
    #: count): every later reader must say the same
    readers_told: bool = False
    legs: list[LegState] = field(default_factory=list)
    phase: RoomPhase = RoomPhase.OPEN
    failure: Failure | None = None
    t_done: float | None = None  # when it became DONE

    # ------------------------------------------------------------------ reads

    @property
    def all_legs(self) -> bool:
        """Every leg the room expects is there (False while the count is not known)."""
        return self.expected is not None and len(self.legs) >= self.expected

    @property
    def poll(self) -> KVPoll:
        """The room's KVPoll state: Failed once it failed; else the least advanced leg's
        (Bootstrapping while legs are missing)."""
        if self.failure is not None:
            return KVPoll.Failed
        if self.all_legs:
            if not self.legs:
                return KVPoll.Success
            return min(leg.machine.state for leg in self.legs)
        return min([KVPoll.Bootstrapping] + [leg.machine.state for leg in self.legs])

    @property
    def done(self) -> bool:
        """Terminal as the engine sees it (the phase moved on from OPEN)."""
        return self.phase is not RoomPhase.OPEN

    @property
    def released(self) -> bool:
        return self.phase is RoomPhase.RELEASED

    # ------------------------------------------------------------------ transitions

    def add(self, leg: LegState) -> None:
        """A leg of this room (decode: one per prefill rank; prefill: one per reader)."""
        self.legs.append(leg)

    def expect(self, legs: int, *, told_by_reader: bool = False) -> None:
        """The room needs `legs` legs (decode: its prefill ranks are known; prefill: the
        first reader said how many read this rank, `told_by_reader`)."""
        self.expected = legs
        self.readers_told = self.readers_told or told_by_reader

    def fail(self, failure: Failure) -> bool:
        """Fails the room with `failure`: the first failure wins (False: it had one)."""
        if self.failure is not None:
            return False
        self.failure = failure
        return True

    def finish(self, now: float) -> bool:
        """DONE at `now` once its state is terminal (once); whether it moved."""
        if self.done or not self.poll.is_terminal:
            return False
        self.advance(RoomPhase.DONE)
        self.t_done = now
        return True

    def release(self) -> bool:
        """RELEASED once it is DONE and every leg is released (once); whether it moved."""
        if not self.done or self.released or not all(leg.released for leg in self.legs):
            return False
        self.advance(RoomPhase.RELEASED)
        return True

    def advance(self, to: RoomPhase) -> None:
        """Moves the room to phase `to` (`ROOM_PHASES`; RELEASED only once every leg is).

        Raises:
            InvalidTransition: `to` is not reachable from the room's phase.
        """
        ok = to in ROOM_PHASES[self.phase] and (
            to is not RoomPhase.RELEASED or all(leg.released for leg in self.legs))
        if not ok:
            raise InvalidTransition(f"room {self.room}: phase {self.phase.value} -> "
                                    f"{to.value} is not allowed")
        self.phase = to
