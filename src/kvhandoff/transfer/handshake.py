"""The peer handshake, sans-IO: a peer's record (`Peer`, its state an enum) and the checks of a
`Hello` (HMAC, transport kind, role, layout compatibility).

A peer goes NEW -> HELLO_SENT (we said Hello first) -> CONNECTING (its Hello/HelloAck passed
the checks; the transport connects) -> MATCHED, or to REJECTED from any of them (its layout
differs, its HMAC does not verify, the transport could not connect, or it refused us). A
peer declared lost is dropped from the table (and remembered for a while: see the session).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.errors import Failure, KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, layout_compat_diff
from kvhandoff.state_machine import Role
from kvhandoff.transfer import protocol as P

if TYPE_CHECKING:
    from kvhandoff.transfer.rooms import Leg


class PeerState(enum.Enum):
    """Where the handshake with one peer stands."""

    NEW = "new"
    HELLO_SENT = "hello_sent"
    CONNECTING = "connecting"
    MATCHED = "matched"
    REJECTED = "rejected"



@dataclass(eq=False, kw_only=True)
class Peer:
    """One peer agent, by control address."""

    addr: str
    state: PeerState = PeerState.NEW
    gen: int = 0
    agent_id: str = ""
    rejected: Failure | None = None  # why, when REJECTED
    authenticated: bool = False  # its Hello verified (or no shared secret is configured)
    initiated: bool = False  # we said Hello first
    layout: LayoutSpec | None = None
    transport_address: bytes = b""
    last_seen: float = 0.0
    waiting: list[Leg] = field(default_factory=list)  # legs waiting for the handshake

    @property
    def matched(self) -> bool:
        return self.state is PeerState.MATCHED

    @property
    def talking(self) -> bool:
        """Heartbeats go to it: a handshake is under way or done, or we started one (a peer
        that refused our Hello still hears from us; it counts those messages stale)."""
        return self.state in (PeerState.HELLO_SENT, PeerState.CONNECTING,
                              PeerState.MATCHED) or self.initiated


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """What this agent says about itself in a Hello."""

    address: str
    generation: int
    agent_id: str
    role: Role
    transport_kind: str
    transport_address: bytes
    layout: LayoutSpec
    layout_hash: str
    buffers: tuple[P.BufferDesc, ...]
    hmac_secret: bytes | None = None

    def hello(self, cls: type[P.Hello]) -> P.Hello:
        """This agent's Hello (or HelloAck), signed when a shared secret is set."""
        msg = cls(src=self.address, gen=self.generation, agent_id=self.agent_id,
                  role=self.role.value, transport=self.transport_kind,
                  transport_address=self.transport_address, layout=self.layout.to_dict(),
                  layout_hash=self.layout_hash, buffers=list(self.buffers))
        return P.sign_hello(msg, self.hmac_secret) if self.hmac_secret else msg

    def verifies(self, msg: P.Hello) -> bool:
        """Whether `msg` authenticates (always, without a shared secret)."""
        return not self.hmac_secret or P.verify_hello(msg, self.hmac_secret)

    def check_hello(self, msg: P.Hello) -> tuple[list[str], LayoutSpec | None]:
        """(reasons to refuse `msg` (empty: accept), the peer's layout when it parses)."""
        if not self.verifies(msg):
            return ["hello: HMAC does not verify (wrong or missing shared secret)"], None
        if msg.transport != self.transport_kind:
            return [f"transport: {self.role.value}={self.transport_kind} "
                    f"peer={msg.transport}"], None
        if msg.role == self.role.value:
            return [f"role: both sides are {msg.role}"], None
        try:
            theirs = LayoutSpec.from_dict(msg.layout)
        except KVHandoffError as e:
            return [f"layout: peer sent an invalid layout: {e}"], None
        if msg.layout_hash == self.layout_hash:
            return [], theirs
        # page size, TP rank and packing are factored out (kv_layout.layout_compat_diff)
        if self.role is Role.DECODE:  # always name prefill first
            return layout_compat_diff(theirs, self.layout, ("prefill", "decode")), theirs
        return layout_compat_diff(self.layout, theirs, ("prefill", "decode")), theirs


def peer_summary(p: Peer) -> dict[str, Any]:
    """A peer as `status()` shows it."""
    return {"addr": p.addr, "matched": p.matched, "state": p.state.value,
            "rejected": p.rejected.reason if p.rejected else None}
