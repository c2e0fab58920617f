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
        """Decode-step bytes of top-k sparse main-KV reads (start regions, top_k tokens)."""
        return sum(
            self.top_k * r.bytes_per_token for r in self.regions if not r.suffix_only
        )

    @property
    def indexer_read_bytes(self) -> int:
        """Decode-step bytes of the indexer: it reads its whole context every step."""
        return sum(r.bytes_per_context for r in self.regions if r.suffix_only)

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
