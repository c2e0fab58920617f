"""CUDA buffers without a GPU: `BufferSet` takes objects with ``__cuda_array_interface__``
(here fakes over host addresses nobody reads through; on CPU they become `DeviceBytes`),
checks their sizes like host buffers, keeps one memory kind (and one device) per agent, and
the host-only transports (tcp, ucx) refuse CUDA buffers at `register` naming the transports
meant for device memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.buffers.bufferset import BufferSet, DeviceBytes, allocate, as_bytes, view_memory
from kvhandoff.buffers.devsum import memory_kind, refuse_device_memory
from kvhandoff.errors import ConfigError, TransportError
from kvhandoff.kv_layout import preset
from kvhandoff.settings import Settings

from .conftest import tiny_layout

_BASE = 0x7F00_0000_0000


class FakeCudaArray:
    """Exposes __cuda_array_interface__ as CuPy/Numba device arrays do (no GPU needed)."""

    def __init__(self, ptr: int, nbytes: int, typestr: str = "|u1") -> None:
        item = int(typestr[2:])
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes // item,),
                                         "typestr": typestr, "strides": None, "version": 3}


def fake_buffers(layout: Any, pages: int, *, typestr: str = "|u1") -> dict[str, Any]:
    ps = layout.page_size_tokens
    out: dict[str, Any] = {}
    ptr = _BASE
    for reg in layout.regions:
        per: dict[int, Any] = {}
        for lid in reg.layer_ids:
            n = reg.page_nbytes(ps) * pages
            per[lid] = FakeCudaArray(ptr, n, typestr)
            ptr += n + 4096
        out[reg.name] = per
    return out


def test_cuda_array_interface_buffers_are_taken_and_sized() -> None:
    lay = tiny_layout()
    bs = BufferSet(lay, fake_buffers(lay, 8, typestr="<f2"))
    assert bs.memory == "cuda" and bs.device is None
    v = bs.array("main_kv", 0)
    assert isinstance(v, DeviceBytes) and v.ptr == _BASE
    assert v.nbytes == lay.region("main_kv").page_nbytes(16) * 8
    assert bs.num_pages("main_kv") == 8
    assert view_memory(v) == ("cuda", None)
    assert memory_kind(v).kind == "cuda" and memory_kind(v).ptr == _BASE
    part = v[100:228]
    assert part.ptr == _BASE + 100 and part.nbytes == 128 and len(v[5:2]) == 0
    names = [n for n, _ in bs.views()]
    assert names[0] == "main_kv/0" and len(names) == len(list(bs.extents()))


def test_cuda_buffers_must_hold_whole_pages() -> None:
    lay = tiny_layout()
    bufs = fake_buffers(lay, 4)
    bufs["main_kv"][2] = FakeCudaArray(_BASE, lay.region("main_kv").page_nbytes(16) * 4 + 3)
    with pytest.raises(ConfigError, match=r"buffers\[main_kv\]\[2\]: .* not a whole number"):
        BufferSet(lay, bufs)


def test_mixed_host_and_cuda_buffers_are_refused_naming_the_buffer() -> None:
    lay = tiny_layout()
    host = allocate(lay, 4)
    bufs = fake_buffers(lay, 4)
    bufs["main_kv"][3] = host["main_kv"][3]
    with pytest.raises(ConfigError, match=r"buffers\[main_kv\]\[3\]: host memory but "
                       r"buffers\[main_kv\]\[0\] is CUDA memory; one agent's buffers"):
        BufferSet(lay, bufs)
    host["indexer_k"][lay.region("indexer_k").layer_ids[0]] = FakeCudaArray(_BASE, 16)
    with pytest.raises(ConfigError, match=r"buffers\[indexer_k\]\[0\]: CUDA memory but "
                       r"buffers\[main_kv\]\[0\] is host memory"):
        BufferSet(lay, host)


def test_packed_row_as_cuda_memory_gives_per_layer_device_views() -> None:
    spec = preset("glm-5.3-vllm")
    stride = spec.region("main_kv").page_stride(spec.page_size_tokens)
    bs = BufferSet(spec, {"kv_block": FakeCudaArray(_BASE, 3 * stride)})
    assert bs.memory == "cuda" and bs.num_pages("indexer_k") == 3
    key, off = spec.address("indexer_k", 77, 0)
    v = bs.array("indexer_k", 77)
    assert key == "kv_block" and isinstance(v, DeviceBytes) and v.ptr == _BASE + off


def test_host_buffers_keep_working_and_say_so() -> None:
    lay = tiny_layout()
    bs = BufferSet(lay, allocate(lay, 4))
    assert bs.memory == "host" and bs.device is None
    assert isinstance(bs.array("main_kv", 0), np.ndarray)


def test_other_devices_and_objects_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor on device 'meta'"):
        as_bytes(torch.empty(8, device="meta"), "buffers[x][0]")
    with pytest.raises(ConfigError, match="expected a numpy array, a torch tensor or an object "
                       "with __cuda_array_interface__, got object"):
        as_bytes(object(), "buffers[x][0]")
    bad = FakeCudaArray(_BASE, 16)
    bad.__cuda_array_interface__["strides"] = (2,)
    with pytest.raises(ConfigError, match=r"buffers\[x\]\[0\]: .*not C-contiguous"):
        as_bytes(bad, "buffers[x][0]")


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_host_transports_refuse_cuda_buffers_at_register(kind: str) -> None:
    from kvhandoff.transports.base import load_transport

    t = load_transport(kind, Settings(transport=kind))
    try:
        dev = DeviceBytes(_BASE, 4096, 0, None)
        with pytest.raises(TransportError, match=rf"register 'main_kv/0': the buffer is cuda:0 "
                           rf"memory and the {kind} transport moves host memory only.*shm "
                           r"transport's CUDA IPC lane.*nixl transport, which registers "
                           r"CUDA buffers as VRAM"):
            t.register("main_kv/0", dev)  # type: ignore[arg-type]
        with pytest.raises(TransportError, match="CUDA memory and the"):
            t.register("main_kv/1", FakeCudaArray(_BASE, 64))  # type: ignore[arg-type]
        t.register("main_kv/2", np.zeros(64, dtype=np.uint8))  # host memory still goes
    finally:
        t.close()


def test_refusal_helper_lets_host_memory_through() -> None:
    refuse_device_memory("tcp", "a", np.zeros(4, dtype=np.uint8))
    refuse_device_memory("tcp", "b", torch.zeros(4))
    refuse_device_memory("tcp", "c", bytearray(4))
    refuse_device_memory("tcp", "d", object())  # unknown: the transport's own check says


class _CupyLikeDevice:
    def __init__(self, i: int) -> None:
        self.id = i


def test_cuda_buffers_on_two_devices_are_refused() -> None:
    lay = tiny_layout()
    bufs = fake_buffers(lay, 4)
    for per in bufs.values():
        for b in per.values():
            b.device = _CupyLikeDevice(0)  # as CuPy arrays say where they live
    bufs["main_kv"][4].device = _CupyLikeDevice(1)
    with pytest.raises(ConfigError, match=r"buffers\[main_kv\]\[4\]: CUDA memory on cuda:1 but "
                       r"buffers\[main_kv\]\[0\] is on cuda:0"):
        BufferSet(lay, bufs)
    bufs["main_kv"][4].device = _CupyLikeDevice(0)
    assert BufferSet(lay, bufs).device == 0


def test_an_agent_refused_by_its_transport_closes_it() -> None:
    """CUDA buffers torch cannot copy here (array interfaces, no CUDA torch) on tcp: neither
    the transport nor host staging can move them; the agent raises the refusal and closes the
    transport it built on (no I/O thread left behind)."""
    import threading

    from kvhandoff.transfer import TransferAgent
    from kvhandoff.transports.base import load_transport

    lay = tiny_layout()
    t = load_transport("tcp", Settings(transport="tcp"))
    before = {th.ident for th in threading.enumerate()}
    with pytest.raises(ConfigError, match="moves host memory only and host staging"):
        TransferAgent("prefill", lay, fake_buffers(lay, 4), Settings(transport="tcp"),
                      transport=t)
    with pytest.raises(TransportError, match="closed"):
        t.connect("peer", t.address)
    assert {th.ident for th in threading.enumerate() if th.is_alive()} <= before
