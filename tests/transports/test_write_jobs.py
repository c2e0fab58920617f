"""Several one-sided writes as one job (`post_writes`: a layer's regions): one completion, a
digest per write, the bytes of every write landed; shm copies them as one copy job, and
`_split_writes` (the transports' private fallback) posts them one by one under their own tags
and still completes once. Real transports, real lanes (as test_one_sided.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from test_conformance import BUF, WAIT_S, Pair, base_kind, buffer, need, stream
from test_one_sided import WRITERS

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import SpanPlan, plan_of
from kvhandoff.transports import OneSidedTransport
from kvhandoff.transports.base import OnWritten, WriteResult, _post_in_groups, _split_writes


class WrittenMany:
    """An OnWritten callback of a job: records every WriteResult it gets."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.results: list[WriteResult] = []

    def __call__(self, result: WriteResult) -> None:
        assert isinstance(result, WriteResult), result
        self.results.append(result)
        self.event.set()

    def result(self) -> WriteResult:
        """The job's one WriteResult, once it came."""
        assert self.event.wait(WAIT_S), "on_done was not called in time"
        assert len(self.results) == 1, f"on_done called {len(self.results)} times"
        return self.results[0]

    def wait(self) -> tuple[BaseException | None, tuple[int | None, ...]]:
        """The job's (error, digests)."""
        r = self.result()
        return r.error, r.digests


class Two:
    """A pair with a second buffer each side ("kv2"), both installed for writes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.p = Pair(kind)
        self.src2, self.dst2 = buffer(kind), buffer(kind)
        self.src2[:] = np.random.default_rng(8).integers(0, 256, BUF, dtype=np.uint8)
        self.p.a.register("kv2", self.src2)
        self.p.b.register("kv2", self.dst2)
        for name in ("kv", "kv2"):
            self.writer.register_remote("b", name, self.p.b.describe(name))  # type: ignore[attr-defined]

    @property
    def writer(self) -> OneSidedTransport:
        assert isinstance(self.p.a, OneSidedTransport)
        return self.p.a


@pytest.fixture(params=WRITERS)
def two(request: pytest.FixtureRequest) -> Iterator[Two]:
    t = Two(need(str(request.param)))
    yield t
    t.p.close()


# pieces of each buffer, out of order and of odd sizes (a region's plan)
PLAN_A = plan_of([4096, 0, 70_000], [100, 9000, 20_000], [3000, 1000, 5000])
PLAN_B = plan_of([10, 50_000], [60_000, 0], [40_000, 777])


def source_sum(src: np.ndarray, plan: SpanPlan) -> int:
    return xxhash.xxh3_64_intdigest(stream(src, plan.src_offsets, plan.nbytes).tobytes())


def landed(src: np.ndarray, dst: np.ndarray, plan: SpanPlan) -> bool:
    return all(np.array_equal(dst[d:d + n], src[s:s + n]) for s, d, n in plan)


def count_copy_jobs(t: Two) -> list[Any]:
    """The copy jobs the shm writer starts from now on (empty list for other transports)."""
    jobs: list[Any] = []
    copier = getattr(t.writer, "_copier", None)
    if copier is not None:
        submit = copier.submit

        def counted(job: Any) -> None:
            jobs.append(job)
            submit(job)

        copier.submit = counted
    return jobs


@pytest.mark.parametrize("checksum", [True, False])
def test_a_write_job_completes_once_with_a_digest_per_write(two: Two, checksum: bool) -> None:
    jobs = count_copy_jobs(two)
    w = WrittenMany()
    two.writer.post_writes("b", [(11, "kv", "kv", PLAN_A), (12, "kv2", "kv2", PLAN_B)], w,
                           checksum=checksum)
    err, digests = w.wait()
    assert err is None
    want = ((source_sum(two.p.src, PLAN_A), source_sum(two.src2, PLAN_B)) if checksum
            else (None, None))
    assert digests == want
    assert landed(two.p.src, two.p.dst, PLAN_A) and landed(two.src2, two.dst2, PLAN_B)
    if base_kind(two.kind) == "shm":  # both writes' pieces in ONE copy job
        assert len(jobs) == 1 and jobs[0].bounds == (0, len(PLAN_A), len(PLAN_A) + len(PLAN_B))


def test_a_write_job_with_an_empty_region_gives_that_regions_empty_sum(two: Two) -> None:
    w = WrittenMany()
    empty = plan_of([], [], [])
    two.writer.post_writes("b", [(11, "kv", "kv", empty), (12, "kv2", "kv2", PLAN_B)], w,
                           checksum=True)
    assert w.wait() == (None, (xxhash.xxh3_64_intdigest(b""), source_sum(two.src2, PLAN_B)))


def test__split_writes_posts_each_write_under_its_tag_and_completes_once(two: Two) -> None:
    tags: list[int] = []
    post = two.writer.post_writes

    def recorded(peer: str, writes: Any, *args: Any, **kw: Any) -> None:
        tags.extend(w[0] for w in writes)
        assert len(writes) == 1  # a job of its own
        post(peer, writes, *args, **kw)

    two.writer.post_writes = recorded  # type: ignore[method-assign]
    w = WrittenMany()
    _split_writes(two.writer, "b", [(11, "kv", "kv", PLAN_A), (12, "kv2", "kv2", PLAN_B)], w,
                  checksum=True)
    assert w.wait() == (None, (source_sum(two.p.src, PLAN_A), source_sum(two.src2, PLAN_B)))
    assert tags == [11, 12]
    assert landed(two.p.src, two.p.dst, PLAN_A) and landed(two.src2, two.dst2, PLAN_B)


def test__split_writes_refusal_of_a_later_write_ends_the_job_once_with_it(two: Two) -> None:
    """The first write was posted: the job waits for it, then fails naming the refusal."""
    w = WrittenMany()
    _split_writes(two.writer, "b", [(11, "kv", "kv", PLAN_A), (12, "kv2", "nope", PLAN_B)], w,
                  checksum=True)
    err, digests = w.wait()
    assert isinstance(err, TransportError) and "nope" in str(err) and digests == ()
    assert landed(two.p.src, two.p.dst, PLAN_A)  # it completed before the job did
    with pytest.raises(TransportError, match="nope"):  # nothing posted: refused at once
        _split_writes(two.writer, "b", [(13, "kv2", "nope", PLAN_B)], WrittenMany())


def test_a_write_job_is_refused_naming_the_bad_write(two: Two) -> None:
    """shm and NIXL check every write before they post the job: a bad one, first or later,
    is refused at once and nothing of the job is pending."""
    for bad in ([(11, "nope", "kv", PLAN_A), (12, "kv2", "kv2", PLAN_B)],
                [(11, "kv", "kv", PLAN_A), (12, "nope", "kv2", PLAN_B)]):
        with pytest.raises(TransportError, match="nope"):
            two.writer.post_writes("b", bad, WrittenMany())
    with pytest.raises(TransportError, match="at least one"):
        two.writer.post_writes("b", [], WrittenMany())
    w = WrittenMany()  # its tag is free
    two.writer.post_writes("b", [(11, "kv", "kv", PLAN_A)], w)
    assert w.wait() == (None, (None,))


def test_a_job_posted_in_groups_completes_once_with_its_results_in_write_order() -> None:
    """`_post_in_groups` (no transport: the groups complete here, out of order): the digests
    come back in write order; the landed sums each group's result carried, None for the
    writes of a group that read nothing back, () when no group did; the first error wins and
    the job has no digests. `WriteResult.writes` hands a caller its slice of a job's
    result."""
    pending: dict[int, OnWritten] = {}

    def post(idx: Any, done: OnWritten) -> None:
        pending[idx[0]] = done

    for with_landed in (True, False):
        w = WrittenMany()
        _post_in_groups(post, [[0, 2], [1]], w)
        pending[1](WriteResult(None, (11,), (111,) if with_landed else ()))
        assert not w.event.is_set()  # one group of two still out
        pending[0](WriteResult(None, (10, 12), (110, 112)))
        r = w.result()
        assert r == WriteResult(None, (10, 11, 12), (110, 111 if with_landed else None, 112))
        assert r.writes(1, 3) == WriteResult(None, (11, 12), (111 if with_landed else None, 112))
    w = WrittenMany()  # no group read anything back: no landed sums at all
    _post_in_groups(post, [[0], [1]], w)
    pending[0](WriteResult(None, (10,)))
    pending[1](WriteResult(None, (11,)))
    assert w.result() == WriteResult(None, (10, 11))
    w = WrittenMany()
    _post_in_groups(post, [[0], [1]], w)
    pending[0](WriteResult(None, (10,), (110,)))
    failed = TransportError("peer gone")
    pending[1](WriteResult(failed))
    assert w.result() == WriteResult(failed) and w.result().writes(0, 1) == WriteResult(failed)
