"""A peer's state on one agent, in one place: `PeerState` (where the handshake with one peer
stands, and the obligations it carries) and `Peer`, the record of one peer agent. Pure data with
its transitions (no threads, no clock).

Rules (as `roomstate`'s for a room):
- A peer's `PeerPhase` moves only through a `PeerState` method named for the protocol event
  that moves it, which checks the move against `PEER_PHASES` (`InvalidTransition` otherwise);
  so do its flags (`initiated`, `ack_owed`, `writes`), its refusal (`rejected`) and the
  recheck out to it (`recheck`). No other
  module assigns them (`tests/unit/protocol/test_peer_state_owner.py` reads every module for
  it).
- The peer table (`peers.PeerTable`) decides WHEN an event happened (a Hello verified, the
  transport connected, a refusal came); this object decides WHETHER the move is allowed.
- What the peer said of itself in its last Hello taken (generation, layout, transport address,
  buffers' descriptors, memory kind) and what waits for the handshake (legs, room messages) are
  plain fields of `Peer`, written by the table as it takes that Hello.

A peer goes NEW -> HELLO_SENT (we said Hello first) -> CONNECTING (its Hello / HelloAck passed
the checks; the transport connects) -> [REGISTERING (prefill writing one-sided: the peer's
buffers are being installed)] -> MATCHED; to REJECTED from any of them (its layout differs, the
transport could not connect, or it refused us); back to NEW when one attempt failed without a
verified refusal (a HelloAck or HelloReject whose MAC does not verify), so the next room says
Hello again; and back to CONNECTING when another of its Hellos is taken (a rejected peer that
says Hello again, or a confirmed new handshake). A peer declared lost is dropped from the table
(and remembered for a while: see the session).

A matched peer may be under recheck (`recheck`): this agent woke from a stall long enough for
the peer to have declared it lost, and asked whether it still holds this agent; the room
messages the peer sends meanwhile wait (in `Peer.backlog`) for the answer.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvhandoff.errors import Failure, InvalidTransition
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.protocol import wire as P

if TYPE_CHECKING:
    from kvhandoff.protocol.rooms import Leg


@dataclass(frozen=True, slots=True)
class Recheck:
    """A recheck out to a peer: the `probe` nonce its answer must echo, when it was sent, how
    long this agent had sent no heartbeat when it woke, and when the peer last asked us the
    same (it woke from a stall too: its answer to ours is then on its way, and the wait for it
    counts from there; 0: it did not ask)."""

    probe: int
    sent_at: float
    gap: float
    peer_asked_at: float = 0.0

    @property
    def waiting_since(self) -> float:
        """What the 2-heartbeat bound on the answer counts from."""
        return max(self.sent_at, self.peer_asked_at)


class PeerPhase(enum.Enum):
    """Where the handshake with one peer stands."""

    NEW = "new"
    HELLO_SENT = "hello_sent"  # we said Hello first; no answer taken yet
    CONNECTING = "connecting"  # its Hello / HelloAck passed the checks; the transport connects
    REGISTERING = "registering"  # prefill: connected; the peer's buffers are being installed
    MATCHED = "matched"
    REJECTED = "rejected"


_ATTEMPT = frozenset({PeerPhase.REJECTED, PeerPhase.NEW})

#: the phase transitions a peer may take, each by one `PeerState` method (named alongside)
PEER_PHASES: dict[PeerPhase, frozenset[PeerPhase]] = {
    # hello_sent; hello_taken; refused (its Hello's layout, say)
    PeerPhase.NEW: frozenset({PeerPhase.HELLO_SENT, PeerPhase.CONNECTING, PeerPhase.REJECTED}),
    # hello_taken; refused; attempt_failed
    PeerPhase.HELLO_SENT: frozenset({PeerPhase.CONNECTING}) | _ATTEMPT,
    # connected (to MATCHED, or REGISTERING first); hello_taken again; refused; attempt_failed
    PeerPhase.CONNECTING: frozenset({PeerPhase.MATCHED, PeerPhase.REGISTERING,
                                     PeerPhase.CONNECTING}) | _ATTEMPT,
    # registered; hello_taken again; refused; attempt_failed
    PeerPhase.REGISTERING: frozenset({PeerPhase.MATCHED, PeerPhase.CONNECTING}) | _ATTEMPT,
    # hello_taken again (a new handshake of the same generation); refused
    PeerPhase.MATCHED: frozenset({PeerPhase.CONNECTING, PeerPhase.REJECTED}),
    # hello_taken (it says Hello again); refused again (the newer reason wins)
    PeerPhase.REJECTED: frozenset({PeerPhase.CONNECTING, PeerPhase.REJECTED}),
}


@dataclass(eq=False, kw_only=True, slots=True)
class PeerState:
    """Where the handshake with one peer stands (see the module doc): its phase, why it was
    rejected, and the flags the handshake carries. Read anywhere; moved only by its methods."""

    addr: str  # the peer's control address (named in errors)
    phase: PeerPhase = PeerPhase.NEW
    #: why, while REJECTED
    rejected: Failure | None = None
    #: we said Hello first (heartbeats go to it even after it refused us)
    initiated: bool = False
    #: its Hello is to be answered with a HelloAck once matched (an obligation, not a hold)
    ack_owed: bool = False
    #: its buffers' descriptors are installed: this side writes into it one-sided
    writes: bool = False
    #: the recheck out to it (this agent woke from a stall), None when none is
    recheck: Recheck | None = None

    # ------------------------------------------------------------------ reads

    @property
    def matched(self) -> bool:
        return self.phase is PeerPhase.MATCHED

    @property
    def connecting(self) -> bool:
        """Its Hello was taken and the transport connects (or its buffers are installed):
        room messages from it wait until it is matched."""
        return self.phase in (PeerPhase.CONNECTING, PeerPhase.REGISTERING)

    @property
    def talking(self) -> bool:
        """Heartbeats go to it: a handshake is under way or done, or we started one (a peer
        that refused our Hello still hears from us; it counts those messages stale)."""
        return self.phase in (PeerPhase.HELLO_SENT, PeerPhase.CONNECTING,
                              PeerPhase.REGISTERING, PeerPhase.MATCHED) or self.initiated

    # ------------------------------------------------------------------ events
    # Every field moves through one of these methods (`tests/unit/protocol/
    # test_peer_state_owner.py`): each names the event of the protocol that moves it.

    def hello_sent(self) -> None:
        """We said Hello first (a leg waits for this peer)."""
        self._to(PeerPhase.HELLO_SENT)
        self.initiated = True

    def hello_taken(self, *, answer: bool) -> None:
        """Its Hello or HelloAck passed the checks: the transport connects. `answer`: a
        HelloAck is owed once matched (its Hello was not answered yet). What a previous
        handshake decided (a refusal, one-sided writes) no longer holds."""
        self._to(PeerPhase.CONNECTING)
        self.rejected, self.ack_owed, self.writes = None, answer, False

    def connected(self, *, register: bool) -> None:
        """The transport connected; `register`: the peer's buffers are installed first
        (prefill writing one-sided), else it is matched now."""
        self._to(PeerPhase.REGISTERING if register else PeerPhase.MATCHED)

    def registered(self, *, writes: bool) -> None:
        """Its buffers are installed (`writes`: one-sided writes into it from now on) or
        refused (its rooms are sent two-sided): it is matched."""
        if self.phase is not PeerPhase.REGISTERING:
            raise InvalidTransition(f"peer {self.addr}: registered while "
                                    f"{self.phase.value}")
        self._to(PeerPhase.MATCHED)
        self.writes = writes

    def answer_hello(self) -> bool:
        """The HelloAck owed goes out now: True when one was owed (once)."""
        owed, self.ack_owed = self.ack_owed, False
        return owed

    def refused(self, failure: Failure) -> None:
        """The handshake with it is refused (by its Hello's checks, by the transport, or by
        its verified HelloReject): `failure` says why."""
        self._to(PeerPhase.REJECTED)
        self.rejected, self.ack_owed = failure, False

    def attempt_failed(self) -> None:
        """One attempt failed without a verified refusal (an answer whose MAC does not
        verify): the next room says Hello again. A matched peer stays matched."""
        if self.phase not in (PeerPhase.NEW, PeerPhase.MATCHED):
            self._to(PeerPhase.NEW)
            self.ack_owed = False

    def recheck_sent(self, recheck: Recheck) -> None:
        """This agent woke from a stall and asked the peer whether it still holds it: its
        room messages wait for the answer. Only a matched peer is rechecked (another has no
        room under way with us). A newer recheck replaces one out (this agent stalled again:
        an answer to the older one may predate the peer giving us up)."""
        if self.phase is not PeerPhase.MATCHED:
            raise InvalidTransition(f"peer {self.addr}: rechecked while {self.phase.value}")
        self.recheck = recheck

    def recheck_peer_asked(self, now: float) -> None:
        """The peer, under recheck, asked whether this agent still holds it (it woke from a
        stall too, and was answered yes): it holds the handshake it asks about, and its answer
        to our probe comes once it reads it. The wait for that answer counts from now: had it
        run out while the peer was stalled, this agent would give up a peer it had just told
        that it holds it, and the peer, reading on, could end a room Success that this agent
        fails."""
        if self.recheck is not None:
            self.recheck = dataclasses.replace(self.recheck, peer_asked_at=now)

    def recheck_answered(self, probe: int) -> bool:
        """The peer answered `probe`: True (once) when that is the recheck out, which ends."""
        if self.recheck is None or probe != self.recheck.probe:
            return False
        self.recheck = None
        return True

    def _to(self, to: PeerPhase) -> None:
        if to not in PEER_PHASES[self.phase]:
            raise InvalidTransition(f"peer {self.addr}: phase {self.phase.value} -> "
                                    f"{to.value} is not allowed")
        self.phase = to


@dataclass(eq=False, kw_only=True)
class Peer:
    """One peer agent, by control address: its handshake's `state`, what its last Hello taken
    said, when it was last heard from, and what waits for the handshake."""

    addr: str
    state: PeerState = field(init=False)
    # what its Hello said (written by the peer table as it takes that Hello)
    gen: int = 0
    agent_id: str = ""
    layout: LayoutSpec | None = None
    transport_address: bytes = b""
    descriptors: dict[str, bytes] = field(default_factory=dict)  # its buffers, for our writes
    memory: str = "host"  # where its KV buffers live (its Hello's `memory`)
    heartbeat_s: float = 0.0  # its heartbeat interval (its Hello's; 0: not said)
    stall_s: float = 0.0  # its stall_timeout_s (its Hello's; 0: not said)
    last_seen: float = 0.0
    #: legs waiting for the handshake
    waiting: list[Leg] = field(default_factory=list)
    #: room messages that came while its transport connected, read once matched
    backlog: list[P.Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = PeerState(addr=self.addr)

    @property
    def matched(self) -> bool:
        return self.state.matched

    @property
    def writes(self) -> bool:
        """This side writes into it one-sided (its buffers are installed)."""
        return self.state.writes
