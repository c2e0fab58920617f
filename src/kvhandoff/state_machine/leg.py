"""`LegMachine`: one room on one side, driven by events, holding its deadlines.

Rules:
- The machine never reads a clock. The caller passes `now` (float seconds from any monotonic
  source, the same source for the whole life of the machine) with every event; the machine
  stores *absolute* deadlines computed from the durations in `DeadlineConfig`.
- The caller asks `next_deadline()` to know when to wake up and `expired(now)` to know what
  passed, then feeds `DeadlinePassed(which)`. A `DeadlinePassed` for a deadline that is no
  longer armed, or not yet due at `now` (a timer that raced with progress), is stale: ignored,
  `apply` returns False.
- Where a room may go is `TRANSITIONS`' business (see `transitions.py`); this class adds the
  guards that need memory: RequestAccepted needs PeerMatched first, a layer moves once, a
  layer outside the expected set (when one was given) is refused, and AllLayers* needs every
  expected layer. A refused event raises `InvalidTransition` and changes nothing.
- Terminal states accept nothing: `apply` returns False and the room stays as it was; the first
  failure's reason is the one kept.
- Layers that moved together (the engine marked them ready at once, one write job landed them,
  one `LayerDone` announced them) are one step: `apply_layers` decides exactly what feeding
  `LayerSent` / `LayerLanded` for each of them in order decides, every layer guarded, but all
  or nothing (a refused layer refuses the step).

Deadlines, armed and cleared as the state changes:
    BOOTSTRAP          armed at creation, cleared on leaving Bootstrapping
    WAITING_FOR_INPUT  armed on entering WaitingForInput, cleared on leaving it
    TRANSFER_STALL     armed by `started` (the prefill posted its first write: a room whose
                       first layer never lands is bounded by it, not by WAITING_FOR_INPUT) or on
                       entering Transferring, re-armed by every LayerSent/LayerLanded
    LEASE              armed at creation, re-armed by LeaseRenewed
A terminal state clears them all. A duration of None leaves that deadline unarmed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from kvhandoff.errors import ConfigError, InvalidTransition
from kvhandoff.state_machine.transitions import INITIAL, next_state
from kvhandoff.state_machine.vocabulary import (
    AllLayersAcked,
    AllLayersLanded,
    Deadline,
    DeadlinePassed,
    FailureEvent,
    KVPoll,
    LayerLanded,
    LayerSent,
    LeaseRenewed,
    LegEvent,
    PeerMatched,
    RequestAccepted,
    Role,
)

# The deadline that belongs to each state: armed on entering it, cleared on leaving it.
_STATE_DEADLINE: dict[KVPoll, Deadline] = {
    KVPoll.Bootstrapping: Deadline.BOOTSTRAP,
    KVPoll.WaitingForInput: Deadline.WAITING_FOR_INPUT,
    KVPoll.Transferring: Deadline.TRANSFER_STALL,
}
_ORDER = {d: i for i, d in enumerate(Deadline)}  # ties between equal deadlines: enum order


@dataclass(frozen=True, slots=True)
class DeadlineConfig:
    """How long a room may stay in each phase, in seconds; None means no deadline."""

    bootstrap_s: float | None = None
    waiting_for_input_s: float | None = None
    transfer_stall_s: float | None = None
    lease_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"DeadlineConfig.{f.name} must be a finite number of seconds > 0 or None, "
                    f"got {value!r}"
                )

    def duration_s(self, which: Deadline) -> float | None:
        """The configured duration of deadline `which`."""
        if which is Deadline.TRANSFER_STALL:  # re-armed by every layer: asked first
            return self.transfer_stall_s
        if which is Deadline.BOOTSTRAP:
            return self.bootstrap_s
        if which is Deadline.WAITING_FOR_INPUT:
            return self.waiting_for_input_s
        return self.lease_s


class LegMachine:
    """The state of one leg of a room (its transfer with one peer) on one side (prefill or
    decode), fed events by its owner.

    Args:
        role: which side this room is on; events of the other side are refused.
        now: the current time (caller's monotonic clock), to arm the first deadlines.
        deadlines: the durations of the deadlines; all None (no deadline) by default.
        layers: the layer ids expected to move, when known; enables the layer guards.

    Example:
        >>> m = LegMachine(Role.DECODE, now=0.0, deadlines=DeadlineConfig(bootstrap_s=5))
        >>> m.next_deadline()
        (<Deadline.BOOTSTRAP: 'bootstrap'>, 5.0)
    """

    __slots__ = (
        "role",
        "state",
        "failure",
        "failure_event",
        "peer_matched",
        "_config",
        "_expected",
        "_layers",
        "_deadlines",
    )

    def __init__(
        self,
        role: Role,
        *,
        now: float,
        deadlines: DeadlineConfig | None = None,
        layers: Iterable[int] | None = None,
    ) -> None:
        self.role: Role = role
        self.state: KVPoll = INITIAL
        self.failure: str | None = None
        """The reason of the first failure event; None unless the state is Failed."""
        self.failure_event: FailureEvent | None = None
        self.peer_matched: bool = False
        self._config = deadlines if deadlines is not None else DeadlineConfig()
        self._expected: frozenset[int] | None = None if layers is None else frozenset(layers)
        self._layers: set[int] = set()
        self._deadlines: dict[Deadline, float] = {}
        self._arm(Deadline.BOOTSTRAP, now)
        self._arm(Deadline.LEASE, now)

    def __repr__(self) -> str:
        failure = f", failure={self.failure!r}" if self.failure is not None else ""
        return (
            f"LegMachine(role={self.role}, state={self.state.name}, "
            f"layers={len(self._layers)}{failure})"
        )

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    @property
    def layers(self) -> frozenset[int]:
        """The layers sent (prefill) or landed (decode) so far (a copy)."""
        return frozenset(self._layers)

    def has_layers(self, layers: Iterable[int]) -> bool:
        """Whether every layer of `layers` was sent (prefill) or landed (decode): asked once a
        layer, so without copying `layers` (a room of 78 layers asked it 78 times)."""
        return self._layers.issuperset(layers)

    # --- deadlines -----------------------------------------------------------------------

    def deadline(self, which: Deadline) -> float | None:
        """When deadline `which` is due (absolute, caller's clock), or None if not armed."""
        return self._deadlines.get(which)

    def next_deadline(self) -> tuple[Deadline, float] | None:
        """The earliest armed deadline and when it is due, or None if none is armed."""
        if not self._deadlines:
            return None
        which = min(self._deadlines, key=lambda d: (self._deadlines[d], _ORDER[d]))
        return which, self._deadlines[which]

    def expired(self, now: float) -> list[Deadline]:
        """The armed deadlines due at `now` (due time <= now), earliest first."""
        due = [d for d, when in self._deadlines.items() if when <= now]
        return sorted(due, key=lambda d: (self._deadlines[d], _ORDER[d]))

    def progressed(self, now: float) -> None:
        """Part of a layer moved (a chunk of a chunked prefill): the stall deadline, when
        armed, counts from `now` (whole layers re-arm it through `LayerSent` / `LayerLanded`,
        and they land only after the last chunk)."""
        if Deadline.TRANSFER_STALL in self._deadlines:
            self._arm(Deadline.TRANSFER_STALL, now)

    def started(self, now: float) -> None:
        """The first bytes of this room were handed to the transport (the prefill posted a
        write): the stall deadline counts from `now` if it is not armed yet. Before, it was
        armed only once a first layer had moved, so a room whose first write never completed
        (its bytes refused or lost on the way) held its pages for the whole WAITING_FOR_INPUT
        bound (`waiting_timeout_s`, 300 s by default) instead of `stall_timeout_s`."""
        if not self.state.is_terminal and Deadline.TRANSFER_STALL not in self._deadlines:
            self._arm(Deadline.TRANSFER_STALL, now)

    def _arm(self, which: Deadline, now: float) -> None:
        duration = self._config.duration_s(which)
        if duration is not None:
            self._deadlines[which] = now + duration

    # --- events --------------------------------------------------------------------------

    def apply(self, event: LegEvent, now: float) -> bool:
        """Feed `event`, which happened at `now`.

        Returns:
            Whether anything changed (state, layers, deadlines, peer). False for any event in
            a terminal state (ignored), a stale `DeadlinePassed`, a repeated `PeerMatched`,
            or a `LeaseRenewed` when no lease is configured.

        Raises:
            InvalidTransition: the event is not allowed now; the machine is unchanged.
        """
        if self.state.is_terminal:
            return False
        if isinstance(event, DeadlinePassed):
            when = self._deadlines.get(event.which)
            if when is None or when > now:
                return False
        old = self.state
        new = next_state(old, event, role=self.role)
        self._check_guards(event)

        changed = new != old
        if isinstance(event, PeerMatched):
            changed = not self.peer_matched
            self.peer_matched = True
        elif isinstance(event, LayerSent | LayerLanded):
            self._layers.add(event.layer)
            self._arm(Deadline.TRANSFER_STALL, now)
            changed = True
        elif isinstance(event, LeaseRenewed):
            changed = self._config.lease_s is not None
            self._arm(Deadline.LEASE, now)
        elif isinstance(event, FailureEvent):
            self.failure = event.reason
            self.failure_event = event

        if new != old:
            self.state = new
            if new.is_terminal:
                self._deadlines.clear()
            else:
                self._deadlines.pop(_STATE_DEADLINE[old], None)
                self._arm(_STATE_DEADLINE[new], now)
        return changed

    def apply_layers(self, layers: Sequence[int], now: float) -> bool:
        """Feed the layers that moved together at `now` as one step: this side's layer event
        (`LayerSent` on a prefill, `LayerLanded` on a decode) for each of `layers`, in order,
        the table asked once and every layer guarded, all or nothing.

        Returns:
            Whether anything changed (False for no layers, or in a terminal state).

        Raises:
            InvalidTransition: the event is not allowed in this state, or a layer is refused
                (already moved, named twice, not one of the room's): the machine is unchanged.
        """
        if self.state.is_terminal or not layers:
            return False
        kind = LayerSent if self.role is Role.PREFILL else LayerLanded
        old = self.state
        first = kind(layers[0])
        new = next_state(old, first, role=self.role)
        if len(layers) > 1:
            next_state(new, first, role=self.role)  # the later layers step from `new`
        fresh = set(layers)
        verb = "sent" if self.role is Role.PREFILL else "landed"
        if len(fresh) != len(layers):
            twice = sorted({x for x in layers if layers.count(x) > 1})
            raise InvalidTransition(f"layers {twice} {verb} twice in one step")
        again = fresh & self._layers
        if again:
            raise InvalidTransition(f"layer {min(again)} already {verb} in this room")
        if self._expected is not None and not fresh <= self._expected:
            raise InvalidTransition(
                f"layer {min(fresh - self._expected)} is not one of this room's layers "
                f"{sorted(self._expected)}"
            )
        self._layers |= fresh
        self._arm(Deadline.TRANSFER_STALL, now)
        if new != old:
            self.state = new
            self._deadlines.pop(_STATE_DEADLINE[old], None)
            self._arm(_STATE_DEADLINE[new], now)
        return True

    def _check_guards(self, event: LegEvent) -> None:
        if isinstance(event, RequestAccepted) and not self.peer_matched:
            raise InvalidTransition(
                "RequestAccepted before PeerMatched: a TransferRequest needs the peer's Hello "
                "first; feed PeerMatched when the handshake completes"
            )
        if isinstance(event, LayerSent | LayerLanded):
            verb = "sent" if isinstance(event, LayerSent) else "landed"
            if event.layer in self._layers:
                raise InvalidTransition(f"layer {event.layer} already {verb} in this room")
            if self._expected is not None and event.layer not in self._expected:
                raise InvalidTransition(
                    f"layer {event.layer} is not one of this room's layers {sorted(self._expected)}"
                )
        if isinstance(event, AllLayersAcked | AllLayersLanded) and self._expected is not None:
            missing = sorted(self._expected - self._layers)
            if missing:
                raise InvalidTransition(
                    f"{type(event).__name__} with layers {missing} not yet "
                    f"{'sent' if self.role is Role.PREFILL else 'landed'}"
                )
