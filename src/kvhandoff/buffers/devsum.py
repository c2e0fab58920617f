"""Device checksum of one (layer, region): a position-keyed hash over a span list, computed with
torch ops where the buffer lives (CPU or CUDA), without first gathering the pages into one
contiguous copy; plus a pure-numpy reference and the memory-kind helper.

Definition (both sides of a plan get the same value for the same bytes in plan order, whatever
their page sizes; the value depends only on the stream, never on where it is cut into spans or
where the pages sit; note that two plans for other page sizes may order the pieces differently,
since the span planner merges pieces that are contiguous on both sides, and then hash another
stream):

- The *stream* is the concatenation of ``buf[o:o+n]`` for each span ``(o, n)``, in plan order.
  Every span length must be a multiple of 4 (every plane of every preset is: the smallest is
  the indexer's 4-byte scale), so the stream is a sequence of 32-bit words
  ``w_0 .. w_{m-1}`` (little-endian), and a cut between spans always falls between words.
  Offsets need not be aligned.
- Each word is keyed by its position: ``x_i = (i << 32) | w_i`` (unique per (i, w_i)), and
  mixed by the splitmix64 finalizer ``mix``, a bijection of 64-bit integers.
- ``digest = mix(sum_i mix(x_i)  XOR  mix(m XOR (seed << 33)))``, sums and products mod 2**64.

Because `mix` is a bijection and each position is keyed, changing any one word (e.g. any
single flipped byte) changes exactly one term of the sum, hence always changes the sum and the
digest; words swapped between positions or a changed length change it with probability
~1 - 2**-64. The sum is order-independent, so the words can be hashed in any grouping: here
in chunks of at most `CHUNK_WORDS` words, each gathered through an index table built from the
span list (the page table never becomes a contiguous copy of the stream).

Limits: at most 2**31 words (8 GiB) per (layer, region) stream. The torch path relies on
int64 arithmetic wrapping mod 2**64 (it does on CPU and CUDA; the tests check it against the
numpy reference, which uses uint64). A fused Triton/CUDA kernel over the (pointer, offset)
table would read each byte once; these torch ops make several passes over each chunk (the
cost is measured by ``python -m kvhandoff.bench.devsum``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.buffers.checksum import ChecksumAlg, span_checksum

WORD = 4
MAX_WORDS = 1 << 31
CHUNK_WORDS = 1 << 22  # CUDA: 4 Mi words (16 MiB of data) per pass; CPU: 32 Ki words
_M64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C1S, _C2S = _signed(_C1), _signed(_C2)


# ---- memory kind ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryInfo:
    """Where a buffer lives: kind "host" or "cuda", the CUDA device when known, its address
    and size in bytes."""

    kind: str
    device: int | None
    ptr: int
    nbytes: int


def _typestr_itemsize(typestr: str) -> int:
    # array-interface typestr: byte order, kind, item size in bytes ("<f2", "|u1", "<V8")
    try:
        return int(typestr[2:])
    except ValueError as e:
        raise ValueError(f"__cuda_array_interface__.typestr: cannot read {typestr!r}") from e


def _cai_device(buf: Any) -> int | None:
    """The CUDA device of an array-interface object when it says (an int `device`, as
    `DeviceBytes`, or a `device.id`, as CuPy); None when it does not."""
    dev = getattr(buf, "device", None)
    dev = getattr(dev, "id", dev)
    return dev if isinstance(dev, int) and not isinstance(dev, bool) else None


def memory_kind(buf: Any) -> MemoryInfo:
    """Detects host vs CUDA memory for torch tensors, objects with
    ``__cuda_array_interface__`` (CuPy, Numba, ...), numpy arrays and other host buffers.

    Raises:
        ValueError: a device torch does not hand to kvhandoff (mps, meta, ...), a malformed
            or non-contiguous CUDA array interface, or an object that is none of the above.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(buf, torch.Tensor):
        dev = buf.device
        nbytes = buf.numel() * buf.element_size()
        if dev.type == "cpu":
            return MemoryInfo("host", None, int(buf.data_ptr()), nbytes)
        if dev.type == "cuda":
            return MemoryInfo("cuda", dev.index, int(buf.data_ptr()), nbytes)
        raise ValueError(f"buffer: torch device {dev.type!r} is neither cpu nor cuda")
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        if not isinstance(cai, dict):
            raise ValueError("__cuda_array_interface__: expected a dict")
        try:
            ptr = int(cai["data"][0])
            shape = tuple(int(s) for s in cai["shape"])
            itemsize = _typestr_itemsize(str(cai["typestr"]))
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"__cuda_array_interface__: missing or bad field: {e}") from e
        strides = cai.get("strides")
        if strides is not None:
            want, expect = [], itemsize
            for s in reversed(shape):
                want.append(expect)
                expect *= s
            if tuple(strides) != tuple(reversed(want)):
                raise ValueError(f"__cuda_array_interface__.strides: {tuple(strides)} is not "
                                 "C-contiguous")
        n = itemsize
        for s in shape:
            n *= s
        return MemoryInfo("cuda", _cai_device(buf), ptr, n)
    if isinstance(buf, np.ndarray):
        return MemoryInfo("host", None, int(buf.ctypes.data), int(buf.nbytes))
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ValueError(f"buffer: {type(buf).__name__} is not a torch tensor, a CUDA array "
                         "(__cuda_array_interface__) nor a host buffer") from None
    arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.zeros(0, np.uint8)
    return MemoryInfo("host", None, int(arr.ctypes.data) if mv.nbytes else 0, mv.nbytes)


def refuse_device_memory(transport: str, name: str, buf: Any) -> None:
    """For a transport that moves host memory only: raises `TransportError` when `buf` is
    CUDA memory, saying which transports are meant for device buffers. Host buffers (and
    objects `memory_kind` cannot classify, left to the transport's own checks) pass."""
    if isinstance(buf, np.ndarray):
        return
    try:
        info = memory_kind(buf)
    except ValueError:
        return
    if info.kind != "cuda":
        return
    from kvhandoff.errors import TransportError

    dev = f"cuda:{info.device}" if info.device is not None else "CUDA"
    raise TransportError(
        f"register {name!r}: the buffer is {dev} memory and the {transport} transport moves "
        "host memory only (as built here); device buffers need the shm transport's CUDA IPC "
        "lane (same host, one-sided writes: one_sided_writes on) or the nixl transport, which "
        "registers CUDA buffers as VRAM. Use host buffers with this transport.")


# ---- span list checks -----------------------------------------------------------------------

def _spans(offsets: Any, nbytes: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    nb = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    if off.shape != nb.shape:
        raise ValueError(f"spans: {off.size} offsets but {nb.size} lengths")
    if nb.size:
        if nb.min() < 0 or off.min() < 0:
            raise ValueError("spans: offsets and lengths must be >= 0")
        if np.any(nb % WORD):
            bad = int(np.flatnonzero(nb % WORD)[0])
            raise ValueError(f"spans: length {int(nb[bad])} of span {bad} is not a multiple of "
                             f"{WORD} bytes")
        if int((off + nb).max()) > size:
            raise ValueError(f"spans: a span ends past the buffer ({size} bytes)")
    if int(nb.sum()) // WORD > MAX_WORDS:
        raise ValueError(f"spans: more than {MAX_WORDS} words in one stream")
    return off, nb


# ---- numpy reference ------------------------------------------------------------------------

def _mix_np(x: Any) -> Any:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_C1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_C2)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * _C1) & _M64
    x ^= x >> 27
    x = (x * _C2) & _M64
    return x ^ (x >> 31)


def _finish(total: int, words: int, seed: int) -> int:
    return _mix_int((total & _M64) ^ _mix_int(words ^ ((seed & _M64) << 33)))


def devsum_reference(buf: np.ndarray, offsets: Any, nbytes: Any, *, seed: int = 0) -> int:
    """The definition, in plain numpy: gathers the stream and hashes it (tests, not speed)."""
    b = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    off, nb = _spans(offsets, nbytes, int(b.size))
    stream = np.concatenate([b[o:o + n] for o, n in zip(off.tolist(), nb.tolist(),
                                                        strict=True)] or [b[:0]])
    w = stream.view("<u4").astype(np.uint64)
    pos = np.arange(w.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix_np((pos << np.uint64(32)) | w)
        total = int(h.sum(dtype=np.uint64))
    return _finish(total, int(w.size), seed)


# ---- torch implementation -------------------------------------------------------------------

def _mix_(x: Any, tmp: Any) -> None:
    """splitmix64 finalizer in place on an int64 tensor with uint64 semantics (logical shifts
    by masking; products wrap mod 2**64). `tmp` is scratch of the same shape."""
    import torch

    for shift, mult in ((30, _C1S), (27, _C2S), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)


def _as_u8(buf: Any) -> Any:
    import torch

    if isinstance(buf, np.ndarray):
        buf = torch.from_numpy(np.ascontiguousarray(buf))
    elif not isinstance(buf, torch.Tensor) and hasattr(buf, "__cuda_array_interface__"):
        buf = torch.as_tensor(buf)  # in place on its device (a device argument may copy)
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"buffer: expected a torch tensor, numpy array or CUDA array, got "
                         f"{type(buf).__name__}")
    if not buf.is_contiguous():
        raise ValueError("buffer: must be contiguous")
    return buf.reshape(-1).view(torch.uint8)


def default_chunk_words(device_type: str) -> int:
    """Words hashed per pass: small on CPU (temporaries stay in cache), large on CUDA (fewer
    kernel launches)."""
    return CHUNK_WORDS if device_type == "cuda" else 1 << 15


def devsum(buf: Any, offsets: Any, nbytes: Any, *, seed: int = 0,
           chunk_words: int | None = None, index_on_device: bool | None = None) -> int:
    """The device checksum of the stream `buf[offsets[k]:offsets[k]+nbytes[k]]`, k in order
    (see the module docstring), computed on `buf`'s device. Equal to `devsum_reference`.

    `buf` is a contiguous torch tensor (any dtype, CPU or CUDA), a numpy array or an object
    with ``__cuda_array_interface__``. Raises ValueError for a span length that is not a
    multiple of 4, a span past the end of the buffer, or a bad buffer.

    Word-aligned spans of 64 words or more are hashed from slices of the buffer, packed per
    chunk (a long span needs no copy); short or unaligned ones go through a per-chunk index
    table, built with numpy for CPU buffers and on the device for CUDA ones
    (`index_on_device` forces either way; tests use it to run the CUDA way on CPU). One device
    sync, at the end.
    """
    import torch

    b = _as_u8(buf)
    off, nb = _spans(offsets, nbytes, int(b.numel()))
    keep = nb > 0
    off, nb = off[keep], nb[keep]
    words = int(nb.sum()) // WORD
    if words == 0:
        return _finish(0, 0, seed)
    dev = b.device
    chunk = max(1, chunk_words or default_chunk_words(dev.type))
    counts = nb // WORD
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # stream word index of each span
    aligned = b.data_ptr() % WORD == 0 and not np.any(off % WORD)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    x_buf = torch.empty(min(chunk, words), dtype=torch.int64, device=dev)
    tmp_buf = torch.empty_like(x_buf)
    base = torch.arange(min(chunk, words), dtype=torch.int64, device=dev)

    def hash_piece(pos0: int, w: Any) -> None:
        # x = (position << 32) | word, mixed, summed into total
        nonlocal total
        n = int(w.numel())
        x, tmp = x_buf[:n], tmp_buf[:n]
        torch.add(base[:n], pos0, out=x)
        x.bitwise_left_shift_(32)
        tmp.copy_(w)  # int32 -> int64 (sign-extends: mask back to 32 bits)
        tmp.bitwise_and_(0xFFFFFFFF)
        x.bitwise_or_(tmp)
        _mix_(x, tmp)
        total = total + x.sum()

    if aligned and int(counts.mean()) >= 64:  # slices of the buffer, packed per chunk
        src = b[: (b.numel() // WORD) * WORD].view(torch.int32)
        w_buf = torch.empty(min(chunk, words), dtype=torch.int32, device=dev)
        pieces: list[Any] = []
        have, pos = 0, 0
        for o, c in zip((off // WORD).tolist(), counts.tolist(), strict=True):
            k = 0
            while k < c:
                n = min(chunk - have, c - k)
                pieces.append(src[o + k:o + k + n])
                have += n
                k += n
                if have == chunk:
                    hash_piece(pos, pieces[0] if len(pieces) == 1 else
                               torch.cat(pieces, out=w_buf[:have]))
                    pos += have
                    pieces, have = [], 0
        if have:
            hash_piece(pos, pieces[0] if len(pieces) == 1 else
                       torch.cat(pieces, out=w_buf[:have]))
        return _finish(int(total.item()), words, seed)

    # short or unaligned spans: the stream in chunks, each gathered through an index table
    if aligned:
        src = b[: (b.numel() // WORD) * WORD].view(torch.int32)
        starts, step = off // WORD, 1
    else:
        src, starts, step = b, off, WORD  # byte index; words are assembled from 4 bytes
    on_device = dev.type != "cpu" if index_on_device is None else index_on_device
    starts_t = torch.as_tensor(starts, device=dev)
    first_t = torch.as_tensor(first, device=dev)
    span_end = np.cumsum(counts)
    pos = 0
    while pos < words:
        stop = min(words, pos + chunk)
        k0 = int(np.searchsorted(span_end, pos, side="right"))
        k1 = int(np.searchsorted(span_end, stop - 1, side="right")) + 1
        cnt = counts[k0:k1].copy()  # words of each span inside this chunk
        cnt[0] -= pos - int(first[k0])
        cnt[-1] -= int(span_end[k1 - 1]) - stop
        if not on_device:  # the index table in numpy (no copy into torch)
            i_np = np.arange(pos, stop, dtype=np.int64) * step
            idx = torch.from_numpy(i_np + np.repeat(starts[k0:k1] - first[k0:k1] * step, cnt))
        else:  # built on the device: nothing crosses the bus but the span table
            span = torch.repeat_interleave(torch.arange(k0, k1, device=dev),
                                           torch.as_tensor(cnt, device=dev),
                                           output_size=stop - pos)
            idx = (base[:stop - pos] + pos - first_t[span]) * step + starts_t[span]
        if aligned:
            w = torch.index_select(src, 0, idx)
        else:
            w = torch.index_select(src, 0, idx).to(torch.int64)
            for k in range(1, WORD):
                w.bitwise_or_(torch.index_select(src, 0, idx + k).to(torch.int64) << (8 * k))
        hash_piece(pos, w)
        pos = stop
    return _finish(int(total.item()), words, seed)


# ---- the agent's checksum of a span list, by the room's algorithm ----------------------------

def room_checksum(buf: Any, offsets: Any, nbytes: Any, alg: str) -> int:
    """The checksum the agent puts in (or checks against) a `LayerDone` for one (layer,
    region) span list, with the room's algorithm (`protocol.checksums.checksum_alg`, a
    `checksum.ChecksumAlg`): "xxh3" is
    xxh3-64 over host bytes (`checksum.span_checksum`; a device buffer is refused: rooms
    with a device side use devsum), "devsum" is `devsum` computed where `buf` lives (torch
    ops on CUDA, the same value on the CPU for a host buffer).

    Raises:
        ValueError: an unknown `alg`, xxh3 of device memory, or what `devsum` refuses (a
            span length that is not a multiple of 4, a span past the buffer).
    """
    if alg == ChecksumAlg.XXH3:
        if not isinstance(buf, np.ndarray):
            kind = memory_kind(buf).kind
            if kind != "host":
                raise ValueError(f"checksum xxh3 of {kind} memory: rooms where either side's "
                                 "buffers are device memory use devsum")
            buf = np.frombuffer(memoryview(buf), dtype=np.uint8)
        return span_checksum(buf, np.asarray(offsets, dtype=np.int64),
                             np.asarray(nbytes, dtype=np.int64))
    if alg == ChecksumAlg.DEVSUM:
        return devsum(buf, offsets, nbytes)
    raise ValueError(f"checksum algorithm {alg!r}: expected one of "
                     f"{', '.join(a.value for a in ChecksumAlg)}")
