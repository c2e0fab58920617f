"""The vocabulary of a room's life: its states (`KVPoll`), the two sides (`Role`), the deadlines
it holds (`Deadline`) and the events that move it.

Rules:
- Events are frozen, slotted dataclasses named as *facts* that already happened
  (`LayerLanded`, not `LandLayer`). They carry only what the machine needs to decide.
- Every failure event derives from `FailureEvent` and exposes a human `reason` (a field or a
  property), which the room keeps as its failure reason. It is named for what the machine
  saw (`ChecksumsDiffered`, `PeerWasLost`, `DeadlinePassed`); the exception an engine then
  gets is named for what it is told (`errors.ChecksumMismatch`, `errors.PeerLost`,
  `errors.DeadlineExpired`): no name is both an event and an exception.
- (The transfer session's own inputs are `protocol.events`: messages, engine calls,
  completions. This module holds the room machine's words only.)
- `KVPoll` keeps SGLang's numbers, so ``min()`` over the states of several ranks is the worst
  rank (Failed < Bootstrapping < WaitingForInput < Transferring < Success).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING


class KVPoll(enum.IntEnum):
    """The life-cycle state of one room on one side (same numbers as SGLang)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        """Success and Failed accept no further event."""
        return self is KVPoll.Success or self is KVPoll.Failed


class Role(enum.Enum):
    """Which side of a handoff a room (or rank, or agent) is on."""

    PREFILL = "prefill"
    DECODE = "decode"

    # members are singletons, equal only to themselves: hashed by identity, in C (Enum's own
    # hash calls Python; a room's events look roles and deadlines up in dicts per layer)
    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.value


class Deadline(enum.Enum):
    """The deadlines a room holds; each fails the room when it passes unmet."""

    BOOTSTRAP = "bootstrap"
    """Leaving Bootstrapping: the peer must be matched and the TransferRequest accepted."""
    WAITING_FOR_INPUT = "waiting_for_input"
    """Leaving WaitingForInput: the first layer must be sent (prefill) or land (decode)."""
    TRANSFER_STALL = "transfer_stall"
    """While Transferring: the longest gap allowed between two layers (re-armed by each)."""
    LEASE = "lease"
    """The room's lease on its pages; renewed by `LeaseRenewed`, over at a terminal state."""

    def __str__(self) -> str:
        return self.value

    __hash__ = object.__hash__  # as Role's


@dataclass(frozen=True, slots=True)
class LegEvent:
    """Base of every event fed to a leg's `LegMachine` (one per leg: the transfer with one
    peer). Not `protocol.events.Event`, the transfer session's inputs."""


# --- progress events ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerMatched(LegEvent):
    """The peer is known and its `Hello` was exchanged (layouts agree)."""


@dataclass(frozen=True, slots=True)
class RequestAccepted(LegEvent):
    """The TransferRequest was accepted: decode learnt that prefill accepted it (the wire's
    `protocol.wire.TransferAccepted` came); prefill accepted the request it received."""


@dataclass(frozen=True, slots=True)
class LayerSent(LegEvent):
    """Prefill: the bytes of `layer` were written to the decode side."""

    layer: int


@dataclass(frozen=True, slots=True)
class LayerLanded(LegEvent):
    """Decode: the bytes of `layer` landed and their checksums verified."""

    layer: int


@dataclass(frozen=True, slots=True)
class AllLayersAcked(LegEvent):
    """Prefill: decode's `RoomAck` came; the pages may be freed."""


@dataclass(frozen=True, slots=True)
class AllLayersLanded(LegEvent):
    """Decode: every layer landed and verified (the `RoomAck` is about to go)."""


@dataclass(frozen=True, slots=True)
class LeaseRenewed(LegEvent):
    """The room's lease was renewed; allowed in every non-terminal state, no state change."""


# --- failure events ----------------------------------------------------------------------


class FailureEvent(LegEvent):
    """Base of the events that fail a room. Every subclass exposes a human `reason`."""

    __slots__ = ()

    if TYPE_CHECKING:
        # Declared for the type checker only: at run time a property here would become the
        # default value of the subclasses' `reason` fields (dataclasses look defaults up with
        # getattr). Each subclass defines `reason` as a field or a property.
        @property
        def reason(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RoomAborted(FailureEvent):
    """Someone aborted the room: `by` says which side, `reason` why."""

    reason: str
    by: Role


@dataclass(frozen=True, slots=True)
class DeadlinePassed(FailureEvent):
    """The deadline `which` passed unmet (the caller's clock says so)."""

    which: Deadline

    @property
    def reason(self) -> str:
        return f"{self.which} deadline expired"


@dataclass(frozen=True, slots=True)
class PeerWasLost(FailureEvent):
    """The peer stopped answering (missed heartbeats, closed connection, ...)."""

    reason: str


@dataclass(frozen=True, slots=True)
class ChecksumsDiffered(FailureEvent):
    """The bytes of (`layer`, `region`) do not hash to what the sender computed."""

    layer: int
    region: str

    @property
    def reason(self) -> str:
        return f"checksum mismatch on layer {self.layer}, region {self.region!r}"


@dataclass(frozen=True, slots=True)
class LayoutsDiffered(FailureEvent):
    """The two sides' KV layouts differ; `diff` lists each differing field."""

    diff: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "layout mismatch: " + ("; ".join(self.diff) or "(no diff given)")


@dataclass(frozen=True, slots=True)
class PeerFailedRoom(FailureEvent):
    """The peer reported that its side of the room failed, with its reason."""

    reason: str
