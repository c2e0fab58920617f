"""The cases every data transport runs (inproc, tcp, ucx, shm, nixl) beyond the public kit's
(kvhandoff.testing.conformance, run by test_kit.py: two-sided byte exactness, cancel,
disconnect, a dead peer): many tags, both directions, size mismatch, cancel in flight,
reconnects, close, status, bad input, cross-process pairs; and the shared harness.

Two real transports talk over their real lanes (sockets, UCX shared memory, shm: cross-memory
writes, or a mapped shared segment for "shm-map", whose buffers are kvhandoff shared segments);
for tcp, ucx, shm and nixl a variant puts the peer in a real second process (peer_proc.py). nixl
(skipped where nixl_cu12 is not installed) does its two-sided ops over tcp. One-sided
writes are checked on every transport that supports them (and refused by the others). Every
wait is bounded. shm's cancel never waits on the peer: its receive's on_done waits for the
writer instead (here: snapshots after on_done; a frozen peer process: test_peer_death.py).
"""

from __future__ import annotations

import importlib.util
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvhandoff.buffers.shared import SharedSegment
from kvhandoff.errors import TransportError
from kvhandoff.settings import Settings
from kvhandoff.transports import Transport, TransportStatus, load_transport
from kvhandoff.transports.streams import ChunkPlan, normalise_spans

KINDS = ["inproc", "tcp", "ucx", "shm", "shm-map", "nixl"]
HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None
# The suite characterises UCX on its shared-memory lanes (peer error handling off for same-host
# peers, as before the safe default); the default (error handling on, TCP lanes, degraded) is
# covered by test_peer_death.py and the loopback handoff tests.
UCX_SHM: dict[str, bool] = {"ucx_same_host_error_handling": False}
CHUNK = 64 << 10
BUF = 3 << 20
WAIT_S = 20.0
PEER = Path(__file__).with_name("peer_proc.py")


class Done:
    """An on_done callback that records its result and sets an event."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.results: list[BaseException | None] = []

    def __call__(self, exc: BaseException | None) -> None:
        self.results.append(exc)
        self.event.set()

    def wait(self) -> BaseException | None:
        assert self.event.wait(WAIT_S), "on_done was not called in time"
        assert len(self.results) == 1, f"on_done called {len(self.results)} times"
        return self.results[0]


def random_spans(rng: np.random.Generator, total: int, buf_bytes: int, max_span: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A span list of `total` bytes cut at random places, its spans scattered in the buffer
    in a random order with random gaps (so neighbours are rarely contiguous)."""
    sizes: list[int] = []
    left = total
    while left:
        n = int(min(left, rng.choice([rng.integers(1, 300), rng.integers(1, 9000),
                                      rng.integers(1, max_span)])))
        sizes.append(n)
        left -= n
    nb = np.asarray(sizes, dtype=np.int64)
    slack = buf_bytes - total
    assert slack >= 0
    gaps = rng.multinomial(slack, np.ones(nb.size + 1) / (nb.size + 1))[:-1]
    perm = rng.permutation(nb.size)
    laid = nb[perm] + gaps
    starts = np.concatenate([[0], np.cumsum(laid)[:-1]]) + gaps
    off = np.empty_like(nb)
    off[perm] = starts
    assert int((off + nb).max()) <= buf_bytes
    return off, nb


def stream(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> np.ndarray:
    if nb.size == 0:
        return np.zeros(0, np.uint8)
    return np.concatenate([buf[o:o + n] for o, n in zip(off.tolist(), nb.tolist(), strict=True)])


def base_kind(kind: str) -> str:
    """The transport of a test kind ("shm-map" is shm with buffers in shared segments)."""
    return kind.split("-")[0]


def need(kind: str) -> str:
    """Skips the test when the kind's optional dependency is not installed."""
    if base_kind(kind) == "nixl" and not HAVE_NIXL:
        pytest.skip("nixl_cu12 is not importable: pip install 'kvhandoff[nixl]' (make setup "
                    "installs it)")
    return kind


def buffer(kind: str) -> np.ndarray:
    """A zeroed BUF-byte buffer: in a kvhandoff shared segment for "shm-map"."""
    if kind == "shm-map":
        return SharedSegment(BUF).array
    return np.zeros(BUF, np.uint8)


class Pair:
    def __init__(self, kind: str, **settings: object) -> None:
        s = Settings(chunk_bytes=CHUNK, stall_timeout_s=WAIT_S, **{**UCX_SHM, **settings})  # type: ignore[arg-type]
        self.a: Transport = load_transport(base_kind(kind), s)
        self.b: Transport = load_transport(base_kind(kind), s)
        rng = np.random.default_rng(7)
        self.src = buffer(kind)
        self.src[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
        self.dst = buffer(kind)
        self.a.register("kv", self.src)
        self.b.register("kv", self.dst)
        self.a.connect("b", self.b.address)
        self.b.connect("a", self.a.address)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return need(str(request.param))


@pytest.fixture
def pair(kind: str) -> Iterator[Pair]:
    p = Pair(kind)
    yield p
    p.close()


def transfer(p: Pair, tag: int, s: tuple[np.ndarray, np.ndarray],
             d: tuple[np.ndarray, np.ndarray], send_first: bool) -> tuple[Done, Done]:
    ds, dr = Done(), Done()
    if send_first:
        p.a.post_send("b", tag, "kv", *s, ds)
        p.b.post_recv("a", tag, "kv", *d, dr)
    else:
        p.b.post_recv("a", tag, "kv", *d, dr)
        p.a.post_send("b", tag, "kv", *s, ds)
    return ds, dr


# ---- data movement ----------------------------------------------------------------------------

def test_one_contiguous_region(pair: Pair) -> None:
    n = BUF - 12345
    s = (np.array([12345]), np.array([n]))
    d = (np.array([0]), np.array([n]))
    ds, dr = transfer(pair, 9, s, d, True)
    assert dr.wait() is None and ds.wait() is None
    assert np.array_equal(pair.dst[:n], pair.src[12345:])


def test_many_tags_concurrently(pair: Pair) -> None:
    rng = np.random.default_rng(11)
    ntags, per = 24, BUF // 24
    jobs = []
    for i in range(ntags):
        total = int(rng.integers(1, per))
        s = random_spans(rng, total, per, 2 * CHUNK)
        d = random_spans(rng, total, per, 2 * CHUNK)
        s = (s[0] + i * per, s[1])
        d = (d[0] + i * per, d[1])
        jobs.append((i, s, d))
    order = rng.permutation(2 * ntags)
    dones: dict[tuple[int, str], Done] = {}
    for j in order.tolist():
        i, s, d = jobs[j // 2]
        tag = (1 << 39) + i * 1000003
        done = dones[(i, "s" if j % 2 else "r")] = Done()
        if j % 2:
            pair.a.post_send("b", tag, "kv", *s, done)
        else:
            pair.b.post_recv("a", tag, "kv", *d, done)
    for key, done in dones.items():
        assert done.wait() is None, key
    for _, s, d in jobs:
        assert np.array_equal(stream(pair.dst, *d), stream(pair.src, *s))


def test_both_directions_at_once(kind: str) -> None:
    p = Pair(kind)
    try:
        p.b.register("out", p.src.copy())
        inbox = np.zeros(BUF, np.uint8)
        p.a.register("in", inbox)
        n = BUF // 3
        dones = [Done() for _ in range(4)]
        p.a.post_send("b", 5, "kv", np.array([0]), np.array([n]), dones[0])
        p.b.post_send("a", 5, "out", np.array([n]), np.array([n]), dones[1])
        p.a.post_recv("b", 5, "in", np.array([7]), np.array([n]), dones[2])
        p.b.post_recv("a", 5, "kv", np.array([1]), np.array([n]), dones[3])
        assert [d.wait() for d in dones] == [None] * 4
        assert np.array_equal(p.dst[1:n + 1], p.src[:n])
        assert np.array_equal(inbox[7:n + 7], p.src[n:2 * n])
    finally:
        p.close()


def test_size_mismatch_fails_the_receive(pair: Pair) -> None:
    ds, dr = transfer(pair, 8, (np.array([0]), np.array([1000])),
                      (np.array([0]), np.array([2000])), True)
    err = dr.wait()
    assert isinstance(err, TransportError) and "size mismatch" in str(err)
    assert not pair.dst.any()
    pair.a.cancel("b", 8)  # the send may have completed or failed; either way it ends
    ds.wait()


# ---- cancel, disconnect, close ----------------------------------------------------------------

def marker_transfer(p: Pair, tag: int) -> None:
    """A small transfer that must complete (the link still works)."""
    ds, dr = transfer(p, tag, (np.array([0]), np.array([100])),
                      (np.array([BUF - 100]), np.array([100])), True)
    assert dr.wait() is None and ds.wait() is None
    assert np.array_equal(p.dst[BUF - 100:], p.src[:100])


def test_cancel_in_flight_nothing_written_after_return(pair: Pair, kind: str) -> None:
    """After cancel() returns (shm: after the receive's on_done, which waits for the writer's
    confirmation; shm's cancel never waits on the peer) nothing more lands."""
    n = BUF - 200
    ds, dr = transfer(pair, 31, (np.array([0]), np.array([n])),
                      (np.array([0]), np.array([n])), True)
    pair.b.cancel("a", 31)
    if base_kind(kind) == "shm":
        dr.event.wait(WAIT_S)
    snapshot = pair.dst.copy()
    err = dr.wait()
    if err is None:  # it completed before cancel: then all of it landed
        assert np.array_equal(pair.dst[:n], pair.src[:n])
    else:
        assert isinstance(err, TransportError) and "cancelled" in str(err)
    pair.a.cancel("b", 31)
    ds.wait()
    marker_transfer(pair, 32)
    assert np.array_equal(pair.dst[:n], snapshot[:n])


def test_cancel_send_reports_error(pair: Pair) -> None:
    """A send the peer never receives cannot complete on its own (no receive is posted, and the
    send is past UCX's eager limit, so nothing completes it locally): cancel() must end it with
    a 'cancelled' error, exactly once, and leave the link usable."""
    ds = Done()
    pair.a.post_send("b", 41, "kv", np.array([0]), np.array([400_000]), ds)
    pair.a.cancel("b", 41)
    err = ds.wait()
    assert isinstance(err, TransportError) and "cancelled" in str(err)
    pair.a.cancel("b", 41)  # cancelling again is harmless
    pair.b.cancel("a", 12345)  # nothing pending: harmless
    assert len(ds.results) == 1
    marker_transfer(pair, 42)


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_one_sided_reconnect_keeps_both_directions(kind: str, side: str) -> None:
    """One side alone disconnects and connects again to the same address (an agent that took
    a busy peer for dead re-handshakes; the peer never disconnected): transfers in both
    directions work afterwards. With UCX, closing an endpoint the peer's endpoint is paired
    with made every large message the peer sent afterwards fail with "Request canceled"."""
    p = Pair(kind)
    try:
        p.b.register("out", p.src.copy())
        inbox = np.zeros(BUF, np.uint8)
        p.a.register("in", inbox)
        n = 400_000  # several chunks, each past UCX's eager limit (rendezvous)

        def both_ways(tag: int, at: int) -> None:
            dones = [Done() for _ in range(4)]
            p.b.post_recv("a", tag, "kv", np.array([at]), np.array([n]), dones[0])
            p.a.post_send("b", tag, "kv", np.array([at]), np.array([n]), dones[1])
            p.a.post_recv("b", tag, "in", np.array([at]), np.array([n]), dones[2])
            p.b.post_send("a", tag, "out", np.array([at]), np.array([n]), dones[3])
            assert [dones[0].wait(), dones[2].wait()] == [None, None]  # receives first
            assert [dones[1].wait(), dones[3].wait()] == [None, None]
            assert np.array_equal(p.dst[at:at + n], p.src[at:at + n])
            assert np.array_equal(inbox[at:at + n], p.src[at:at + n])

        both_ways(71, 0)
        t, name, other = (p.b, "a", p.a) if side == "receiver" else (p.a, "b", p.b)
        t.disconnect(name)
        t.connect(name, other.address)
        both_ways(72, n)
        t.disconnect(name)  # twice: the second reconnect reuses what the first kept
        t.connect(name, other.address)
        both_ways(73, 2 * n)
    finally:
        p.close()


def test_reconnect_after_dropping_a_peer_mid_send(kind: str) -> None:
    """The sender drops its peer while a send is still in flight (the receive was never
    posted), then connects again: its later sends arrive. (UCX closes the endpoint in this
    case, so that nothing writes into a peer that may be dead.)"""
    p = Pair(kind)
    try:
        n = 400_000
        stuck = Done()
        p.a.post_send("b", 81, "kv", np.array([0]), np.array([n]), stuck)
        p.a.disconnect("b")
        assert isinstance(stuck.wait(), TransportError)
        p.a.connect("b", p.b.address)
        for i, tag in enumerate((82, 83)):
            ds, dr = transfer(p, tag, (np.array([i * n]), np.array([n])),
                              (np.array([i * n]), np.array([n])), bool(i))
            assert dr.wait() is None and ds.wait() is None
        assert np.array_equal(p.dst[:2 * n], p.src[:2 * n])
    finally:
        p.close()


def test_close_is_idempotent_and_fails_pending(kind: str) -> None:
    p = Pair(kind)
    dr = Done()
    p.b.post_recv("a", 61, "kv", np.array([0]), np.array([1000]), dr)
    p.b.close()
    err = dr.wait()
    assert isinstance(err, TransportError) and "closed" in str(err)
    p.b.close()
    with pytest.raises(TransportError, match="closed"):
        p.b.post_recv("a", 62, "kv", np.array([0]), np.array([10]), Done())
    p.a.close()
    p.a.close()


# ---- status and bad input ---------------------------------------------------------------------

def test_status_fields(pair: Pair, kind: str) -> None:
    kind = base_kind(kind)
    st = pair.a.status()
    assert isinstance(st, TransportStatus)
    assert st.kind == kind == type(pair.a).kind
    assert isinstance(st.lanes, tuple) and st.lanes and all(isinstance(x, str) for x in st.lanes)
    assert isinstance(st.degraded, bool) and isinstance(st.reason, str) and st.reason
    if kind == "tcp":
        assert st.degraded and "no RDMA" in st.reason
    n = 300_000
    ds, dr = transfer(pair, 71, (np.array([0]), np.array([n])), (np.array([5]), np.array([n])),
                      True)
    assert ds.wait() is None and dr.wait() is None
    assert pair.a.status().bytes_sent - st.bytes_sent == n
    assert pair.b.status().bytes_received == n
    with pytest.raises(AttributeError):
        st.kind = "x"  # type: ignore[misc]


def test_require_rdma(kind: str) -> None:
    kind = base_kind(kind)
    s = Settings(require_rdma=True, chunk_bytes=CHUNK)
    if kind in ("tcp", "shm"):  # no RDMA at all: refused outright
        with pytest.raises(TransportError, match="require_rdma"):
            load_transport(kind, s)
        return
    if kind == "nixl":  # refused at load when NIXL's UCX has no RDMA lane
        probe = load_transport(kind, Settings(chunk_bytes=CHUNK))
        degraded = probe.status().degraded
        probe.close()
        if degraded:
            with pytest.raises(TransportError, match="require_rdma"):
                load_transport(kind, s)
            return
    a = load_transport(kind, s)
    b = load_transport(kind, Settings(chunk_bytes=CHUNK, **UCX_SHM))
    try:
        if kind == "ucx" and "no RDMA device" in a.status().reason:
            with pytest.raises(TransportError, match="require_rdma"):
                a.connect("b", b.address)
        else:
            a.connect("b", b.address)
    finally:
        a.close()
        b.close()


def test_bad_input_names_the_field(pair: Pair) -> None:
    a = pair.a
    with pytest.raises(TransportError, match="no buffer registered as 'nope'"):
        a.post_send("b", 1, "nope", np.array([0]), np.array([1]), Done())
    with pytest.raises(TransportError, match=r"offsets\[1\]=.* exceeds"):
        a.post_send("b", 1, "kv", np.array([0, BUF - 5]), np.array([1, 10]), Done())
    with pytest.raises(TransportError, match=r"nbytes\[0\]=-1 is negative"):
        a.post_send("b", 1, "kv", np.array([0]), np.array([-1]), Done())
    with pytest.raises(TransportError, match="equal length"):
        a.post_send("b", 1, "kv", np.array([0, 1]), np.array([1]), Done())
    with pytest.raises(TransportError, match="tag"):
        a.post_send("b", 1 << 40, "kv", np.array([0]), np.array([1]), Done())
    with pytest.raises(TransportError, match="not connected"):
        a.post_send("zzz", 1, "kv", np.array([0]), np.array([1]), Done())
    with pytest.raises(TransportError, match="already registered"):
        a.register("kv", np.zeros(10, np.uint8))
    with pytest.raises(TransportError, match="1-D uint8"):
        a.register("f32", np.zeros(10, np.float32))
    done = Done()
    # large: UCX would complete a small (eager) send before the second post
    a.post_send("b", 2, "kv", np.array([0]), np.array([400_000]), done)
    with pytest.raises(TransportError, match="already pending"):
        a.post_send("b", 2, "kv", np.array([0]), np.array([400_000]), Done())
    a.cancel("b", 2)
    done.wait()


def test_load_transport_unknown_kind() -> None:
    with pytest.raises(TransportError, match="unknown kind 'rdma'.*inproc, nixl, shm, tcp, ucx"):
        load_transport("rdma", Settings())


# ---- chunk plan (shared by every transport) -------------------------------------------------

def test_chunk_plan_pairs_any_two_cuttings() -> None:
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for _ in range(20):
        total = int(rng.integers(1, 1 << 19))
        off, nb = random_spans(rng, total, buf.size, 50_000)
        off, nb = normalise_spans(off, nb, buf.size)
        chunk = int(rng.integers(1, 70_000))
        plan = ChunkPlan(off, nb, chunk)
        parts = []
        for k in range(plan.nchunks):
            out = np.empty(chunk, np.uint8)
            start = plan.direct(k)
            if start is not None:
                parts.append(buf[start:start + plan.chunk_len(k)])
            else:
                plan.gather(buf, k, out)
                parts.append(out[:plan.chunk_len(k)].copy())
        assert sum(map(len, parts)) == total
        assert np.array_equal(np.concatenate(parts), stream(buf, off, nb))


def test_normalise_coalesces_and_drops_empty() -> None:
    off, nb = normalise_spans(np.array([0, 10, 30, 40, 50]), np.array([10, 0, 10, 10, 5]), 100)
    assert off.tolist() == [0, 30] and nb.tolist() == [10, 25]


# ---- cross-process ----------------------------------------------------------------------------

class PeerProcess:
    def __init__(self, kind: str, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), kind, str(CHUNK), str(BUF), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.held: list[dict[str, object]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, **msg: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def expect(self, key: str) -> dict[str, object]:
        """The next message carrying `key` (a completion may overtake its 'posted')."""
        for i, msg in enumerate(self.held):
            if key in msg:
                return self.held.pop(i)
        while True:
            try:
                msg = self.lines.get(timeout=WAIT_S * 2)
            except queue.Empty:
                raise AssertionError(f"peer process sent no {key!r} in time") from None
            if key in msg:
                return msg
            self.held.append(msg)

    def ask(self, cmd: str) -> dict[str, object]:
        """Sends `cmd` and returns the peer's answer carrying the key `cmd`."""
        self.send(cmd=cmd)
        answer = self.expect(cmd)[cmd]
        assert isinstance(answer, dict)
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(cmd="exit")
            self.expect("closed")
        assert self.proc.wait(timeout=WAIT_S) == 0


@pytest.mark.parametrize("xkind", ["tcp", "ucx", "shm", "shm-map", "nixl"])
def test_cross_process_both_directions(xkind: str) -> None:
    need(xkind)
    peer_seed = 99
    peer = PeerProcess(xkind, peer_seed)
    tr = load_transport(base_kind(xkind), Settings(chunk_bytes=CHUNK, **UCX_SHM))
    try:
        rng = np.random.default_rng(3)
        mine = buffer(xkind)
        mine[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
        tr.register("kv", mine)
        addr = bytes.fromhex(str(peer.expect("address")["address"]))
        tr.connect("peer", addr)
        peer.send(cmd="connect", address=tr.address.hex())
        peer.expect("connected")
        if xkind != "tcp":
            assert tr.status().lanes, f"{xkind} reports the lanes it uses"

        # parent -> peer, sender first, spans cut differently on each side
        total = BUF // 2 + 777
        s = random_spans(rng, total, BUF, 4 * CHUNK)
        d = random_spans(rng, total, BUF, 4 * CHUNK)
        ds = Done()
        tr.post_send("peer", 1, "kv", *s, ds)
        peer.send(cmd="recv", tag=1, offsets=d[0].tolist(), nbytes=d[1].tolist())
        peer.expect("posted")
        res = peer.expect("done")
        assert res["error"] is None
        assert res["digest"] == xxhash.xxh3_64(stream(mine, *s).data).hexdigest()
        assert ds.wait() is None

        # peer -> parent, receiver first
        theirs = np.random.default_rng(peer_seed).integers(0, 256, BUF, dtype=np.uint8)
        s = random_spans(rng, total, BUF, 4 * CHUNK)
        d = random_spans(rng, total, BUF, 4 * CHUNK)
        mine[:] = 0
        dr = Done()
        tr.post_recv("peer", 2, "kv", *d, dr)
        peer.send(cmd="send", tag=2, offsets=s[0].tolist(), nbytes=s[1].tolist())
        peer.expect("posted")
        assert dr.wait() is None
        assert peer.expect("done")["error"] is None
        assert np.array_equal(stream(mine, *d), stream(theirs, *s))
        assert tr.status().bytes_received == total
        if xkind.startswith("shm"):  # the peer wrote into us: by mapping our segment or not
            lane = "shm/map" if xkind == "shm-map" else "shm/cma"
            assert peer.ask("status")["lanes"] == [lane]
            assert tr.status().lanes == (lane,)  # the lane our receive offered
    finally:
        tr.close()
        peer.close()


@pytest.mark.parametrize("base", [0, 1000])
def test_scatter_of_uniform_pages_matches_naive(base: int) -> None:
    # page-aligned slots of one size take the vectorised scatter path; chunks cut pages
    rng = np.random.default_rng(base)
    page, slots, n = 4096, 400, 150
    off = base + rng.choice(slots, n, replace=False).astype(np.int64) * page
    nb = np.full(n, page, np.int64)
    size = base + slots * page
    src = rng.integers(0, 256, n * page, dtype=np.uint8)
    for chunk in (5 * page + 123, 64 * page, 3 * page):
        dst = np.zeros(size, np.uint8)
        o, b = normalise_spans(off, nb, size)
        plan = ChunkPlan(o, b, chunk)
        for k in range(plan.nchunks):
            start = k * chunk
            plan.scatter(dst, k, src[start:start + plan.chunk_len(k)])
        assert np.array_equal(stream(dst, off, nb), src)
        assert int(np.count_nonzero(dst)) == int(np.count_nonzero(src))
