"""Admission and prompt-prefix agreement (seed 003): pure functions both sides of a handshake
run before any byte moves.

Admission. A 57 GB request cannot wait for its KV to arrive before finding room: the decode
decides up front, and a request that will not fit is refused at the handshake, never half
transferred. The allocation unit is a page of every region (a vLLM block, `page_size` SGLang
cells): the decode reserves one page per `page_size` tokens of the sequence, except the pages of
its page-aligned cached prefix, which it already holds. `AllocationPolicy` says when it
reserves (SGLang's ``--disaggregation-decode-allocation-policy``):

- ``early``: when the request reaches the decode; the transfer request carries the pages it
  reserved and the prefill checks them against `decode_need`.
- ``prefill_complete``: after the prefill finished; the decode asks with its free pages and the
  request is refused if they are short (`check_capacity`).

Both sides must run the same policy (`policy_mismatch`).

What a request needs is its prompt AND the tokens it will generate: `decode_need` counts
``seq_len + new_tokens`` rounded up to pages (one page of every region: main KV and indexer
together), less the held prefix. `request_budget` adds the indexer's workspace (the top-k index
buffer and the logits matrix, seed 000: outside the paged pool) as a line of its own and refuses
a request that only fits without its output, saying so. Decode context parallelism (DCP: the
indexer's slots scale as ``(size + page) x dcp - page``) is not modelled: refused by name.

Prefix agreement. Suffix-only regions (the indexer) move from the decode's page-aligned cached
prefix on; that is only right if the decode's prefix is the SAME tokens as the prompt. A
`PromptDigest` holds a chained hash per page of prompt token ids (page i's hash covers pages
0..i, as a prefix cache's block hashes do) so a mismatch names the first differing page, and a
whole-sequence hash. `prompt_mismatch` compares the prefill's digest with the decode's digest of
the prompt and of its cached prefix.

Pure: hashlib and numpy, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.pages import num_pages, page_aligned
from kvhandoff.kv_layout.planner import is_indexer
from kvhandoff.kv_layout.spec import LayoutSpec, SendFrom

DIGEST_BYTES = 8  # per page: 16,384 pages of a 1M-token prompt are 128 KiB of hashes


class AllocationPolicy(str, Enum):
    """When the decode reserves a request's pages."""

    EARLY = "early"  # when the request reaches the decode (SGLang's default)
    PREFILL_COMPLETE = "prefill_complete"  # after the prefill finished; KV waits on the prefill

    @classmethod
    def parse(cls, value: object, field: str = "allocation_policy") -> AllocationPolicy:
        """The policy named `value`; anything else is a `ConfigError` naming `field`."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{field}: expected one of {', '.join(p.value for p in cls)}, "
                              f"got {value!r}") from None


def policy_mismatch(prefill: AllocationPolicy, decode: AllocationPolicy) -> str | None:
    """The refusal reason when the two sides run different allocation policies."""
    if prefill is decode:
        return None
    return (f"allocation_policy: prefill={prefill.value} decode={decode.value} "
            "(both sides must run the same --disaggregation-decode-allocation-policy)")


@dataclass(frozen=True, slots=True)
class RegionNeed:
    """What one region of a request takes on the decode."""

    name: str
    pages: int  # new pages (the unit is shared by all regions)
    bytes_reserved: int  # pages x item length x live layers
    bytes_moved: int  # what the handoff writes into them (start regions: the whole sequence)


@dataclass(frozen=True, slots=True)
class DecodeNeed:
    """What a request needs on the decode: new pages and their bytes, per region and total."""

    seq_len: int
    decode_prefix_len: int
    page_size_tokens: int
    held_pages: int  # the page-aligned cached prefix the decode already holds
    pages: int  # new pages to reserve (prompt and output)
    bytes_per_page: int
    regions: tuple[RegionNeed, ...]
    new_tokens: int = 0  # tokens the request will generate
    prompt_pages: int = 0  # new pages of the prompt alone

    @property
    def bytes(self) -> int:
        return self.pages * self.bytes_per_page

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.regions)


def decode_need(layout: LayoutSpec, *, seq_len: int, decode_prefix_len: int,
                new_tokens: int = 0) -> DecodeNeed:
    """The pages and bytes a request of `seq_len` prompt tokens and `new_tokens` generated
    ones needs on a decode of `layout` that holds `decode_prefix_len` tokens of it cached
    (page-aligned down)."""
    if seq_len <= 0:
        raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
    if new_tokens < 0:
        raise ConfigError(f"new_tokens: expected >= 0, got {new_tokens}")
    if not 0 <= decode_prefix_len <= seq_len:
        raise ConfigError(f"decode_prefix_len: expected 0..seq_len={seq_len}, got "
                          f"{decode_prefix_len}")
    ps = layout.page_size_tokens
    held_tokens = page_aligned(decode_prefix_len, ps)
    held = held_tokens // ps
    new = num_pages(seq_len + new_tokens, ps) - held
    regions = []
    for r in layout.regions:
        moved_tokens = seq_len - held_tokens if r.send_from is SendFrom.DECODE_PREFIX else seq_len
        regions.append(RegionNeed(
            name=r.name, pages=new,
            bytes_reserved=new * r.page_nbytes(ps) * r.num_live_layers,
            bytes_moved=r.nbytes_for(moved_tokens) * r.num_live_layers))
    return DecodeNeed(seq_len=seq_len, decode_prefix_len=decode_prefix_len,
                      page_size_tokens=ps, held_pages=held, pages=new,
                      bytes_per_page=layout.bytes_per_page, regions=tuple(regions),
                      new_tokens=new_tokens, prompt_pages=num_pages(seq_len, ps) - held)


def _need_text(need: DecodeNeed) -> str:
    out = f" + {need.new_tokens:,} new" if need.new_tokens else ""
    return (f"{need.seq_len:,} tokens{out} with {need.held_pages * need.page_size_tokens:,} "
            f"cached need {need.pages:,} pages of {need.page_size_tokens} tokens "
            f"({need.bytes:,} B)")


def check_capacity(need: DecodeNeed, *, free_pages: int) -> str | None:
    """``prefill_complete`` (and the decode's own check under ``early``): the refusal reason
    when `free_pages` cannot hold the request, else None."""
    if free_pages < 0:
        raise ConfigError(f"free_pages: expected >= 0, got {free_pages}")
    if need.pages <= free_pages:
        return None
    return f"admission: {_need_text(need)}; the decode has {free_pages:,} free"


def check_reservation(need: DecodeNeed, *, reserved_pages: int) -> str | None:
    """``early``: the prefill's check of what the decode says it reserved."""
    if reserved_pages < 0:
        raise ConfigError(f"reserved_pages: expected >= 0, got {reserved_pages}")
    if reserved_pages >= need.pages:
        return None
    return f"admission: {_need_text(need)}; the decode reserved {reserved_pages:,}"


# ---- prompt-prefix agreement ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PromptDigest:
    """Hashes of prompt token ids: one chained hash per page (a partial last page included) and
    one of the whole sequence."""

    page_size_tokens: int
    num_tokens: int
    pages: tuple[bytes, ...]
    whole: bytes


def _tokens(token_ids: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ConfigError(f"token_ids: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ConfigError("token_ids: ids must be >= 0")
    return arr


def prompt_digest(token_ids: Sequence[int] | npt.ArrayLike, page_size_tokens: int,
                  *, num_tokens: int | None = None) -> PromptDigest:
    """The digest of the first `num_tokens` (default: all) prompt tokens in pages of
    `page_size_tokens`."""
    if page_size_tokens <= 0:
        raise ConfigError(f"page_size_tokens: expected > 0, got {page_size_tokens}")
    arr = _tokens(token_ids)
    n = arr.shape[0] if num_tokens is None else num_tokens
    if not 0 <= n <= arr.shape[0]:
        raise ConfigError(f"num_tokens: expected 0..{arr.shape[0]}, got {n}")
    raw = arr[:n].astype("<i8").tobytes()
    step = page_size_tokens * 8
    prev = b""
    pages = []
    for off in range(0, len(raw), step):
        prev = hashlib.blake2b(prev + raw[off:off + step], digest_size=DIGEST_BYTES).digest()
        pages.append(prev)
    whole = hashlib.blake2b(n.to_bytes(8, "little") + raw, digest_size=16).digest()
    return PromptDigest(page_size_tokens=page_size_tokens, num_tokens=n, pages=tuple(pages),
                        whole=whole)


def prefix_digest(token_ids: Sequence[int] | npt.ArrayLike, decode_prefix_len: int,
                  page_size_tokens: int) -> PromptDigest:
    """The digest of the cached prefix as the transfer uses it: page-aligned down."""
    held = page_aligned(decode_prefix_len, page_size_tokens)
    return prompt_digest(token_ids, page_size_tokens, num_tokens=held)


def first_differing_page(a: Sequence[bytes], b: Sequence[bytes]) -> int | None:
    """The first page whose chained hash differs (a shorter list differs at its end), or None
    when the lists are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_mismatch(prefill: PromptDigest, decode: PromptDigest,
                    decode_prefix: PromptDigest | None = None) -> str | None:
    """The refusal reason when the decode's prompt (or its cached prefix) is not the prefill's
    prompt, naming the first differing page; None when they agree."""
    ps = prefill.page_size_tokens
    for d, what in ((decode, "prompt"), (decode_prefix, "cached prefix")):
        if d is not None and d.page_size_tokens != ps:
            raise ConfigError(f"{what} digest: page_size_tokens={d.page_size_tokens}, the "
                              f"prefill's is {ps} (both must hash in the same pages)")
    if decode.num_tokens != prefill.num_tokens:
        return (f"prompt mismatch: seq_len prefill={prefill.num_tokens} "
                f"decode={decode.num_tokens}")
    if decode.whole != prefill.whole:
        page = first_differing_page(prefill.pages, decode.pages)
        return _page_text("prompt mismatch: the prompt token ids differ", page, ps)
    if decode_prefix is not None:
        held = decode_prefix.num_tokens
        if held % ps or held > prefill.num_tokens:
            return (f"prefix mismatch: the decode's cached prefix of {held} tokens is not "
                    f"page-aligned to {ps} within the {prefill.num_tokens}-token prompt")
        page = first_differing_page(prefill.pages[:held // ps], decode_prefix.pages)
        if page is not None:
            return _page_text(f"prefix mismatch: the decode's cached {held}-token prefix is "
                              "not the prompt's", page, ps)
    return None


def _page_text(head: str, page: int | None, ps: int) -> str:
    if page is None:  # equal page hashes but different whole hashes: cannot happen by design
        return head
    return f"{head}; first differing page {page} (tokens {page * ps}..{(page + 1) * ps - 1})"


def admission_refusal(
    decode_layout: LayoutSpec,
    *,
    seq_len: int,
    decode_prefix_len: int,
    prefill_policy: AllocationPolicy,
    decode_policy: AllocationPolicy,
    reserved_pages: int | None = None,
    free_pages: int | None = None,
    prefill_prompt: PromptDigest | None = None,
    decode_prompt: PromptDigest | None = None,
    decode_prefix: PromptDigest | None = None,
) -> str | None:
    """Everything the prefill checks about a transfer request before any byte moves, as ONE
    reason (the first that applies) or None: the allocation policies agree; the prompts (and
    the decode's cached prefix) agree, when digests are given; the request fits: under
    ``early`` the decode's `reserved_pages`, under ``prefill_complete`` its `free_pages`.

    Raises:
        ConfigError: the count the decode's policy needs is missing (names the field).
    """
    reason = policy_mismatch(prefill_policy, decode_policy)
    if reason:
        return reason
    if (prefill_prompt is None) != (decode_prompt is None):
        return ("prompt digest: only one side sent one (prefill="
                f"{'yes' if prefill_prompt else 'no'} decode={'yes' if decode_prompt else 'no'})")
    if prefill_prompt is not None and decode_prompt is not None:
        reason = prompt_mismatch(prefill_prompt, decode_prompt, decode_prefix)
        if reason:
            return reason
    need = decode_need(decode_layout, seq_len=seq_len, decode_prefix_len=decode_prefix_len)
    if decode_policy is AllocationPolicy.EARLY:
        if reserved_pages is None:
            raise ConfigError("reserved_pages: required under allocation_policy=early")
        return check_reservation(need, reserved_pages=reserved_pages)
    if free_pages is None:
        raise ConfigError("free_pages: required under allocation_policy=prefill_complete")
    return check_capacity(need, free_pages=free_pages)


# ---- the whole budget of one request on a decode (issue 22) -------------------------------

LOGITS_ROW_ALIGN = 256  # SGLang's MQA logits rows are padded to 256 fp32 columns (seed 000)


@dataclass(frozen=True, slots=True)
class IndexerWorkspace:
    """The DSA indexer's memory outside the paged pool (seed 000), allocated per engine: the
    top-k index buffer (``max_num_batched_tokens x index_topk`` int32, vLLM's
    ``topk_indices_buffer``) and the fp32 logits of one decode step (``decode_rows`` query
    rows, 1 + MTP draft tokens, over the context padded to `LOGITS_ROW_ALIGN` columns)."""

    max_num_batched_tokens: int = 8192
    index_topk: int = 2048
    decode_rows: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "index_topk", "decode_rows"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: expected > 0, got {getattr(self, name)}")

    def topk_bytes(self) -> int:
        return self.max_num_batched_tokens * self.index_topk * 4

    def logits_bytes(self, context_tokens: int) -> int:
        cols = -(-context_tokens // LOGITS_ROW_ALIGN) * LOGITS_ROW_ALIGN
        return self.decode_rows * cols * 4


@dataclass(frozen=True, slots=True)
class BudgetLine:
    name: str
    nbytes: int
    detail: str


@dataclass(frozen=True, slots=True)
class RequestBudget:
    """What one request needs on a decode, line by line, against `available_bytes`."""

    need: DecodeNeed
    lines: tuple[BudgetLine, ...]
    available_bytes: int
    prompt_only_bytes: int  # the same without the output's pages
    reason: str | None  # None: admitted

    @property
    def total_bytes(self) -> int:
        return sum(line.nbytes for line in self.lines)

    @property
    def admitted(self) -> bool:
        return self.reason is None


def request_budget(layout: LayoutSpec, *, seq_len: int, new_tokens: int, available_bytes: int,
                   decode_prefix_len: int = 0, workspace: IndexerWorkspace | None = None,
                   dcp_size: int = 1) -> RequestBudget:
    """The pages of every region for the prompt and its `new_tokens` (rounded to pages), the
    indexer workspace when the layout has an indexer, and the verdict against
    `available_bytes`: refused when the total does not fit, saying so when the prompt alone
    would (a request admitted that way runs out of memory while decoding).

    Raises:
        ConfigError: `dcp_size` > 1 (not modelled), bad counts (names the field).
    """
    if dcp_size != 1:
        raise ConfigError(f"dcp_size: {dcp_size} is not modelled (decode context parallelism "
                          "splits the latent across ranks and sizes the indexer's slots as "
                          "(size + page) x dcp - page); plan with dcp_size 1")
    if available_bytes < 0:
        raise ConfigError(f"available_bytes: expected >= 0, got {available_bytes}")
    need = decode_need(layout, seq_len=seq_len, decode_prefix_len=decode_prefix_len,
                       new_tokens=new_tokens)
    ps = layout.page_size_tokens
    lines = [BudgetLine(r.name, need.pages * r.page_nbytes(ps) * r.num_live_layers,
                        f"{need.pages:,} pages x {r.num_live_layers} layers x "
                        f"{r.page_nbytes(ps):,} B")
             for r in layout.regions if r.num_live_layers]
    ws = 0
    if any(is_indexer(r.name) for r in layout.regions):
        w = workspace or IndexerWorkspace()
        ctx = seq_len + new_tokens
        ws = w.topk_bytes() + w.logits_bytes(ctx)
        lines.append(BudgetLine(
            "indexer workspace", ws,
            f"top-k index buffer {w.max_num_batched_tokens:,} x {w.index_topk:,} x 4 B = "
            f"{w.topk_bytes():,} B + logits {w.decode_rows} x {ctx:,} tokens (padded to "
            f"{LOGITS_ROW_ALIGN}) x 4 B = {w.logits_bytes(ctx):,} B"))
    total = sum(line.nbytes for line in lines)
    prompt_only = need.prompt_pages * need.bytes_per_page + ws
    reason = None
    if total > available_bytes:
        head = (f"admission: {_need_text(need)} + indexer workspace {ws:,} B = {total:,} B; "
                f"{available_bytes:,} B free")
        if prompt_only <= available_bytes:
            reason = (f"{head}: it fits only without its output ({prompt_only:,} B for the "
                      f"prompt alone), so it would run out of memory while decoding")
        else:
            reason = head
    return RequestBudget(need=need, lines=tuple(lines), available_bytes=available_bytes,
                         prompt_only_bytes=prompt_only, reason=reason)
