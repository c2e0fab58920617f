# The byte stream of one side's span list, as every transport takes it: argument checks, the
# chunk grid of two-sided ops, and the checks of a one-sided write's span plan. (Pairing two
# sides' spans is kv_layout.spans': a one-sided write is handed its SpanPlan as is.)
#
# Rules:
# - A span list is validated once (types, lengths, bounds) and normalised: zero-length spans
#   dropped, adjacent contiguous spans coalesced. Errors name the field and the index.
# - The logical byte stream of a span list is cut into chunks of `chunk_bytes` on a fixed grid
#   (chunk k = stream bytes [k*C, (k+1)*C)). Both sides compute the same grid from their own span
#   list and the shared chunk size, so chunk k of a send always pairs with chunk k of a receive
#   even though the two span lists cut the stream differently.
# - A chunk that lies inside one span is "direct": a zero-copy view of the buffer. Any other
#   chunk is gathered into (sender) or scattered from (receiver) a staging buffer; all index
#   math is vectorised, only the per-piece memcpy is a loop.
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan, cut_spans
from kvhandoff.transports.base import TAG_LIMIT

_VECTOR_MIN = 8  # pieces in a chunk before the vectorised path is tried

__all__ = ["ChunkPlan", "check_buffer", "check_tag", "normalise_spans", "write_plan"]


def check_buffer(name: str, buf: object) -> np.ndarray:
    """Returns `buf` as a 1-D C-contiguous uint8 numpy array, or raises naming the problem."""
    if not isinstance(name, str) or not name:
        raise TransportError(f"register: name must be a non-empty string, got {name!r}")
    if not isinstance(buf, np.ndarray):
        raise TransportError(f"register {name!r}: buf must be a numpy.ndarray (pass a CPU tensor "
                             f"as tensor.numpy()), got {type(buf).__name__}")
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise TransportError(f"register {name!r}: buf must be 1-D uint8, got dtype={buf.dtype} "
                             f"ndim={buf.ndim}; pass buf.view(np.uint8).reshape(-1)")
    if not buf.flags.c_contiguous:
        raise TransportError(f"register {name!r}: buf must be contiguous")
    return buf


def check_tag(tag: int) -> int:
    """Checks 0 <= tag < 2**40."""
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TransportError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= int(tag) < TAG_LIMIT:
        raise TransportError(f"tag must be in [0, 2**40), got {tag}")
    return int(tag)


def normalise_spans(offsets: object, nbytes: object, buf_nbytes: int,
                    what: str = "spans") -> tuple[np.ndarray, np.ndarray]:
    """Validates a span list against a buffer of `buf_nbytes` bytes; drops empty spans and
    coalesces adjacent contiguous ones. Returns int64 (offsets, nbytes)."""
    arrays = []
    for field, value in (("offsets", offsets), ("nbytes", nbytes)):
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise TransportError(f"{what}: {field} must be a 1-D array, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TransportError(f"{what}: {field} must be an integer array, got {arr.dtype}")
        arrays.append(arr.astype(np.int64, copy=False))
    off, nb = arrays
    if off.shape != nb.shape:
        raise TransportError(f"{what}: offsets and nbytes must have equal length, got "
                             f"{off.size} and {nb.size}")
    if off.size == 0:
        return off, nb
    bad = np.flatnonzero(off < 0)
    if bad.size:
        raise TransportError(f"{what}: offsets[{bad[0]}]={off[bad[0]]} is negative")
    bad = np.flatnonzero(nb < 0)
    if bad.size:
        raise TransportError(f"{what}: nbytes[{bad[0]}]={nb[bad[0]]} is negative")
    bad = np.flatnonzero(off + nb > buf_nbytes)
    if bad.size:
        i = bad[0]
        raise TransportError(f"{what}: offsets[{i}]={off[i]} + nbytes[{i}]={nb[i]} exceeds the "
                             f"registered buffer of {buf_nbytes} bytes")
    keep = nb > 0
    if not keep.all():
        off, nb = off[keep], nb[keep]
        if off.size == 0:
            return off, nb
    new_group = np.empty(off.size, dtype=bool)
    new_group[0] = True
    np.not_equal(off[1:], off[:-1] + nb[:-1], out=new_group[1:])
    if new_group.all():
        return off, nb
    heads = np.flatnonzero(new_group)
    return off[heads], np.add.reduceat(nb, heads)



def write_plan(peer: str, name: str, plan: object, size: int, remote: str,
               target_nbytes: int | None, *, connected: bool) -> SpanPlan:
    """The checks of each write of a `post_writes` job once it has looked the peer up: the peer
    is connected, its buffer `remote` is installed (`target_nbytes`, None if not), and `plan`
    is a `SpanPlan` whose pieces fit both buffers. Returns the plan without its empty pieces
    (nothing is re-paired or coalesced: the plan's pieces are the copy's). The plan's bounds
    are computed once per plan (`SpanPlan.bounds`); the checks that name the bad item run
    only when they say the plan does not fit."""
    if not isinstance(plan, SpanPlan):
        raise TransportError(f"post_writes {name!r}: plan must be a kvhandoff.kv_layout.SpanPlan "
                             "(build_spans, plan_of, or pair_spans of two span lists), got "
                             f"{type(plan).__name__}")
    if not connected:
        raise TransportError(f"post_writes: peer {peer!r} is not connected; call connect "
                             "first")
    if target_nbytes is None:
        raise TransportError(f"post_writes: no remote buffer {remote!r} of peer {peer!r}; "
                             "call register_remote first")
    b = plan.bounds()  # once per plan: the same plan object comes for every layer of a room
    if b.well_formed and b.src_end <= size and b.dst_end <= target_nbytes:
        return plan.nonempty()
    so, do, nb = plan.src_offsets, plan.dst_offsets, plan.nbytes
    for field, arr in (("src_offsets", so), ("dst_offsets", do), ("nbytes", nb)):
        if arr.ndim != 1 or arr.shape != nb.shape or (arr.size and arr.dtype.kind not in "iu"):
            raise TransportError(f"post_writes {name!r}: plan.{field} must be a 1-D integer "
                                 f"array of {nb.size} items, got {arr.dtype} {arr.shape}")
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            raise TransportError(f"post_writes {name!r}: plan.{field}[{bad[0]}]={arr[bad[0]]} is "
                                 "negative")
    for field, off, limit, whose in (("src_offsets", so, size, f"local buffer {name!r}"),
                                     ("dst_offsets", do, target_nbytes,
                                      f"remote buffer {remote!r}")):
        bad = np.flatnonzero(off + nb > limit)
        if bad.size:
            i = bad[0]
            raise TransportError(f"post_writes {name!r}: plan.{field}[{i}]={off[i]} + "
                                 f"nbytes[{i}]={nb[i]} exceeds the {whose} of {limit} bytes")
    return plan.nonempty()  # (not reached: bounds() and the checks above agree)


def write_plans(peer: str, writes: Sequence[tuple[int, str, str, object]], on_done: object,
                sizes: Sequence[int | None], targets: Sequence[int | None], *,
                connected: bool) -> list[SpanPlan]:
    """The checks of a `post_writes` job, write by write (its tag, its local buffer registered:
    `sizes[i]`, None if not, and `write_plan` against `targets[i]`, the installed remote's
    size); the plans without their empty pieces, in order."""
    if not callable(on_done):
        raise TransportError("post_writes: on_done must be callable")
    if not writes:
        raise TransportError("post_writes: writes must name at least one write")
    plans = []
    for (tag, name, remote, plan), size, target in zip(writes, sizes, targets, strict=True):
        check_tag(tag)
        if size is None:
            raise TransportError(f"post_writes: no buffer registered as {name!r}")
        plans.append(write_plan(peer, name, plan, size, remote, target, connected=connected))
    return plans


class ChunkPlan:
    """The chunk grid of one span list (see module comment)."""

    __slots__ = ("total", "chunk_bytes", "nchunks", "_off", "_len", "_lo", "_spans")

    def __init__(self, offsets: np.ndarray, nbytes: np.ndarray, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise TransportError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self._spans = (offsets, nbytes)
        self.chunk_bytes = int(chunk_bytes)
        self.total = int(nbytes.sum()) if nbytes.size else 0
        self.nchunks = -(-self.total // self.chunk_bytes)
        if self.total == 0:
            self._off = self._len = self._lo = np.zeros(1, dtype=np.int64)
            return
        cuts = np.arange(self.chunk_bytes, self.total, self.chunk_bytes, dtype=np.int64)
        self._off, self._len, pos = cut_spans(offsets, nbytes, cuts)
        self._lo = np.searchsorted(pos, np.arange(self.nchunks + 1, dtype=np.int64)
                                   * self.chunk_bytes, side="left")

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """The (normalised) span list the plan was made of."""
        return self._spans

    def chunk_len(self, k: int) -> int:
        """Bytes in chunk k."""
        return min(self.chunk_bytes, self.total - k * self.chunk_bytes)

    def direct(self, k: int) -> int | None:
        """Buffer offset of chunk k if it lies inside one span (zero-copy), else None."""
        lo = self._lo[k]
        if self._lo[k + 1] - lo == 1:
            return int(self._off[lo])
        return None

    def pieces(self, k: int) -> tuple[list[int], list[int]]:
        """(buffer offsets, lengths) of the pieces of chunk k, in stream order."""
        lo, hi = self._lo[k], self._lo[k + 1]
        return self._off[lo:hi].tolist(), self._len[lo:hi].tolist()

    def gather(self, buf: np.ndarray, k: int, out: np.ndarray) -> None:
        """Copies chunk k of `buf` into out[:chunk_len(k)]."""
        self._copy(buf, k, out, gather=True)

    def scatter(self, buf: np.ndarray, k: int, src: np.ndarray | memoryview) -> None:
        """Copies src[:chunk_len(k)] into the pieces of chunk k of `buf`."""
        s = np.frombuffer(src, dtype=np.uint8) if isinstance(src, memoryview) else src
        self._copy(buf, k, s, gather=False)

    def _copy(self, buf: np.ndarray, k: int, stage: np.ndarray, gather: bool) -> None:
        lo, hi = int(self._lo[k]), int(self._lo[k + 1])
        off, lens = self._off[lo:hi], self._len[lo:hi]
        pos = 0
        # Scatter of pages of one size at page-aligned slots (the common case: a KV pool) is
        # one vectorised put over a (slots, page) view instead of a Python loop per page; the
        # first and last pieces may be cut by the chunk grid, so only the middle run is tested.
        # (Measured: put 27 GB/s vs loop 22; for gathers np.take is slower than the loop, 12 vs
        # 20 GB/s, so gathers keep the loop.)
        if not gather and off.size > _VECTOR_MIN:
            size = int(lens[1])
            mid_off, mid_len = off[1:-1], lens[1:-1]
            base = int(mid_off[0]) % size
            if (mid_len == size).all() and ((mid_off - base) % size == 0).all():
                pos = self._copy_loop(buf, off[:1], lens[:1], stage, 0, gather)
                rows = (mid_off - base) // size
                slots = (buf.size - base) // size
                table = buf[base:base + slots * size].reshape(slots, size)
                flat = stage[pos:pos + rows.size * size].reshape(rows.size, size)
                table[rows] = flat
                pos += rows.size * size
                self._copy_loop(buf, off[-1:], lens[-1:], stage, pos, gather)
                return
        self._copy_loop(buf, off, lens, stage, pos, gather)

    @staticmethod
    def _copy_loop(buf: np.ndarray, off: np.ndarray, lens: np.ndarray, stage: np.ndarray,
                   pos: int, gather: bool) -> int:
        for o, n in zip(off.tolist(), lens.tolist(), strict=True):
            if gather:
                stage[pos:pos + n] = buf[o:o + n]
            else:
                buf[o:o + n] = stage[pos:pos + n]
            pos += n
        return pos

    def __repr__(self) -> str:
        return (f"ChunkPlan(total={self.total}, chunk_bytes={self.chunk_bytes}, "
                f"nchunks={self.nchunks}, pieces={int(self._lo[-1]) if self.total else 0})")
