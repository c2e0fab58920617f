"""Admission of a transfer request and prompt-prefix agreement (issue 17), on the protocol's
side: the wire form of prompt digests, the pages a decode reserved, and the prefill's decision
(`admission_of`, over `kv_layout.admission`'s pure rules). Sans-IO.

Rules:
- The prefill decides before any byte moves; a refusal fails the room on both sides with the
  reason (`Refusal` inside the session, `FailureKind.ADMISSION` on the room).
- Malformed digests are a `ConfigError` naming the field, never a crash or a silent accept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, SendFrom
from kvhandoff.kv_layout.admission import (
    DIGEST_BYTES,
    AllocationPolicy,
    PromptDigest,
    admission_refusal,
    prompt_digest,
)
from kvhandoff.protocol import wire as P


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
                   page_size: int, starts: Mapping[str, int] | None = None
                   ) -> dict[str, int]:
    """Decode (`early`): the new pages its table holds per region: the pages beyond the
    page-aligned cached prefix (suffix-only regions' tables start there already). A region
    that starts later (`starts`: a sliding window, whose decode holds no page before it)
    counts the pages it skips as held: it needs none there."""
    held = prefix_len // page_size
    out = {}
    for reg in layout.regions:
        if reg.name not in pages:
            continue
        n = len(pages[reg.name]) - (held if reg.send_from is SendFrom.START else 0)
        start = (starts or {}).get(reg.name, 0) // page_size
        base = held if reg.send_from is SendFrom.DECODE_PREFIX else 0
        out[reg.name] = n + max(0, start - base)
    return out


def region_starts(msg: P.TransferRequest, layout: LayoutSpec) -> dict[str, int]:
    """Prefill: the decode's per-region starts (`TransferRequest.region_starts`), validated:
    regions of the layout, tokens in 0..seq_len aligned to the decode's page size.
    `ConfigError` naming the field otherwise."""
    out: dict[str, int] = {}
    names = {reg.name for reg in layout.regions}
    for name, start in (msg.region_starts or {}).items():
        if name not in names:
            raise ConfigError(f"region_starts[{name!r}]: not a region of this layout "
                              f"({sorted(names)})")
        if not 0 <= start <= msg.seq_len or (msg.page_size > 0 and start % msg.page_size):
            raise ConfigError(f"region_starts[{name!r}]: {start} is not a token in "
                              f"0..{msg.seq_len} aligned to the decode page size "
                              f"{msg.page_size}")
        out[name] = start
    return out


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
