"""transport=auto: shm for peers on this host, settings.auto_cross_host for the others.

Real parts: two auto transports in this process or a second process (auto_peer_proc.py), real
sockets on 127.0.0.1. A peer "on another host" is one whose address carries another host
identity (built by hand, as a peer on another machine would send it): the route is chosen from
that identity alone, so the cross-host lane is exercised on one machine.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pydantic
import pytest
import xxhash
from test_conformance import (  # the shared harness (tests/transports is on sys.path)
    BUF,
    CHUNK,
    WAIT_S,
    Done,
    PeerProcess,
    random_spans,
    stream,
)
from test_one_sided import Written

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans
from kvhandoff.settings import Settings, TransportKind
from kvhandoff.transports import load_transport
from kvhandoff.transports.auto import (
    VERSION,
    AutoAddress,
    AutoDescriptor,
    AutoTransport,
    decode_address,
    encode_address,
    shm_usable,
)

AUTO_PEER = Path(__file__).with_name("auto_peer_proc.py")
OTHER_HOST = b"\xee" * 16


def make(cross: str = "tcp") -> AutoTransport:
    tr = load_transport("auto", Settings(auto_cross_host=cross, chunk_bytes=CHUNK,
                                         stall_timeout_s=WAIT_S))
    assert isinstance(tr, AutoTransport)
    return tr


def as_other_host(address: bytes) -> bytes:
    a = decode_address(address)
    return encode_address(OTHER_HOST, a.shm, a.cross_kind, a.cross, pidns=a.pidns)


class AutoPair:
    """a and b, each with one "kv" buffer; `other_host` makes each see the other as remote."""

    def __init__(self, other_host: bool, cross: str = "tcp") -> None:
        self.a, self.b = make(cross), make(cross)
        rng = np.random.default_rng(5)
        self.src = rng.integers(0, 256, BUF, dtype=np.uint8)
        self.dst = np.zeros(BUF, np.uint8)
        self.a.register("kv", self.src)
        self.b.register("kv", self.dst)
        fix = as_other_host if other_host else (lambda x: x)
        self.a.connect("b", fix(self.b.address))
        self.b.connect("a", fix(self.a.address))

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=[False, True], ids=["same-host", "other-host"])
def pair(request: pytest.FixtureRequest) -> Iterator[AutoPair]:
    p = AutoPair(bool(request.param))
    yield p
    p.close()


# ---- settings -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["shm", "auto", "inproc"])
def test_auto_cross_host_refuses_same_host_kinds_naming_the_field(bad: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"auto_cross_host must be ucx, tcp or "
                       rf"nixl .*got '{bad}'"):
        Settings(auto_cross_host=bad)


def test_auto_cross_host_defaults_to_ucx_and_accepts_tcp() -> None:
    assert Settings().auto_cross_host is TransportKind.UCX
    assert Settings(auto_cross_host="tcp").auto_cross_host is TransportKind.TCP


# ---- routing ------------------------------------------------------------------------------

def test_address_is_versioned_msgpack_with_this_host_and_both_parts() -> None:
    tr = make()
    try:
        raw = msgspec.msgpack.decode(tr.address)
        assert isinstance(raw, list | dict)  # plain msgpack, no pickle
        a = decode_address(tr.address)
        assert a.v == VERSION and a.cross_kind == "tcp"
        assert a.shm and a.cross and a.host != OTHER_HOST
    finally:
        tr.close()


def test_same_host_peer_goes_to_shm() -> None:
    pair = AutoPair(False)
    try:
        _check_same_host(pair)
    finally:
        pair.close()


def _check_same_host(pair: AutoPair) -> None:
    assert pair.a.route("b") == "shm" and pair.b.route("a") == "shm"
    st = pair.a.status()
    assert st.kind == "auto" and not st.degraded
    assert "shm for 1 same-host peer(s), tcp for 0 peer(s)" in st.reason
    # tcp on its own is degraded, but no connected peer uses it
    assert "would be degraded, but no connected peer uses it" in st.reason
    assert st.lanes == ("shm", "tcp")  # nothing moved yet; the unused cross part only named
    assert "same-host peer(s) over" not in st.reason


def test_other_host_peer_goes_cross_host_and_degrades_naming_it() -> None:
    pair = AutoPair(True)
    try:
        _check_other_host(pair)
    finally:
        pair.close()


def _check_other_host(pair: AutoPair) -> None:
    assert pair.a.route("b") == "tcp" and pair.b.route("a") == "tcp"
    st = pair.a.status()
    assert st.degraded
    assert "shm for 0 same-host peer(s), tcp for 1 peer(s)" in st.reason
    assert "the tcp lane to peer(s) b is degraded" in st.reason
    assert "tcp:tcp" in st.lanes
    pair.a.disconnect("b")
    assert pair.a.route("b") is None
    assert not pair.a.status().degraded  # nobody uses the degraded lane any more


@pytest.mark.parametrize("seed", [1, 2])
def test_two_sided_bytes_exact_on_either_route(pair: AutoPair, seed: int) -> None:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, BUF // 2))
    s = random_spans(rng, total, BUF, 4 * CHUNK)
    d = random_spans(rng, total, BUF, 4 * CHUNK)
    sent, got = Done(), Done()
    pair.b.post_recv("a", seed, "kv", *d, got)
    pair.a.post_send("b", seed, "kv", *s, sent)
    assert got.wait() is None and sent.wait() is None
    assert np.array_equal(stream(pair.dst, *d), stream(pair.src, *s))
    assert pair.a.status().bytes_sent == total
    assert pair.b.status().bytes_received == total
    route = pair.a.route("b")
    lanes = pair.b.status().lanes
    if route == "shm":  # the writer copied into b's memory with process_vm_writev
        assert "shm/cma" in lanes
    else:
        assert route == "tcp" and "shm/cma" not in lanes and "shm/map" not in lanes


def test_one_sided_write_same_host_in_process() -> None:
    p = AutoPair(False)
    try:
        assert p.a.can_write("b") and p.a.route("b") == "shm"
        p.a.register_remote("b", "kv", p.b.describe("kv"))
        rng = np.random.default_rng(9)
        s = random_spans(rng, BUF // 3, BUF, 4 * CHUNK)
        d = random_spans(rng, BUF // 3, BUF, 4 * CHUNK)
        w = Written()
        p.a.post_writes("b", [(4, "kv", "kv", pair_spans(*s, *d))], w, checksum=True)
        err, digest = w.wait()
        assert err is None
        assert digest == xxhash.xxh3_64(stream(p.src, *s).data).intdigest()
        assert np.array_equal(stream(p.dst, *d), stream(p.src, *s))
        assert p.a.peer_exited("b") is False  # alive
    finally:
        p.close()


def test_cross_host_tcp_route_refuses_one_sided_writes_naming_lane_and_peer() -> None:
    p = AutoPair(True)
    try:
        assert p.a.can_write("b") is False  # asked, not learnt from the refusal below
        with pytest.raises(TransportError, match=r"register_remote 'kv': the tcp lane to peer "
                           r"'b' has no one-sided writes"):
            p.a.register_remote("b", "kv", p.b.describe("kv"))
        # the session then sends two-sided: that still works on the same pair
        done, got = Done(), Done()
        p.b.post_recv("a", 1, "kv", np.array([0]), np.array([BUF]), got)
        p.a.post_send("b", 1, "kv", np.array([0]), np.array([BUF]), done)
        assert done.wait() is None and got.wait() is None
        assert np.array_equal(p.dst, p.src)
    finally:
        p.close()


def test_describe_holds_the_shm_part_and_no_cross_part_for_tcp() -> None:
    tr = make()
    try:
        tr.register("kv", np.zeros(64, np.uint8))
        d = msgspec.msgpack.decode(tr.describe("kv"), type=AutoDescriptor)
        assert d.v == VERSION and d.cross_kind == "tcp"
        assert d.shm and d.cross == b""  # tcp has no one-sided writes: no cross-host part
        with pytest.raises(TransportError, match="no buffer registered as 'nope'"):
            tr.describe("nope")
    finally:
        tr.close()


def test_bad_addresses_and_unknown_peers_are_clear_errors() -> None:
    a, b = make(), make()
    try:
        a.register("kv", np.zeros(64, np.uint8))
        with pytest.raises(TransportError, match="not an auto transport AutoAddress"):
            a.connect("x", b"\x01\x02garbage")
        old = msgspec.msgpack.encode(AutoAddress(VERSION + 1, OTHER_HOST, "", True, "", b"",
                                                 "tcp", b""))
        with pytest.raises(TransportError, match=f"version {VERSION + 1}"):
            a.connect("x", old)
        ucx_peer = decode_address(b.address)  # another host whose cross-host kind differs
        wrong = encode_address(OTHER_HOST, ucx_peer.shm, "ucx", ucx_peer.cross,
                               pidns=ucx_peer.pidns)
        with pytest.raises(TransportError, match="auto_cross_host is ucx, this side's is tcp"):
            a.connect("x", wrong)
        assert a.route("x") is None
        one = np.array([1])
        calls: list[tuple[Callable[[], object], str]] = [
            (lambda: a.post_send("x", 1, "kv", one * 0, one, Done()), "post_send"),
            (lambda: a.post_recv("x", 1, "kv", one * 0, one, Done()), "post_recv"),
            (lambda: a.register_remote("x", "kv", b"\x90"), "register_remote"),
            (lambda: a.can_write("x"), "can_write"),
            (lambda: a.post_writes("x", [(1, "kv", "kv",
                                          pair_spans(one * 0, one, one * 0, one))], Written()),
             "post_writes")]  # a post_writes job of one write
        for call, what in calls:
            with pytest.raises(TransportError, match=f"{what}: peer 'x' is not connected"):
                call()
        a.cancel("x", 1)  # nothing of an unknown peer to cancel
        a.disconnect("x")
        assert a.peer_exited("x") is False
        a.connect("b", b.address)
        a.connect("b", b.address)  # idempotent
        with pytest.raises(TransportError, match="already connected at another address"):
            a.connect("b", as_other_host(b.address))
        with pytest.raises(TransportError, match="descriptor"):
            a.register_remote("b", "kv", b"short")
    finally:
        a.close()
        b.close()
    with pytest.raises(TransportError, match="closed"):
        a.post_send("b", 1, "kv", np.array([0]), np.array([1]), Done())


def _rewrite(address: bytes, **change: object) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(decode_address(address), **change))


@pytest.mark.parametrize(("change", "why"), [
    ({"pidns": "0:12345"}, "another PID namespace (peer 0:12345"),
    ({"shm_ok": False, "shm_why": "Yama ptrace_scope=1 forbids"},
     "the peer's side: Yama ptrace_scope=1 forbids"),
])
def test_same_host_peer_that_cannot_use_shm_goes_cross_host_saying_why(
        change: dict[str, object], why: str) -> None:
    a, b = make(), make()
    try:
        src = np.arange(4096, dtype=np.int64).view(np.uint8).copy()
        dst = np.zeros_like(src)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", _rewrite(b.address, **change))  # same host identity, unlike otherwise
        b.connect("a", as_other_host(a.address))  # (b sees a over tcp as well)
        assert a.route("b") == "tcp"
        st = a.status()
        assert f"same-host peer(s) over tcp: b ({why}" in st.reason
        assert st.degraded and "tcp:tcp" in st.lanes and "shm/cma" not in st.lanes
        done, got = Done(), Done()
        b.post_recv("a", 3, "kv", np.array([0]), np.array([src.size]), got)
        a.post_send("b", 3, "kv", np.array([0]), np.array([src.size]), done)
        assert done.wait() is None and got.wait() is None
        assert np.array_equal(dst, src)
        a.disconnect("b")
        assert "same-host peer(s) over" not in a.status().reason
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("scope", "cap", "ok"), [
    (None, 0, True), ("0\n", 0, True), ("1\n", 0, False), ("1\n", 1 << 19, True),
    ("2", 1 << 19, True), ("2", 0, False), ("3", 1 << 19, False)])
def test_shm_usable_follows_ptrace_scope_and_cap_sys_ptrace(scope: str | None, cap: int,
                                                            ok: bool) -> None:
    got, why = shm_usable(scope, cap)
    assert got is ok
    assert (why == "") is ok and (ok or "ptrace_scope" in why)


def test_require_rdma_applies_to_the_cross_host_part() -> None:
    with pytest.raises(TransportError, match="tcp transport refused: require_rdma is set"):
        load_transport("auto", Settings(auto_cross_host="tcp", require_rdma=True))
    ucx = load_transport("ucx", Settings())
    ucx_degraded = ucx.status().degraded
    ucx.close()
    s = Settings(auto_cross_host="ucx", require_rdma=True, chunk_bytes=CHUNK)
    if ucx_degraded:  # refused at start, as ucx alone fails the agent's readiness check
        with pytest.raises(TransportError, match="require_rdma is set but its cross-host ucx"):
            load_transport("auto", s)
        return
    a, b = load_transport("auto", s), load_transport("auto", s)
    try:  # shm (no RDMA, never degraded) still serves same-host peers
        a.connect("b", b.address)
        assert isinstance(a, AutoTransport) and a.route("b") == "shm"
        assert not a.status().degraded
    finally:
        a.close()
        b.close()


# ---- two processes --------------------------------------------------------------------------

class AutoPeer(PeerProcess):
    """auto_peer_proc.py in a second process (the line protocol of PeerProcess)."""

    def __init__(self, cross: str, host: str) -> None:  # noqa: D107 (no super: another script)
        self.proc = subprocess.Popen([sys.executable, str(AUTO_PEER), cross, str(BUF), host],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.held: list[dict[str, object]] = []
        threading.Thread(target=self._read, daemon=True).start()


def test_two_processes_one_sided_writes_through_auto() -> None:
    peer = AutoPeer("tcp", "same")
    tr = make()
    try:
        rng = np.random.default_rng(11)
        mine = rng.integers(0, 256, BUF, dtype=np.uint8)
        tr.register("kv", mine)
        hello = peer.expect("address")
        tr.connect("peer", bytes.fromhex(str(hello["address"])))
        assert tr.route("peer") == "shm"
        peer.send(cmd="connect", address=tr.address.hex())
        assert peer.expect("connected")["connected"] == "shm"
        # the decode's Hello descriptor, installed as the session does after connect
        tr.register_remote("peer", "kv", bytes.fromhex(str(hello["descriptor"])))
        for tag in (1, 2, 3):
            total = int(rng.integers(1, BUF // 3))
            s = random_spans(rng, total, BUF, 4 * CHUNK)
            d = random_spans(rng, total, BUF, 4 * CHUNK)
            w = Written()
            tr.post_writes("peer", [(tag, "kv", "kv", pair_spans(*s, *d))], w, checksum=True)
            err, digest = w.wait()
            assert err is None
            want = xxhash.xxh3_64(stream(mine, *s).data)
            assert digest == want.intdigest()
            peer.send(cmd="digest", offsets=d[0].tolist(), nbytes=d[1].tolist())
            assert peer.expect("digest")["digest"] == want.hexdigest()  # landed in the peer
        st = tr.status()
        assert "shm/cma" in st.lanes and not st.degraded
        assert st.bytes_sent > 0
        assert tr.peer_exited("peer") is False
    finally:
        tr.close()
        peer.close()


def test_two_processes_other_host_route_is_two_sided_over_tcp() -> None:
    peer = AutoPeer("tcp", "other")
    tr = make()
    try:
        rng = np.random.default_rng(12)
        mine = rng.integers(0, 256, BUF, dtype=np.uint8)
        tr.register("kv", mine)
        hello = peer.expect("address")
        tr.connect("peer", bytes.fromhex(str(hello["address"])))
        assert tr.route("peer") == "tcp"
        peer.send(cmd="connect", address=as_other_host(tr.address).hex())
        assert peer.expect("connected")["connected"] == "tcp"
        with pytest.raises(TransportError, match="the tcp lane to peer 'peer' has no one-sided"):
            tr.register_remote("peer", "kv", bytes.fromhex(str(hello["descriptor"])))
        total = BUF // 2 + 333
        s = random_spans(rng, total, BUF, 4 * CHUNK)
        d = random_spans(rng, total, BUF, 4 * CHUNK)
        sent = Done()
        peer.send(cmd="recv", tag=5, offsets=d[0].tolist(), nbytes=d[1].tolist())
        peer.expect("posted")
        tr.post_send("peer", 5, "kv", *s, sent)
        assert sent.wait() is None
        assert peer.expect("done")["error"] is None
        peer.send(cmd="digest", offsets=d[0].tolist(), nbytes=d[1].tolist())
        assert peer.expect("digest")["digest"] == xxhash.xxh3_64(stream(mine, *s).data).hexdigest()
        assert peer.ask("status")["degraded"] is True  # its one peer uses the tcp lane
        assert tr.status().degraded
    finally:
        tr.close()
        peer.close()


def test_cross_host_nixl_route_writes_one_sided() -> None:
    try:
        a = make("nixl")
    except TransportError as e:
        if "cannot be loaded" in str(e):
            pytest.skip(f"nixl is not installed here: {e}")
        raise
    b = make("nixl")
    try:
        rng = np.random.default_rng(21)
        src = rng.integers(0, 256, BUF, dtype=np.uint8)
        dst = np.zeros(BUF, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", as_other_host(b.address))
        b.connect("a", as_other_host(a.address))
        assert a.routes() == {"b": "nixl"} and b.routes() == {"a": "nixl"}
        a.register_remote("b", "kv", b.describe("kv"))  # the nixl part of the descriptor
        s = random_spans(rng, BUF // 4, BUF, 4 * CHUNK)
        d = random_spans(rng, BUF // 4, BUF, 4 * CHUNK)
        w = Written()
        a.post_writes("b", [(8, "kv", "kv", pair_spans(*s, *d))], w, checksum=True)
        err, digest = w.wait()
        assert err is None
        assert digest == xxhash.xxh3_64(stream(src, *s).data).intdigest()
        assert np.array_equal(stream(dst, *d), stream(src, *s))
        assert any(lane.startswith("nixl:") for lane in a.status().lanes)
    finally:
        a.close()
        b.close()
