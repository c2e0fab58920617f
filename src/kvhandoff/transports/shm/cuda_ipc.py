"""Same-host GPU lane pieces (CUDA IPC), standalone: the shm transport is meant to call them
for CUDA buffers; nothing calls them yet but the tests and the GPU bench.

- `export_buffer(t)`: a CUDA tensor as (IPC handle of its allocation block, offset of the
  tensor's bytes in the block, nbytes, device). The torch caching allocator hands out
  sub-blocks of larger allocations and CUDA IPC shares whole allocations, so the handle is
  the block's (``UntypedStorage._share_cuda_()`` finds the block and the storage's offset in
  it) and the offset adds the tensor's own offset in its storage.
- `IpcExport.encode()` / `decode_export()`: a versioned msgpack map (no pickle); a decode
  names the field that is missing or of the wrong type, and refuses other versions.
- `PeerBlocks.open(peer, export)`: a uint8 tensor over the peer's bytes. Each (peer, block
  handle) is opened once (one ``_new_shared_cuda``); the other buffers of that block are
  addressed from the opened block's base pointer. `close_peer` drops a peer's blocks.
- `plan_batches`: the pieces of a span plan (`kv_layout.SpanPlan`, paired once where it was
  built) as copy batches: long pieces one device copy each, runs of short pieces of one length
  a single gather/scatter kernel each.
- `copy_spans(src, dst, plan)`: runs the batches with async copies on a private stream (one per
  device, created on first use), after the caller's `after` event, and returns an event
  recorded behind the last copy (`query()` / `synchronize()`, as `Sender.layer_ready`
  takes). CPU tensors take the same path synchronously (tests): the event is already done.

Only torch CUDA tensors from the caching allocator are exported here (objects seen only
through ``__cuda_array_interface__`` are refused with a clear error).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvhandoff.kv_layout.spans import SpanPlan

VERSION = 1
SMALL_PIECE = 1 << 20  # shorter pieces are batched into gather/scatter kernels (a copy
# call costs microseconds of launch, the time of megabytes at device bandwidth)
MAX_BATCH = 1 << 16  # pieces per gather batch


# ---- descriptor --------------------------------------------------------------------------

@dataclass(frozen=True)
class IpcExport:
    """What a peer needs to open one CUDA buffer of this process (see module doc)."""

    device: int
    handle: bytes  # cudaIpcMemHandle of the allocation block (as torch gives it)
    storage_offset: int  # byte offset of the storage in the block
    storage_nbytes: int  # size of that storage
    offset: int  # byte offset of the buffer in its storage
    nbytes: int
    ref_counter_handle: bytes  # torch's producer-side reference counter (keeps the block)
    ref_counter_offset: int
    event_handle: bytes  # torch's IPC event of the producer's last use
    event_sync_required: bool

    @property
    def block_offset(self) -> int:
        """Byte offset of the buffer in the allocation block."""
        return self.storage_offset + self.offset

    def encode(self) -> bytes:
        return msgspec.msgpack.encode({"v": VERSION, **{f: getattr(self, f) for f in _FIELDS}})


_FIELDS: dict[str, type] = {"device": int, "handle": bytes, "storage_offset": int,
                            "storage_nbytes": int, "offset": int, "nbytes": int,
                            "ref_counter_handle": bytes, "ref_counter_offset": int,
                            "event_handle": bytes, "event_sync_required": bool}


def decode_export(blob: bytes) -> IpcExport:
    """The `IpcExport` of `blob`; ValueError naming the field on anything unexpected."""
    try:
        m = msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as e:
        raise ValueError(f"cuda ipc descriptor: not msgpack: {e}") from None
    if not isinstance(m, dict):
        raise ValueError("cuda ipc descriptor: expected a map")
    v = m.get("v")
    if v != VERSION:
        raise ValueError(f"cuda ipc descriptor: version {v!r}, this side reads {VERSION}")
    out: dict[str, Any] = {}
    for f, typ in _FIELDS.items():
        if f not in m:
            raise ValueError(f"cuda ipc descriptor: field {f!r} missing")
        x = m[f]
        ok = isinstance(x, typ) and (typ is bool or not isinstance(x, bool))
        if not ok:
            raise ValueError(f"cuda ipc descriptor: field {f!r} must be {typ.__name__}, got "
                             f"{type(x).__name__}")
        if typ is int and x < 0:
            raise ValueError(f"cuda ipc descriptor: field {f!r} must be >= 0, got {x}")
        out[f] = x
    if out["offset"] + out["nbytes"] > out["storage_nbytes"]:
        raise ValueError(f"cuda ipc descriptor: offset {out['offset']} + nbytes "
                         f"{out['nbytes']} past the storage ({out['storage_nbytes']} bytes)")
    return IpcExport(**out)


def export_buffer(t: Any) -> IpcExport:
    """The `IpcExport` of a contiguous CUDA tensor (any dtype) from torch's allocator."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"cuda ipc export: expected a torch CUDA tensor, got "
                         f"{type(t).__name__} (buffers seen only through "
                         "__cuda_array_interface__ are not exported yet)")
    if t.device.type != "cuda":
        raise ValueError(f"cuda ipc export: tensor is on {t.device}, not a CUDA device")
    if not t.is_contiguous():
        raise ValueError("cuda ipc export: tensor must be contiguous")
    st = t.untyped_storage()
    (device, handle, size, st_off, ref_h, ref_off, ev_h,
     ev_sync) = st._share_cuda_()  # type: ignore[no-untyped-call]
    return IpcExport(device=int(device), handle=bytes(handle), storage_offset=int(st_off),
                     storage_nbytes=int(size),
                     offset=int(t.storage_offset()) * t.element_size(),
                     nbytes=t.numel() * t.element_size(), ref_counter_handle=bytes(ref_h),
                     ref_counter_offset=int(ref_off), event_handle=bytes(ev_h or b""),
                     event_sync_required=bool(ev_sync))


class _Raw:
    """A CUDA byte range by address for torch.as_tensor; keeps the opened block alive."""

    def __init__(self, ptr: int, nbytes: int, keep: Any) -> None:
        self._keep = keep
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3}


class PeerBlocks:
    """Peers' allocation blocks opened through CUDA IPC, each (peer, handle) once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, bytes], tuple[Any, int]] = {}  # -> (storage, base)
        # peer reference counters accounted for: held by an opened storage or given back
        self._released: set[tuple[str, bytes, int]] = set()
        self.opens = 0  # IPC opens done (tests: once per block per peer)

    def open(self, peer: str, exp: IpcExport) -> Any:
        """A uint8 CUDA tensor over the peer's buffer `exp` (no copy)."""
        import torch

        key = (peer, exp.handle)
        with self._lock:
            got = self._blocks.get(key)
            counter = (peer, exp.ref_counter_handle, exp.ref_counter_offset)
            if got is not None and counter not in self._released:
                # the block is open already: give back the reference the peer took for this
                # export (as torch does for a storage it has open), once
                torch.UntypedStorage._release_ipc_counter(
                    exp.ref_counter_handle, exp.ref_counter_offset,
                    device=exp.device)  # type: ignore[no-untyped-call]
                self._released.add(counter)
            if got is None:
                torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
                st = torch.UntypedStorage._new_shared_cuda(
                    exp.device, exp.handle, exp.storage_nbytes, exp.storage_offset,
                    exp.ref_counter_handle, exp.ref_counter_offset, exp.event_handle,
                    exp.event_sync_required)
                got = (st, int(st.data_ptr()) - exp.storage_offset)  # the block's base
                self._blocks[key] = got
                self._released.add(counter)  # held by the opened storage, released with it
                self.opens += 1
        st, base = got
        raw = _Raw(base + exp.block_offset, exp.nbytes, st)
        t = torch.as_tensor(raw)  # in place: no device argument, which could copy
        if t.device.type != "cuda" or t.data_ptr() != base + exp.block_offset:
            raise RuntimeError(f"cuda ipc open: torch did not map the peer's buffer in place "
                               f"(got {t.device})")
        return t

    def close_peer(self, peer: str) -> int:
        """Drops every block of `peer` (its tensors keep theirs alive); how many."""
        with self._lock:
            keys = [k for k in self._blocks if k[0] == peer]
            for k in keys:
                del self._blocks[k]
            self._released = {c for c in self._released if c[0] != peer}
        return len(keys)


# ---- batching (pure numpy) ----------------------------------------------------------------

@dataclass(frozen=True)
class IpcBatch:
    """One device operation: `kind` "copy" (one piece, `nbytes` long) or "gather" (len(src)
    pieces of `nbytes` each, one kernel)."""

    kind: str
    src: np.ndarray
    dst: np.ndarray
    nbytes: int


def plan_batches(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *,
                 small: int = SMALL_PIECE, max_batch: int = MAX_BATCH) -> list[IpcBatch]:
    """The pieces as batches, in order: a long piece (>= `small` bytes) is one copy; runs of
    short pieces of equal length are one gather each (at most `max_batch` pieces); a lone
    short piece is a copy. Pieces never overlap on the destination, so their order within
    the stream does not matter to the result."""
    out: list[IpcBatch] = []
    i, n = 0, len(nbytes)
    while i < n:
        L = int(nbytes[i])
        if L >= small:
            out.append(IpcBatch("copy", src[i:i + 1], dst[i:i + 1], L))
            i += 1
            continue
        j = i + 1
        while j < n and j - i < max_batch and int(nbytes[j]) == L:
            j += 1
        kind = "gather" if j - i > 1 else "copy"
        out.append(IpcBatch(kind, src[i:j], dst[i:j], L))
        i = j
    return out


# ---- copies ------------------------------------------------------------------------------

class _Done:
    """A completed event (CPU copies)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StreamPool:
    """Private CUDA streams, one per device, made on first use and kept for the process
    (a pool per purpose: the copies here, the source checksums in `cuda`). Any thread."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def of(self, device: Any) -> Any:
        """The pool's stream on `device` (a torch device; no index: the current one)."""
        import torch

        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            s = self._streams.get(idx)
            if s is None:
                s = self._streams[idx] = torch.cuda.Stream(device=idx)  # type: ignore[no-untyped-call]
            return s


_copy_streams = StreamPool()


def copy_spans(src: Any, dst: Any, plan: SpanPlan, *, after: Any = None,
               small: int = SMALL_PIECE) -> Any:
    """Copies each piece of `plan` from `src` (at its src offset) into `dst` (at its dst
    offset) (1-D uint8 tensors, both CUDA, on one device or two, or both CPU), batched
    (`plan_batches`), async on private streams
    (one per device) that first wait for `after` (an event, e.g. recorded behind the
    kernels that wrote `src`; default: the current stream's work so far on `src`'s
    device). Returns an event recorded behind the last copy.

    Across two devices the gathers run on the source device's private stream and the
    scatters on the destination's; torch's cross-device copy orders the two both ways, so
    the event, recorded on the destination's stream, is behind every byte."""
    import torch

    if (src.device.type == "cuda") != (dst.device.type == "cuda"):
        raise ValueError(f"copy_spans: source on {src.device}, destination on {dst.device}: "
                         "both CUDA or both CPU")
    s_off, d_off, nb = plan.src_offsets, plan.dst_offsets, plan.nbytes
    if nb.size and int(nb.min()) < 0:
        raise ValueError("copy_spans: a piece of the plan has a negative length")
    if nb.size:
        if int((s_off + nb).max()) > src.numel() or int((d_off + nb).max()) > dst.numel():
            raise ValueError("copy_spans: a span ends past its buffer")
    batches = plan_batches(s_off, d_off, nb, small=small)
    if src.device.type != "cuda":
        _run(batches, src, dst)
        return _Done()
    s_stream, d_stream = _copy_streams.of(src.device), _copy_streams.of(dst.device)
    if after is not None:
        s_stream.wait_event(after)
    else:
        s_stream.wait_stream(torch.cuda.current_stream(src.device))
    if d_stream is not s_stream:
        d_stream.wait_stream(s_stream)
    with torch.cuda.stream(s_stream), torch.cuda.stream(d_stream):
        _run(batches, src, dst)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(d_stream)
    # the allocator must not reuse these blocks before the copies ran (memory opened
    # through IPC is not the allocator's: torch skips it)
    src.record_stream(s_stream)
    dst.record_stream(d_stream)
    return done


_WORDS = ((8, "int64"), (4, "int32"), (2, "int16"))


def word_size(ptrs: tuple[int, ...], *arrays: np.ndarray) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every address and every value."""
    for w, _ in _WORDS:
        if all(p % w == 0 for p in ptrs) and all(not np.any(a % w) for a in arrays):
            return w
    return 1


def as_words(t: Any, w: int) -> Any:
    """A 1-D uint8 tensor viewed as `w`-byte words (its tail past the last whole word cut)."""
    import torch

    if w == 1:
        return t
    dtype = getattr(torch, dict(_WORDS)[w])
    return t[: t.numel() // w * w].view(dtype)


def _run(batches: list[IpcBatch], src: Any, dst: Any) -> None:
    import torch

    for b in batches:
        if b.kind == "copy":
            so, do = int(b.src[0]), int(b.dst[0])
            dst[do:do + b.nbytes].copy_(src[so:so + b.nbytes], non_blocking=True)
            continue
        # one kernel for the run: gather words of the source, scatter into the destination
        # (index built on the device from the pieces' offsets: only those cross the bus)
        w = word_size((src.data_ptr(), dst.data_ptr()), b.src, b.dst, np.array([b.nbytes]))
        sw, dw = as_words(src, w), as_words(dst, w)
        cols = torch.arange(b.nbytes // w, dtype=torch.int64, device=src.device)
        si = (torch.as_tensor(b.src // w, device=src.device)[:, None] + cols[None, :])
        vals = torch.index_select(sw, 0, si.reshape(-1))
        di = (torch.as_tensor(b.dst // w, device=dst.device)[:, None]
              + cols.to(dst.device)[None, :])
        if vals.device != dst.device:
            vals = vals.to(dst.device, non_blocking=True)
        dw.index_copy_(0, di.reshape(-1), vals)
