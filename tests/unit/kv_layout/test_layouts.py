"""Layouts real engines use (issue 17): packed rows with strides (per side), compressed rows
(index_kpool), per-layer item lengths including 0, draft (MTP) regions — the span builder
against a naive per-row reference over whole memories, for every combination (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import (
    LayoutSpec,
    PackedRow,
    PageRule,
    Plane,
    RegionSpec,
    RuleKind,
    SendFrom,
    build_spans,
    check_page_rules,
    infer_packed_row,
    layout_compat_diff,
    layout_diff,
    layout_hash,
    peer_page_problems,
    preset,
    require_page_rules,
)

# ---- a whole side's memory: one array per buffer key ------------------------------------------


def buffer_sizes(spec: LayoutSpec, num_pages: int) -> dict[tuple[str, int | None], int]:
    """Bytes of every buffer of `spec` with `num_pages` pages: a packed row is one buffer
    (key (row, None)), a per-layer region one per live layer (key (region, layer))."""
    ps = spec.page_size_tokens
    out: dict[tuple[str, int | None], int] = {}
    for reg in spec.regions:
        row = spec.row_of(reg.name)
        if row is not None:
            out[(row.name, None)] = num_pages * reg.page_stride(ps)
        else:
            for lid in reg.live_layer_ids:
                out[(reg.name, lid)] = num_pages * reg.page_nbytes(ps)
    return out


def key_of(spec: LayoutSpec, region: str, layer: int) -> tuple[str, int | None]:
    row = spec.row_of(region)
    return (row.name, None) if row is not None else (region, layer)


def naive(src_spec, dst_spec, region, layer, src_mem, dst_mem, t0, t1, sp, dp):
    """Per row, per plane (by name), through `LayoutSpec.address`: the obviously right copy."""
    s_reg, d_reg = src_spec.region(region), dst_spec.region(region)
    if s_reg.is_empty(layer) or d_reg.is_empty(layer):
        return
    k = s_reg.tokens_per_row
    s_rpp = s_reg.rows_per_page(src_spec.page_size_tokens)
    d_rpp = d_reg.rows_per_page(dst_spec.page_size_tokens)
    s_off = dict(zip([p.name for p in s_reg.planes], s_reg.plane_offsets(), strict=True))
    d_off = dict(zip([p.name for p in d_reg.planes], d_reg.plane_offsets(), strict=True))
    s_key, d_key = key_of(src_spec, region, layer), key_of(dst_spec, region, layer)
    for row in range(t0 // k, -(-t1 // k)):
        _, s_base = src_spec.address(region, layer, int(sp[row // s_rpp]))
        _, d_base = dst_spec.address(region, layer, int(dp[row // d_rpp]))
        for p in s_reg.planes:
            if p.name not in d_off:
                continue
            b = p.bytes_per_token
            so = s_base + s_off[p.name] * s_rpp + (row % s_rpp) * b
            do = d_base + d_off[p.name] * d_rpp + (row % d_rpp) * b
            dst_mem[d_key][do:do + b] = src_mem[s_key][so:so + b]


# ---- layouts ---------------------------------------------------------------------------------

LAYERS = (0, 2, 3, 5)


def regions(k: int, empty: tuple[int, ...], draft: bool, dst_subset: bool) -> list[RegionSpec]:
    out = [
        RegionSpec("main", LAYERS, (Plane("lat", 7),)),
        RegionSpec("idx", (0, 3, 5), (Plane("key", 5), Plane("scale", 2)),
                   send_from=SendFrom.DECODE_PREFIX, tokens_per_row=k, empty_layers=empty),
    ]
    if dst_subset:  # a destination taking only the keys (planes pair by name)
        out[1] = RegionSpec("idx", (0, 3, 5), (Plane("key", 5),),
                            send_from=SendFrom.DECODE_PREFIX, tokens_per_row=k,
                            empty_layers=empty)
    if draft:
        out.append(RegionSpec("draft_idx", (6,), (Plane("key", 5), Plane("scale", 2)),
                              send_from=SendFrom.DECODE_PREFIX, tokens_per_row=k, draft=True))
    return out


ROWS = {
    "per_layer": (),
    "main": (PackedRow("row", ("main",)),),
    "block": (PackedRow("row", ("main", "idx"), pad_bytes=3),),
    "block_rev": (PackedRow("row", ("idx", "main")),),
    "two": (PackedRow("row", ("main",)), PackedRow("row2", ("idx",), pad_bytes=5)),
    "layer_major": (PackedRow("row", ("idx", "main"), pad_bytes=1, layer_major=True),),
}


@st.composite
def pairs(draw):
    k = draw(st.sampled_from([1, 2, 4]))
    empty = tuple(sorted(draw(st.sets(st.sampled_from((0, 3, 5)), max_size=2))))
    draft = draw(st.booleans())
    rows_s = draw(st.sampled_from(sorted(ROWS)))
    rows_d = draw(st.sampled_from(sorted(ROWS)))
    if draft and draw(st.booleans()):
        rows_s = "draft"
    ps = k * draw(st.sampled_from([1, 2, 3, 4, 8]))
    pd = k * draw(st.sampled_from([1, 2, 3, 4, 8])) if draw(st.booleans()) else ps
    sub = draw(st.booleans())

    def spec(page, rows_name, subset):
        rows = ((PackedRow("row", ("main", "draft_idx")),) if rows_name == "draft"
                else ROWS[rows_name])
        return LayoutSpec(page_size_tokens=page, kv_dtype="x",
                          regions=tuple(regions(k, empty, draft, subset)), rows=rows,
                          num_layers=6)

    src, dst = spec(ps, rows_s, False), spec(pd, rows_d, sub)
    prefix = draw(st.integers(0, 40))
    seq = draw(st.integers(prefix, prefix + 90))
    return src, dst, seq, prefix, sub


def table(n: int, pool: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(pool)[:n].astype(np.int64)


@settings(max_examples=300, deadline=None)
@given(pairs(), st.integers(0, 2**32 - 1))
def test_every_combination_matches_the_naive_reference(case, seed):
    src, dst, seq, prefix, sub = case
    rng = np.random.default_rng(seed)
    ps, pd = src.page_size_tokens, dst.page_size_tokens
    pool_s, pool_d = -(-seq // ps) + 3, -(-seq // pd) + 3
    src_mem = {key: rng.integers(0, 256, n, dtype=np.uint8)
               for key, n in buffer_sizes(src, pool_s).items()}
    want = {key: np.zeros(n, dtype=np.uint8) for key, n in buffer_sizes(dst, pool_d).items()}
    got = {key: v.copy() for key, v in want.items()}
    s_all, d_all = table(-(-seq // ps), pool_s, rng), table(-(-seq // pd), pool_d, rng)
    moved = 0
    for reg in dst.regions:
        # suffix-only regions from the decode prefix aligned down to the decode page
        first = (prefix // pd) * pd if reg.send_from is SendFrom.DECODE_PREFIX else 0
        sp = s_all[(first // ps):]
        dp = d_all[(first // pd):]
        for lid in reg.layer_ids:
            naive(src, dst, reg.name, lid, src_mem, want, first, seq, s_all, d_all)
            plan = by_plan_from(src, dst, reg.name, lid, src_mem, got, first, seq, sp, dp,
                                ps, pd)
            moved += plan.total_bytes
            if reg.is_empty(lid):
                assert plan.count == 0
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    # every live layer of each region moved its rows once
    expect = sum(reg.num_live_layers * reg.bytes_per_token
                 * (reg.rows_for(seq - ((prefix // pd) * pd
                                        if reg.send_from is SendFrom.DECODE_PREFIX else 0)))
                 for reg in dst.regions)
    assert moved == expect
    # both sides agree on what they must share, whatever their packing
    diff = layout_compat_diff(src, dst)
    assert diff == [] if not sub else diff == [
        "idx.planes: prefill=['key', 'scale'] decode=['key']"], diff


def by_plan_from(src, dst, region, layer, src_mem, dst_mem, first, seq, sp, dp, ps, pd):
    """`by_plan` with page tables starting at the page holding `first` on each side."""
    plan = build_spans(src.region(region), token_start=first, token_end=seq, src_pages=sp,
                       src_page_size=ps, src_first_token=(first // ps) * ps, dst_pages=dp,
                       dst_page_size=pd, dst_first_token=(first // pd) * pd,
                       dst_region=dst.region(region), layer=layer)
    if plan.count:
        s_base, d_base = src.layer_offset(region, layer), dst.layer_offset(region, layer)
        s_buf, d_buf = src_mem[key_of(src, region, layer)], dst_mem[key_of(dst, region, layer)]
        for s, d, n in plan:
            d_buf[d_base + d:d_base + d + n] = s_buf[s_base + s:s_base + s + n]
    return plan


# ---- fixed cases -----------------------------------------------------------------------------


def test_existing_preset_hashes_are_unchanged():
    """Fields added after version 1 are written only when set: the hashes the fleet already
    registered stay (values computed with the layout code before issue 17) for the same
    layouts: since issue 22 the presets' main KV is suffix-only (another layout, another
    hash); ``whole_sequence=True`` is the earlier layout and keeps its hash."""
    old_glm = "v1:7f659485d2653c8fa2056c198fdd1f1a542271716817bd9120da33238b921b39"
    old_llama = "v1:a9f4545e9fda2127dbbd50302f0bdcc32ca6cafee3fcb443031cd595b3914ad5"
    assert layout_hash(preset("glm-5.3", whole_sequence=True).without_page_rules()) == old_glm
    assert layout_hash(preset("glm-5.3")) == layout_hash(preset("glm-5.3").without_page_rules())
    assert layout_hash(preset("llama-3.1-8b", whole_sequence=True)) == old_llama
    assert layout_hash(preset("glm-5.3")) != old_glm  # send_from differs: named at handshake
    diff = layout_diff(preset("glm-5.3"), preset("glm-5.3", whole_sequence=True))
    assert diff == ["main_kv.send_from: prefill='decode_prefix' decode='start'"]


def test_round_trip_keeps_every_new_field():
    for spec in (preset("glm-5.3-mtp"), preset("glm-5.3-kpool2"), preset("glm-5.3-vllm"),
                 preset("glm-5.3-vllm-mla"),
                 LayoutSpec(64, "x", (RegionSpec("a", (0, 1, 2), (Plane("p", 4),),
                                                 empty_layers=(1,)),))):
        again = LayoutSpec.from_dict(spec.to_dict())
        assert again.to_dict() == spec.to_dict()
        assert layout_hash(again) == layout_hash(spec)
        assert [r.placement for r in again.regions] == [r.placement for r in spec.regions]


def test_packed_and_per_layer_agree_on_the_compat_form_only():
    packed, flat = preset("glm-5.3-vllm"), preset("glm-5.3")
    assert layout_compat_diff(packed, flat) == []
    assert layout_diff(packed, flat) == [
        "rows: prefill=[{'name': 'kv_block', 'regions': ['main_kv', 'indexer_k'], "
        "'pad_bytes': 0}] decode='<absent>'"]
    # a draft region on one side only is a region mismatch (the receiver must know the draft)
    diff = layout_compat_diff(preset("glm-5.3-mtp"), flat)
    assert diff and "draft_indexer_k" in diff[0]


def test_vllm_block_is_78_mla_pages_then_21_indexer_pages():
    spec = preset("glm-5.3-vllm")
    main, idx = spec.region("main_kv"), spec.region("indexer_k")
    assert main.page_stride(64) == idx.page_stride(64) == 3_452_160
    assert spec.bytes_per_page == 3_452_160
    assert spec.address("main_kv", 0, 0) == ("kv_block", 0)
    assert spec.address("main_kv", 77, 2) == ("kv_block", 2 * 3_452_160 + 77 * 41_984)
    first_idx = spec.region("indexer_k").layer_ids[0]
    assert spec.address("indexer_k", first_idx, 1) == ("kv_block", 3_452_160 + 78 * 41_984)
    last_idx = spec.region("indexer_k").layer_ids[-1]
    assert spec.layer_offset("indexer_k", last_idx) == 78 * 41_984 + 20 * 8_448
    # the seed-003 variant: MLA row packed, the indexer passes through with its own stride
    mla = preset("glm-5.3-vllm-mla")
    assert mla.region("main_kv").page_stride(64) == 78 * 41_984 == 3_274_752
    assert mla.region("indexer_k").page_stride(64) == 8_448
    assert mla.address("indexer_k", last_idx, 3) == ("indexer_k", 3 * 8_448)


def test_kpool2_indexer_page_is_64_rows_of_a_128_token_page():
    spec = preset("glm-5.3-kpool2")
    assert spec.page_size_tokens == 128
    idx = spec.region("indexer_k")
    assert idx.tokens_per_row == 2 and idx.rows_per_page(128) == 64
    assert idx.page_nbytes(128) == 64 * 132 == 8_448
    # 130 tokens: 65 rows; from a 128-token prefix: 1 row (a partial row still moves)
    plan = build_spans(idx, token_start=0, token_end=130, src_pages=[4, 9], src_page_size=128,
                       dst_pages=[1, 2], dst_page_size=128)
    assert plan.total_bytes == 65 * 132
    with pytest.raises(ConfigError, match="tokens_per_row"):
        build_spans(idx, token_start=1, token_end=130, src_pages=[4, 9], src_page_size=128,
                    dst_pages=[1, 2], dst_page_size=128)
    flat = idx.__class__(idx.name, idx.layer_ids, idx.planes, idx.send_from)
    with pytest.raises(ConfigError, match="tokens_per_row: source=2 destination=1"):
        build_spans(idx, token_start=0, token_end=10, src_pages=[0], src_page_size=128,
                    dst_pages=[0], dst_page_size=128, dst_region=flat)


def test_layer_major_rows_interleave_each_layers_pages():
    regs = (RegionSpec("k", (0, 1, 2), (Plane("x", 4),)),
            RegionSpec("v", (0, 2), (Plane("x", 2),)))
    spec = LayoutSpec(8, "x", regs, rows=(PackedRow("kv", ("k", "v"), layer_major=True),))
    # block: k0 (32) v0 (16) k1 (32) k2 (32) v2 (16) = 128 B
    assert [spec.layer_offset("k", 0), spec.layer_offset("v", 0), spec.layer_offset("k", 1),
            spec.layer_offset("k", 2), spec.layer_offset("v", 2)] == [0, 32, 48, 80, 112]
    assert spec.address("v", 2, 3) == ("kv", 3 * 128 + 112)
    assert LayoutSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["rows"][0]["layer_major"] is True


def test_zero_row_layers_move_nothing_and_own_no_memory():
    reg = RegionSpec("idx", tuple(range(6)), (Plane("k", 4),), empty_layers=(1, 2, 4))
    spec = LayoutSpec(64, "x", (reg,))
    assert spec.regions_of_layer(1) == () and spec.regions_of_layer(3) == (spec.region("idx"),)
    assert [reg.item_len(lid, 64) for lid in range(6)] == [256, 0, 0, 256, 0, 256]
    plan = build_spans(reg, token_start=0, token_end=64, src_pages=[0], src_page_size=64,
                       dst_pages=[0], dst_page_size=64, layer=2)
    assert plan.count == 0
    with pytest.raises(ConfigError, match="holds 0 rows"):
        spec.address("idx", 2, 0)
    with pytest.raises(ConfigError, match="empty_layers"):
        RegionSpec("idx", (0, 1), (Plane("k", 4),), empty_layers=(7,))


def test_draft_layers_are_kept_apart_from_the_target_model():
    spec = preset("glm-5.3-mtp")
    assert spec.num_layers == 78 and spec.draft_layer_ids == (78,)
    assert [r.name for r in spec.regions_of_layer(78)] == ["draft_main_kv", "draft_indexer_k"]
    assert all(r.draft for r in spec.regions_of_layer(78))
    assert not any(r.draft for r in spec.regions_of_layer(77))
    with pytest.raises(ConfigError, match="collide with the target"):
        LayoutSpec(64, "x", (RegionSpec("m", (0, 1), (Plane("k", 4),)),
                             RegionSpec("d", (1,), (Plane("k", 4),), draft=True)))


def test_bad_rows_are_refused_naming_the_field():
    regs = (RegionSpec("a", (0,), (Plane("k", 4),)), RegionSpec("b", (0,), (Plane("k", 4),)))
    with pytest.raises(ConfigError, match=r"rows\[r\].regions: 'c' is not a region"):
        LayoutSpec(64, "x", regs, rows=(PackedRow("r", ("c",)),))
    with pytest.raises(ConfigError, match="already in row"):
        LayoutSpec(64, "x", regs, rows=(PackedRow("r", ("a",)), PackedRow("s", ("a", "b"))))
    with pytest.raises(ConfigError, match="clashes with a region name"):
        LayoutSpec(64, "x", regs, rows=(PackedRow("a", ("a",)),))
    with pytest.raises(ConfigError, match=r"rows\[0\].pad_bytes: expected int"):
        LayoutSpec.from_dict({**LayoutSpec(64, "x", regs).to_dict(),
                              "rows": [{"name": "r", "regions": ["a"], "pad_bytes": "1"}]})


# ---- kernel page rules -----------------------------------------------------------------------


def test_glm_page_32_breaks_flashmla_and_the_indexer_kernel():
    spec = preset("glm-5.3", page_size_tokens=32)
    assert check_page_rules(spec) == [
        "region 'main_kv': rule FlashMLA: page == 64 rows; got 32 rows (page_size_tokens=32)",
        "region 'indexer_k': rule DSA indexer paged-MQA: page == 64 rows; got 32 rows "
        "(page_size_tokens=32)",
    ]
    with pytest.raises(ConfigError, match=r"^page rules: region 'main_kv': rule FlashMLA"):
        require_page_rules(spec)
    for name in ("glm-5.3", "glm-5.3-mtp", "glm-5.3-kpool2", "glm-5.3-vllm", "glm-5.3-vllm-mla",
                 "deepseek-v3.2"):
        assert check_page_rules(preset(name)) == [], name
        require_page_rules(preset(name))
    # the MTP draft regions carry the same rules
    assert len(check_page_rules(preset("glm-5.3-mtp", page_size_tokens=128))) == 4


def test_kpool2_rules_count_indexer_rows_not_tokens():
    assert check_page_rules(preset("glm-5.3-kpool2", page_size_tokens=256)) == [
        "region 'indexer_k': rule DSA indexer paged-MQA: page == 64 rows; got 128 rows "
        "(page_size_tokens=256, tokens_per_row=2)"]
    assert check_page_rules(preset("glm-5.3-kpool2", page_size_tokens=65)) == [
        "region 'indexer_k': page_size_tokens=65 is not a multiple of tokens_per_row=2 "
        "(index_kpool)"]


def test_layouts_without_rules_take_any_page_and_peers_are_checked_against_mine():
    assert check_page_rules(preset("llama-3.1-8b", page_size_tokens=48)) == []
    assert check_page_rules(preset("glm-5.3", page_size_tokens=32).without_page_rules()) == []
    mine, peer = preset("glm-5.3"), preset("glm-5.3", page_size_tokens=128).without_page_rules()
    assert peer_page_problems(mine, peer) == [
        "peer region 'main_kv': rule FlashMLA: page == 64 rows; got 128 rows "
        "(page_size_tokens=128)",
        "peer region 'indexer_k': rule DSA indexer paged-MQA: page == 64 rows; got 128 rows "
        "(page_size_tokens=128)",
    ]
    assert peer_page_problems(mine.without_page_rules(), peer) == []
    # rules are local: not in the hash, not in the wire form
    assert "page_rules" not in mine.to_dict()
    assert layout_hash(mine) == layout_hash(mine.without_page_rules())
    bad = mine.with_page_rules(PageRule("nope", "K", RuleKind.EQ, 64))
    assert check_page_rules(bad) == [
        "region 'nope': rule K: page == 64 rows names a region the layout does not have "
        "(indexer_k, main_kv)"]
    with pytest.raises(ConfigError, match=r"page_rule\[main_kv\].rows"):
        PageRule("main_kv", "K", RuleKind.MULTIPLE_OF, 0)
    assert check_page_rules(mine.with_page_rules(
        PageRule("main_kv", "pool", RuleKind.MULTIPLE_OF, 32))) == []


def test_infer_packed_row_from_observed_offsets():
    """A connector sees per-layer views into one block-outermost tensor: their offsets from the
    base and the block stride give the row back (order, layer-major or not, pad)."""
    vllm = preset("glm-5.3-vllm")
    flat = vllm.unpacked()
    offsets = {(r.name, lid): vllm.layer_offset(r.name, lid)
               for r in vllm.regions for lid in r.live_layer_ids}
    row = infer_packed_row(flat, "kv_block", ("indexer_k", "main_kv"), offsets=offsets,
                           block_stride=3_452_160 + 64)
    assert row == PackedRow("kv_block", ("main_kv", "indexer_k"), pad_bytes=64)
    regs = (RegionSpec("k", (0, 1, 2), (Plane("x", 4),)), RegionSpec("v", (0, 1, 2),
                                                                      (Plane("x", 4),)))
    spec = LayoutSpec(8, "x", regs)
    inter = {("k", i): 64 * i for i in range(3)} | {("v", i): 64 * i + 32 for i in range(3)}
    assert infer_packed_row(spec, "kv", ("k", "v"), offsets=inter, block_stride=192) == (
        PackedRow("kv", ("k", "v"), 0, layer_major=True))
    inter[("v", 2)] += 1
    with pytest.raises(ConfigError, match=r"match no packing of \['k', 'v'\] \(k layer 1 is at "
                       "64, a region-major row of"):
        infer_packed_row(spec, "kv", ("k", "v"), offsets=inter, block_stride=192)
    with pytest.raises(ConfigError, match="block_stride: 100 is smaller"):
        infer_packed_row(spec, "kv", ("k", "v"), offsets=inter, block_stride=100)
    with pytest.raises(ConfigError, match=r"no offset for \[\('k', 0\)"):
        infer_packed_row(spec, "kv", ("k", "v"), offsets={}, block_stride=192)
