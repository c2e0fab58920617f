"""What a `SpanPlan` keeps of itself for the transports (`bounds`, `nonempty`, `digest`),
against a naive reference: computed once per plan, equal for two plans built alike."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.kv_layout import build_spans, preset
from kvhandoff.kv_layout.spans import SpanPlan

pieces = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20),
                            st.integers(0, 4096)), max_size=40)


def plan_of(items: list[tuple[int, int, int]]) -> SpanPlan:
    arr = np.array(items, dtype=np.int64).reshape(-1, 3)
    return SpanPlan(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), len(items))


@settings(max_examples=200, deadline=None)
@given(pieces)
def test_bounds_and_nonempty_match_a_naive_reference(items: list[tuple[int, int, int]]) -> None:
    plan = plan_of(items)
    b = plan.bounds()
    assert b.well_formed
    assert b.src_end == max((s + n for s, _, n in items), default=0)
    assert b.dst_end == max((d + n for _, d, n in items), default=0)
    assert plan.bounds() is b  # once per plan
    kept = plan.nonempty()
    assert list(kept) == [x for x in items if x[2] > 0]
    assert plan.nonempty() is kept
    assert (kept is plan) == all(n > 0 for _, _, n in items)
    assert plan.total_bytes == sum(n for _, _, n in items)


@settings(max_examples=200, deadline=None)
@given(pieces, st.integers(0, 39), st.integers(0, 2))
def test_the_digest_tells_plans_apart(items: list[tuple[int, int, int]], i: int,
                                      field: int) -> None:
    plan = plan_of(items)
    assert plan_of(list(items)).digest() == plan.digest()
    if not items:
        return
    other = [list(x) for x in items]
    other[i % len(items)][field] += 1
    assert plan_of([(a, b, c) for a, b, c in other]).digest() != plan.digest()


def test_a_negative_item_is_not_well_formed() -> None:
    plan = SpanPlan(np.array([0, -8]), np.array([0, 0]), np.array([4, 4]), 2)
    assert not plan.bounds().well_formed


def test_two_sides_building_the_same_plan_agree_on_its_digest() -> None:
    idx = preset("glm-5.3").region("indexer_k")

    def build(dst_first_page: int) -> SpanPlan:
        return build_spans(idx, token_start=0, token_end=64 * 5, src_page_size=64,
                           dst_page_size=64, src_pages=np.array([4, 1, 2, 9, 3]),
                           dst_pages=np.arange(5) + dst_first_page)

    assert build(7).digest() == build(7).digest() != build(8).digest()
