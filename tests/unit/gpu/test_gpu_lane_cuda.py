"""GPU tests (marker `gpu`; skipped with "no CUDA device" without one) of the device-memory
pieces: the CUDA IPC lane between two real processes (export of sub-block buffers, one open
per block, span copies cut differently on both sides, device checksums equal on both sides),
`BufferSet` on CUDA tensors and CUDA array interfaces, the host transports' refusal, and the
event waiter with real `torch.cuda.Event`s behind a long kernel. Run by scripts/gpu_check.sh.
Written without a GPU at hand: nothing here has run on a real GPU yet."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from kvhandoff.buffers.bufferset import BufferSet, allocate
from kvhandoff.buffers.devsum import devsum
from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import LayoutSpec, pair_spans
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.protocol import events as ev
from kvhandoff.runtime.eventwait import EventWaiter
from kvhandoff.settings import Settings
from kvhandoff.transports.shm.cuda_ipc import copy_spans, export_buffer

from .cuda_ipc_peer import pattern

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PEER = Path(__file__).with_name("cuda_ipc_peer.py")


def tiny_layout() -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=6, indexer_layer_ids=(0, 3, 5),
                          page_size_tokens=16).without_page_rules()


def _pages(rng: np.random.Generator, buf_bytes: int, page: int, n: int) -> tuple[list[int],
                                                                                 list[int]]:
    slots = rng.permutation(buf_bytes // page)[:n]
    return (slots * page).tolist(), [page] * n


@pytest.mark.parametrize("small", [1, 64 << 10])  # every piece one copy / all gathered
def test_cuda_ipc_copy_between_two_processes(small: int) -> None:
    rng = np.random.default_rng(11)
    # small buffers: the caching allocator carves them out of shared blocks
    bufs = [torch.zeros(96 << 10, dtype=torch.uint8, device="cuda") for _ in range(6)]
    bufs.append(torch.zeros(8 << 20, dtype=torch.uint8, device="cuda"))  # a block of its own
    exports = [export_buffer(b) for b in bufs]
    assert any(e.block_offset > 0 for e in exports), "no buffer inside a shared block"
    handles = {e.handle for e in exports}
    assert len(handles) < len(exports)
    src_bytes = 16 << 20
    items = []
    for b, e in zip(bufs, exports, strict=True):
        n = 20
        d_off, d_nb = _pages(rng, b.numel(), 1024, n)  # decode pages of 1024 B
        s_off, s_nb = _pages(rng, src_bytes, 256, n * 4)  # prefill pages of 256 B
        items.append({"desc": e.encode(), "src_off": s_off, "src_nb": s_nb, "dst_off": d_off,
                      "dst_nb": d_nb})
    torch.cuda.synchronize()
    req = {"device": torch.cuda.current_device(), "seed": 5, "src_bytes": src_bytes,
           "small": small, "items": items}
    r = subprocess.run([sys.executable, str(PEER)], input=msgspec.msgpack.encode(req),
                       capture_output=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    out = msgspec.msgpack.decode(r.stdout)
    assert out["ok"], out["error"]
    assert out["opens"] == len(handles)  # one open per block, not per buffer
    src = pattern(5, src_bytes)
    for b, item, digest in zip(bufs, items, out["digests"], strict=True):
        assert devsum(b, item["dst_off"], item["dst_nb"]) == digest
        host = b.cpu().numpy()
        want = b"".join(src[o:o + n].tobytes()
                        for o, n in zip(item["src_off"], item["src_nb"], strict=True))
        got = b"".join(host[o:o + n].tobytes()
                       for o, n in zip(item["dst_off"], item["dst_nb"], strict=True))
        assert got == want
        touched = np.zeros(host.size, bool)
        for o, n in zip(item["dst_off"], item["dst_nb"], strict=True):
            touched[o:o + n] = True
        assert not host[~touched].any()


def test_copy_spans_on_one_device_returns_an_event_behind_the_copies() -> None:
    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    s_off, s_nb = list(range(0, 1 << 21, 4096)), [4096] * 512
    d_off = [(1 << 22) - 4096 * (i + 1) for i in range(512)]
    e = copy_spans(src, dst, pair_spans(s_off, s_nb, d_off, [4096] * 512), small=1)
    e.synchronize()
    assert e.query()
    assert devsum(dst, d_off, [4096] * 512) == devsum(src, s_off, s_nb)


def test_buffer_set_takes_cuda_tensors_and_array_interfaces() -> None:
    lay = tiny_layout()
    bs = BufferSet(lay, allocate(lay, 4, device="cuda"))
    assert bs.memory == "cuda" and bs.device == torch.cuda.current_device()
    v = bs.array("main_kv", 0)
    assert isinstance(v, torch.Tensor) and v.is_cuda and v.dtype == torch.uint8

    class CudaArray:
        def __init__(self, t: torch.Tensor) -> None:
            self._t = t
            self.__cuda_array_interface__ = t.__cuda_array_interface__

    raw = allocate(lay, 4, device="cuda")
    wrapped = {r: {lid: CudaArray(t) for lid, t in per.items()} for r, per in raw.items()}
    bs2 = BufferSet(lay, wrapped)
    assert bs2.memory == "cuda"
    assert bs2.array("main_kv", 0).data_ptr() == raw["main_kv"][0].data_ptr()
    from kvhandoff.transports.tcp import TcpTransport

    t = TcpTransport(Settings(transport="tcp"))
    try:
        with pytest.raises(TransportError, match="cuda:0 memory and the tcp transport"):
            t.register("main_kv/0", v)
    finally:
        t.close()


def test_event_waiter_posts_after_a_real_cuda_event() -> None:
    posted = threading.Event()
    w = EventWaiter(lambda e: posted.set(), closed=lambda: False)

    class View:
        room, done = 1, False

    torch.cuda._sleep(200_000_000)  # a long kernel (~0.1 s on a 2 GHz clock)
    e = torch.cuda.Event()
    e.record()
    w.submit(View(), e, ev.LayerReady(1, None, 0), layer=0)  # returns while it runs
    assert posted.wait(30)
    assert e.query()  # the post came after the kernel ended
    assert w.posted == 1  # through the waiter thread, not on the caller's
