"""The shm copy pool runs a small job (a short prompt's layer) on the submitting thread and a
large one on its copy threads; both end exactly once with the same digests."""

from __future__ import annotations

import threading

import numpy as np
import xxhash

from kvhandoff.transports.shm.copy import INLINE_MAX, CopyJob, CopyPool, Target


def _job(nbytes: int, ended: list[tuple[str, CopyJob]],
         on_end: threading.Event | None = None) -> tuple[CopyJob, np.ndarray, np.ndarray]:
    src = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    half = nbytes // 2  # two regions of one piece each, as a layer of K and V
    s0, d0 = int(src.ctypes.data), int(dst.ctypes.data)
    target = Target("map", 0, d0, nbytes, None)
    job = CopyJob(np.array([s0, s0 + half], np.int64), np.array([d0, d0 + half], np.int64),
                  np.array([half, nbytes - half], np.int64), target, True,
                  lambda j: (ended.append((threading.current_thread().name, j)),
                             on_end is not None and on_end.set()), bounds=(0, 1, 2))
    return job, src, dst


def test_small_job_runs_and_ends_on_the_submitting_thread() -> None:
    pool = CopyPool(2, "kvh-test-copy")
    try:
        ended: list[tuple[str, CopyJob]] = []
        job, src, dst = _job(INLINE_MAX, ended)
        pool.submit(job)
        assert [name for name, _ in ended] == [threading.current_thread().name]
        assert job.error is None and bytes(dst) == bytes(src)
        half = INLINE_MAX // 2
        assert job.digests == [xxhash.xxh3_64_intdigest(bytes(src[:half])),
                               xxhash.xxh3_64_intdigest(bytes(src[half:]))]
    finally:
        pool.stop()


def test_large_job_runs_on_the_copy_threads() -> None:
    pool = CopyPool(2, "kvh-test-copy")
    try:
        ended: list[tuple[str, CopyJob]] = []
        called = threading.Event()
        job, src, dst = _job(INLINE_MAX + 4096, ended, called)
        pool.submit(job)
        assert called.wait(30)
        assert len(ended) == 1 and ended[0][0].startswith("kvh-test-copy-")
        assert job.error is None and bytes(dst) == bytes(src)
        half = (INLINE_MAX + 4096) // 2
        assert job.digests[1] == xxhash.xxh3_64_intdigest(bytes(src[half:]))
    finally:
        pool.stop()


def test_ended_event_is_set_whether_asked_for_before_or_after_the_end() -> None:
    pool = CopyPool(2, "kvh-test-copy")
    try:
        small, _, _ = _job(4096, [])
        pool.submit(small)  # ended inline, before anyone asked for its event
        assert small.ended_event.is_set() and small.wait(0)
        large, src, dst = _job(INLINE_MAX + 4096, [])
        event = large.ended_event  # asked for before it ends (as a cancel waits on it)
        assert not event.is_set()
        pool.submit(large)
        assert event.wait(30) and large.wait(0) and bytes(dst) == bytes(src)
    finally:
        pool.stop()
