"""One-sided writes (OneSidedTransport) beyond the kit's one_sided check (test_kit.py):
no digest without checksum, concurrent writes, cancel of a write, bad input, status lanes,
the map lane's copy paths, and the refusal of transports without writes.

The receiver only registers its buffer and hands its descriptor over (as the agent does in
Hello); it posts nothing per write. Real transports, real lanes: "shm" writes with
process_vm_writev, "shm-map" into a mapped kvhandoff shared segment, "nixl" through NIXL's
UCX (skipped where nixl_cu12 is not installed; test_nixl.py has its cross-process cases).
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from test_conformance import (  # the shared harness (tests/transports is on sys.path)
    BUF,
    CHUNK,
    KINDS,
    WAIT_S,
    Pair,
    base_kind,
    need,
    random_spans,
    stream,
)

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans, plan_of
from kvhandoff.settings import Settings
from kvhandoff.transports import OneSidedTransport, WriteResult, load_transport

WRITERS = [k for k in KINDS if base_kind(k) in ("shm", "nixl")]
OTHERS = [k for k in KINDS if base_kind(k) not in ("shm", "nixl")]


class Written:
    """The OnWritten callback of a job of one write: records (error, digest) and the order of
    completions."""

    def __init__(self, log: list[str] | None = None, name: str = "") -> None:
        self.event = threading.Event()
        self.results: list[tuple[BaseException | None, int | None]] = []
        self.log, self.name = log, name

    def __call__(self, result: WriteResult) -> None:
        assert isinstance(result, WriteResult) and len(result.digests) in (0, 1), result
        self.results.append((result.error, result.digests[0] if result.digests else None))
        if self.log is not None:
            self.log.append(self.name)
        self.event.set()

    def wait(self) -> tuple[BaseException | None, int | None]:
        assert self.event.wait(WAIT_S), "on_done was not called in time"
        assert len(self.results) == 1, f"on_done called {len(self.results)} times"
        return self.results[0]


@pytest.fixture(params=WRITERS)
def wpair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(need(str(request.param)))
    p.a.register_remote("b", "kv", p.b.describe("kv"))
    yield p
    p.close()


def test_write_without_checksum_has_no_digest(wpair: Pair) -> None:
    w = Written()
    wpair.a.post_writes("b", [(1, "kv", "kv", plan_of([0], [0], [BUF]))], w)
    assert w.wait() == (None, None)
    assert np.array_equal(wpair.dst, wpair.src)


def test_concurrent_writes_each_complete_once(wpair: Pair) -> None:
    order: list[str] = []
    writes = []
    n = BUF // 8
    for i in range(8):
        w = Written(order, f"w{i}")
        writes.append(w)
        wpair.a.post_writes("b", [(100 + i, "kv", "kv", plan_of([i * n], [(7 - i) * n], [n]))], w)
    for i, w in enumerate(writes):
        assert w.wait() == (None, None), i
        assert w.results == [(None, None)], i
        assert np.array_equal(wpair.dst[(7 - i) * n:(8 - i) * n], wpair.src[i * n:(i + 1) * n])
    assert sorted(order) == [f"w{i}" for i in range(8)]


def test_cancel_write_nothing_written_after_return(wpair: Pair) -> None:
    n = BUF - 100
    w = Written()
    wpair.a.post_writes("b", [(7, "kv", "kv", plan_of([0], [100], [n]))], w)
    wpair.a.cancel("b", 7)
    snapshot = wpair.dst.copy()
    err, _ = w.wait()
    if err is None:  # it completed before cancel: then all of it landed
        assert np.array_equal(wpair.dst[100:], wpair.src[:n])
    else:
        assert isinstance(err, TransportError) and "cancelled" in str(err)
    assert np.array_equal(wpair.dst, snapshot)


def test_write_bad_input_names_the_field(wpair: Pair) -> None:
    a, one = wpair.a, np.array([1])
    with pytest.raises(TransportError, match="no remote buffer 'nope' of peer 'b'"):
        a.post_writes("b", [(1, "kv", "nope", plan_of([0], [0], [1]))], Written())
    with pytest.raises(TransportError, match="no buffer registered as 'nope'"):
        a.post_writes("b", [(1, "nope", "kv", plan_of([0], [0], [1]))], Written())
    with pytest.raises(TransportError, match=r"plan\.dst_offsets\[0\]=.* exceeds the remote "
                                             "buffer 'kv'"):
        a.post_writes("b", [(1, "kv", "kv", plan_of([0], [BUF], [1]))], Written())
    with pytest.raises(TransportError, match=r"plan\.src_offsets\[1\]=-4 is negative"):
        a.post_writes("b", [(1, "kv", "kv", plan_of([0, -4], [0, 8], [1, 1]))], Written())
    with pytest.raises(TransportError, match="plan must be a kvhandoff.kv_layout.SpanPlan"):
        a.post_writes("b", [(1, "kv", "kv", (np.array([0]), one))], Written())  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="not connected"):
        a.post_writes("zzz", [(1, "kv", "kv", plan_of([0], [0], [1]))], Written())
    with pytest.raises(TransportError, match="not connected"):
        a.register_remote("zzz", "kv", wpair.b.describe("kv"))
    with pytest.raises(TransportError, match="descriptor"):
        a.register_remote("b", "kv2", b"short")
    with pytest.raises(TransportError, match="no buffer registered as 'nope'"):
        wpair.b.describe("nope")
    assert not wpair.dst.any()


def test_write_lane_in_status(wpair: Pair) -> None:
    st = wpair.a.status()
    if st.kind == "nixl":  # the UCX transports NIXL's UCX can reach other hosts with
        assert st.lanes and all(lane.startswith("nixl/ucx") for lane in st.lanes)
        assert st.degraded == all(lane == "nixl/ucx:tcp" for lane in st.lanes), st
        assert "NIXL's bundled UCX" in st.reason and "verbs" in st.reason
        return
    shared = wpair.dst.base is not None and not isinstance(wpair.dst.base, np.ndarray)
    assert st.lanes == (("shm/map",) if shared else ("shm/cma",))


@pytest.mark.parametrize("kind", OTHERS)
def test_transports_without_writes_are_not_one_sided(kind: str) -> None:
    """The capability is the type: ucx, tcp and inproc are no OneSidedTransport and have no
    write methods at all (the agent asks isinstance and sends two-sided)."""
    tr = load_transport(base_kind(kind),
                        Settings(chunk_bytes=CHUNK, ucx_same_host_error_handling=False))
    try:
        assert not isinstance(tr, OneSidedTransport)
        assert not any(hasattr(tr, m) for m in ("describe", "register_remote", "post_writes"))
    finally:
        tr.close()


@pytest.mark.parametrize("kind", ["shm", "auto", "nixl"])
def test_writers_are_one_sided(kind: str) -> None:
    need(kind)
    tr = load_transport(kind, Settings(chunk_bytes=CHUNK, auto_cross_host="tcp"))
    try:
        assert isinstance(tr, OneSidedTransport)
    finally:
        tr.close()


@pytest.mark.parametrize("helper", ["python", "native-without-libxxhash", "native"])
def test_map_lane_copy_paths_agree(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The map lane copies (and hashes) the same bytes whichever way it runs: piece by piece
    from Python, the native batch copy with the hash in Python, or fused in C."""
    from kvhandoff.transports.shm import copy as _shm_copy
    from kvhandoff.transports.shm import native as _native

    built, _ = _native.native()
    if helper != "python" and built is None:
        pytest.skip("the native copy helper is not built here (make setup builds it)")
    if helper == "python":
        monkeypatch.setattr(_shm_copy, "native", lambda: (None, "python"))
    elif helper == "native-without-libxxhash":
        assert built is not None
        plain = _native.Native(ctypes.CDLL(str(_native._target())), None)
        monkeypatch.setattr(_shm_copy, "native", lambda: (plain, "no libxxhash"))
    p = Pair("shm-map")
    try:
        p.a.register_remote("b", "kv", p.b.describe("kv"))
        rng = np.random.default_rng(9)
        total = BUF // 2
        s = random_spans(rng, total, BUF, 4 * CHUNK)
        d = random_spans(rng, total, BUF, 4 * CHUNK)
        w = Written()
        p.a.post_writes("b", [(1, "kv", "kv", pair_spans(*s, *d))], w, checksum=True)
        err, digest = w.wait()
        assert err is None and p.a.status().lanes == ("shm/map",)
        assert digest == xxhash.xxh3_64(stream(p.src, *s).data).intdigest()
        assert np.array_equal(stream(p.dst, *d), stream(p.src, *s))
    finally:
        p.close()


@pytest.mark.parametrize("helper", ["python", "native"])
def test_a_write_result_carries_what_landed_where_the_writer_reads_it(
        wpair: Pair, helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one write API gives what landed (`WriteResult.landed`, no second public call): on
    shm's map lane the xxh3 of the peer's destination pieces (the oracle: numpy reading the
    peer's buffer), natively or from Python; () where the writer does not map the peer's
    memory (cma, nixl). shm's private read-back (`_landed_digest`, the fault wrapper's)
    reads a byte changed after the write."""
    from kvhandoff.transports.shm import copy as _shm_copy
    from kvhandoff.transports.shm import native as _native
    from kvhandoff.transports.shm.transport import ShmTransport

    if helper == "python":
        monkeypatch.setattr(_shm_copy, "native", lambda: (None, "python"))
    elif _native.native()[0] is None:
        pytest.skip("the native copy helper is not built here (make setup builds it)")
    assert not hasattr(wpair.a, "landed_digest")
    rng = np.random.default_rng(11)
    s = random_spans(rng, BUF // 2, BUF, 4 * CHUNK)
    d = random_spans(rng, BUF // 2, BUF, 4 * CHUNK)
    plan = pair_spans(*s, *d)
    got: queue.SimpleQueue[WriteResult] = queue.SimpleQueue()
    wpair.a.post_writes("b", [(1, "kv", "kv", plan)], got.put, checksum=True)
    r = got.get(timeout=WAIT_S)
    assert r.error is None
    if wpair.a.status().lanes != ("shm/map",):
        assert r.landed == ()
        if isinstance(wpair.a, ShmTransport):
            assert wpair.a._landed_digest("b", "kv", plan) is None
        return
    assert isinstance(wpair.a, ShmTransport)
    assert r.landed == r.digests == (xxhash.xxh3_64(stream(wpair.dst, *d).data).intdigest(),)
    wpair.dst[int(plan.dst_offsets[0])] ^= 0xFF  # the peer's page changed after the write
    read_back = wpair.a._landed_digest
    assert read_back("b", "kv", plan) == xxhash.xxh3_64(stream(wpair.dst, *d).data).intdigest()
    assert read_back("b", "kv", plan) != r.landed[0]
    assert read_back("b", "other", plan) is None  # no such remote buffer
