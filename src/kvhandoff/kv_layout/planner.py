"""Capacity and transfer-time planning: the byte accounts of seeds 000 and 003.

Rules: every figure is derived from a `LayoutSpec`; nothing is typed in. Decimal (GB = 1e9 B)
and binary (GiB = 2**30 B) units are both reported and never mixed. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.pages import num_pages
from kvhandoff.kv_layout.spec import LayoutSpec, SendFrom

GB = 10**9
GIB = 2**30


@dataclass(frozen=True, slots=True)
class RegionPlan:
    """The byte account of one region at one context length."""

    name: str
    layers: int
    bytes_per_token_layer: int  # one row of one layer (a token unless index_kpool > 1)
    bytes_per_token: int
    bytes_per_page: int
    bytes_per_context: int
    bytes_per_layer: int  # one layer, whole context
    suffix_only: bool
    transfer_s: float
    layer_transfer_s: float
    indexer: bool = False  # a DSA indexer region (read whole every decode step)


@dataclass(frozen=True, slots=True)
class Plan:
    """The byte account and ideal transfer times of a layout at one context length."""

    model: str
    page_size_tokens: int
    context_tokens: int
    pages: int
    link_gbps: float
    regions: tuple[RegionPlan, ...]
    top_k: int

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8

    @property
    def bytes_per_token(self) -> int:
        return sum(r.bytes_per_token for r in self.regions)

    @property
    def bytes_per_page(self) -> int:
        return sum(r.bytes_per_page for r in self.regions)

    @property
    def bytes_per_context(self) -> int:
        return sum(r.bytes_per_context for r in self.regions)

    @property
    def transfer_s(self) -> float:
        return self.bytes_per_context / self.link_bytes_per_s

    def region(self, name: str) -> RegionPlan:
        for r in self.regions:
            if r.name == name:
                return r
        raise ConfigError(f"region {name!r}: not in plan")

    @property
    def sparse_read_bytes(self) -> int:
        """Decode-step bytes of top-k sparse main-KV reads (non-indexer regions, top_k
        tokens)."""
        return sum(self.top_k * r.bytes_per_token for r in self.regions if not r.indexer)

    @property
    def indexer_read_bytes(self) -> int:
        """Decode-step bytes of the indexer: it reads its whole context every step."""
        return sum(r.bytes_per_context for r in self.regions if r.indexer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "page_size_tokens": self.page_size_tokens,
            "context_tokens": self.context_tokens,
            "pages": self.pages,
            "link_gbps": self.link_gbps,
            "link_bytes_per_s": self.link_bytes_per_s,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_page": self.bytes_per_page,
            "bytes_per_context": self.bytes_per_context,
            "transfer_s": self.transfer_s,
            "decode_step": {
                "top_k": self.top_k,
                "sparse_kv_read_bytes": self.sparse_read_bytes,
                "indexer_read_bytes": self.indexer_read_bytes,
            },
            "regions": [
                {
                    "name": r.name,
                    "layers": r.layers,
                    "bytes_per_token_layer": r.bytes_per_token_layer,
                    "bytes_per_token": r.bytes_per_token,
                    "bytes_per_page": r.bytes_per_page,
                    "bytes_per_context": r.bytes_per_context,
                    "bytes_per_layer": r.bytes_per_layer,
                    "suffix_only": r.suffix_only,
                    "transfer_s": r.transfer_s,
                    "layer_transfer_s": r.layer_transfer_s,
                }
                for r in self.regions
            ],
        }


def is_indexer(region: str) -> bool:
    """Whether a region is a DSA indexer cache (the presets' ``indexer_k`` /
    ``draft_indexer_k``, the SGLang adapter's ``indexer`` / ``draft_indexer``)."""
    return "indexer" in region


def plan(
    spec: LayoutSpec, *, context_tokens: int, link_gbps: float = 3200.0, top_k: int = 2048
) -> Plan:
    """The byte account of `spec` at `context_tokens`, times at `link_gbps` (bits/s / 1e9)."""
    if context_tokens <= 0:
        raise ConfigError(f"context: expected > 0 tokens, got {context_tokens}")
    if link_gbps <= 0:
        raise ConfigError(f"link_gbps: expected > 0, got {link_gbps}")
    rate = link_gbps * 1e9 / 8
    regions = []
    for r in spec.regions:
        # live layers only (0-row layers hold nothing); compressed regions count rows
        per_layer = r.nbytes_for(context_tokens)
        per_ctx = per_layer * r.num_live_layers
        regions.append(
            RegionPlan(
                name=r.name,
                layers=r.num_live_layers,
                bytes_per_token_layer=r.bytes_per_token,
                bytes_per_token=r.bytes_per_token * r.num_live_layers // r.tokens_per_row,
                bytes_per_page=r.page_nbytes(spec.page_size_tokens) * r.num_live_layers,
                bytes_per_context=per_ctx,
                bytes_per_layer=per_layer,
                suffix_only=r.send_from is SendFrom.DECODE_PREFIX,
                transfer_s=per_ctx / rate,
                layer_transfer_s=per_layer / rate,
                indexer=is_indexer(r.name),
            )
        )
    return Plan(
        model=spec.model,
        page_size_tokens=spec.page_size_tokens,
        context_tokens=context_tokens,
        pages=num_pages(context_tokens, spec.page_size_tokens),
        link_gbps=link_gbps,
        regions=tuple(regions),
        top_k=top_k,
    )


def handoff_bytes(spec: LayoutSpec, *, seq_len: int, decode_prefix_len: int) -> dict[str, int]:
    """Bytes a handoff moves per region: start regions whole, suffix-only regions from the
    page-aligned-down prefix on (live layers, rows of compressed regions)."""
    from kvhandoff.kv_layout.pages import page_aligned

    start = page_aligned(decode_prefix_len, spec.page_size_tokens)
    out: dict[str, int] = {}
    for r in spec.regions:
        tokens = seq_len - start if r.send_from is SendFrom.DECODE_PREFIX else seq_len
        out[r.name] = r.nbytes_for(tokens) * r.num_live_layers
    return out


# ---- the remaining accounts of seeds 000 and 003 (issue 17) ---------------------------------

MIB = 2**20


@dataclass(frozen=True, slots=True)
class LinkAccount:
    """The handoff time at a fraction of the line rate (small RDMA messages: 64-token pages
    reach 60-80 % of it)."""

    efficiency: float
    bytes_per_s: float
    transfer_s: float


def link_accounts(p: Plan, efficiencies: tuple[float, ...]) -> tuple[LinkAccount, ...]:
    """`p`'s whole-context transfer time at each link efficiency (0 < e <= 1)."""
    out = []
    for e in efficiencies:
        if not 0 < e <= 1:
            raise ConfigError(f"link_efficiency: expected 0 < e <= 1, got {e}")
        rate = p.link_bytes_per_s * e
        out.append(LinkAccount(efficiency=e, bytes_per_s=rate,
                               transfer_s=p.bytes_per_context / rate))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TTFTTail:
    """What per-layer overlap cannot hide: the last layer's transfer (every region of it).
    TTFT >= T_prefill + `last_layer_s` + T_first_decode_step."""

    last_layer: int
    regions: tuple[str, ...]
    last_layer_bytes: int
    last_layer_s: float  # at the line rate
    last_layer_s_at: tuple[tuple[float, float], ...]  # (efficiency, seconds)

    def floor_s(self, prefill_s: float, first_step_s: float, efficiency: float = 1.0) -> float:
        t = dict(self.last_layer_s_at).get(efficiency, self.last_layer_s / efficiency)
        return prefill_s + t + first_step_s


def ttft_tail(spec: LayoutSpec, p: Plan, *, decode_prefix_len: int = 0,
              efficiencies: tuple[float, ...] = ()) -> TTFTTail:
    """The transfer of the highest layer id (the last one handed over), with suffix-only
    regions from the page-aligned decode prefix."""
    from kvhandoff.kv_layout.pages import page_aligned

    last = max(lid for r in spec.regions for lid in r.live_layer_ids)
    held = page_aligned(min(decode_prefix_len, p.context_tokens), spec.page_size_tokens)
    regions = spec.regions_of_layer(last)
    nbytes = sum(r.nbytes_for(p.context_tokens - (held if r.send_from is SendFrom.DECODE_PREFIX
                                                  else 0)) for r in regions)
    rate = p.link_bytes_per_s
    return TTFTTail(last_layer=last, regions=tuple(r.name for r in regions),
                    last_layer_bytes=nbytes, last_layer_s=nbytes / rate,
                    last_layer_s_at=tuple((e, nbytes / (rate * e)) for e in efficiencies))


@dataclass(frozen=True, slots=True)
class Capacity:
    """Admission capacity of `available_bytes` of KV memory, in both engines' terms.

    SGLang: ``max_total_num_tokens = available // cell_size`` (rounded down to a page),
    ``cell_size`` the bytes of one token over every region. vLLM: ``num_blocks = available //
    bytes_per_block``, a block one page of every region (plus any packed-row padding)."""

    available_bytes: int
    page_size_tokens: int
    cell_size: int
    max_total_num_tokens: int
    bytes_per_block: int
    num_blocks: int
    context_tokens: int
    pages_per_request: int
    requests_at_context: int  # whole requests of `context_tokens` that fit at once

    @property
    def block_tokens(self) -> int:
        return self.num_blocks * self.page_size_tokens

    @property
    def bytes_per_block_mib(self) -> float:
        return self.bytes_per_block / MIB


def cell_size(spec: LayoutSpec) -> int:
    """Bytes of one token over every live layer of every region (SGLang's cell_size); a
    compressed region counts its page's bytes per token, rounded up."""
    return -(-spec.bytes_per_page // spec.page_size_tokens)


def capacity(spec: LayoutSpec, *, available_bytes: int, context_tokens: int) -> Capacity:
    """How many tokens, blocks and `context_tokens`-long requests `available_bytes` hold."""
    if available_bytes <= 0:
        raise ConfigError(f"memory: expected > 0 bytes, got {available_bytes}")
    if context_tokens <= 0:
        raise ConfigError(f"context: expected > 0 tokens, got {context_tokens}")
    ps = spec.page_size_tokens
    cell = cell_size(spec)
    tokens = (available_bytes // cell) // ps * ps
    per_block = spec.bytes_per_page + sum(w.pad_bytes for w in spec.rows)
    blocks = available_bytes // per_block
    need = num_pages(context_tokens, ps)
    return Capacity(available_bytes=available_bytes, page_size_tokens=ps, cell_size=cell,
                    max_total_num_tokens=tokens, bytes_per_block=per_block, num_blocks=blocks,
                    context_tokens=context_tokens, pages_per_request=need,
                    requests_at_context=blocks // need)


@dataclass(frozen=True, slots=True)
class TailWaste:
    """The partial last page of every request: on average half a page of tokens, each at
    `cell_size` bytes."""

    requests: int
    avg_tokens: float
    per_request_bytes: float
    total_bytes: float


def tail_waste(spec: LayoutSpec, *, requests: int) -> TailWaste:
    """The tail-page waste of `requests` requests whose lengths fall anywhere in a page."""
    if requests < 0:
        raise ConfigError(f"requests: expected >= 0, got {requests}")
    avg = spec.page_size_tokens / 2
    per = avg * cell_size(spec)
    return TailWaste(requests=requests, avg_tokens=avg, per_request_bytes=per,
                     total_bytes=per * requests)
