"""GPU test (marker `gpu`; skipped with "no CUDA device" without one; run by
scripts/gpu_check.sh): host staging (runtime.staging) with real CUDA KV pages. Two agents of
one process over the tcp transport, which cannot reach device memory: the prefill's layers,
each marked ready with a CUDA event behind the kernel that wrote it, are copied from device
pages to a pinned host arena, sent, received into the decode's pinned arena and copied into its
device pages; devsum on both sides; every page compared byte for byte; status, counters and
the arena's pinning checked. The CPU stand-in of the same handoff is
tests/unit/gpu/test_gpu_cpu_staging.py.

Written without a GPU at hand: its first run on a lent machine is the first check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

from .shm_cuda_agent_peer import tiny_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PS = 16
WAIT_S = 60.0


def test_cuda_pages_move_through_pinned_host_staging_over_tcp() -> None:
    lay = tiny_layout()
    pbufs, dbufs = allocate(lay, 64, device="cuda"), allocate(lay, 64, device="cuda")
    s = Settings(transport="tcp", host_staging_mib=256)
    with TransferAgent("prefill", lay, pbufs, s) as pa, \
            TransferAgent("decode", lay, dbufs, s) as da:
        for a in (pa, da):
            st = a.status()
            assert st["staging"] == "host", st
            assert "host-staging" in st["transport"]["lanes"]
        src = list(range(0, 40))
        dst = list(range(63, 23, -1))  # other pages, reversed: every page a span of its own
        seq_len = len(src) * PS
        sender = pa.sender(1, pages=np.array(src), seq_len=seq_len)
        receiver = da.receiver(1, peer=pa.address)
        receiver.init(np.array(dst), seq_len, 0)
        g = torch.Generator(device="cuda").manual_seed(3)
        for layer in range(lay.num_layers):
            for reg in lay.regions:  # the layer's kernel: random bytes, then its event
                if layer in reg.live_layer_ids:
                    v = pa.buffers.array(reg.name, layer)
                    v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda",
                                          generator=g))
            ev = torch.cuda.Event()
            ev.record()
            sender.layer_ready(layer, ev)
        assert receiver.wait(WAIT_S) is KVPoll.Success, receiver.stats()
        assert sender.wait(WAIT_S) is KVPoll.Success
        stats = receiver.stats()
        moved = sum(stats["bytes_per_region"].values())
        torch.cuda.synchronize()
        for reg in lay.regions:
            stride, nb = reg.page_stride(PS), reg.page_nbytes(PS)
            for lid in reg.live_layer_ids:
                pv = pa.buffers.array(reg.name, lid).cpu().numpy()
                dv = da.buffers.array(reg.name, lid).cpu().numpy()
                for sp, dp in zip(src, dst, strict=True):
                    assert (dv[dp * stride:dp * stride + nb] ==
                            pv[sp * stride:sp * stride + nb]).all(), (reg.name, lid, sp)
                for untouched in range(0, 24):
                    assert not dv[untouched * stride:untouched * stride + nb].any()
        assert pa.status()["counters"]["staged_bytes_out"] == moved
        assert da.status()["counters"]["staged_bytes_in"] == moved
        assert da.status()["counters"]["checksums_verified"] > 0
        for a in (pa, da):
            pool = a.transport.pool  # type: ignore[attr-defined]
            assert pool.pinned and pool.arena.is_pinned()
            assert pool.in_use() == 0
