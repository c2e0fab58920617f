"""The span builder against a naive per-token reference (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import Plane, RegionSpec, build_spans, preset

PAGE_SIZES = [1, 2, 3, 4, 8, 16, 32, 64, 128]


def naive_copy(region, dst_region, src_buf, dst_buf, t0, t1, sp, ps, dp, pd, sfirst, dfirst):
    """Per token, per plane (paired by name): the obviously correct copy."""
    s_off = dict(zip([p.name for p in region.planes], region.plane_offsets(), strict=True))
    d_off = dict(zip([p.name for p in dst_region.planes], dst_region.plane_offsets(), strict=True))
    d_names = {p.name for p in dst_region.planes}
    for t in range(t0, t1):
        spage, stok = sp[(t - sfirst) // ps], (t - sfirst) % ps
        dpage, dtok = dp[(t - dfirst) // pd], (t - dfirst) % pd
        for p in region.planes:
            if p.name not in d_names:
                continue
            b = p.bytes_per_token
            so = spage * region.page_nbytes(ps) + s_off[p.name] * ps + stok * b
            do = dpage * dst_region.page_nbytes(pd) + d_off[p.name] * pd + dtok * b
            dst_buf[do:do + b] = src_buf[so:so + b]


def apply_plan(plan, src_buf, dst_buf):
    for s, d, n in plan:
        dst_buf[d:d + n] = src_buf[s:s + n]


def assert_maximal(plan):
    """No two spans of the plan could be merged (contiguous on both sides)."""
    ends = {(s + n, d + n) for s, d, n in plan}
    starts = {(s, d) for s, d, _ in plan}
    assert not (ends & starts), "two spans are contiguous on both sides but were not merged"


@st.composite
def cases(draw):
    nplanes = draw(st.integers(1, 3))
    planes = tuple(Plane(f"p{i}", draw(st.integers(1, 9))) for i in range(nplanes))
    region = RegionSpec(name="r", layer_ids=(0,), planes=planes)
    ps = draw(st.sampled_from(PAGE_SIZES))
    pd = draw(st.sampled_from(PAGE_SIZES)) if draw(st.booleans()) else ps
    sfirst = ps * draw(st.integers(0, 2))
    dfirst = pd * draw(st.integers(0, 2))
    lo = max(sfirst, dfirst)
    t0 = draw(st.integers(lo, lo + 70))
    t1 = draw(st.integers(t0, t0 + 300))
    n_sp = -(-(t1 - sfirst) // ps)
    n_dp = -(-(t1 - dfirst) // pd)
    pool_s = n_sp + draw(st.integers(0, 6))
    pool_d = n_dp + draw(st.integers(0, 6))
    order = draw(st.sampled_from(["seq", "perm", "runs"]))

    def pages(n, pool):
        if order == "seq":
            return np.arange(n)
        perm = np.array(draw(st.permutations(list(range(pool)))))[:n]
        if order == "runs":  # mostly consecutive with a few breaks
            perm = np.sort(perm)
        return perm

    sub = None
    if nplanes > 1 and draw(st.booleans()):  # destination takes a subset of the planes
        keep = draw(st.sets(st.integers(0, nplanes - 1), min_size=1, max_size=nplanes))
        sub = RegionSpec(name="r", layer_ids=(0,), planes=tuple(planes[i] for i in sorted(keep)))
    return region, sub, t0, t1, pages(n_sp, pool_s), ps, pages(n_dp, pool_d), pd, sfirst, dfirst


@settings(max_examples=400, deadline=None)
@given(cases(), st.integers(0, 2**32 - 1))
def test_build_spans_matches_naive_reference(case, seed):
    region, sub, t0, t1, sp, ps, dp, pd, sfirst, dfirst = case
    dst_region = sub or region
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=(int(sp.max(initial=0)) + 1) * region.page_nbytes(ps),
                       dtype=np.uint8)
    dsize = (int(dp.max(initial=0)) + 1) * dst_region.page_nbytes(pd)
    want = np.zeros(dsize, dtype=np.uint8)
    got = np.zeros(dsize, dtype=np.uint8)
    naive_copy(region, dst_region, src, want, t0, t1, sp, ps, dp, pd, sfirst, dfirst)
    plan = build_spans(region, token_start=t0, token_end=t1, src_pages=sp, src_page_size=ps,
                       dst_pages=dp, dst_page_size=pd, src_first_token=sfirst,
                       dst_first_token=dfirst, dst_region=sub)
    apply_plan(plan, src, got)
    assert np.array_equal(got, want)
    assert plan.total_bytes == (t1 - t0) * dst_region.bytes_per_token
    assert plan.count <= plan.descriptors_before
    assert_maximal(plan)
    # deterministic: the other side computes the very same plan
    again = build_spans(region, token_start=t0, token_end=t1, src_pages=sp.copy(),
                        src_page_size=ps, dst_pages=dp.copy(), dst_page_size=pd,
                        src_first_token=sfirst, dst_first_token=dfirst, dst_region=sub)
    assert again == plan


def test_consecutive_equal_pages_collapse_to_one_span():
    spec = preset("glm-5.3")
    idx = spec.region("indexer_k")
    plan = build_spans(idx, token_start=0, token_end=64 * 10, src_pages=np.arange(10) + 5,
                       src_page_size=64, dst_pages=np.arange(10) + 100, dst_page_size=64)
    assert plan.count == 1
    assert list(plan) == [(5 * 8448, 100 * 8448, 10 * 8448)]
    assert plan.descriptors_before == 10  # one whole-page descriptor per page


def test_partial_last_page_goes_per_plane():
    idx = preset("glm-5.3").region("indexer_k")
    plan = build_spans(idx, token_start=0, token_end=64 + 10, src_pages=[0, 1],
                       src_page_size=64, dst_pages=[0, 1], dst_page_size=64)
    # page 0 whole + page 1's first 10 keys merge into one span; page 1's 10 scales are another
    assert list(plan) == [(0, 0, 8448 + 10 * 128), (8448 + 64 * 128, 8448 + 64 * 128, 40)]


def test_different_page_sizes_token_granular():
    main = preset("glm-5.3").region("main_kv")
    plan = build_spans(main, token_start=0, token_end=128, src_pages=[3, 7], src_page_size=64,
                       dst_pages=[0, 1, 9, 4], dst_page_size=32)
    # dst pages 0,1 are consecutive: the first src page lands as one span
    assert list(plan) == [
        (3 * 41984, 0, 41984),
        (7 * 41984, 9 * 20992, 20992),
        (7 * 41984 + 20992, 4 * 20992, 20992),
    ]


def test_bad_inputs_name_the_field():
    main = preset("glm-5.3").region("main_kv")
    with pytest.raises(ConfigError, match="dst_pages"):
        build_spans(main, token_start=0, token_end=200, src_pages=[0, 1, 2, 3],
                    src_page_size=64, dst_pages=[0], dst_page_size=64)
    with pytest.raises(ConfigError, match="page_size"):
        build_spans(main, token_start=0, token_end=1, src_pages=[0], src_page_size=0,
                    dst_pages=[0], dst_page_size=64)
    with pytest.raises(ConfigError, match="src_first_token"):
        build_spans(main, token_start=64, token_end=65, src_pages=[0], src_page_size=64,
                    dst_pages=[0, 1], dst_page_size=64, src_first_token=3)


def test_empty_range_is_empty_plan():
    main = preset("glm-5.3").region("main_kv")
    plan = build_spans(main, token_start=5, token_end=5, src_pages=[0], src_page_size=64,
                       dst_pages=[0], dst_page_size=64)
    assert plan.count == 0 and plan.total_bytes == 0
