"""Token-major pages (`RegionSpec.token_major`: a row holds every plane, as SGLang's MHA pools
keep a token's heads side by side): head slices of such pages move between TP sizes by the
span builder, byte-exact per head; whole rows still coalesce into page runs."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, TPSplit, build_spans

HEAD = 8  # bytes of one head of one token
HEADS = 4
PS = 4  # tokens per page


def _region(heads: range) -> RegionSpec:
    return RegionSpec(name="k", layer_ids=(0,), planes=tuple(Plane(f"h{h}", HEAD) for h in heads),
                      tp_split=TPSplit.HEAD_SHARDED, token_major=True)


def _pool(pages: int, heads: int, seed: int) -> np.ndarray:
    """A token-major pool [pages * PS tokens, heads, HEAD] of random bytes."""
    return np.random.default_rng(seed).integers(0, 256, (pages * PS, heads, HEAD), np.uint8)


def _apply(plan, src: np.ndarray, dst: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    s, d = src.reshape(-1), dst.reshape(-1)
    for so, do, n in plan:
        d[do:do + n] = s[so:so + n]


def test_one_rank_feeds_two_each_its_heads() -> None:
    whole = _region(range(HEADS))
    src = _pool(6, HEADS, 1)
    src_pages, dst_pages = [4, 1, 3], [0, 5, 2]
    for rank in (0, 1):
        mine = range(rank * 2, rank * 2 + 2)
        dst = np.zeros((6 * PS, 2, HEAD), np.uint8)
        plan = build_spans(whole, token_start=0, token_end=10, src_pages=src_pages,
                           src_page_size=PS, dst_pages=dst_pages, dst_page_size=PS,
                           dst_region=_region(mine), planes=[f"h{h}" for h in mine])
        _apply(plan, src, dst)
        for k, (sp, dp) in enumerate(zip(src_pages, dst_pages, strict=True)):
            n = min(PS, 10 - k * PS)
            got = dst[dp * PS:dp * PS + n]
            assert np.array_equal(got, src[sp * PS:sp * PS + n, rank * 2:rank * 2 + 2])
            assert not got[n:].any()
        # the two heads of a token are contiguous on both sides: one piece per token
        assert plan.count == 10


def test_two_ranks_fill_one_each_its_heads() -> None:
    dst_region = _region(range(HEADS))
    dst = np.zeros((6 * PS, HEADS, HEAD), np.uint8)
    srcs = [_pool(6, 2, 10 + r) for r in (0, 1)]
    for rank, src in enumerate(srcs):
        mine = range(rank * 2, rank * 2 + 2)
        plan = build_spans(_region(mine), token_start=0, token_end=2 * PS, src_pages=[3, 0],
                           src_page_size=PS, dst_pages=[1, 4], dst_page_size=PS,
                           dst_region=dst_region)
        _apply(plan, src, dst)
    for sp, dp in ((3, 1), (0, 4)):
        for rank, src in enumerate(srcs):
            assert np.array_equal(dst[dp * PS:(dp + 1) * PS, rank * 2:rank * 2 + 2],
                                  src[sp * PS:(sp + 1) * PS])


def test_whole_rows_move_as_page_runs() -> None:
    r = _region(range(HEADS))
    plan = build_spans(r, token_start=0, token_end=3 * PS, src_pages=[1, 2, 3], src_page_size=PS,
                       dst_pages=[5, 6, 7], dst_page_size=PS)
    assert list(plan) == [(1 * PS * HEADS * HEAD, 5 * PS * HEADS * HEAD, 3 * PS * HEADS * HEAD)]


def test_token_major_is_memory_organisation_not_identity() -> None:
    a = LayoutSpec(page_size_tokens=PS, kv_dtype="bf16", regions=(_region(range(2)),))
    b = LayoutSpec(page_size_tokens=PS, kv_dtype="bf16", regions=(_region(range(2, 4)),))
    assert a.compat_form() == b.compat_form()
    assert LayoutSpec.from_dict(a.to_dict()) == a
    with pytest.raises(ConfigError, match="token_major"):
        RegionSpec(name="x", layer_ids=(0,), planes=(Plane("p", 4),), token_major=True,
                   tokens_per_row=2)
