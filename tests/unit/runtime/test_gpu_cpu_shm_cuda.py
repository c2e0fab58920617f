"""The shm transport's CUDA lane on a machine without a GPU.

What runs here for real: two shm transports (real sockets, real I/O threads, real pidfds), the
lane's descriptor format, the dispatch by memory kind at register / describe /
register_remote / post_writes / post_send, the refusals, and the whole one-sided write path of
device buffers: the lane's worker, `_cuda_ipc.copy_spans` (its executor runs on CPU tensors),
the device checksum of the source, completion only once the copy's event completed,
disconnect closing the peer's blocks. What stands in for CUDA: `CpuLane` treats CPU torch
tensors as the device buffers and replaces the IPC export/open (CUDA IPC needs a GPU; the
two-process CUDA case is tests/unit/gpu/test_shm_cuda_handoff.py, marked gpu)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.buffers.bufferset import DeviceBytes
from kvhandoff.buffers.devsum import devsum_reference
from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans, plan_of
from kvhandoff.settings import Settings
from kvhandoff.transports.base import WriteResult
from kvhandoff.transports.shm.cuda import (
    DEV_MAGIC,
    DeviceJob,
    DeviceLane,
    encode_device_descriptor,
    parse_device_descriptor,
)
from kvhandoff.transports.shm.cuda_ipc import IpcExport
from kvhandoff.transports.shm.transport import ShmTransport

from .test_gpu_cpu_buffers import FakeCudaArray

WAIT_S = 15.0
BUF = 1 << 16


class GateEvent:
    """A copy's event that completes once the test opens `gate`; counts its polls."""

    def __init__(self, inner: Any, gate: threading.Event, polled: threading.Condition,
                 counter: list[int]) -> None:
        self.inner, self.gate, self.polled, self.counter = inner, gate, polled, counter

    def query(self) -> bool:
        with self.polled:
            self.counter[0] += 1
            self.polled.notify_all()
        return self.gate.is_set() and bool(self.inner.query())


class CpuLane(DeviceLane):
    """CPU torch tensors stand in for CUDA ones; export/open go through a process-local table
    keyed like CUDA IPC (one block per storage, buffers addressed by offset in it)."""

    blocks_by_handle: dict[bytes, torch.Tensor] = {}

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.opened: dict[tuple[str, bytes], torch.Tensor] = {}
        self.opens = 0
        self.closed: list[str] = []
        self.copy_threads: list[str] = []
        self.gate: threading.Event | None = None
        self.polled = threading.Condition()
        self.polls = [0]

    def claims(self, buf: Any) -> bool:
        return isinstance(buf, torch.Tensor) or super().claims(buf)

    def export(self, buf: Any) -> IpcExport:
        if not isinstance(buf, torch.Tensor):
            return super().export(buf)
        st = buf.untyped_storage()
        handle = st.data_ptr().to_bytes(8, "little")
        whole = torch.empty(0, dtype=torch.uint8).set_(st)
        CpuLane.blocks_by_handle[handle] = whole
        return IpcExport(device=0, handle=handle, storage_offset=0,
                         storage_nbytes=st.nbytes(), offset=buf.data_ptr() - st.data_ptr(),
                         nbytes=buf.numel(), ref_counter_handle=b"", ref_counter_offset=0,
                         event_handle=b"", event_sync_required=False)

    def open(self, peer: str, export: IpcExport) -> Any:
        key = (peer, export.handle)
        if key not in self.opened:
            self.opened[key] = CpuLane.blocks_by_handle[export.handle]
            self.opens += 1
        block = self.opened[key]
        return block[export.block_offset:export.block_offset + export.nbytes]

    def close_peer(self, peer: str) -> int:
        self.closed.append(peer)
        keys = [k for k in self.opened if k[0] == peer]
        for k in keys:
            del self.opened[k]
        return len(keys)

    def copy(self, job: DeviceJob) -> Any:
        self.copy_threads.append(threading.current_thread().name)
        event = super().copy(job)
        return event if self.gate is None else GateEvent(event, self.gate, self.polled,
                                                         self.polls)


class Written:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.results: list[tuple[BaseException | None, int | None]] = []

    def __call__(self, result: WriteResult) -> None:
        assert isinstance(result, WriteResult) and len(result.digests) in (0, 1), result
        self.results.append((result.error, result.digests[0] if result.digests else None))
        self.event.set()

    def wait(self) -> tuple[BaseException | None, int | None]:
        assert self.event.wait(WAIT_S), "on_done was not called in time"
        assert len(self.results) == 1
        return self.results[0]


def _shm(lane: DeviceLane | None = None) -> ShmTransport:
    return ShmTransport(Settings(transport="shm"), device_lane=lane)


class DevPair:
    """Writer `a` and receiver `b`, each with two device buffers cut from one storage."""

    def __init__(self) -> None:
        self.la, self.lb = CpuLane("a"), CpuLane("b")
        self.a, self.b = _shm(self.la), _shm(self.lb)
        g = torch.Generator().manual_seed(7)
        self.src_store = torch.randint(0, 256, (2 * BUF,), dtype=torch.uint8, generator=g)
        self.dst_store = torch.zeros(2 * BUF, dtype=torch.uint8)
        for i, name in enumerate(("kv/0", "kv/1")):
            self.a.register(name, self.src_store[i * BUF:(i + 1) * BUF])
            self.b.register(name, self.dst_store[i * BUF:(i + 1) * BUF])
        self.a.connect("b", self.b.address)
        self.b.connect("a", self.a.address)

    def install(self) -> None:
        for name in ("kv/0", "kv/1"):
            self.a.register_remote("b", name, self.b.describe(name))

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def dev() -> Iterator[DevPair]:
    p = DevPair()
    yield p
    p.close()


def _word_spans(rng: np.random.Generator, total_words: int, limit: int, pieces: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping spans of whole 4-byte words carrying `total_words` words, in random
    order, inside a buffer of `limit` bytes."""
    cuts = np.sort(rng.choice(np.arange(1, total_words), pieces - 1, replace=False))
    lens = np.diff(np.concatenate([[0], cuts, [total_words]])) * 4
    slots = limit // len(lens)
    order = rng.permutation(len(lens))
    offs = order * slots + rng.integers(0, slots - lens.max() + 1, len(lens)) // 4 * 4
    return offs.astype(np.int64), lens.astype(np.int64)


def _stream(buf: torch.Tensor, off: np.ndarray, nb: np.ndarray) -> np.ndarray:
    a = buf.numpy()
    return np.concatenate([a[o:o + n] for o, n in zip(off.tolist(), nb.tolist(), strict=True)])


# ---- descriptor ----------------------------------------------------------------------------

def _export(nbytes: int = 64) -> IpcExport:
    return IpcExport(device=1, handle=b"h" * 64, storage_offset=512, storage_nbytes=4096,
                     offset=128, nbytes=nbytes, ref_counter_handle=b"r", ref_counter_offset=8,
                     event_handle=b"e", event_sync_required=True)


def test_device_descriptor_round_trip_and_errors_name_the_field() -> None:
    desc = encode_device_descriptor(4242, 64, _export())
    assert desc.startswith(DEV_MAGIC)
    pid, n, exp = parse_device_descriptor(desc)
    assert (pid, n, exp) == (4242, 64, _export())
    import msgspec

    def with_map(m: dict[str, Any]) -> bytes:
        return DEV_MAGIC + msgspec.msgpack.encode(m)

    good = {"v": 1, "pid": 1, "nbytes": 64, "ipc": _export().encode()}
    cases = [
        (b"KVHSHMD1" + desc[8:], "bad magic"),
        (with_map({**good, "v": 2}), "version 2"),
        (with_map({k: v for k, v in good.items() if k != "pid"}), "'pid'"),
        (with_map({**good, "nbytes": "64"}), "'nbytes'"),
        (with_map({**good, "ipc": b"\x01\x02"}), "'ipc'"),
        (with_map({**good, "nbytes": 65}), "nbytes 65"),
        (DEV_MAGIC + b"\xc1", "not msgpack"),
    ]
    for blob, want in cases:
        with pytest.raises(TransportError, match=want):
            parse_device_descriptor(blob)


# ---- dispatch by memory kind (real lane, no CUDA: array-interface buffers) ----------------

def test_register_dispatches_by_memory_kind_and_refuses_a_mix() -> None:
    t = _shm()
    try:
        t.register("kv/0", FakeCudaArray(0x7F00_0000_0000, 256))
        t.register("kv/1", DeviceBytes(0x7F00_0000_1000, 256, 0, None))
        assert t.write_digest_alg("kv/0") == "devsum"
        assert t.write_digest_alg("nope") is None
        with pytest.raises(TransportError, match="host memory but 'kv/0' is device memory"):
            t.register("host", np.zeros(64, np.uint8))
        with pytest.raises(TransportError, match="already registered"):
            t.register("kv/0", FakeCudaArray(0x7F00_0000_2000, 64))
        for post in (t.post_send, t.post_recv):
            with pytest.raises(TransportError, match="one-sided writes only"):
                post("p", 1, "kv/0", np.array([0]), np.array([4]), lambda e: None)
        # no torch CUDA tensor to export here: describe says why
        with pytest.raises(TransportError, match="__cuda_array_interface__"):
            t.describe("kv/1")
    finally:
        t.close()
    h = _shm()
    try:
        h.register("host", np.zeros(64, np.uint8))
        assert h.write_digest_alg("host") == "xxh3"
        with pytest.raises(TransportError, match="device memory but 'host' is host memory"):
            h.register("kv/0", FakeCudaArray(0x7F00_0000_0000, 256))
    finally:
        h.close()


def test_host_device_mix_is_refused_at_register_remote() -> None:
    dev, host = _shm(CpuLane("d")), _shm()
    try:
        dev.register("kv/0", torch.zeros(256, dtype=torch.uint8))
        host.register("kv/0", np.zeros(256, np.uint8))
        dev.connect("h", host.address)
        host.connect("d", dev.address)
        with pytest.raises(TransportError, match="host to host or device to device"):
            dev.register_remote("h", "kv/0", host.describe("kv/0"))
        with pytest.raises(TransportError, match="host to host or device to device"):
            host.register_remote("d", "kv/0", dev.describe("kv/0"))
    finally:
        dev.close()
        host.close()


# ---- one-sided writes of device buffers ----------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_device_write_lands_with_the_device_checksum(dev: DevPair, seed: int) -> None:
    dev.install()
    assert dev.la.opens == 1  # two buffers of one block: one open for the peer
    rng = np.random.default_rng(seed)
    words = int(rng.integers(64, BUF // 8))
    s = _word_spans(rng, words, BUF, 17)
    d = _word_spans(rng, words, BUF, 5)
    w = Written()
    dev.a.post_writes("b", [(seed, "kv/1", "kv/1", pair_spans(*s, *d))], w, checksum=True)
    err, digest = w.wait()
    assert err is None
    src, dst = dev.src_store[BUF:], dev.dst_store[BUF:]
    assert digest == devsum_reference(src.numpy(), *s)
    assert np.array_equal(_stream(dst, *d), _stream(src, *s))
    mask = np.ones(BUF, bool)
    for o, n in zip(*d, strict=True):
        mask[o:o + n] = False
    assert not dst.numpy()[mask].any()  # nothing outside the spans
    assert not dev.dst_store[:BUF].any()  # nor in the other buffer
    assert dev.la.copy_threads and all(n.startswith("kvhandoff-shm-cuda-")
                                       for n in dev.la.copy_threads)
    st = dev.a.status()
    assert "shm/cuda-ipc" in st.lanes and st.bytes_sent == words * 4


def test_on_done_waits_for_the_copys_event(dev: DevPair) -> None:
    dev.install()
    dev.la.gate = threading.Event()
    w = Written()
    dev.a.post_writes("b", [(9, "kv/0", "kv/0", plan_of([0], [8192], [4096]))], w, checksum=False)
    with dev.la.polled:  # the worker polled the pending event several times
        assert dev.la.polled.wait_for(lambda: dev.la.polls[0] >= 3, WAIT_S)
    assert not w.event.is_set()
    dev.la.gate.set()
    err, digest = w.wait()
    assert err is None and digest is None
    assert torch.equal(dev.dst_store[8192:8192 + 4096], dev.src_store[:4096])


def test_a_host_write_into_a_device_target_is_refused(dev: DevPair) -> None:
    dev.install()
    with pytest.raises(TransportError, match="no buffer registered"):
        dev.a.post_writes("b", [(1, "host", "kv/0", plan_of([0], [0], [4]))], Written())
    with pytest.raises(TransportError, match="exceeds the local buffer 'kv/0'"):
        dev.a.post_writes("b", [(1, "kv/0", "kv/0", plan_of([0], [0], [1 << 40]))], Written())


def test_a_devsum_failure_fails_the_write_after_its_copy(dev: DevPair) -> None:
    dev.install()
    w = Written()
    dev.a.post_writes("b", [(3, "kv/0", "kv/0", plan_of([0], [0], [6]))], w, checksum=True)
    err, digest = w.wait()
    assert err is not None and "multiple of 4" in str(err) and digest is None
    assert torch.equal(dev.dst_store[:6], dev.src_store[:6])  # the copy itself ran


def test_disconnect_closes_the_peers_blocks(dev: DevPair) -> None:
    dev.install()
    w = Written()
    dev.a.post_writes("b", [(4, "kv/0", "kv/0", plan_of([0], [0], [64]))], w)
    assert w.wait()[0] is None
    dev.a.disconnect("b")
    assert dev.la.closed == ["b"] and not dev.la.opened


# ---- a peer process that exits ---------------------------------------------------------------

_CHILD = r"""
import sys, torch
from kvhandoff.settings import Settings
from kvhandoff.transports.shm.cuda_ipc import IpcExport
from kvhandoff.transports.shm.cuda import DeviceLane
from kvhandoff.transports.shm.transport import ShmTransport

class Lane(DeviceLane):
    def claims(self, buf):
        return True
    def export(self, buf):
        return IpcExport(device=0, handle=b"child", storage_offset=0,
                         storage_nbytes=buf.numel(), offset=0, nbytes=buf.numel(),
                         ref_counter_handle=b"", ref_counter_offset=0, event_handle=b"",
                         event_sync_required=False)

t = ShmTransport(Settings(transport="shm"), device_lane=Lane("child"))
t.register("kv/0", torch.zeros(4096, dtype=torch.uint8))
print(t.address.hex(), t.describe("kv/0").hex(), flush=True)
sys.stdin.read()
"""


def test_no_device_copy_into_a_peer_process_that_exited() -> None:
    """The receiver is a real second process; once it exited, a write into its (IPC-opened)
    memory fails without launching a copy, and the writer keeps
    working and closes."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    lane = CpuLane("w")
    CpuLane.blocks_by_handle[b"child"] = torch.zeros(4096, dtype=torch.uint8)  # stand-in
    w = _shm(lane)
    try:
        assert proc.stdout is not None
        addr_hex, desc_hex = proc.stdout.readline().split()
        w.register("kv/0", torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        w.connect("child", bytes.fromhex(addr_hex))
        w.register_remote("child", "kv/0", bytes.fromhex(desc_hex))
        assert lane.opens == 1
        ok = Written()
        w.post_writes("child", [(1, "kv/0", "kv/0", plan_of([0], [0], [64]))], ok)
        assert ok.wait()[0] is None and len(lane.copy_threads) == 1
        proc.kill()
        proc.wait(WAIT_S)
        assert w.peer_exited("child")
        gone = Written()
        w.post_writes("child", [(2, "kv/0", "kv/0", plan_of([0], [64], [64]))], gone)
        err, _ = gone.wait()
        assert err is not None and "exited" in str(err)
        assert len(lane.copy_threads) == 1  # no second copy launched
        w.disconnect("child")
        assert lane.closed == ["child"]
    finally:
        w.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- agents with device buffers ------------------------------------------------------------

def test_agents_with_device_buffers_fail_a_two_sided_room_saying_why() -> None:
    """Two real agents over shm with CUDA array-interface buffers (no GPU: nothing reads
    them) and one_sided_writes off: both Hellos say cuda, and the room fails naming the rule
    (device memory moves by one-sided writes only) instead of moving anything."""
    from kvhandoff.state_machine import KVPoll
    from kvhandoff.transfer import TransferAgent

    from .conftest import layers_of, tiny_layout
    from .test_gpu_cpu_buffers import fake_buffers

    lay = tiny_layout()
    # (checksum off: the CPU cannot hash memory known only by address)
    st = Settings(transport="shm", one_sided_writes=False, heartbeat_interval_s=1.0,
                  checksum="off")
    p = TransferAgent("prefill", lay, fake_buffers(lay, 8), st, engine_id="dev-p")
    try:
        d = TransferAgent("decode", lay, fake_buffers(lay, 8), st, engine_id="dev-d")
        try:
            assert p.buffers.memory == d.buffers.memory == "cuda"
            sender = p.sender(5, pages=np.arange(2), seq_len=20)
            receiver = d.receiver(5, peer=p.address)
            receiver.init(np.arange(2), 20, 0)
            for lid in layers_of(lay):
                sender.layer_ready(lid)
            assert receiver.wait(WAIT_S) is KVPoll.Failed
            assert sender.wait(WAIT_S) is KVPoll.Failed
            why = f"{receiver.failure} {sender.failure}"
            assert "one-sided writes only" in why, why
            assert p._session.me.memory == d._session.me.memory == "cuda"
        finally:
            d.close()
    finally:
        p.close()
