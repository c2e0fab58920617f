"""The nixl transport beyond the shared suites: one-sided writes into a real second process
(byte-exact with digest, cancel in flight, a killed peer), the missing-extra error, and its
pure helpers (descriptor pairing, memory kinds, UCX resource parsing).

Cases that load NIXL skip where nixl_cu12 is not installed (make setup installs it).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from test_conformance import WAIT_S, random_spans, stream
from test_one_sided import Written

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans, plan_of
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport
from kvhandoff.transports.nixl.lib import parse_resources
from kvhandoff.transports.nixl.wire import (
    VERSION,
    Memory,
    NixlRegion,
    decode_region,
    encode,
    memory_of,
    write_descs,
)
from kvhandoff.transports.streams import normalise_spans

try:
    import nixl_cu12  # noqa: F401
    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl_cu12 is not importable: pip "
                                "install 'kvhandoff[nixl]' (make setup installs it)")
PEER = Path(__file__).with_name("nixl_peer.py")
BUF = 3 << 20


class NixlPeer:
    """tests/transports/nixl_peer.py in a second process, connected both ways to `tr`."""

    def __init__(self, tr: Any, size: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self.expect("address")
        tr.connect("peer", bytes.fromhex(hello["address"]))
        tr.register_remote("peer", "in", bytes.fromhex(hello["descriptor"]))
        self.send(cmd="connect", address=tr.address.hex())
        self.expect("connected")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, **msg: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def expect(self, key: str) -> dict[str, Any]:
        try:
            msg = self.lines.get(timeout=WAIT_S * 2)
        except queue.Empty:
            raise AssertionError(f"nixl peer sent no {key!r} in time") from None
        assert key in msg, msg
        return msg

    def digest(self, off: np.ndarray, nb: np.ndarray) -> str:
        self.send(cmd="digest", offsets=off.tolist(), nbytes=nb.tolist())
        return str(self.expect("digest")["digest"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(cmd="exit")
            self.expect("closed")
        assert self.proc.wait(timeout=WAIT_S) == 0  # also: no crash at exit


@pytest.fixture
def writer() -> Any:
    tr = load_transport("nixl", Settings(stall_timeout_s=WAIT_S))
    yield tr
    tr.close()


@needs_nixl
def test_write_into_another_process_byte_exact(writer: Any) -> None:
    src = np.random.default_rng(4).integers(0, 256, BUF, dtype=np.uint8)
    writer.register("kv", src)
    peer = NixlPeer(writer, BUF)
    try:
        rng = np.random.default_rng(5)
        for tag in (1, 2):
            total = int(rng.integers(1, BUF // 2))
            s = random_spans(rng, total, BUF, 256 << 10)
            d = random_spans(rng, total, BUF, 256 << 10)
            w = Written()
            writer.post_writes("peer", [(tag, "kv", "in", pair_spans(*s, *d))], w, checksum=True)
            err, digest = w.wait()
            want = xxhash.xxh3_64(stream(src, *s).data)
            assert err is None and digest == want.intdigest()
            assert peer.digest(*d) == want.hexdigest()
    finally:
        peer.close()


@needs_nixl
def test_cancel_in_flight_nothing_lands_after_return(writer: Any) -> None:
    size = 64 << 20
    src = np.random.default_rng(6).integers(1, 256, size, dtype=np.uint8)  # no zero bytes
    writer.register("kv", src)
    peer = NixlPeer(writer, size)
    try:
        n = size - 4096
        pages = np.arange(0, n, 4096, dtype=np.int64)  # many descriptors: a longer write
        sizes = np.full(pages.size, 4096, np.int64)
        w = Written()
        writer.post_writes("peer", [(7, "kv", "in",
                                     pair_spans(pages, sizes, pages[::-1].copy(), sizes))], w)
        writer.cancel("peer", 7)
        whole = (np.array([0]), np.array([n]))
        after_cancel = peer.digest(*whole)
        err, _ = w.wait()
        marker = Written()  # the link still works, and nothing of tag 7 arrived meanwhile
        writer.post_writes("peer", [(8, "kv", "in", plan_of([0], [n], [4096]))], marker)
        assert marker.wait() == (None, None)
        assert peer.digest(np.array([n]), np.array([4096])) == \
            xxhash.xxh3_64(src[:4096].data).hexdigest()
        if err is None:  # it completed before cancel: then all of it landed
            expect = stream(src, pages, sizes)
            d_off = pages[::-1].copy()
            assert peer.digest(d_off, sizes) == xxhash.xxh3_64(expect.data).hexdigest()
        else:
            assert isinstance(err, TransportError) and "cancelled" in str(err)
            assert peer.digest(*whole) == after_cancel
    finally:
        peer.close()


@needs_nixl
def test_killed_peer_fails_the_write_never_hangs(writer: Any) -> None:
    src = np.random.default_rng(8).integers(0, 256, BUF, dtype=np.uint8)
    writer.register("kv", src)
    peer = NixlPeer(writer, BUF)
    warm = Written()
    writer.post_writes("peer", [(1, "kv", "in", plan_of([0], [0], [BUF]))], warm)
    assert warm.wait() == (None, None)
    peer.proc.send_signal(signal.SIGKILL)
    assert peer.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    w = Written()
    writer.post_writes("peer", [(2, "kv", "in", plan_of([0], [0], [BUF]))], w, checksum=True)
    err, digest = w.wait()  # bounded: an error, not a hang
    assert isinstance(err, TransportError) and digest is None, err
    writer.disconnect("peer")
    with pytest.raises(TransportError, match="not connected"):
        writer.post_writes("peer", [(3, "kv", "in", plan_of([0], [0], [1]))], Written())


def test_missing_nixl_names_the_extra_to_install() -> None:
    code = ("import sys; sys.modules['nixl_cu12'] = None\n"
            "from kvhandoff.errors import TransportError\n"
            "from kvhandoff.settings import Settings\n"
            "from kvhandoff.transports import load_transport\n"
            "try:\n    load_transport('nixl', Settings())\n"
            "except TransportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvhandoff[nixl]'" in out.stdout, out.stdout


# ---- pure helpers ---------------------------------------------------------------------------

def test_write_descs_one_per_piece_of_any_plan() -> None:
    rng = np.random.default_rng(12)
    size = 1 << 20
    src = rng.integers(0, 256, size, dtype=np.uint8)
    for _ in range(20):
        total = int(rng.integers(1, size // 2))
        s = normalise_spans(*random_spans(rng, total, size, 40_000), size)
        d = normalise_spans(*random_spans(rng, total, size, 40_000), size)
        local = Memory("DRAM", 1 << 40, size, 0, None)
        region = NixlRegion(VERSION, "peer", "DRAM", 2 << 40, size, 3, b"")
        plan = pair_spans(*s, *d)
        ld, rd = write_descs(local, plan, region)
        assert ld.shape == rd.shape and ld.shape[1] == 3
        assert (ld[:, 1] == rd[:, 1]).all() and (ld[:, 1] > 0).all()
        assert (ld[:, 2] == 0).all() and (rd[:, 2] == 3).all()
        dst = np.zeros(size, np.uint8)
        for lo, ro, n in zip((ld[:, 0] - (1 << 40)).tolist(), (rd[:, 0] - (2 << 40)).tolist(),
                             ld[:, 1].tolist(), strict=True):
            dst[ro:ro + n] = src[lo:lo + n]
        assert np.array_equal(stream(dst, *d), stream(src, *s))
        assert ld.shape[0] == plan.count  # one descriptor per piece of the plan


def test_memory_kinds() -> None:
    host = np.zeros(100, np.uint8)
    m = memory_of("kv", host)
    assert (m.mem, m.addr, m.length, m.device) == ("DRAM", host.ctypes.data, 100, 0)

    class Dev:
        index = 2

    class FakeCuda:
        device = Dev()
        __cuda_array_interface__ = {"data": (0x7000_0000, False), "shape": (10, 4),
                                    "typestr": "<f2", "strides": None, "version": 3}

    m = memory_of("kv", FakeCuda())
    assert (m.mem, m.addr, m.length, m.device, m.host) == ("VRAM", 0x7000_0000, 80, 2, None)
    FakeCuda.__cuda_array_interface__ = {**FakeCuda.__cuda_array_interface__,
                                         "strides": (16, 2)}
    with pytest.raises(TransportError, match="contiguous"):
        memory_of("kv", FakeCuda())
    with pytest.raises(TransportError, match="numpy.ndarray .*CUDA"):
        memory_of("kv", [1, 2])


def test_region_descriptor_round_trip_and_errors() -> None:
    region = NixlRegion(VERSION, "a", "DRAM", 4096, 100, 0, b"md")
    assert decode_region(encode(region)) == region
    with pytest.raises(TransportError, match="descriptor"):
        decode_region(b"short")
    with pytest.raises(TransportError, match="version 9"):
        decode_region(encode(NixlRegion(9, "a", "DRAM", 4096, 100, 0, b"")))


def test_parse_ucx_resources() -> None:
    text = ("#\n# UCP context\n#\n#            md 0  :  component 0  self \n"
            "#      resource 0  :  md 0  dev 0  flags -- self/memory\n"
            "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0\n"
            "#      resource 2  :  md 5  dev 3  flags -- rc_mlx5/mlx5_0:1\n")
    assert parse_resources(text) == ("self/memory", "tcp/eth0", "rc_mlx5/mlx5_0:1")
