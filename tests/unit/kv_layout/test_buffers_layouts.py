"""`transfer.buffers` with the layouts of issue 17: packed rows are one buffer whose per-layer
views start at the layer's offset in the block, 0-row layers own nothing. Packed <-> per-layer
moves byte-exact through the very calls an agent makes (views by (region, layer), one span plan
per region)."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.buffers.bufferset import BufferSet
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom, build_spans, preset


def numpy_buffers(spec: LayoutSpec, pages: int, rng: np.random.Generator | None = None):
    ps = spec.page_size_tokens

    def buf(n):
        return (rng.integers(0, 256, n, dtype=np.uint8) if rng is not None
                else np.zeros(n, dtype=np.uint8))

    out = {row.name: buf(spec.region(row.regions[0]).page_stride(ps) * pages)
           for row in spec.rows}
    for reg in spec.regions:
        if reg.placement is None:
            out[reg.name] = {lid: buf(0 if reg.is_empty(lid) else reg.page_nbytes(ps) * pages)
                             for lid in reg.layer_ids}
    return out


def test_packed_views_start_at_each_layers_offset_in_the_block():
    spec = preset("glm-5.3-vllm")
    raw = numpy_buffers(spec, 3)
    bs = BufferSet(spec, raw)
    row = raw["kv_block"]
    assert bs.num_pages("main_kv") == bs.num_pages("indexer_k") == 3
    assert row.shape[0] == 3 * 3_452_160
    v = bs.array("indexer_k", 77)
    v[2 * 3_452_160] = 9  # page 2 of indexer layer 77 through its view
    key, off = spec.address("indexer_k", 77, 2)
    assert key == "kv_block" and row[off] == 9 and np.count_nonzero(row) == 1
    assert np.shares_memory(bs.array("main_kv", 0), row)
    names = [n for n, _ in bs.views()]
    assert len(names) == 78 + 21 and names[0] == "main_kv/0"
    with pytest.raises(ConfigError, match=r"buffers\[kv_block\]: 100 bytes is not a whole "
                       "number of 3452160-byte blocks"):
        BufferSet(spec, {"kv_block": np.zeros(100, dtype=np.uint8)})
    with pytest.raises(ConfigError, match="packed row 'kv_block'"):
        BufferSet(spec, {})
    with pytest.raises(ConfigError, match=r"region 'main_kv' lives in packed row 'kv_block'"):
        BufferSet(spec, {**raw, "main_kv": {}})


def test_zero_row_placeholders_own_no_memory_and_get_no_view():
    reg = RegionSpec("idx", tuple(range(6)), (Plane("k", 4), Plane("s", 1)),
                     empty_layers=(1, 2, 4))
    spec = LayoutSpec(64, "x", (reg,))
    raw = numpy_buffers(spec, 5)
    bs = BufferSet(spec, raw)
    assert bs.num_pages("idx") == 5
    assert [n for n, _ in bs.views()] == ["idx/0", "idx/3", "idx/5"]
    assert [(d.layer, d.nbytes) for d in bs.extents()] == [(0, 1600), (3, 1600), (5, 1600)]
    with pytest.raises(ConfigError, match="no live layer 2"):
        bs.array("idx", 2)
    raw["idx"][2] = np.zeros(320, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"buffers\[idx\]\[2\]: layer 2 holds 0 rows"):
        BufferSet(spec, raw)
    del raw["idx"][2]
    BufferSet(spec, raw)  # an absent placeholder is fine too


def _handoff(src: LayoutSpec, dst: LayoutSpec, seq: int, prefix: int, seed: int):
    """Moves one request with the agent's calls: per (region, live layer) of the destination,
    the region's one plan over each side's (region, layer) view; every row is then checked
    against `LayoutSpec.address` on both sides. Returns the bytes moved."""
    rng = np.random.default_rng(seed)
    ps, pd = src.page_size_tokens, dst.page_size_tokens
    npages = -(-seq // min(ps, pd)) + 2
    s_set = BufferSet(src, numpy_buffers(src, npages, rng))
    d_set = BufferSet(dst, numpy_buffers(dst, npages))
    sp = rng.permutation(npages)[:-(-seq // ps)]
    dp = rng.permutation(npages)[:-(-seq // pd)]
    held = (prefix // pd) * pd
    moved = 0
    for reg in dst.regions:
        first = held if reg.send_from is SendFrom.DECODE_PREFIX else 0
        plan = build_spans(src.region(reg.name), token_start=first, token_end=seq,
                           src_pages=sp[first // ps:], src_page_size=ps,
                           src_first_token=(first // ps) * ps, dst_pages=dp[first // pd:],
                           dst_page_size=pd, dst_first_token=(first // pd) * pd,
                           dst_region=reg)
        for lid in reg.live_layer_ids:
            sv, dv = s_set.array(reg.name, lid), d_set.array(reg.name, lid)
            for s, d, n in plan:
                dv[d:d + n] = sv[s:s + n]
            moved += plan.total_bytes
        # reference: every row of every live layer, through LayoutSpec.address on both sides
        k = reg.tokens_per_row
        for lid in reg.live_layer_ids:
            s_reg, s_rows = src.region(reg.name), src.region(reg.name).rows_per_page(ps)
            d_rows = reg.rows_per_page(pd)
            for row in range(first // k, -(-seq // k)):
                skey, soff = src.address(reg.name, lid, int(sp[row // s_rows]))
                dkey, doff = dst.address(reg.name, lid, int(dp[row // d_rows]))
                sbuf = (s_set.row(skey) if src.row_of(reg.name) else
                        s_set.array(reg.name, lid))
                dbuf = (d_set.row(dkey) if dst.row_of(reg.name) else
                        d_set.array(reg.name, lid))
                for pl, po in zip(s_reg.planes, s_reg.plane_offsets(), strict=True):
                    b = pl.bytes_per_token
                    so = soff + po * s_rows + (row % s_rows) * b
                    do = doff + po * d_rows + (row % d_rows) * b
                    assert np.array_equal(dbuf[do:do + b], sbuf[so:so + b]), (reg.name, lid, row)
    return moved


@pytest.mark.parametrize(("src_name", "dst_name"), [
    ("glm-5.3-vllm", "glm-5.3"),        # packed block -> per layer
    ("glm-5.3", "glm-5.3-vllm"),        # per layer -> packed block
    ("glm-5.3-vllm-mla", "glm-5.3-vllm"),  # MLA row + pass-through indexer -> block
])
def test_packed_and_per_layer_move_byte_exact_both_ways(src_name, dst_name):
    src = preset(src_name, indexer_layers=3)
    dst = preset(dst_name, indexer_layers=3)
    moved = _handoff(src, dst, seq=150, prefix=70, seed=3)
    assert moved == 78 * (150 - 64) * 656 + 3 * (150 - 64) * 132  # both from the prefix


def test_kpool2_zero_row_and_draft_layers_move_byte_exact():
    idx = RegionSpec("indexer_k", tuple(range(8)), (Plane("key", 128), Plane("scale", 4)),
                     send_from=SendFrom.DECODE_PREFIX, tokens_per_row=2,
                     empty_layers=(1, 2, 3, 5, 6))
    regions = (RegionSpec("main_kv", tuple(range(8)), (Plane("latent", 656),)), idx,
               RegionSpec("draft_indexer_k", (8,), idx.planes, send_from=SendFrom.DECODE_PREFIX,
                          tokens_per_row=2, draft=True))
    spec = LayoutSpec(128, "fp8_ds_mla", regions, num_layers=8)
    moved = _handoff(spec, spec, seq=301, prefix=200, seed=5)
    rows = -(-(301 - 128) // 2)
    assert moved == 8 * 301 * 656 + 3 * rows * 132 + rows * 132
