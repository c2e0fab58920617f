"""The peer handshake, sans-IO: a peer's record (`Peer`, its state an enum), what this agent
says of itself (`Identity`, its Hello and the buffers it announces) and the checks of a
peer's `Hello` (HMAC, transport kind, role, memory kind, checksum modes, layout compatibility).
The checksum policy is `checksums`, admission of a transfer request `admission`.

A peer goes NEW -> HELLO_SENT (we said Hello first) -> CONNECTING (its Hello/HelloAck passed
the checks; the transport connects) -> MATCHED, or to REJECTED from any of them (its layout
differs, its HMAC does not verify, the transport could not connect, or it refused us). A
peer declared lost is dropped from the table (and remembered for a while: see the session).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.buffers.bufferset import Extent
from kvhandoff.errors import Failure, KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, layout_compat_diff, peer_page_problems
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.checksums import checksum_problem
from kvhandoff.state_machine import Role

if TYPE_CHECKING:
    from kvhandoff.protocol.rooms import Leg


class PeerState(enum.Enum):
    """Where the handshake with one peer stands."""

    NEW = "new"
    HELLO_SENT = "hello_sent"
    CONNECTING = "connecting"
    MATCHED = "matched"
    REJECTED = "rejected"


#: where an agent's KV buffers live (a Hello's `memory`)
MEMORY_KINDS = ("host", "cuda")


def buffer_descs(extents: Iterable[Extent]) -> tuple[P.BufferDesc, ...]:
    """What a Hello says of this agent's buffers (`buffers.BufferSet.extents`), without
    descriptors (a decode offering one-sided writes adds them)."""
    return tuple(P.BufferDesc(region=x.region, layer=x.layer, nbytes=x.nbytes)
                 for x in extents)


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
    descriptors: dict[str, bytes] = field(default_factory=dict)  # its buffers, for our writes
    writes: bool = False  # its descriptors are installed: we write into it one-sided
    memory: str = "host"  # where its KV buffers live (its Hello's `memory`)
    last_seen: float = 0.0
    waiting: list[Leg] = field(default_factory=list)  # legs waiting for the handshake
    # while the transport connects (and, prefill, its buffers are installed): answer the
    # Hello with a HelloAck once matched; room messages that came meanwhile, read then
    ack_hello: bool = False
    registering: bool = False
    backlog: list[P.Message] = field(default_factory=list)

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
    #: the transport can write one-sided and `one_sided_writes` is on: a decode offers its
    #: buffers' descriptors (in `buffers`), a prefill writes into a decode that offers them
    writes: bool = False
    #: where this agent's KV buffers live, "host" or "cuda" (`BufferSet.memory`)
    memory: str = "host"
    #: its checksum mode, as its Hello says it (the session sets it from `Settings.checksum`)
    checksum: str = ""

    def hello(self, cls: type[P.Hello]) -> P.Hello:
        """This agent's Hello (or HelloAck), signed when a shared secret is set."""
        msg = cls(src=self.address, gen=self.generation, agent_id=self.agent_id,
                  role=self.role.value, transport=self.transport_kind,
                  transport_address=self.transport_address, layout=self.layout.to_dict(),
                  layout_hash=self.layout_hash, buffers=list(self.buffers),
                  memory=self.memory, checksum=self.checksum)
        return P.sign_hello(msg, self.hmac_secret) if self.hmac_secret else msg

    def verifies(self, msg: P.Hello) -> bool:
        """Whether `msg` authenticates (always, without a shared secret)."""
        return not self.hmac_secret or P.verify_hello(msg, self.hmac_secret)

    def check_hello(self, msg: P.Hello) -> tuple[list[str], LayoutSpec | None]:
        """(reasons to refuse `msg` (empty: accept), the peer's layout when it parses): the
        layouts' compatible forms differ, or the peer's pages break this side's kernel page
        rules (`kv_layout.peer_page_problems`)."""
        if not self.verifies(msg):
            return ["hello: HMAC does not verify (wrong or missing shared secret)"], None
        if msg.transport != self.transport_kind:
            return [f"transport: {self.role.value}={self.transport_kind} "
                    f"peer={msg.transport}"], None
        if msg.role == self.role.value:
            return [f"role: both sides are {msg.role}"], None
        if msg.memory not in MEMORY_KINDS:
            return [f"memory: peer says {msg.memory!r}; expected one of "
                    f"{', '.join(MEMORY_KINDS)}"], None
        modes = ((self.checksum, msg.checksum) if self.role is Role.PREFILL
                 else (msg.checksum, self.checksum))
        ck = checksum_problem(*modes)
        if ck is not None:
            return [ck], None
        try:
            theirs = LayoutSpec.from_dict(msg.layout)
        except KVHandoffError as e:
            return [f"layout: peer sent an invalid layout: {e}"], None
        # the peer's physical pages against this side's kernel page rules (seed 004: a
        # refusal, never a warning); layouts without rules pair any page sizes
        pages = peer_page_problems(self.layout, theirs)
        if msg.layout_hash == self.layout_hash:
            return pages, theirs
        # page size, TP rank and packing are factored out (kv_layout.layout_compat_diff)
        if self.role is Role.DECODE:  # always name prefill first
            return layout_compat_diff(theirs, self.layout, ("prefill", "decode")) + pages, theirs
        return layout_compat_diff(self.layout, theirs, ("prefill", "decode")) + pages, theirs


def peer_summary(p: Peer) -> dict[str, Any]:
    """A peer as `status()` shows it."""
    return {"addr": p.addr, "matched": p.matched, "state": p.state.value,
            "rejected": p.rejected.reason if p.rejected else None,
            # how this side moves data to it: one-sided writes into its buffers, or two-sided
            "one_sided_writes": p.writes, "memory": p.memory}
