"""The CUDA IPC lane pieces that need no GPU: the versioned msgpack descriptor, the pairing of
differently cut span lists the lane's plans come from (`kv_layout.pair_spans`), copy batching,
and the copy executor on CPU tensors (the same code path as on CUDA, without the stream)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import pair_spans, plan_of
from kvhandoff.transports.shm.cuda_ipc import (
    VERSION,
    IpcExport,
    copy_spans,
    decode_export,
    export_buffer,
    plan_batches,
)


def _export(**kw: object) -> IpcExport:
    base = {"device": 1, "handle": bytes(range(64)), "storage_offset": 2 << 20,
            "storage_nbytes": 4096, "offset": 512, "nbytes": 1024,
            "ref_counter_handle": b"/torch_123_456", "ref_counter_offset": 8,
            "event_handle": bytes(64), "event_sync_required": True}
    base.update(kw)
    return IpcExport(**base)  # type: ignore[arg-type]


def test_descriptor_round_trip_is_msgpack_with_a_version() -> None:
    e = _export()
    blob = e.encode()
    m = msgspec.msgpack.decode(blob)
    assert m["v"] == VERSION and m["handle"] == bytes(range(64))
    assert decode_export(blob) == e
    assert e.block_offset == (2 << 20) + 512
    assert b"\x80\x04" not in blob[:2]  # not a pickle stream


@pytest.mark.parametrize(("change", "message"), [
    ({"v": 2}, "version 2, this side reads 1"),
    ({"handle": None}, "field 'handle' must be bytes, got NoneType"),
    ({"nbytes": True}, "field 'nbytes' must be int, got bool"),
    ({"offset": -1}, "field 'offset' must be >= 0"),
    ({"event_sync_required": 1}, "field 'event_sync_required' must be bool"),
    ({"offset": 4000}, "offset 4000 \\+ nbytes 1024 past the storage"),
])
def test_descriptor_decode_names_the_bad_field(change: dict[str, object], message: str) -> None:
    m = msgspec.msgpack.decode(_export().encode())
    m.update(change)
    with pytest.raises(ValueError, match=message):
        decode_export(msgspec.msgpack.encode(m))


def test_descriptor_decode_refuses_missing_fields_and_garbage() -> None:
    m = msgspec.msgpack.decode(_export().encode())
    del m["ref_counter_handle"]
    with pytest.raises(ValueError, match="field 'ref_counter_handle' missing"):
        decode_export(msgspec.msgpack.encode(m))
    with pytest.raises(ValueError, match="expected a map"):
        decode_export(msgspec.msgpack.encode([1, 2]))
    with pytest.raises(ValueError, match="not msgpack"):
        decode_export(b"\xc1")


def test_export_refuses_what_it_cannot_share() -> None:
    with pytest.raises(ValueError, match="not a CUDA device"):
        export_buffer(torch.zeros(4))
    with pytest.raises(ValueError, match="expected a torch CUDA tensor, got ndarray"):
        export_buffer(np.zeros(4))


def _random_spans(rng: np.random.Generator, total: int, size: int) -> tuple[np.ndarray,
                                                                            np.ndarray]:
    """Spans carrying `total` bytes cut at random, at shuffled non-overlapping places."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=min(total - 1, rng.integers(0, 30)),
                              replace=False)) if total > 1 else np.zeros(0, np.int64)
    nb = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)
    slots = rng.permutation(len(nb))  # each span gets its own slot of `size` bytes
    off = slots * size + rng.integers(0, size - nb.max() + 1, len(nb))
    return off.astype(np.int64), nb


def _stream(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> bytes:
    return b"".join(buf[o:o + n].tobytes() for o, n in zip(off, nb, strict=True))


@pytest.mark.parametrize("seed", range(8))
def test_matched_pieces_carry_the_stream_whatever_the_cuts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 5000))
    so, sn = _random_spans(rng, total, 8192)
    do, dn = _random_spans(rng, total, 8192)
    src = rng.integers(0, 256, 8192 * 40, dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = pair_spans(so, sn, do, dn)
    ps, pd, pn = plan.src_offsets, plan.dst_offsets, plan.nbytes
    assert int(pn.sum()) == total and len(pn) <= len(sn) + len(dn) - 1
    for a, b, n in zip(ps, pd, pn, strict=True):
        dst[b:b + n] = src[a:a + n]
    assert _stream(dst, do, dn) == _stream(src, so, sn)
    # the executor on CPU tensors lands the same bytes, batched or not
    for small in (1, 64, 1 << 20):
        out = torch.zeros(src.size, dtype=torch.uint8)
        ev = copy_spans(torch.from_numpy(src), out, plan, small=small)
        assert ev.query() is True
        assert _stream(out.numpy(), do, dn) == _stream(src, so, sn)
        outside = np.ones(src.size, bool)
        for o, n in zip(do, dn, strict=True):
            outside[o:o + n] = False
        assert not out.numpy()[outside].any()  # nothing written outside the spans


def test_contiguous_pieces_merge_and_cuts_follow_both_sides() -> None:
    # one contiguous stream cut differently on each side: one piece
    p = pair_spans([100, 140], [40, 60], [0, 30, 70], [30, 40, 30])
    assert (p.src_offsets.tolist(), p.dst_offsets.tolist(), p.nbytes.tolist()) == \
        ([100], [0], [100])
    # source pages 16 apart, destination contiguous: cut at the source's page ends
    p = pair_spans([0, 32, 64], [16, 16, 16], [1000], [48])
    assert (p.src_offsets.tolist(), p.dst_offsets.tolist(), p.nbytes.tolist()) == \
        ([0, 32, 64], [1000, 1016, 1032], [16, 16, 16])
    # empty spans are ignored; unequal totals are refused
    assert pair_spans([5, 0], [0, 8], [0], [8]).nbytes.tolist() == [8]
    with pytest.raises(ConfigError, match="source carries 8 bytes, the destination 9"):
        pair_spans([0], [8], [0], [9])
    with pytest.raises(ConfigError, match=r"pair_spans \(dst\): 2 offsets but 1 lengths"):
        pair_spans([0], [8], [0, 4], [8])
    assert pair_spans([], [], [], []).nbytes.size == 0


def test_batches_copy_long_pieces_and_gather_runs_of_short_ones() -> None:
    nb = np.array([1 << 20, 64, 64, 64, 32, 32, 1 << 17, 16], dtype=np.int64)
    src = np.arange(len(nb), dtype=np.int64) * (1 << 21)
    dst = src + 7
    bs = plan_batches(src, dst, nb, small=64 << 10)
    assert [(b.kind, len(b.src), b.nbytes) for b in bs] == [
        ("copy", 1, 1 << 20), ("gather", 3, 64), ("gather", 2, 32), ("copy", 1, 1 << 17),
        ("copy", 1, 16)]
    assert sum(len(b.src) for b in bs) == len(nb)
    assert np.concatenate([b.dst for b in bs]).tolist() == dst.tolist()
    capped = plan_batches(src[1:4], dst[1:4], nb[1:4], small=1 << 10, max_batch=2)
    assert [(b.kind, len(b.src)) for b in capped] == [("gather", 2), ("copy", 1)]


def test_copy_spans_refuses_spans_past_the_buffer() -> None:
    src = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="past its buffer"):
        copy_spans(src, torch.zeros(128, dtype=torch.uint8), plan_of([32], [0], [64]))
