"""`planning.span_plans` builds one plan per distinct input: regions of the same geometry over
the same pages and tokens (a model's K and V, a draft model's copy of a region) share it, and
every region's plan is exactly what `build_spans` makes for that region alone."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.kv_layout import SpanPlan, build_spans, page_aligned, preset
from kvhandoff.kv_layout.presets import PRESETS
from kvhandoff.protocol.planning import span_plans
from kvhandoff.protocol.rooms import LegPlan
from kvhandoff.settings import Settings
from kvhandoff.state_machine import Role
from kvhandoff.testing.memory import make_side

PAGES = 6


def _ctx(name: str):  # noqa: ANN202 - the session's Context
    lay = preset(name)
    side = make_side("prefill:1", Role.PREFILL, lay, allocate(lay, PAGES),
                     settings=Settings(transport="inproc"), writes=False, generation=1, now=0.0)
    return side.session.ctx


def _alone(lay, plan: LegPlan, reg_name: str, src: np.ndarray, dst: np.ndarray,  # noqa: ANN001
           end: int, planes: list[str] | None) -> SpanPlan:
    reg = lay.region(reg_name)
    first = plan.first_token(reg)
    ps = lay.page_size_tokens
    return build_spans(reg, token_start=first, token_end=end, src_pages=src, src_page_size=ps,
                       src_first_token=page_aligned(first, ps), dst_pages=dst,
                       dst_page_size=ps, dst_first_token=page_aligned(first, ps),
                       dst_region=reg, planes=planes)


def _same(a: SpanPlan, b: SpanPlan) -> bool:
    return (np.array_equal(a.src_offsets, b.src_offsets)
            and np.array_equal(a.dst_offsets, b.dst_offsets)
            and np.array_equal(a.nbytes, b.nbytes)
            and a.descriptors_before == b.descriptors_before)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("differ", ["none", "src", "dst"])
def test_each_region_gets_the_plan_build_spans_makes_for_it(name: str, differ: str) -> None:
    ctx = _ctx(name)
    lay = ctx.layout
    ps = lay.page_size_tokens
    seq, prefix = 3 * ps + ps // 2, ps  # a cached first page, a partly filled last one
    n = PAGES - 1
    # every region on the same pages, or each on its own source (destination) pages
    src = {r.name: np.roll(np.array([4, 1, 3, 0, 2][:n]), i if differ == "src" else 0)
           for i, r in enumerate(lay.regions)}
    dst = {r.name: np.roll(np.array([2, 5, 0, 1, 3][:n]), i if differ == "dst" else 0)
           for i, r in enumerate(lay.regions)}
    plan = LegPlan(seq_len=seq, prefix_len=prefix, page_size=ps)
    plans = span_plans(ctx, plan, src_pages=src, src_ps=ps, dst_pages=dst, dst_ps=ps,
                       src_layout=lay, dst_layout=lay)
    assert set(plans) == {r.name for r in lay.regions}
    for r in lay.regions:
        assert _same(plans[r.name], _alone(lay, plan, r.name, src[r.name], dst[r.name], seq,
                                           None)), r.name
    if differ != "none":  # no two regions move the same pages: nothing may be shared
        assert len({id(p) for p in plans.values()}) == len(plans)


def test_k_and_v_share_one_plan_and_a_head_slice_gets_its_own() -> None:
    ctx = _ctx("llama-3.1-8b")
    lay = ctx.layout
    ps = lay.page_size_tokens
    pages = {r.name: np.array([3, 1]) for r in lay.regions}
    plan = LegPlan(seq_len=2 * ps, page_size=ps)
    plans = span_plans(ctx, plan, src_pages=pages, src_ps=ps, dst_pages=pages, dst_ps=ps,
                       src_layout=lay, dst_layout=lay)
    assert plans["main_k"] is plans["main_v"]
    # the same pages, but each region brings other heads: two plans, each its own
    k, v = (r.name for r in lay.regions)
    plan = LegPlan(seq_len=2 * ps, page_size=ps, planes={k: ["h0", "h1"], v: ["h2"]})
    plans = span_plans(ctx, plan, src_pages=pages, src_ps=ps, dst_pages=pages, dst_ps=ps,
                       src_layout=lay, dst_layout=lay)
    assert plans[k] is not plans[v]
    assert _same(plans[k], _alone(lay, plan, k, pages[k], pages[k], 2 * ps, ["h0", "h1"]))
    assert _same(plans[v], _alone(lay, plan, v, pages[v], pages[v], 2 * ps, ["h2"]))
    # a later chunk: each region from where it stopped, the plans shared again
    plan = LegPlan(seq_len=2 * ps, page_size=ps)
    first = span_plans(ctx, plan, src_pages=pages, src_ps=ps, dst_pages=pages, dst_ps=ps,
                       src_layout=lay, dst_layout=lay, end=ps)
    later = span_plans(ctx, plan, src_pages=pages, src_ps=ps, dst_pages=pages, dst_ps=ps,
                       src_layout=lay, dst_layout=lay)
    assert first["main_k"] is first["main_v"] and later["main_k"] is later["main_v"]
    assert not _same(first["main_k"], later["main_k"])
