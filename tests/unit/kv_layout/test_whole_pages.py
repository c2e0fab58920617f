"""`RegionSpec.whole_pages`: with one page size on both sides the span builder moves whole pages
(a partly filled last page goes whole); with different page sizes it pairs token by token; the
flag is part of the layout's wire form only when set (older hashes stay)."""

from __future__ import annotations

from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, build_spans, layout_compat_diff


def region(whole: bool) -> RegionSpec:
    return RegionSpec(name="kv", layer_ids=(0,), planes=(Plane("k", 4), Plane("v", 8)),
                      whole_pages=whole)


def test_partial_last_page_moves_whole() -> None:
    # 10 tokens on pages of 4: the third page holds 2 tokens; whole pages move 3 * 4 * 12 B
    plan = build_spans(region(True), token_start=0, token_end=10, src_pages=[5, 1, 2],
                       src_page_size=4, dst_pages=[0, 3, 7], dst_page_size=4)
    page = 4 * 12
    assert list(plan) == [(5 * page, 0, page), (page, 3 * page, page), (2 * page, 7 * page, page)]
    token_granular = build_spans(region(False), token_start=0, token_end=10, src_pages=[5, 1, 2],
                                 src_page_size=4, dst_pages=[0, 3, 7], dst_page_size=4)
    assert token_granular.total_bytes == 10 * 12


def test_suffix_start_rounds_down_to_its_page() -> None:
    plan = build_spans(region(True), token_start=4, token_end=6, src_pages=[0, 1],
                       src_page_size=4, dst_pages=[2, 3], dst_page_size=4)
    assert list(plan) == [(48, 144, 48)]


def test_different_page_sizes_pair_token_by_token() -> None:
    plan = build_spans(region(True), token_start=0, token_end=6, src_pages=[0, 1],
                       src_page_size=4, dst_pages=[0], dst_page_size=8)
    assert plan.total_bytes == 6 * 12  # exactly the tokens: the pages do not line up


def test_wire_form_and_compat() -> None:
    plain = LayoutSpec(page_size_tokens=4, kv_dtype="x", regions=(region(False),))
    whole = LayoutSpec(page_size_tokens=4, kv_dtype="x", regions=(region(True),))
    assert "whole_pages" not in plain.to_dict()["regions"][0]
    assert LayoutSpec.from_dict(whole.to_dict()) == whole
    assert layout_compat_diff(plain, whole) == [
        "kv.whole_pages: prefill='<absent>' decode=True"]
