# The shm transport's CUDA lane: one-sided writes between CUDA buffers of two processes of one
# host, through CUDA IPC (_cuda_ipc.py has the pieces). shm.py registers a buffer here when it
# is device memory; the rest of shm (ops, peers, cancel, pidfds) is shared.
#
# - describe(name) of a CUDA buffer: DEV_MAGIC + a versioned msgpack map {"v", "pid",
#   "nbytes", "ipc"}, "ipc" being `_cuda_ipc.IpcExport.encode()` (the allocation block's IPC
#   handle and the buffer's offset in it). `parse_device_descriptor` names what is wrong.
# - register_remote of such a descriptor opens the peer's block once per (peer, block)
#   (`_cuda_ipc.PeerBlocks`); the other buffers of the block are addressed from its base.
# - post_writes from a CUDA buffer into a peer's CUDA buffer: a `DeviceJob` for the lane's
#   worker thread (never the caller's, never shm's I/O thread): it runs `copy_spans` (async
#   copies on a private stream, an event recorded behind them), computes the device checksum
#   of the source spans (`devsum`, on a private stream, while the copies run) when asked, then
#   polls the event (bounded backoff, 20 us doubling to 200 us; never a device-wide sync). The
#   job ends once the event completed; shm's I/O thread then completes the op as for a host
#   write. A copy once launched cannot be recalled: cancel() marks the job, and its on_done
#   still waits for the event (nothing of it writes any more then).
# - Host <-> device writes (one side's buffer host memory, the other's device memory) are
#   refused: at register_remote, and at post_writes. Two-sided sends/receives of CUDA buffers
#   are refused: device memory moves by one-sided writes only.
# - A dead peer: the writer opened the peer's memory. The I/O thread's pidfd says the peer
#   exited; from then on writes to it fail before any copy is launched, and disconnect() closes
#   its opened blocks (the storages, hence cudaIpcCloseMemHandle once the last copy that used
#   them completed). CUDA documents freeing an exported allocation while an importer still has
#   it open as undefined behaviour, and a process exit frees its allocations: a copy launched
#   just before the peer died may land in freed memory or fault (a fault is sticky and breaks
#   this process's CUDA context). Not verified on hardware (docs/GPU.md).
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan
from kvhandoff.transports.shm.cuda_ipc import (
    IpcExport,
    PeerBlocks,
    StreamPool,
    copy_spans,
    decode_export,
    export_buffer,
)

log = logging.getLogger(__name__)

DEV_MAGIC = b"KVHSHMC1"
DEV_VERSION = 1
LANE = "cuda-ipc"
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6


def is_device_descriptor(desc: object) -> bool:
    return isinstance(desc, bytes) and desc.startswith(DEV_MAGIC)


def encode_device_descriptor(pid: int, nbytes: int, export: IpcExport) -> bytes:
    return DEV_MAGIC + msgspec.msgpack.encode({"v": DEV_VERSION, "pid": pid, "nbytes": nbytes,
                                               "ipc": export.encode()})


def parse_device_descriptor(desc: bytes) -> tuple[int, int, IpcExport]:
    """(pid, nbytes, IpcExport) of a CUDA buffer descriptor; TransportError naming the field
    that is missing or wrong, or the version this side does not read."""
    if not is_device_descriptor(desc):
        raise TransportError("shm: not a CUDA buffer descriptor (bad magic)")
    try:
        m = msgspec.msgpack.decode(desc[len(DEV_MAGIC):])
    except msgspec.DecodeError as e:
        raise TransportError(f"shm: CUDA buffer descriptor: not msgpack: {e}") from None
    if not isinstance(m, dict):
        raise TransportError("shm: CUDA buffer descriptor: expected a map")
    if m.get("v") != DEV_VERSION:
        raise TransportError(f"shm: CUDA buffer descriptor: version {m.get('v')!r}, this side "
                             f"reads {DEV_VERSION}")
    for f, typ in (("pid", int), ("nbytes", int), ("ipc", bytes)):
        x = m.get(f)
        if not isinstance(x, typ) or isinstance(x, bool):
            raise TransportError(f"shm: CUDA buffer descriptor: field {f!r} must be "
                                 f"{typ.__name__}, got {type(x).__name__}")
    try:
        export = decode_export(m["ipc"])
    except ValueError as e:
        raise TransportError(f"shm: CUDA buffer descriptor: field 'ipc': {e}") from None
    if export.nbytes != m["nbytes"]:
        raise TransportError(f"shm: CUDA buffer descriptor: nbytes {m['nbytes']} but the IPC "
                             f"export has {export.nbytes}")
    return int(m["pid"]), int(m["nbytes"]), export


class DeviceTarget:
    """A peer's CUDA buffer opened through IPC (a uint8 tensor over its bytes)."""

    __slots__ = ("pid", "nbytes", "tensor")
    lane = LANE

    def __init__(self, pid: int, nbytes: int, tensor: Any) -> None:
        self.pid, self.nbytes, self.tensor = pid, nbytes, tensor


class DeviceJob:
    """One span-plan copy between CUDA buffers; shm's I/O thread handles it as a `CopyJob`
    (cancel / wait / ended_event / total / digest / error / owner)."""

    __slots__ = ("src", "dst", "plan", "checksum", "on_end", "owner", "cancelled", "error",
                 "digest", "total", "ended_event", "started", "thread")

    def __init__(self, src: Any, dst: Any, plan: SpanPlan, checksum: bool,
                 on_end: Callable[[DeviceJob], None], owner: Any = None) -> None:
        self.src, self.dst, self.plan = src, dst, plan
        self.checksum = checksum
        self.on_end = on_end
        self.owner = owner
        self.total = plan.total_bytes
        self.cancelled = False
        self.started = False  # its copies were launched (they then run to their end)
        self.error: str | None = None
        self.digest: int | None = None
        self.ended_event = threading.Event()
        self.thread: str | None = None  # the thread that launched its copies (tests)

    def cancel(self) -> None:
        self.cancelled = True

    def wait(self, timeout: float) -> bool:
        return self.ended_event.wait(timeout)

    def _end(self, error: str | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.ended_event.set()
        self.on_end(self)


class DeviceLane:
    """The CUDA side of one shm transport: which buffers are device memory, their export, the
    peers' opened blocks, and the worker thread that launches copies and polls their events.
    The buffer hooks (`claims`, `flat`, `export`, `open`, `copy`, `digest`) are methods so a
    CPU test can stand CPU tensors in for CUDA ones; production uses them as they are."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.blocks = PeerBlocks()
        self._queue: queue.SimpleQueue[DeviceJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    # ---- buffer hooks -----------------------------------------------------------------

    def claims(self, buf: Any) -> bool:
        """Whether `buf` is device memory this lane handles (CUDA, by `memory_kind`)."""
        if isinstance(buf, np.ndarray):
            return False
        from kvhandoff.buffers.devsum import memory_kind

        try:
            return memory_kind(buf).kind == "cuda"
        except ValueError:
            return False

    def flat(self, buf: Any) -> tuple[Any, int]:
        """(a 1-D uint8 view of `buf` for copies, its size in bytes). A CUDA array interface
        object torch cannot map (no CUDA here: a `DeviceBytes`) is kept as it is: it
        registers and is sized, nothing copies through it."""
        import torch

        if isinstance(buf, torch.Tensor):
            if not buf.is_contiguous():
                raise TransportError("register: the tensor must be contiguous")
            t = buf.reshape(-1).view(torch.uint8)
            return t, int(t.numel())
        from kvhandoff.buffers.devsum import memory_kind

        info = memory_kind(buf)
        if torch.cuda.is_available():
            t = torch.as_tensor(buf).reshape(-1).view(torch.uint8)
            return t, int(t.numel())
        return buf, int(info.nbytes)

    def export(self, buf: Any) -> IpcExport:
        """The IPC export of a registered CUDA buffer. Only memory of torch's caching
        allocator exports; anything else (a `DeviceBytes`, a tensor over memory another
        library allocated, whose torch IPC call raises) is refused here."""
        try:
            return export_buffer(buf)
        except ValueError as e:
            raise TransportError(f"describe: {e}") from None
        except RuntimeError as e:  # torch's IPC export of memory it did not allocate
            raise TransportError(f"describe: torch cannot export this CUDA buffer over IPC "
                                 f"(only memory of torch's caching allocator exports): "
                                 f"{e}") from None

    def open(self, peer: str, export: IpcExport) -> Any:
        return self.blocks.open(peer, export)

    def copy(self, job: DeviceJob) -> Any:
        """Launches the job's copies; the event behind them."""
        return copy_spans(job.src, job.dst, job.plan)

    def digest(self, job: DeviceJob) -> int:
        """The device checksum of the job's source spans, on a private stream of the source's
        device (CUDA), so it runs while the copies do."""
        from kvhandoff.buffers.devsum import devsum

        src = job.src
        if getattr(getattr(src, "device", None), "type", None) == "cuda":
            import torch

            with torch.cuda.stream(_hash_streams.of(src.device)):
                return devsum(src, job.plan.src_offsets, job.plan.nbytes)
        return devsum(src, job.plan.src_offsets, job.plan.nbytes)

    # ---- peers --------------------------------------------------------------------------

    def close_peer(self, peer: str) -> int:
        """Drops `peer`'s opened blocks (closed once the last tensor over them is gone)."""
        return self.blocks.close_peer(peer)

    # ---- the worker ---------------------------------------------------------------------

    def submit(self, job: DeviceJob) -> None:
        with self._lock:
            if self._stopped:
                raise TransportError("shm: the CUDA lane is stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"kvhandoff-shm-cuda-{self._name}")
                self._thread.start()
        self._queue.put(job)

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the worker after the jobs it holds ended (each after its event completed);
        waits at most `timeout` seconds (a warning past it: the daemon worker is left)."""
        with self._lock:
            self._stopped = True
            t = self._thread
        if t is not None:
            self._queue.put(None)
            if threading.current_thread() is not t:
                t.join(timeout)
                if t.is_alive():
                    log.warning("shm: the CUDA lane's copies did not complete within %s s of "
                                "close", timeout)

    def _run(self) -> None:
        pending: list[tuple[DeviceJob, Any]] = []
        delay = _POLL_MIN_S
        stopping = False
        while True:
            try:
                job = (self._queue.get_nowait() if pending or stopping
                       else self._queue.get())
            except queue.Empty:
                job = None
            else:
                if job is None:
                    stopping = True
                else:
                    self._start(job, pending)
                    delay = _POLL_MIN_S
                    continue  # start what is queued before polling
            progressed = False
            for item in list(pending):
                j, event = item
                try:
                    done = bool(event.query())
                except Exception as e:  # noqa: BLE001 - the write fails, the worker lives on
                    pending.remove(item)
                    j._end(f"waiting for the device copy failed: {e}")
                    progressed = True
                    continue
                if done:
                    pending.remove(item)
                    j._end(None)
                    progressed = True
            if stopping and not pending:
                return
            if pending and not progressed:
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            elif progressed:
                delay = _POLL_MIN_S

    def _start(self, job: DeviceJob, pending: list[tuple[DeviceJob, Any]]) -> None:
        if job.cancelled:
            job._end("cancelled")
            return
        job.thread = threading.current_thread().name
        try:
            event = self.copy(job)
        except Exception as e:  # noqa: BLE001 - nothing was launched: the write fails now
            job._end(f"device copy failed: {e}")
            return
        job.started = True
        if job.checksum:
            try:
                job.digest = self.digest(job)
            except Exception as e:  # noqa: BLE001 - reported once the copies ended
                job.error = f"device checksum of the source failed: {e}"
        pending.append((job, event))


_hash_streams = StreamPool()
