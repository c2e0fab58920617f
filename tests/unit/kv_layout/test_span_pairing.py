"""pair_spans / cut_plan / plan_of: the one place two independently cut span lists are paired,
and the cut of a plan at a transport's chunk grid, against a naive byte-by-byte reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import SpanPlan, cut_plan, pair_spans, plan_of


def _spans(draw: st.DrawFn, total: int) -> tuple[list[int], list[int]]:
    """`total` bytes cut at random places (empty spans too), laid out in a random order with
    small gaps (so neighbours are sometimes contiguous)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=6)))
    bounds = [0, *cuts, total]
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    order = draw(st.permutations(range(len(sizes))))
    gaps = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    offsets = [0] * len(sizes)
    pos = 0
    for i, gap in zip(order, gaps, strict=True):
        pos += gap
        offsets[i] = pos
        pos += sizes[i]
    return offsets, sizes


@st.composite
def two_cuttings(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], list[int]]:
    total = draw(st.integers(0, 64))
    return (*_spans(draw, total), *_spans(draw, total))


def _byte_map(off: list[int], nb: list[int]) -> list[int]:
    """Stream position -> buffer offset, the naive way."""
    return [o + k for o, n in zip(off, nb, strict=True) for k in range(n)]


def _plan_map(plan: SpanPlan) -> list[tuple[int, int]]:
    return [(s + k, d + k) for s, d, n in plan for k in range(n)]


@settings(max_examples=100, deadline=None)
@given(two_cuttings())
def test_pairing_moves_stream_byte_i_to_stream_byte_i(c: tuple[list[int], ...]) -> None:
    so, sn, do, dn = c
    plan = pair_spans(so, sn, do, dn)
    want = list(zip(_byte_map(so, sn), _byte_map(do, dn), strict=True))
    assert _plan_map(plan) == want  # in stream order, every byte once
    assert (plan.nbytes > 0).all()
    # maximal: no two neighbouring pieces are contiguous on both sides
    s, d, n = plan.src_offsets, plan.dst_offsets, plan.nbytes
    assert not ((s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])).any()


@settings(max_examples=100, deadline=None)
@given(two_cuttings(), st.integers(1, 20))
def test_cut_plan_splits_at_the_grid_and_keeps_the_bytes(c: tuple[list[int], ...],
                                                        step: int) -> None:
    plan = pair_spans(*c)
    cut, grid = cut_plan(plan, step)
    assert _plan_map(cut) == _plan_map(plan)
    pos = np.cumsum(cut.nbytes) - cut.nbytes  # stream position of each piece
    assert (grid == pos // step).all()
    assert ((pos + cut.nbytes - 1) // step == grid).all()  # no piece crosses a grid line


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="source carries 8 bytes, the destination 9"):
        pair_spans([0], [8], [0], [9])
    with pytest.raises(ConfigError, match=r"pair_spans \(dst\): 2 offsets but 1 lengths"):
        pair_spans([0], [8], [0, 4], [8])
    with pytest.raises(ConfigError, match=r"pair_spans \(src\): offsets and lengths must be"):
        pair_spans([-1], [8], [0], [8])
    with pytest.raises(ConfigError, match="step_bytes must be > 0"):
        cut_plan(SpanPlan.empty(), 0)
    with pytest.raises(ConfigError, match="equal length, got 1, 2 and 1"):
        plan_of([0], [0, 1], [1])
    assert pair_spans([], [], [], []).count == 0
    p = plan_of([5], [7], [3])
    assert list(p) == [(5, 7, 3)] and p.src_offsets.dtype == np.int64
