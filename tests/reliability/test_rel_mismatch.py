"""Configuration mismatch: layouts that cannot hand off fail fast on both sides with the diff.

dtype, layer set, plane sizes, layer count, transport and the head size of TP-sharded regions
are each a mismatch: the decode's Hello
is refused, the decode room fails with the diff, and the prefill room is told (Failed message)
and fails with the same diff. "Fast" is asserted as its mechanism: both rooms fail of the
handshake's kind (LAYOUT_MISMATCH: no deadline, no silence ended them) with no byte moved; the
time from the decode's open to both Failed is printed (how soon is the host's business, and
`kvhandoff bench`'s). Different page sizes are NOT a
mismatch: the span builder pairs pages token by token, so 64 vs 32 (and 16 vs 64) succeeds
byte-exact, with a cached decode prefix. Nor are different TP sizes: a decode rank takes its heads
by name from the prefill rank(s); only heads that no prefill rank holds fail (fast, named).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from relkit import WAIT_S, engine_pair, fast_settings, mini_glm

from kvhandoff.errors import FailureKind
from kvhandoff.kv_layout import LayoutSpec, Plane, preset
from kvhandoff.state_machine import KVPoll

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


def assert_refused_fast(handles: list[Any], t0: float,
                        kind: FailureKind = FailureKind.LAYOUT_MISMATCH) -> float:
    """Each room failed fast, by its mechanism rather than a wall-clock bound a loaded host
    can miss: of the check's `kind` (the handshake's unless said; not a deadline, not a lost
    peer: those are the other ways such a room would end), after `t0`, with no byte moved.
    Returns the slowest time to Failed (printed by the tests, not asserted)."""
    worst = 0.0
    for h in handles:
        st = h.stats()
        assert h.failure_kind is kind, (h.failure_kind, h.failure)
        assert st["failure_kind"] == kind.value, st
        assert st["bytes"] == 0, st  # refused before any data moved
        assert st["t_done"] > t0, (st["t_done"], t0)  # CLOCK_MONOTONIC is system-wide
        worst = max(worst, st["t_done"] - t0)
    return worst


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
        for h in (rv, s):
            assert "layout mismatch" in (h.failure or ""), h.failure
            assert field in (h.failure or ""), h.failure
            assert "prefill=" in (h.failure or "") and "decode=" in (h.failure or "")
        took = assert_refused_fast([rv, s], t0)
        assert d.bad_bytes(1, SEQ) > 0  # nothing landed
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
        assert "transport" in (rv.failure or "") and "transport" in (s.failure or "")
        took = assert_refused_fast([rv, s], t0)
        print(f"transport: both sides Failed in {took * 1e3:.1f} ms: {rv.failure}")


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
        for h in (rv, s):
            assert "layout mismatch" in (h.failure or "") and "bytes_per_token" in (
                h.failure or ""), h.failure
        took = assert_refused_fast([rv, s], t0)
        print(f"tp head size: both sides Failed in {took * 1e3:.1f} ms: {rv.failure}")


def test_tp_heads_nobody_holds_fail_fast() -> None:
    """A decode rank (TP 1: heads 0-7) pointed at one prefill rank of TP 2 (heads 0-3 only):
    the missing heads fail the room fast on both sides, naming them."""
    with engine_pair(llama(2, 0), decode_layout=llama(1), num_pages=6) as (p, d):
        s = p.send(1, SEQ)
        t0 = time.monotonic()
        rv = d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
        for h in (rv, s):
            assert "holds planes" in (h.failure or "") and "h4" in (h.failure or ""), h.failure
        # refused by the transfer request's check (the handshake passed: the layouts agree)
        took = assert_refused_fast([rv, s], t0, FailureKind.INVALID_REQUEST)
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
