"""Shared helpers of the devsum tests: a region's span plans between page tables of different
page sizes, applied to real buffers."""

from __future__ import annotations

import numpy as np

from kvhandoff.kv_layout import SpanPlan, build_spans, preset
from kvhandoff.kv_layout.spec import RegionSpec


def region(name: str) -> RegionSpec:
    return preset("glm-5.3").region(name)


def plan(reg: RegionSpec, tokens: int, src_pages: np.ndarray, src_page: int, dst_page: int,
         rng: np.random.Generator) -> tuple[SpanPlan, np.ndarray]:
    """A plan moving tokens [0, tokens) from `src_pages` to shuffled pages of `dst_page`
    tokens; returns it and the destination page table."""
    n_dst = -(-tokens // dst_page)
    dst_pages = rng.permutation(n_dst * 2)[:n_dst]
    p = build_spans(reg, token_start=0, token_end=tokens, src_pages=src_pages,
                    src_page_size=src_page, dst_pages=dst_pages, dst_page_size=dst_page)
    return p, dst_pages


def pool(reg: RegionSpec, page: int, pages: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, pages * reg.page_nbytes(page), dtype=np.uint8)


def apply(p: SpanPlan, src: np.ndarray, dst: np.ndarray) -> None:
    for so, do, n in p:
        dst[do:do + n] = src[so:so + n]
