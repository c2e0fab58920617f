"""The bench workload: one sequence at random page slots on both sides, and its span plans.

Rules: the plans are built exactly as the agents build theirs (`build_spans` per region, the
token range of suffix-only regions from the decode prefix page-aligned to the decode page size,
each side's pages from its own page-aligned first token), so the memcpy baseline copies the
very spans a single-pair handoff moves. Prefill and decode may use different page sizes: the
plans pair them token by token. Every rank of one side shares that side's page table (as an
engine's TP ranks do).

The byte check is independent of any plan: `plane_digests` hashes every plane of every layer in
token order from one side's own pages, so a decode rank's digests must equal those of the
prefill rank(s) that hold the same planes, whatever the page sizes and rank layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvhandoff.kv_layout import (
    LayoutSpec,
    RegionSpec,
    SendFrom,
    SpanPlan,
    TPSplit,
    build_spans,
    page_aligned,
    preset,
)


def rank_spec(model: str, page_size: int | None, tp_size: int = 1, tp_rank: int = 0
              ) -> LayoutSpec:
    """The layout of one rank: a head-sharded preset gives that rank's heads; a replicated one
    (MLA latent, indexer) is the same on every rank."""
    kw: dict[str, int] = {"page_size_tokens": page_size} if page_size else {}
    spec = preset(model, **kw)
    if tp_size > 1 and any(r.tp_split is TPSplit.HEAD_SHARDED for r in spec.regions):
        spec = preset(model, tp_size=tp_size, tp_rank=tp_rank, **kw)
    # a bench page size chosen on purpose runs no attention kernel: the preset's kernel page
    # rules (which the agent enforces at start) would refuse the P != D pairings it measures
    return spec.without_page_rules() if page_size else spec


def layers_of(spec: LayoutSpec) -> list[int]:
    return sorted({lid for r in spec.regions for lid in r.layer_ids})


@dataclass(frozen=True)
class PageSet:
    """A sequence of `seq_len` tokens; decode holds `prefix` of them (suffix-only regions).

    `src_pages` (prefill, pages of `src_page_size` tokens) and `dst_pages` (decode, pages of
    `dst_page_size`) are page tables from token 0 on, drawn from pools of `*_num_pages` slots.
    """

    seq_len: int
    prefix: int
    src_page_size: int
    dst_page_size: int
    src_num_pages: int
    dst_num_pages: int
    src_pages: np.ndarray
    dst_pages: np.ndarray

    @classmethod
    def random(cls, *, seq_len: int, prefix: int, src_page_size: int, dst_page_size: int,
               slack: float = 1.25, seed: int = 0) -> PageSet:
        """Pages drawn at random from pools of `slack` x the pages needed (a fragmented pool)."""
        rng = np.random.default_rng(seed)

        def draw(ps: int) -> tuple[int, np.ndarray]:
            need = -(-seq_len // ps)
            pool = max(need, int(need * slack))
            return pool, rng.choice(pool, need, replace=False).astype(np.int64)

        sn, sp = draw(src_page_size)
        dn, dp = draw(dst_page_size)
        return cls(seq_len, min(prefix, seq_len), src_page_size, dst_page_size, sn, dn, sp, dp)

    def first_token(self, reg: RegionSpec) -> int:
        """First token a region moves: the decode prefix page-aligned down to the decode page
        size for suffix-only regions (what the decode agent asks for), 0 otherwise."""
        if reg.send_from is SendFrom.DECODE_PREFIX:
            return page_aligned(self.prefix, self.dst_page_size)
        return 0

    def plans(self, src_spec: LayoutSpec, dst_spec: LayoutSpec) -> dict[str, SpanPlan]:
        """Per region, the span plan of one layer buffer (the same for all its layers) from a
        prefill layout to a decode layout holding the same planes (a single pair)."""
        sps, dps = self.src_page_size, self.dst_page_size
        out = {}
        for reg in dst_spec.regions:
            first = self.first_token(reg)
            s0, d0 = page_aligned(first, sps), page_aligned(first, dps)
            out[reg.name] = build_spans(
                src_spec.region(reg.name), token_start=first, token_end=self.seq_len,
                src_pages=self.src_pages[s0 // sps:], src_page_size=sps, src_first_token=s0,
                dst_pages=self.dst_pages[d0 // dps:], dst_page_size=dps, dst_first_token=d0,
                dst_region=reg)
        return out

    def moved_bytes(self, dst_spec: LayoutSpec) -> int:
        """Bytes one decode rank of layout `dst_spec` receives (all its planes and layers)."""
        return sum((self.seq_len - self.first_token(r)) * r.bytes_per_token * r.num_layers
                   for r in dst_spec.regions)

    def to_msg(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "prefix": self.prefix,
                "src_page_size": self.src_page_size, "dst_page_size": self.dst_page_size,
                "src_num_pages": self.src_num_pages, "dst_num_pages": self.dst_num_pages,
                "src_pages": self.src_pages.tolist(), "dst_pages": self.dst_pages.tolist()}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> PageSet:
        return cls(int(msg["seq_len"]), int(msg["prefix"]), int(msg["src_page_size"]),
                   int(msg["dst_page_size"]), int(msg["src_num_pages"]),
                   int(msg["dst_num_pages"]), np.asarray(msg["src_pages"], np.int64),
                   np.asarray(msg["dst_pages"], np.int64))


def plane_digests(bufs: Callable[[str, int], Any], spec: LayoutSpec, ps: PageSet, *,
                  side: str) -> dict[str, str]:
    """xxh3-64 of every plane of every layer, its moved tokens in token order, read from
    `side`'s buffers ("src": prefill pages, "dst": decode pages) in layout `spec`;
    `bufs(region, layer)` returns that layer buffer as a 1-D uint8 array. Keys are
    "region/layer/plane" (plane names are global: a head keeps its name on every rank)."""
    pages, page = ((ps.src_pages, ps.src_page_size) if side == "src"
                   else (ps.dst_pages, ps.dst_page_size))
    out: dict[str, str] = {}
    for reg in spec.regions:
        first = ps.first_token(reg)
        k = np.arange(first // page, -(-ps.seq_len // page), dtype=np.int64)
        lo = np.maximum(first, k * page)
        hi = np.minimum(ps.seq_len, (k + 1) * page)
        base = pages[k] * reg.page_nbytes(page)  # each page's first byte in the layer buffer
        in_page = lo - k * page  # first moved token inside each page
        for pl, poff in zip(reg.planes, reg.plane_offsets(), strict=True):
            b = pl.bytes_per_token
            pieces = list(zip((base + poff * page + in_page * b).tolist(),
                              ((hi - lo) * b).tolist(), strict=True))
            for lid in reg.layer_ids:
                h = xxhash.xxh3_64()
                mv = memoryview(bufs(reg.name, lid))
                for o, n in pieces:
                    h.update(mv[o:o + n])
                out[f"{reg.name}/{lid}/{pl.name}"] = h.hexdigest()
    return out
