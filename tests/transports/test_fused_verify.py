"""The writer's verification fused into shm's copy: on the map lane a checksummed write job
hashes each destination piece right after copying it and completes with the source sums and a
landed sum per write (`WriteResult.landed`); the fault seam (`testing.faults.
post_writes_tampered`) flips a byte inside the copy, before its landed hash. Every copy path
(piece by piece from Python, with or without the native helper; both hashes fused in C, every
region of a job in one call) gives the same sums. The oracle is xxh3 of the peer's buffer as
numpy reads it, never the transport's own read-back. Real transports, real lanes (as
test_write_jobs.py)."""

from __future__ import annotations

import ctypes
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from test_conformance import BUF, WAIT_S, stream
from test_write_jobs import Two, WrittenMany

from kvhandoff.buffers.shared import SharedSegment
from kvhandoff.kv_layout import SpanPlan, plan_of
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import PostWrite, WritePart
from kvhandoff.protocol.wire import data_tag
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.settings import Settings
from kvhandoff.testing.faults import Corrupt, FaultyTransport, post_writes_tampered
from kvhandoff.transports import OneSidedTransport, load_transport
from kvhandoff.transports.shm import copy as shm_copy
from kvhandoff.transports.shm import native as shm_native

# a region's pieces, out of order, of odd sizes, one of several of the C loop's 32 KiB steps
PLAN_A = plan_of([4096, 0, 70_000, 300_000], [100, 9000, 20_000, 1_500_000],
                 [3000, 1000, 5000, 200_001])
PLAN_B = plan_of([10, 50_000], [60_000, 0], [40_000, 777])
WRITES = [(1, "kv", "kv", PLAN_A), (2, "kv2", "kv2", PLAN_B)]
HELPERS = ["python", "native-without-libxxhash", "native"]


@pytest.fixture(params=HELPERS)
def helper(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The map lane's copy path: Python only, the native helper without an XXH3 library to
    call (a checksummed job then copies from Python too), or both hashes fused in C (the
    native ones skipped where the helper is not built)."""
    built, _ = shm_native.native()
    if request.param != "python" and built is None:
        pytest.skip("the native copy helper is not built here (make setup builds it)")
    if request.param == "python":
        monkeypatch.setattr(shm_copy, "native", lambda: (None, "python"))
    elif request.param == "native-without-libxxhash":
        plain = shm_native.Native(ctypes.CDLL(str(shm_native._target())), None)
        monkeypatch.setattr(shm_copy, "native", lambda: (plain, "no libxxhash"))
    return str(request.param)


@pytest.fixture(params=["shm", "shm-map"])
def two(request: pytest.FixtureRequest) -> Iterator[Two]:
    t = Two(str(request.param))
    yield t
    t.p.close()


def xxh3(buf: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(stream(buf, offsets, nbytes).tobytes())


def sums(src: np.ndarray, dst: np.ndarray, plan: SpanPlan) -> tuple[int, int]:
    """(the source stream's xxh3, the peer's destination stream's xxh3 as it is now)."""
    return xxh3(src, plan.src_offsets, plan.nbytes), xxh3(dst, plan.dst_offsets, plan.nbytes)


def bufs(t: Two) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(t.p.src, t.p.dst), (t.src2, t.dst2)]


def lane(t: Two) -> str:
    return t.writer.status().lanes[0]


def test_a_map_lane_job_completes_with_the_landed_sums_of_what_the_peer_holds(
        two: Two, helper: str) -> None:
    """Each write's landed sum is the xxh3 of the peer's destination pieces as numpy reads
    them afterwards, and (nothing corrupted) equal to its source sum, on every copy path; the
    cma lane reads nothing back (no landed sums: the decode verifies)."""
    w = WrittenMany()
    two.writer.post_writes("b", WRITES, w, checksum=True)
    r = w.result()
    assert r.error is None
    want = [sums(s, d, plan) for (s, d), (_, _, _, plan) in zip(bufs(two), WRITES, strict=True)]
    assert r.digests == tuple(src for src, _ in want)
    if lane(two) == "shm/cma":
        assert r.landed == ()
        return
    assert r.landed == tuple(dst for _, dst in want) == r.digests


def test_an_in_copy_flip_is_in_the_peers_memory_and_in_the_landed_sum(two: Two,
                                                                        helper: str) -> None:
    """The seam flips write 1's first destination byte inside the copy: the peer holds the
    flipped byte (every other byte is the source's), the source sum is of the true bytes and,
    on the map lane, the landed sum is of what the peer holds, so the two differ."""
    w = WrittenMany()
    assert post_writes_tampered(two.writer, "b", WRITES, w, {1: 0}, checksum=True)
    r = w.result()
    assert r.error is None
    at_src, at_dst = int(PLAN_B.src_offsets[0]), int(PLAN_B.dst_offsets[0])
    assert two.dst2[at_dst] == two.src2[at_src] ^ 0xFF
    two.dst2[at_dst] ^= 0xFF  # put it back: then the rest must be the source's
    assert all(np.array_equal(d[o:o + n], s[i:i + n]) for (s, d), (_, _, _, plan)
               in zip(bufs(two), WRITES, strict=True) for i, o, n in plan)
    two.dst2[at_dst] ^= 0xFF
    (src_a, dst_a), (src_b, dst_b) = (sums(s, d, plan) for (s, d), (_, _, _, plan)
                                      in zip(bufs(two), WRITES, strict=True))
    assert r.digests == (src_a, src_b)
    if lane(two) == "shm/cma":
        assert r.landed == ()
        return
    assert r.landed == (dst_a, dst_b) and dst_a == src_a and dst_b != src_b


def test_only_a_tampered_job_leaves_the_fused_native_path(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A job without a fault runs the native fused copy; the tampered one copies from Python
    and still gives the same source sums."""
    if shm_native.native()[0] is None:
        pytest.skip("the native copy helper is not built here (make setup builds it)")
    native_parts: list[Any] = []
    fused = shm_copy._copy_mapped_native

    def counted(job: Any, *a: Any) -> Any:
        native_parts.append(job)
        return fused(job, *a)

    monkeypatch.setattr(shm_copy, "_copy_mapped_native", counted)
    t = Two("shm-map")
    try:
        plain, tampered = WrittenMany(), WrittenMany()
        t.writer.post_writes("b", WRITES, plain, checksum=True)
        assert plain.wait()[0] is None and len(native_parts) == 1  # a small job: one part
        post_writes_tampered(t.writer, "b", WRITES, tampered, {0: 0}, checksum=True)
        assert tampered.wait()[0] is None and len(native_parts) == 1
        assert tampered.wait()[1] == plain.wait()[1]
        assert tampered.result().landed[0] != plain.wait()[1][0]
    finally:
        t.p.close()


@pytest.mark.parametrize("flip", [False, True])
def test_the_hasher_posts_the_landed_sums_the_job_carried(two: Two, flip: bool) -> None:
    """The driver's completion (`Hasher.write_plan`) of a shm write job: on the map lane
    `Written` carries the copy's landed sums (the peer's bytes read by numpy are the oracle),
    a flipped byte shows in its region's; on the cma lane it carries none (the decode
    verifies). The transport has no second call to read back with."""
    assert not hasattr(two.writer, "landed_digest")
    posted: queue.SimpleQueue[ev.Event] = queue.SimpleQueue()
    h = Hasher(buffers={"kv": two.p.src, "kv2": two.src2}, transport=two.writer, post=posted.put)
    try:
        eff = PostWrite(9, "b", tuple(WritePart(tag, name, plan) for tag, name, _, plan in WRITES),
                        True, "xxh3")
        fused, done = h.write_plan(eff)
        assert fused
        if flip:
            assert post_writes_tampered(two.writer, "b", WRITES, done, {0: 0}, checksum=True)
        else:
            two.writer.post_writes("b", WRITES, done, checksum=True)
        written = posted.get(timeout=WAIT_S)
        assert isinstance(written, ev.Written) and written.error is None
        want = [sums(s, d, plan) for (s, d), (_, _, _, plan) in zip(bufs(two), WRITES,
                                                                    strict=True)]
        assert written.digests == tuple(src for src, _ in want)
        if lane(two) == "shm/cma":
            assert written.landed == ()
        else:
            assert written.landed == tuple(dst for _, dst in want)
            assert (written.landed[0] != written.digests[0]) is flip
            assert written.landed[1] == written.digests[1]
        assert posted.empty()  # one Written per job
    finally:
        h.close()


@pytest.mark.parametrize("flip", [False, True])
def test_a_job_split_across_lanes_carries_the_mapped_writes_landed_sum(flip: bool) -> None:
    """A layer whose regions lie on both host lanes (the peer's main KV in a shared segment,
    its indexer in plain memory) is posted as one job per write and completes once: its
    result carries the mapped write's landed sum (None for the cma one: the decode verifies
    it), the one the copy computed, and `Written` carries it on. The fault wrapper cannot flip
    inside such a job: it flips the mapped region's byte after it landed, and the landed sum
    the writer hands on is of the flipped byte (read again through shm's private
    read-back), so the writer's verification still sees it."""
    settings = Settings(transport="shm", stall_timeout_s=WAIT_S)
    a, b = load_transport("shm", settings), load_transport("shm", settings)
    faulty = FaultyTransport(a, corrupt=[Corrupt(layer=5, region="main_kv")] if flip else [])
    assert isinstance(faulty, OneSidedTransport)
    names = ["main_kv/5", "indexer_k/5"]
    src = {n: np.random.default_rng(i).integers(0, 256, BUF, dtype=np.uint8)
           for i, n in enumerate(names)}
    dst = {"main_kv/5": SharedSegment(BUF).array, "indexer_k/5": np.zeros(BUF, np.uint8)}
    posted: queue.SimpleQueue[ev.Event] = queue.SimpleQueue()
    h = Hasher(buffers=src, transport=faulty, post=posted.put)
    try:
        for n in names:
            faulty.register(n, src[n])
            b.register(n, dst[n])
        faulty.connect("b", b.address)
        b.connect("a", faulty.address)
        for n in names:
            faulty.register_remote("b", n, b.describe(n))
        writes = [(data_tag(1, 5, r, 0), n, n, plan) for r, (n, plan)
                  in enumerate(zip(names, [PLAN_A, PLAN_B], strict=True))]
        eff = PostWrite(9, "b", tuple(WritePart(tag, name, plan)
                                      for tag, name, _, plan in writes), True, "xxh3")
        fused, done = h.write_plan(eff)
        assert fused
        faulty.post_writes("b", writes, done, checksum=True)
        written = posted.get(timeout=WAIT_S)
        assert isinstance(written, ev.Written) and written.error is None
        assert set(a.status().lanes) == {"shm/map", "shm/cma"}
        want = [sums(src[n], dst[n], plan) for _, n, _, plan in writes]
        assert written.digests == tuple(s for s, _ in want)
        assert written.landed == (want[0][1], None)
        assert (written.landed[0] != written.digests[0]) is flip
        assert want[1][0] == want[1][1]  # the cma region landed as it was
        assert len(faulty.log.corrupted) == int(flip)
    finally:
        h.close()
        faulty.close()
        b.close()


@pytest.mark.parametrize("kind", ["shm", "auto"])
def test_the_fault_wrapper_flips_inside_the_copy_directly_or_through_auto(kind: str) -> None:
    """`FaultyTransport` over shm, or over auto whose same-host lane is shm, corrupts a layer's
    region inside the copy job: the peer holds the flipped byte, the source sum is of the true
    bytes and the landed sum is of what the peer holds (so the writer's fused check is the one
    that must catch it); once its `times` are used up the next job lands clean."""
    settings = Settings(transport=kind, stall_timeout_s=WAIT_S)
    a, b = load_transport(kind, settings), load_transport(kind, settings)
    faulty = FaultyTransport(a, corrupt=[Corrupt(layer=5, region="indexer_k")])
    assert isinstance(faulty, OneSidedTransport)
    names = ["main_kv/5", "indexer_k/5"]
    src = {n: SharedSegment(BUF).array for n in names}
    dst = {n: SharedSegment(BUF).array for n in names}
    try:
        for i, n in enumerate(names):
            src[n][:] = np.random.default_rng(i).integers(0, 256, BUF, dtype=np.uint8)
            faulty.register(n, src[n])
            b.register(n, dst[n])
        faulty.connect("b", b.address)
        b.connect("a", faulty.address)
        for n in names:
            faulty.register_remote("b", n, b.describe(n))  # type: ignore[attr-defined]
        writes = [(data_tag(1, 5, r, 0), n, n, plan) for r, (n, plan)
                  in enumerate(zip(names, [PLAN_A, PLAN_B], strict=True))]
        for attempt in range(2):
            w = WrittenMany()
            faulty.post_writes("b", writes, w, checksum=True)
            r = w.result()
            assert r.error is None and "shm/map" in faulty.status().lanes
            want = [sums(src[n], dst[n], plan) for _, n, _, plan in writes]
            assert r.digests == tuple(s for s, _ in want)
            assert r.landed == tuple(d for _, d in want)
            flipped = want[1][0] != want[1][1]
            assert flipped is (attempt == 0) and want[0][0] == want[0][1]
        assert len(faulty.log.corrupted) == 1
        (layer, region, at), = faulty.log.corrupted
        assert (layer, region) == (5, "indexer_k") and at == int(PLAN_B.dst_offsets[0])
    finally:
        faulty.close()
        b.close()


@pytest.mark.parametrize("piece", [64, 1200], ids=["inline", "copy-threads"])
def test_a_job_of_many_regions_gives_each_region_its_own_sums(helper: str, piece: int) -> None:
    """A job of 40 writes (a batch of several layers' regions), some of them empty, whose
    pieces run past the native copy's batch of IOV_MAX pieces inside a region: each write's
    source and landed sums are the xxh3 of its own source and destination streams as numpy
    reads them, on every copy path, for a job copied on the posting thread (64-byte pieces)
    and one copied by the copy threads (1,200-byte pieces)."""
    t = Two("shm-map")
    try:
        rng = np.random.default_rng(3)
        counts = [0 if i % 7 == 3 else int(rng.integers(1, 60)) for i in range(40)]
        counts[5] = shm_copy.IOV_MAX + 300  # one region across a batch boundary
        writes, at = [], 0
        for i, n in enumerate(counts):
            offs = np.arange(n, dtype=np.int64) * piece + at
            order = rng.permutation(n)
            plan = plan_of(offs, offs[order], np.full(n, piece, dtype=np.int64))
            writes.append((data_tag(1, i, 0, 0), "kv" if i % 2 else "kv2",
                           "kv" if i % 2 else "kv2", plan))
            at += n * piece
        assert at <= BUF
        w = WrittenMany()
        t.writer.post_writes("b", writes, w, checksum=True)
        r = w.result()
        assert r.error is None
        pairs = {"kv": (t.p.src, t.p.dst), "kv2": (t.src2, t.dst2)}
        want = [sums(*pairs[name], plan) for _, name, _, plan in writes]
        assert r.digests == tuple(src for src, _ in want)
        assert r.landed == tuple(dst for _, dst in want) == r.digests
    finally:
        t.p.close()


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_a_job_on_the_copy_threads_goes_as_runs_of_whole_regions(parts: int) -> None:
    """A checksummed job for the copy threads is cut into at most one run of regions per
    thread, of about equal bytes: every region with pieces is in exactly one run, in order,
    none is cut (its hash is one stream), and no run starts with a region without pieces."""
    rng = np.random.default_rng(parts)
    counts = [0, 3, 0, 0, 40, 1, 0, 7, 7, 0, 2, 0]
    lens = np.concatenate([rng.integers(1, 5000, size=n) for n in counts]).astype(np.int64)
    bounds = (0, *np.cumsum(counts).tolist())
    job = shm_copy.CopyJob(lens, lens, lens, shm_copy.Target("map", 0, 0, 1, None), True,
                           lambda _j: None, bounds=bounds)
    runs = shm_copy._region_runs(job, parts)
    assert 1 <= len(runs) <= parts
    covered = [r for lo_r, hi_r in ((r[2], r[3]) for r in runs) for r in range(lo_r, hi_r)]
    with_pieces = [i for i, n in enumerate(counts) if n]
    assert [i for i in covered if counts[i]] == with_pieces  # each once, in order
    for lo, hi, rlo, rhi in runs:
        assert (lo, hi) == (bounds[rlo], bounds[rhi]) and counts[rlo] > 0  # whole regions
    sizes = [int(lens[lo:hi].sum()) for lo, hi, _, _ in runs]
    biggest = max(int(lens[bounds[i]:bounds[i + 1]].sum()) for i in with_pieces)
    assert max(sizes) <= job.total / min(parts, len(with_pieces)) + biggest  # about equal
    if parts == 2:  # both threads get a run (a leading region without pieces takes none)
        assert len(runs) == 2
