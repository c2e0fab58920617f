"""Head slices of token-major pages (SGLang's dense pools between attention TP sizes) copied
by the CUDA IPC lane's span copier (`copy_spans`): on CPU tensors here, on CUDA tensors where
a GPU exists (marker `gpu`, run by scripts/gpu_check.sh). Each decode rank's pages must hold
exactly its heads of the prefill's tokens, and nothing outside the room's pages may move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhandoff.kv_layout import Plane, RegionSpec, TPSplit, build_spans
from kvhandoff.transports.shm.cuda_ipc import copy_spans

HEADS, HEAD_DIM, ELEM = 8, 128, 2  # a GQA layer's K: 8 KV heads of 128 bf16 values
HEAD = HEAD_DIM * ELEM
PS = 16  # tokens per page
PAGES = 12
TOKENS = 100  # 6 pages and a part


def _region(heads: range) -> RegionSpec:
    return RegionSpec(name="k", layer_ids=(0,), planes=tuple(Plane(f"h{h}", HEAD) for h in heads),
                      tp_split=TPSplit.HEAD_SHARDED, token_major=True)


def _devices() -> list[object]:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]


@pytest.mark.parametrize("small", [1, 64 << 10])  # every piece one copy / gathered in batches
@pytest.mark.parametrize("device", _devices())
def test_one_prefill_rank_feeds_two_decode_ranks_their_heads(device: str, small: int) -> None:
    rng = np.random.default_rng(7)
    src_np = rng.integers(0, 256, (PAGES * PS, HEADS, HEAD), np.uint8)
    src = torch.from_numpy(src_np.reshape(-1).copy()).to(device)
    src_pages = rng.permutation(PAGES)[:7].tolist()
    dst_pages = rng.permutation(PAGES)[:7].tolist()
    half = HEADS // 2
    for rank in (0, 1):
        mine = range(rank * half, (rank + 1) * half)
        plan = build_spans(_region(range(HEADS)), token_start=0, token_end=TOKENS,
                           src_pages=src_pages, src_page_size=PS, dst_pages=dst_pages,
                           dst_page_size=PS, dst_region=_region(mine),
                           planes=[f"h{h}" for h in mine])
        dst = torch.zeros(PAGES * PS * half * HEAD, dtype=torch.uint8, device=device)
        done = copy_spans(src, dst, plan, small=small)
        if done is not None and hasattr(done, "synchronize"):
            done.synchronize()
        got = dst.cpu().numpy().reshape(PAGES * PS, half, HEAD)
        want = np.zeros_like(got)
        for k, (sp, dp) in enumerate(zip(src_pages, dst_pages, strict=True)):
            n = min(PS, TOKENS - k * PS)
            want[dp * PS:dp * PS + n] = src_np[sp * PS:sp * PS + n, mine.start:mine.stop]
        assert np.array_equal(got, want), f"decode rank {rank}: its heads differ"


@pytest.mark.parametrize("device", _devices())
def test_two_prefill_ranks_fill_one_decode_rank(device: str) -> None:
    rng = np.random.default_rng(8)
    half = HEADS // 2
    srcs = [rng.integers(0, 256, (PAGES * PS, half, HEAD), np.uint8) for _ in (0, 1)]
    src_pages, dst_pages = [3, 0, 9, 5, 1, 11, 7], [2, 8, 4, 10, 6, 0, 1]
    dst = torch.zeros(PAGES * PS * HEADS * HEAD, dtype=torch.uint8, device=device)
    for rank, src_np in enumerate(srcs):
        mine = range(rank * half, (rank + 1) * half)
        plan = build_spans(_region(mine), token_start=0, token_end=TOKENS, src_pages=src_pages,
                           src_page_size=PS, dst_pages=dst_pages, dst_page_size=PS,
                           dst_region=_region(range(HEADS)))
        src = torch.from_numpy(src_np.reshape(-1).copy()).to(device)
        done = copy_spans(src, dst, plan)
        if done is not None and hasattr(done, "synchronize"):
            done.synchronize()
    got = dst.cpu().numpy().reshape(PAGES * PS, HEADS, HEAD)
    want = np.zeros_like(got)
    for k, (sp, dp) in enumerate(zip(src_pages, dst_pages, strict=True)):
        n = min(PS, TOKENS - k * PS)
        for rank, src_np in enumerate(srcs):
            want[dp * PS:dp * PS + n, rank * half:(rank + 1) * half] = src_np[sp * PS:sp * PS + n]
    assert np.array_equal(got, want)
