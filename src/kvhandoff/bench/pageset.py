"""The bench workload: one sequence at random page slots on both sides, and its span plans.

Rules: the plans are built exactly as the agents build theirs (`build_spans` per region, suffix-
only regions from the page-aligned decode prefix), so the memcpy baseline copies the very spans
the handoff moves, and both processes of a handoff can hash the same logical bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvhandoff.kv_layout import LayoutSpec, SendFrom, SpanPlan, build_spans, page_aligned


@dataclass(frozen=True)
class PageSet:
    """A sequence of `seq_len` tokens; decode holds `prefix` of them (suffix-only regions)."""

    spec: LayoutSpec
    seq_len: int
    prefix: int
    num_pages: int  # pool size of each side (slots the pages are drawn from)
    src_pages: np.ndarray  # prefill page table, token 0 on
    dst_pages: np.ndarray  # decode page table, token 0 on

    @classmethod
    def random(cls, spec: LayoutSpec, *, seq_len: int, prefix: int, slack: float = 1.25,
               seed: int = 0) -> PageSet:
        """Pages drawn at random from pools of `slack` x the pages needed (a fragmented pool)."""
        ps = spec.page_size_tokens
        need = -(-seq_len // ps)
        num_pages = max(need, int(need * slack))
        rng = np.random.default_rng(seed)
        src = rng.choice(num_pages, need, replace=False).astype(np.int64)
        dst = rng.choice(num_pages, need, replace=False).astype(np.int64)
        return cls(spec, seq_len, min(prefix, seq_len), num_pages, src, dst)

    def layers(self) -> list[int]:
        return sorted({lid for r in self.spec.regions for lid in r.layer_ids})

    def plans(self) -> dict[str, SpanPlan]:
        """Per region, the span plan of one layer buffer (the same for all its layers)."""
        ps = self.spec.page_size_tokens
        out = {}
        for reg in self.spec.regions:
            first = (page_aligned(self.prefix, ps) if reg.send_from is SendFrom.DECODE_PREFIX
                     else 0)
            out[reg.name] = build_spans(
                reg, token_start=first, token_end=self.seq_len,
                src_pages=self.src_pages[first // ps:], src_page_size=ps, src_first_token=first,
                dst_pages=self.dst_pages[first // ps:], dst_page_size=ps, dst_first_token=first)
        return out

    def total_bytes(self) -> int:
        plans = self.plans()
        return sum(plans[r.name].total_bytes * r.num_layers for r in self.spec.regions)

    def to_msg(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "prefix": self.prefix, "num_pages": self.num_pages,
                "src_pages": self.src_pages.tolist(), "dst_pages": self.dst_pages.tolist()}

    @classmethod
    def from_msg(cls, spec: LayoutSpec, msg: dict[str, Any]) -> PageSet:
        return cls(spec, int(msg["seq_len"]), int(msg["prefix"]), int(msg["num_pages"]),
                   np.asarray(msg["src_pages"], np.int64), np.asarray(msg["dst_pages"], np.int64))


def digest(bufs: Any, spec: LayoutSpec, plans: dict[str, SpanPlan], *, side: str) -> str:
    """xxh3-64 of every moved byte in (layer, region, span) order, read from `side`'s buffers
    ("src" or "dst"); `bufs(region, layer)` returns that layer buffer as a 1-D uint8 array."""
    h = xxhash.xxh3_64()
    for lid in sorted({lid for r in spec.regions for lid in r.layer_ids}):
        for reg in spec.regions_of_layer(lid):
            p = plans[reg.name]
            offs = p.src_offsets if side == "src" else p.dst_offsets
            mv = memoryview(bufs(reg.name, lid))
            for o, n in zip(offs.tolist(), p.nbytes.tolist(), strict=True):
                h.update(mv[o:o + n])
    return h.hexdigest()
