"""Configuration mismatch: layouts that cannot hand off fail fast on both sides with the diff.

dtype, layer set, plane sizes, layer count, transport and the head size of TP-sharded regions
are each a mismatch: the decode's Hello
is refused, the decode room fails with the diff, and the prefill room is told (Failed message)
and fails with the same diff, both well under a second. Different page sizes are NOT a
mismatch: the span builder pairs pages token by token, so 64 vs 32 (and 16 vs 64) succeeds
byte-exact, with a cached decode prefix. Nor are different TP sizes: a decode rank takes its heads
by name from the prefill rank(s); only heads that no prefill rank holds fail (fast, named).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from relkit import WAIT_S, engine_pair, fast_settings, mini_glm

from kvhandoff.kv_layout import LayoutSpec, Plane, preset
from kvhandoff.state_machine import KVPoll

FAIL_FAST_S = 1.0  # the bound on "fails fast"
SEQ = 48
# A refused layout fails at the Hello, before any lane connects (a refused Hello emits no
# Connect): the shm lane of the matrix repeats the tcp one, so it runs under `long`
REFUSED_AT_HELLO = pytest.mark.parametrize(
    "rel_lane", ["tcp", pytest.param("shm", marks=pytest.mark.long)], indirect=True)


def with_indexer_scale(layout: LayoutSpec, nbytes: int) -> LayoutSpec:
    regions = tuple(
        dataclasses.replace(r, planes=(r.planes[0], Plane("scale", nbytes)))
        if r.name == "indexer_k" else r for r in layout.regions)
    return dataclasses.replace(layout, regions=regions)


MISMATCHES = {
    "dtype": (mini_glm(), dataclasses.replace(mini_glm(), kv_dtype="bfloat16"), "kv_dtype"),
    "layer_set": (mini_glm(), mini_glm(indexer_layer_ids=(1, 4)), "indexer_k.layer_ids"),
    "plane_size": (mini_glm(), with_indexer_scale(mini_glm(), 8),
                   "indexer_k.planes[1].bytes_per_token"),
    "layer_count": (mini_glm(), mini_glm(num_layers=8, indexer_layer_ids=(1, 5)), "num_layers"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
@REFUSED_AT_HELLO
def test_mismatch_fails_fast_on_both_sides_with_the_diff(case: str) -> None:
    pl, dl, field = MISMATCHES[case]
    with engine_pair(pl, decode_layout=dl, num_pages=8) as (p, d):
        s = p.send(1, SEQ)
        t0 = time.monotonic()
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed
        assert s.wait(WAIT_S) is KVPoll.Failed
        took = max(rv.stats()["t_done"], s.stats()["t_done"]) - t0
        for h in (rv, s):
            assert "layout mismatch" in (h.failure or ""), h.failure
            assert field in (h.failure or ""), h.failure
            assert "prefill=" in (h.failure or "") and "decode=" in (h.failure or "")
        assert took < FAIL_FAST_S, f"{case}: both sides failed only after {took:.3f}s"
        print(f"{case}: both sides Failed in {took * 1e3:.1f} ms: {rv.failure}")
        assert p.wait_all_released([1], WAIT_S) and d.wait_all_released([1], WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


# both sides name their transport themselves: the matrix's lane is not used
@pytest.mark.parametrize("rel_lane", ["tcp"], indirect=True)
def test_transport_mismatch_fails_fast() -> None:
    with engine_pair(prefill_settings=fast_settings(transport="tcp"),
                     decode_settings=fast_settings(transport="ucx"), num_pages=8) as (p, d):
        s = p.send(1, SEQ)
        t0 = time.monotonic()
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
        took = max(rv.stats()["t_done"], s.stats()["t_done"]) - t0
        assert "transport" in (rv.failure or "") and "transport" in (s.failure or "")
        assert took < FAIL_FAST_S


@pytest.mark.parametrize(("prefill_ps", "decode_ps"), [(64, 32), (32, 64), (16, 64)])
def test_different_page_sizes_are_supported_byte_exact(prefill_ps: int, decode_ps: int) -> None:
    seq, prefix = 200, 100  # partial pages on both sides, a cached prefix on decode
    with engine_pair(mini_glm(page_size_tokens=prefill_ps),
                     decode_layout=mini_glm(page_size_tokens=decode_ps), num_pages=16) as (p, d):
        s = p.send(1, seq)
        rv = d.recv(1, seq, p.address, prefix=prefix)
        assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
        assert s.wait(WAIT_S) is KVPoll.Success, s.failure
        assert d.bad_bytes(1, seq) == 0
        assert p.wait_all_released([1], WAIT_S) and d.wait_all_released([1], WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


def llama(tp_size: int = 1, tp_rank: int = 0, head_bytes: int | None = None) -> LayoutSpec:
    spec = preset("llama-3.1-8b", tp_size=tp_size, tp_rank=tp_rank)
    if head_bytes is None:
        return spec
    regions = tuple(dataclasses.replace(r, planes=tuple(
        Plane(pl.name, head_bytes) for pl in r.planes)) for r in spec.regions)
    return dataclasses.replace(spec, regions=regions)


@REFUSED_AT_HELLO
def test_tp_head_size_mismatch_fails_fast() -> None:
    """TP ranks of other sizes pair by head name (supported, below); heads of another size
    (head_dim 64 vs 128) cannot pair: fail fast with the diff."""
    with engine_pair(llama(), decode_layout=llama(2, 0, head_bytes=128), num_pages=6) as (p, d):
        s = p.send(1, SEQ)
        t0 = time.monotonic()
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
        took = max(rv.stats()["t_done"], s.stats()["t_done"]) - t0
        for h in (rv, s):
            assert "layout mismatch" in (h.failure or "") and "bytes_per_token" in (
                h.failure or ""), h.failure
        assert took < FAIL_FAST_S
        print(f"tp head size: both sides Failed in {took * 1e3:.1f} ms: {rv.failure}")


def test_tp_heads_nobody_holds_fail_fast() -> None:
    """A decode rank (TP 1: heads 0-7) pointed at one prefill rank of TP 2 (heads 0-3 only):
    the missing heads fail the room fast on both sides, naming them."""
    with engine_pair(llama(2, 0), decode_layout=llama(1), num_pages=6) as (p, d):
        s = p.send(1, SEQ)
        t0 = time.monotonic()
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
        took = max(rv.stats()["t_done"], s.stats()["t_done"]) - t0
        for h in (rv, s):
            assert "holds planes" in (h.failure or "") and "h4" in (h.failure or ""), h.failure
        assert took < FAIL_FAST_S
        print(f"tp missing heads: both sides Failed in {took * 1e3:.1f} ms: {rv.failure}")
        assert p.wait_all_released([1], WAIT_S) and d.wait_all_released([1], WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_heterogeneous_tp_is_supported_byte_exact(tp_rank: int) -> None:
    """Prefill TP 1 (8 heads) to a decode rank of TP 2 (4 heads): that rank's heads land,
    each head's bytes in its own plane (per-plane patterns: a head mix-up shows)."""
    with engine_pair(llama(), decode_layout=llama(2, tp_rank), num_pages=6) as (p, d):
        s = p.send(1, SEQ)
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
        assert d.bad_bytes(1, SEQ) == 0
        assert s.wait(WAIT_S) is KVPoll.Success, s.failure
