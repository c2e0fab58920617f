"""One-sided writes (Transport.supports_write): the conformance cases every transport that
supports them passes, and the refusal of those that do not.

The receiver only registers its buffer and hands its descriptor over (as the agent does in
Hello); it posts nothing per write. Real transports, real lanes: "shm" writes with
process_vm_writev, "shm-map" into a mapped kvhandoff shared segment, "nixl" through NIXL's
UCX (skipped where nixl_cu12 is not installed; test_nixl.py has its cross-process cases).
"""

from __future__ import annotations

import ctypes
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
    Done,
    Pair,
    base_kind,
    need,
    random_spans,
    stream,
)

from kvhandoff.errors import TransportError
from kvhandoff.settings import Settings
from kvhandoff.transfer.transports import load_transport

WRITERS = [k for k in KINDS if base_kind(k) in ("shm", "nixl")]
OTHERS = [k for k in KINDS if base_kind(k) not in ("shm", "nixl")]


class Written:
    """An OnWritten callback: records (error, digest) and the order of completions."""

    def __init__(self, log: list[str] | None = None, name: str = "") -> None:
        self.event = threading.Event()
        self.results: list[tuple[BaseException | None, int | None]] = []
        self.log, self.name = log, name

    def __call__(self, exc: BaseException | None, digest: int | None) -> None:
        self.results.append((exc, digest))
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


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_write_random_spans_byte_exact_with_digest(wpair: Pair, seed: int) -> None:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, BUF // 2))
    s = random_spans(rng, total, BUF, 4 * CHUNK)
    d = random_spans(rng, total, BUF, 4 * CHUNK)
    w = Written()
    wpair.a.post_write("b", seed, "kv", *s, "kv", *d, w, checksum=True)
    err, digest = w.wait()
    assert err is None
    assert digest == xxhash.xxh3_64(stream(wpair.src, *s).data).intdigest()
    assert np.array_equal(stream(wpair.dst, *d), stream(wpair.src, *s))
    mask = np.ones(BUF, bool)
    for o, n in zip(d[0].tolist(), d[1].tolist(), strict=True):
        mask[o:o + n] = False
    assert not wpair.dst[mask].any()  # nothing outside the destination spans
    assert wpair.a.status().bytes_sent == total


def test_write_without_checksum_has_no_digest(wpair: Pair) -> None:
    w = Written()
    wpair.a.post_write("b", 1, "kv", np.array([0]), np.array([BUF]), "kv", np.array([0]),
                       np.array([BUF]), w)
    assert w.wait() == (None, None)
    assert np.array_equal(wpair.dst, wpair.src)


def test_fence_completes_after_every_earlier_write(wpair: Pair) -> None:
    order: list[str] = []
    lock = threading.Lock()
    writes = []
    n = BUF // 8
    for i in range(8):
        w = Written(order, f"w{i}")
        writes.append(w)
        wpair.a.post_write("b", 100 + i, "kv", np.array([i * n]), np.array([n]), "kv",
                           np.array([(7 - i) * n]), np.array([n]), w)
    fenced = Done()

    def on_fence(exc: BaseException | None) -> None:
        with lock:
            order.append("fence")
        fenced(exc)

    wpair.a.fence("b", on_fence)
    assert fenced.wait() is None
    assert order[-1] == "fence" and sorted(order[:-1]) == [f"w{i}" for i in range(8)]
    for i, w in enumerate(writes):
        assert w.results == [(None, None)], i
        assert np.array_equal(wpair.dst[(7 - i) * n:(8 - i) * n], wpair.src[i * n:(i + 1) * n])
    empty = Done()  # nothing in flight: a fence completes at once
    wpair.a.fence("b", empty)
    assert empty.wait() is None


def test_cancel_write_nothing_written_after_return(wpair: Pair) -> None:
    n = BUF - 100
    w = Written()
    wpair.a.post_write("b", 7, "kv", np.array([0]), np.array([n]), "kv", np.array([100]),
                       np.array([n]), w)
    wpair.a.cancel("b", 7)
    snapshot = wpair.dst.copy()
    err, _ = w.wait()
    if err is None:  # it completed before cancel: then all of it landed
        assert np.array_equal(wpair.dst[100:], wpair.src[:n])
    else:
        assert isinstance(err, TransportError) and "cancelled" in str(err)
    done = Done()
    wpair.a.fence("b", done)
    assert done.wait() is None
    assert np.array_equal(wpair.dst, snapshot)


def test_write_bad_input_names_the_field(wpair: Pair) -> None:
    a, one = wpair.a, np.array([1])
    with pytest.raises(TransportError, match="no remote buffer 'nope' of peer 'b'"):
        a.post_write("b", 1, "kv", np.array([0]), one, "nope", np.array([0]), one, Written())
    with pytest.raises(TransportError, match="no buffer registered as 'nope'"):
        a.post_write("b", 1, "nope", np.array([0]), one, "kv", np.array([0]), one, Written())
    with pytest.raises(TransportError, match=r"remote 'kv': offsets\[0\]=.* exceeds"):
        a.post_write("b", 1, "kv", np.array([0]), one, "kv", np.array([BUF]), one, Written())
    with pytest.raises(TransportError, match="size mismatch"):
        a.post_write("b", 1, "kv", np.array([0]), np.array([10]), "kv", np.array([0]),
                     np.array([11]), Written())
    with pytest.raises(TransportError, match="not connected"):
        a.post_write("zzz", 1, "kv", np.array([0]), one, "kv", np.array([0]), one, Written())
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
def test_transports_without_writes_refuse_them(kind: str) -> None:
    tr = load_transport(base_kind(kind),
                        Settings(chunk_bytes=CHUNK, ucx_same_host_error_handling=False))
    try:
        assert type(tr).supports_write is False
        tr.register("kv", np.zeros(16, np.uint8))
        for call in (lambda: tr.describe("kv"),
                     lambda: tr.register_remote("b", "kv", b""),
                     lambda: tr.post_write("b", 1, "kv", np.array([0]), np.array([1]), "kv",
                                           np.array([0]), np.array([1]), Written()),
                     lambda: tr.fence("b", Done())):
            with pytest.raises(TransportError, match="no one-sided writes"):
                call()
    finally:
        tr.close()


@pytest.mark.parametrize("helper", ["python", "native-without-libxxhash", "native"])
def test_map_lane_copy_paths_agree(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The map lane copies (and hashes) the same bytes whichever way it runs: piece by piece
    from Python, the native batch copy with the hash in Python, or fused in C."""
    from kvhandoff.transfer.transports import _native, _shm_copy

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
        p.a.post_write("b", 1, "kv", *s, "kv", *d, w, checksum=True)
        err, digest = w.wait()
        assert err is None and p.a.status().lanes == ("shm/map",)
        assert digest == xxhash.xxh3_64(stream(p.src, *s).data).intdigest()
        assert np.array_equal(stream(p.dst, *d), stream(p.src, *s))
    finally:
        p.close()
