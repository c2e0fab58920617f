"""GPU tests (marker `gpu`; skipped with "no CUDA device" without one): the device checksum on
CUDA tensors equals the numpy reference and the CPU value, both sides of a plan agree on the
GPU, a flipped byte is seen; memory kinds of CUDA tensors and CUDA array interfaces; the
doctor's two-process CUDA IPC probe. Run by scripts/gpu_check.sh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhandoff.buffers.devsum import devsum, devsum_reference, memory_kind
from kvhandoff.doctor import Status, check_cuda_ipc

from .devsum_kit import plan, pool, region

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


class CudaArray:
    """A device array seen only through __cuda_array_interface__ (as CuPy/Numba hand them)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t  # keeps the memory alive
        self.__cuda_array_interface__ = t.__cuda_array_interface__


@pytest.mark.parametrize("seed", range(4))
def test_cuda_equals_reference_and_cpu(seed: int) -> None:
    rng = np.random.default_rng(seed)
    host = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dev = torch.from_numpy(host).cuda()
    n = 300
    off = rng.integers(0, host.size - 40000, n)
    if seed % 2 == 0:
        off -= off % 4
    for nb in (rng.integers(1, 10000, n) * 4, rng.integers(0, 30, n) * 4):  # long, short
        want = devsum_reference(host, off, nb)
        assert devsum(dev, off, nb) == want
        assert devsum(dev, off, nb, chunk_words=1000) == want
        assert devsum(dev, off, nb, index_on_device=False) == want
        assert devsum(host, off, nb) == want


def test_cuda_both_sides_of_a_plan_agree() -> None:
    reg = region("main_kv")
    rng = np.random.default_rng(7)
    tokens = 4096
    src_pages = rng.permutation(2 * tokens // 16)[: tokens // 16]
    src = torch.from_numpy(pool(reg, 16, int(src_pages.max()) + 1, rng)).cuda()
    for dst_page in (64, 1):
        p, dst_pages = plan(reg, tokens, src_pages, 16, dst_page, rng)
        dst = torch.zeros((int(dst_pages.max()) + 1) * reg.page_nbytes(dst_page),
                          dtype=torch.uint8, device="cuda")
        for so, do, n in p:  # device-to-device copies of the plan
            dst[do:do + n].copy_(src[so:so + n])
        value = devsum(src, p.src_offsets, p.nbytes)
        assert devsum(dst, p.dst_offsets, p.nbytes) == value
        assert devsum_reference(dst.cpu().numpy(), p.dst_offsets, p.nbytes) == value
        dst[int(p.dst_offsets[0]) + 5] ^= 0x10
        assert devsum(dst, p.dst_offsets, p.nbytes) != value


def test_cuda_memory_kinds_and_array_interface() -> None:
    t = torch.arange(1024, dtype=torch.int32, device="cuda")
    info = memory_kind(t)
    assert info.kind == "cuda" and info.device == t.device.index and info.nbytes == 4096
    arr = CudaArray(t)
    cai = memory_kind(arr)
    assert cai.kind == "cuda" and cai.ptr == t.data_ptr() and cai.nbytes == 4096
    b = t.cpu().numpy().view(np.uint8)
    assert devsum(arr, [0, 2048], [1024, 2048]) == devsum_reference(b, [0, 2048], [1024, 2048])


def test_doctor_cuda_ipc_between_two_processes() -> None:
    r = check_cuda_ipc(probe=True)
    assert r.status is Status.OK, r.summary
