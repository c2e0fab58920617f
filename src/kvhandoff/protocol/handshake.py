"""The handshake's two halves of one agent, sans-IO: what this agent says of itself
(`Identity`: its Hello, signed for its recipient, and the buffers it announces, `buffer_descs`)
and the checks of a peer's `Hello` (HMAC, transport kind, role, memory kind, checksum modes,
layout compatibility). The checksum policy is `checksums`, admission of a transfer request
`admission`; a peer's record and where its handshake stands are `peerstate`, the table of
peers that runs the handshake `peers`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvhandoff.buffers.bufferset import Extent
from kvhandoff.errors import KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, layout_compat_diff, peer_page_problems
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.checksums import checksum_problem
from kvhandoff.state_machine import Role

#: where an agent's KV buffers live (a Hello's `memory`)
MEMORY_KINDS = ("host", "cuda")


def buffer_descs(extents: Iterable[Extent]) -> tuple[P.BufferDesc, ...]:
    """What a Hello says of this agent's buffers (`buffers.BufferSet.extents`), without
    descriptors (a decode offering one-sided writes adds them)."""
    return tuple(P.BufferDesc(region=x.region, layer=x.layer, nbytes=x.nbytes)
                 for x in extents)


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
    #: its heartbeat interval, as its Hello says it (the session sets it from
    #: `Settings.heartbeat_interval_s`) and its bound on stopping a copy (`stall_timeout_s`)
    heartbeat_s: float = 0.0
    stall_s: float = 0.0

    def hello(self, cls: type[P.Hello], recipient: str, *, nonce: bytes = b"",
              echo: bytes = b"") -> P.Hello:
        """This agent's Hello (or HelloAck) to `recipient` (its control address), with the
        handshake's `nonce` (and, a HelloAck, the `echo` of the Hello it answers); signed for
        `recipient` when a shared secret is set."""
        msg = cls(src=self.address, gen=self.generation, agent_id=self.agent_id,
                  role=self.role.value, transport=self.transport_kind,
                  transport_address=self.transport_address, layout=self.layout.to_dict(),
                  layout_hash=self.layout_hash, buffers=list(self.buffers),
                  memory=self.memory, checksum=self.checksum, nonce=nonce, echo=echo,
                  heartbeat_s=self.heartbeat_s, stall_s=self.stall_s)
        if not self.hmac_secret:
            return msg
        return P.sign_hello(msg, self.hmac_secret, recipient=recipient)

    def verifies(self, msg: P.Hello) -> bool:
        """Whether `msg` authenticates as said to this agent (always, without a shared
        secret)."""
        return not self.hmac_secret or P.verify_hello(msg, self.hmac_secret,
                                                      recipient=self.address)

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
