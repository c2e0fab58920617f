"""The peer handshake, sans-IO: a peer's record (`Peer`, its state an enum) and the checks of a
`Hello` (HMAC, transport kind, role, checksum modes, layout compatibility).

A peer goes NEW -> HELLO_SENT (we said Hello first) -> CONNECTING (its Hello/HelloAck passed
the checks; the transport connects) -> MATCHED, or to REJECTED from any of them (its layout
differs, its HMAC does not verify, the transport could not connect, or it refused us). A
peer declared lost is dropped from the table (and remembered for a while: see the session).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.errors import ConfigError, Failure, KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, SendFrom, layout_compat_diff, peer_page_problems
from kvhandoff.kv_layout.admission import (
    DIGEST_BYTES,
    AllocationPolicy,
    PromptDigest,
    admission_refusal,
    prompt_digest,
)
from kvhandoff.protocol import wire as P
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



MEMORY_KINDS = ("host", "cuda")
#: checksum modes from the weakest to the strictest (the layers each sums: none, every 4th
#: and the last, all; each one's layers include the previous one's)
CHECKSUM_MODES = ("off", "sampled", "full")


def checksum_problem(prefill: str, decode: str) -> str | None:
    """Why a prefill summing by mode `prefill` cannot serve a decode verifying by mode
    `decode` (None: it can): the decode checks landed bytes only against the sums the
    prefill sends, so a prefill that sums fewer layers than the decode requires would leave
    layers unverified while the decode believes them checked. Both sides compute the same
    answer and refuse each other, naming both modes. An empty mode (an older peer that does
    not say) is not refused here; its layers are checked as their sums come."""
    for side, mode in (("prefill", prefill), ("decode", decode)):
        if mode and mode not in CHECKSUM_MODES:
            return (f"checksum: {side} says {mode!r}; expected one of "
                    f"{', '.join(CHECKSUM_MODES)}")
    if prefill and decode and CHECKSUM_MODES.index(prefill) < CHECKSUM_MODES.index(decode):
        return (f"checksum: decode={decode!r} verifies more layers than prefill={prefill!r} "
                f"sums; set the prefill's checksum to {decode!r} (or the decode's to "
                f"{prefill!r})")
    return None


def buffer_name(region: str, layer: int) -> str:
    """The transport name of the buffer of (region, layer) (`buffers.BufferSet.name`): what a
    Hello's buffer descriptors and the data effects name."""
    return f"{region}/{layer}"

XXH3, DEVSUM = "xxh3", "devsum"


def checksum_alg(mine: str, theirs: str) -> str:
    """The checksum algorithm of a room between an agent whose buffers live in `mine` and a
    peer whose buffers live in `theirs` (each "host" or "cuda"): "devsum" (the position-keyed
    device checksum of transfer/devsum.py, computed where the bytes are; a host side computes
    the same value on the CPU) when either side's buffers are device memory, else "xxh3"
    (xxh3-64 over host bytes, `checksum.span_checksum`). Both sides compute it from their own
    kind and the other's Hello, so they always agree."""
    return DEVSUM if "cuda" in (mine, theirs) else XXH3


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
    backlog: list[Any] = field(default_factory=list)

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


# ---- admission and prefix agreement (issue 17) ---------------------------------------------


def digest_to_wire(d: PromptDigest | None) -> P.Digest | None:
    """A `kv_layout.PromptDigest` as the `TransferRequest` carries it."""
    if d is None:
        return None
    return P.Digest(page_size=d.page_size_tokens, num_tokens=d.num_tokens,
                    pages=b"".join(d.pages), whole=d.whole)


def digest_from_wire(d: P.Digest, field_name: str) -> PromptDigest:
    """The `PromptDigest` of a request's `Digest`; `ConfigError` naming the field when it is
    malformed."""
    if d.page_size <= 0 or d.num_tokens < 0:
        raise ConfigError(f"{field_name}: page_size={d.page_size} num_tokens={d.num_tokens}")
    n = -(-d.num_tokens // d.page_size)
    if len(d.pages) != n * DIGEST_BYTES:
        raise ConfigError(f"{field_name}.pages: {len(d.pages)} bytes; {d.num_tokens} tokens in "
                          f"pages of {d.page_size} need {n} x {DIGEST_BYTES}")
    return PromptDigest(page_size_tokens=d.page_size, num_tokens=d.num_tokens,
                        pages=tuple(d.pages[i:i + DIGEST_BYTES]
                                    for i in range(0, len(d.pages), DIGEST_BYTES)),
                        whole=d.whole)


def reserved_pages(layout: LayoutSpec, pages: Mapping[str, Sized], prefix_len: int,
                   page_size: int) -> dict[str, int]:
    """Decode (`early`): the new pages its table holds per region: the pages beyond the
    page-aligned cached prefix (suffix-only regions' tables start there already)."""
    held = prefix_len // page_size
    return {reg.name: len(pages[reg.name]) - (held if reg.send_from is SendFrom.START else 0)
            for reg in layout.regions if reg.name in pages}


def admission_of(msg: P.TransferRequest, *, decode_layout: LayoutSpec,
                 policy: AllocationPolicy, prompt_tokens: Any,
                 prompt: PromptDigest | None) -> str | None:
    """Prefill: the refusal reason of a transfer request (`kv_layout.admission_refusal`:
    allocation policies, prompt/prefix agreement, capacity), or None to accept. The prompts
    are compared only when both sides gave them. `ConfigError` (naming the field) for a
    request that lacks what its policy needs."""
    theirs = AllocationPolicy.parse(msg.allocation_policy, "allocation_policy")
    mine = prompt
    decode_prompt = decode_prefix = None
    if msg.prompt is not None and prompt_tokens is not None:
        decode_prompt = digest_from_wire(msg.prompt, "prompt")
        if msg.cached_prefix is not None:
            decode_prefix = digest_from_wire(msg.cached_prefix, "cached_prefix")
        if mine is None or mine.page_size_tokens != decode_prompt.page_size_tokens:
            mine = prompt_digest(prompt_tokens, decode_prompt.page_size_tokens)
    else:
        mine = None
    reserved = free = None
    if theirs is AllocationPolicy.EARLY and msg.reserved_pages is not None:
        reserved = min(msg.reserved_pages.values(), default=0)
    if theirs is AllocationPolicy.PREFILL_COMPLETE:
        free = msg.free_pages
    return admission_refusal(
        decode_layout, seq_len=msg.seq_len, decode_prefix_len=msg.decode_prefix_len,
        prefill_policy=policy, decode_policy=theirs, reserved_pages=reserved, free_pages=free,
        prefill_prompt=mine, decode_prompt=decode_prompt, decode_prefix=decode_prefix)


class Refusal(Exception):
    """(inside the session) A transfer request the prefill refuses at admission; the room
    fails on both sides with this reason (`FailureKind.ADMISSION`)."""
