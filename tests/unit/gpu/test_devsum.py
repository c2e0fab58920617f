"""The device checksum on CPU: torch ops equal the numpy reference, the value depends only on
the bytes in plan order (not on page sizes, page tables or where spans cut the stream), and
any single flipped byte changes it. Plus the memory-kind helper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhandoff.buffers.devsum import MemoryInfo, devsum, devsum_reference, memory_kind

from .devsum_kit import apply, plan, pool, region


@pytest.mark.parametrize("seed", range(6))
def test_torch_equals_reference_aligned_unaligned_and_chunked(seed: int) -> None:
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, 64 * 1024, dtype=np.uint8)
    n = int(rng.integers(1, 40))
    nb = rng.integers(0, 200, n) * 4
    off = rng.integers(0, buf.size - 800, n)
    if seed % 2 == 0:
        off -= off % 4  # aligned: the word-view path; odd seeds take the byte path
    want = devsum_reference(buf, off, nb)
    assert devsum(torch.from_numpy(buf), off, nb) == want
    assert devsum(buf, off, nb, chunk_words=int(rng.integers(1, 50))) == want
    for on_device in (False, True):  # the index table as built for CPU and for CUDA buffers
        assert devsum(buf, off, nb // 64 * 4, chunk_words=int(rng.integers(1, 50)),
                      index_on_device=on_device) == devsum_reference(buf, off, nb // 64 * 4)
    assert devsum(buf, off, nb, seed=7) != want  # the seed keys the digest


def _stream(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> bytes:
    return b"".join(buf[o:o + n].tobytes() for o, n in zip(off, nb, strict=True))


@pytest.mark.parametrize(("name", "tokens"), [("main_kv", 1000), ("indexer_k", 777)])
def test_same_value_whatever_the_page_sizes(name: str, tokens: int) -> None:
    """Prefill pages of 16 tokens to decode pages of 64, 8 and 1 (shuffled page tables): both
    sides of each plan get the same value; plans whose order is the same get the same value
    whatever their cuts, and it is the value of a token-by-token span list."""
    reg = region(name)
    rng = np.random.default_rng(1)
    src_pages = rng.permutation(2 * -(-tokens // 16))[: -(-tokens // 16)]
    src = pool(reg, 16, int(src_pages.max()) + 1, rng)
    # the token-order stream of the source, one span per (token, plane)
    t = np.arange(tokens)
    page_base = src_pages[t // 16] * reg.page_nbytes(16)
    tok_off = np.stack([page_base + po * 16 + (t % 16) * p.bytes_per_token
                        for po, p in zip(reg.plane_offsets(), reg.planes, strict=True)], 1)
    tok_nb = np.broadcast_to([p.bytes_per_token for p in reg.planes], tok_off.shape)
    by_token = devsum(src, tok_off.ravel(), tok_nb.ravel())
    token_stream = _stream(src, tok_off.ravel(), tok_nb.ravel())
    same_order = 0
    counts = set()
    for dst_page in (64, 8, 1):
        p, dst_pages = plan(reg, tokens, src_pages, 16, dst_page, rng)
        dst = np.zeros((int(dst_pages.max()) + 1) * reg.page_nbytes(dst_page), dtype=np.uint8)
        apply(p, src, dst)
        counts.add(p.count)
        value = devsum(src, p.src_offsets, p.nbytes)
        assert devsum(torch.from_numpy(dst), p.dst_offsets, p.nbytes) == value
        assert devsum_reference(dst, p.dst_offsets, p.nbytes) == value
        if _stream(src, p.src_offsets, p.nbytes) == token_stream:
            same_order += 1
            assert value == by_token
        else:  # the planner merged pieces out of token order: another stream, another value
            assert value != by_token
        dst[int(p.dst_offsets[-1])] ^= 1
        assert devsum(dst, p.dst_offsets, p.nbytes) != value
    assert len(counts) == 3 and same_order >= 1


def test_recutting_the_stream_keeps_the_value() -> None:
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 256, 4096, dtype=np.uint8)
    off, nb = np.array([0, 2048]), np.array([1024, 1024])
    cut_off = np.array([0, 4, 100, 2048, 2052])
    cut_nb = np.array([4, 96, 924, 4, 1020])
    assert devsum(buf, off, nb) == devsum(buf, cut_off, cut_nb)
    assert devsum(buf, off, nb) != devsum(buf, off[::-1], nb[::-1])  # plan order matters


def test_any_single_flipped_byte_changes_it() -> None:
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 2048, dtype=np.uint8)
    off, nb = np.array([1536, 2, 600]), np.array([256, 124, 132])
    t = torch.from_numpy(buf)
    base = devsum(t, off, nb)
    inside = np.concatenate([np.arange(o, o + n) for o, n in zip(off, nb, strict=True)])
    for pos in inside:  # every byte of the stream, one random bit each
        bit = 1 << int(rng.integers(0, 8))
        buf[pos] ^= bit
        assert devsum(t, off, nb) != base, f"flip at byte {pos} not seen"
        buf[pos] ^= bit
    outside = np.setdiff1d(np.arange(buf.size), inside)[:64]
    for pos in outside:  # bytes outside the spans do not count
        buf[pos] ^= 0xFF
    assert devsum(t, off, nb) == base


def test_swapped_words_change_it() -> None:
    buf = np.arange(64, dtype=np.uint8)
    swapped = buf.copy()
    swapped[0:4], swapped[8:12] = buf[8:12], buf[0:4]
    assert devsum(buf, [0], [64]) != devsum(swapped, [0], [64])


def test_typed_multidimensional_tensor() -> None:
    t = torch.randn(4, 16, 8, dtype=torch.bfloat16)
    b = t.view(torch.uint8).reshape(-1).numpy()
    assert devsum(t, [256, 0], [512, 256]) == devsum_reference(b, [256, 0], [512, 256])


def test_bad_spans_name_the_problem() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="length 6 of span 1 is not a multiple of 4"):
        devsum(buf, [0, 8], [4, 6])
    with pytest.raises(ValueError, match="past the buffer"):
        devsum(buf, [60], [8])
    with pytest.raises(ValueError, match="2 offsets but 1 lengths"):
        devsum(buf, [0, 4], [4])
    with pytest.raises(ValueError, match="contiguous"):
        devsum(torch.zeros(8, 8)[:, 0], [0], [4])
    assert devsum(buf, [], []) == devsum_reference(buf, [], [])


# ---- memory kind ----------------------------------------------------------------------------

class FakeCudaArray:
    """Exposes __cuda_array_interface__ like CuPy/Numba device arrays (no GPU needed)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str,
                 strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


def test_memory_kind_host() -> None:
    t = torch.zeros(10, dtype=torch.float16)
    assert memory_kind(t) == MemoryInfo("host", None, t.data_ptr(), 20)
    a = np.zeros(7, dtype=np.uint8)
    assert memory_kind(a) == MemoryInfo("host", None, a.ctypes.data, 7)
    assert memory_kind(bytearray(5)).kind == "host"
    assert memory_kind(b"").nbytes == 0


def test_memory_kind_cuda_array_interface() -> None:
    info = memory_kind(FakeCudaArray(0x7F0000001000, (3, 4), "<f2"))
    assert info == MemoryInfo("cuda", None, 0x7F0000001000, 24)
    assert memory_kind(FakeCudaArray(4096, (3, 4), "<f2", strides=(8, 2))).nbytes == 24
    with pytest.raises(ValueError, match="not C-contiguous"):
        memory_kind(FakeCudaArray(4096, (3, 4), "<f2", strides=(16, 2)))
    bad = FakeCudaArray(4096, (3,), "<f2")
    del bad.__cuda_array_interface__["shape"]
    with pytest.raises(ValueError, match="missing or bad field"):
        memory_kind(bad)


def test_memory_kind_refuses_other_devices_and_objects() -> None:
    with pytest.raises(ValueError, match="'meta' is neither cpu nor cuda"):
        memory_kind(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="not a torch tensor, a CUDA array"):
        memory_kind(object())


def test_views_that_start_off_word_boundaries_equal_the_reference() -> None:
    """A layer view inside a packed row starts at the layer's offset in the block, which need
    not be a multiple of 4: the byte path must give the reference value."""
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, 8192, dtype=np.uint8)
    t = torch.from_numpy(buf)
    off, nb = np.array([0, 1000, 4096]), np.array([400, 2048, 256])
    for start in (1, 2, 3, 4, 6):
        want = devsum_reference(buf[start:], off, nb)
        assert devsum(t[start:], off, nb) == want
        assert devsum(t[start:], off, nb, chunk_words=37, index_on_device=True) == want


def test_packed_and_per_layer_sides_agree() -> None:
    """A vLLM packed block on one side, SGLang per-layer buffers on the other: the same
    plan-order stream, the same value on both sides."""
    from kvhandoff.buffers.bufferset import BufferSet
    from kvhandoff.kv_layout import build_spans, preset

    packed = preset("glm-5.3-vllm-mla", page_size_tokens=64)
    flat = preset("glm-5.3", page_size_tokens=64)
    rng = np.random.default_rng(4)
    pages = 6
    stride = packed.region("main_kv").page_stride(64)
    row = rng.integers(0, 256, pages * stride, dtype=np.uint8)
    bufs = {"mla_row": row}
    for reg in packed.regions:
        if reg.placement is None:
            bufs[reg.name] = {lid: np.zeros(reg.page_nbytes(64) * pages, np.uint8)
                              for lid in reg.layer_ids}
    src = BufferSet(packed, bufs)
    reg_p, reg_f = packed.region("main_kv"), flat.region("main_kv")
    src_pages, dst_pages = rng.permutation(pages), rng.permutation(pages)
    p = build_spans(reg_p, token_start=0, token_end=300, src_pages=src_pages,
                    src_page_size=64, dst_pages=dst_pages, dst_page_size=64, dst_region=reg_f)
    for lid in (0, 5, reg_p.layer_ids[-1]):
        view = src.array("main_kv", lid)
        dst = np.zeros(reg_f.page_nbytes(64) * pages, np.uint8)
        apply(p, view, dst)
        value = devsum(view, p.src_offsets, p.nbytes)
        assert value == devsum_reference(np.asarray(view), p.src_offsets, p.nbytes)
        assert devsum(dst, p.dst_offsets, p.nbytes) == value
