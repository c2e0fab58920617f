# What the threaded transports (tcp, ucx, shm) share: the table of pending ops, argument checks
# of post_*, completion delivery, the command queue that wakes their I/O thread, and the send
# side of the chunk grid (a per-op window of chunks in flight, staged through a small pool of
# reusable buffers).
#
# Rules: `_lock` guards `_ops` and every op's `finished` flag; an op is finished exactly once
# (`_finish_locked`), and its callback runs on the CallbackThread, outside the lock. Only the
# I/O thread touches the network; other threads append to `_commands` and write a byte to the
# wake pipe (only while the I/O thread may be asleep, when its loop says so: `_command`). The
# send window and the staging pool belong to the I/O thread.
from __future__ import annotations

import enum
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.transports.base import OnDone, Transport
from kvhandoff.transports.callbacks import CallbackThread
from kvhandoff.transports.streams import ChunkPlan, check_buffer, check_tag, normalise_spans

WINDOW = 8  # chunks of one send op in flight (not yet confirmed / completed)
POOL_MAX = 16  # free staging buffers kept


class IoCommand(enum.Enum):
    """What other threads ask an I/O thread to do (the first item of a queued command)."""

    CONNECT = "connect"
    DISCONNECT = "disconnect"
    SEND = "send"
    RECV = "recv"
    FORGET = "forget"
    STOP = "stop"
    WRITE = "write"  # a one-sided write to start
    WRITTEN = "written"  # a copy thread ended a job
    HOLD = "hold"  # an op's completion is held: re-read the time bound (shm)


class _OpLike(Protocol):
    peer: str
    tag: int
    is_send: bool
    on_done: OnDone
    finished: bool


class ThreadedTransport(Transport):
    """Base of transports driven by one I/O thread (see module comment). Subclasses call
    `_init_threaded` in their constructor and implement `_make_op` and the I/O thread."""

    def _init_threaded(self, chunk_bytes: int, callback_thread_name: str) -> None:
        self._chunk_bytes = int(chunk_bytes)
        self._lock = threading.Lock()
        self._buffers: dict[str, np.ndarray] = {}
        self._peers: dict[str, bytes] = {}
        self._ops: dict[tuple[str, int, bool], Any] = {}
        self._closed = False
        self._commands: deque[tuple[Any, ...]] = deque()
        self._io_asleep = True  # the I/O thread may be in poll (see _command)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._callbacks = CallbackThread(callback_thread_name)
        # owned by the I/O thread: send ops with chunks left to post, free staging buffers
        self._active_sends: list[Any] = []
        self._pool: list[np.ndarray] = []

    # ---- shared public API ----------------------------------------------------------------

    def register(self, name: str, buf: np.ndarray) -> None:
        arr = check_buffer(name, buf)
        with self._lock:
            self._check_open()
            if name in self._buffers:
                raise TransportError(f"register: a buffer named {name!r} is already registered")
            self._buffers[name] = arr

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._post(True, peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._post(False, peer, tag, name, offsets, nbytes, on_done)

    # ---- helpers (any thread) -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.kind} transport is closed")

    def _check_plan(self, what: str, plan: ChunkPlan) -> None:
        """Subclass hook: refuse a plan the transport cannot carry."""

    def _make_op(self, is_send: bool, peer: str, address: bytes, tag: int, buf: np.ndarray,
                 plan: ChunkPlan, on_done: OnDone) -> Any:
        raise NotImplementedError

    def _post(self, is_send: bool, peer: str, tag: int, name: str, offsets: np.ndarray,
              nbytes: np.ndarray, on_done: OnDone) -> None:
        what = "post_send" if is_send else "post_recv"
        tag = check_tag(tag)
        if not callable(on_done):
            raise TransportError(f"{what}: on_done must be callable")
        buf = self._buffers.get(name)
        if buf is None:
            raise TransportError(f"{what}: no buffer registered as {name!r}")
        off, nb = normalise_spans(offsets, nbytes, buf.size, what=f"{what} {name!r}")
        plan = ChunkPlan(off, nb, self._chunk_bytes)
        self._check_plan(what, plan)
        with self._lock:
            self._check_open()
            address = self._peers.get(peer)
            if address is None:
                raise TransportError(f"{what}: peer {peer!r} is not connected; call connect "
                                     "first")
            key = (peer, tag, is_send)
            if key in self._ops:
                raise TransportError(f"{what}: tag {tag} with peer {peer!r} is already pending")
            op = self._make_op(is_send, peer, address, tag, buf, plan, on_done)
            if plan.nchunks == 0:  # nothing to move: complete without a message
                op.finished = True
                self._callbacks.submit(lambda: on_done(None))
                return
            self._ops[key] = op
        self._command(IoCommand.SEND if is_send else IoCommand.RECV, op)

    def _finish_locked(self, ops: list[Any], reason: str | None
                       ) -> list[tuple[Any, BaseException | None]]:
        out: list[tuple[Any, BaseException | None]] = []
        for op in ops:
            if op.finished:
                continue
            op.finished = True
            self._ops.pop((op.peer, op.tag, op.is_send), None)
            out.append((op, None if reason is None else TransportError(reason)))
        return out

    def _deliver(self, done: list[tuple[Any, BaseException | None]]) -> None:
        for op, exc in done:
            self._callbacks.submit(_call(op.on_done, exc))

    def _finish(self, op: Any, reason: str | None) -> bool:
        """Finishes `op` (error when `reason`); whether this call did it."""
        with self._lock:
            done = self._finish_locked([op], reason)
        self._deliver(done)
        return bool(done)

    def _command(self, cmd: IoCommand, *args: Any) -> None:
        """Queues a command for the I/O thread. The wake pipe is written only while the I/O
        thread may be asleep: a loop that sets `_io_asleep` (shm) sets it before its last
        look at `_commands` and polls without a timeout when one is queued, so a command is
        never left waiting; a loop that does not leaves it True (every command wakes it)."""
        self._commands.append((cmd, *args))
        if not self._io_asleep:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the I/O thread is awake anyway

    def _shutdown_io(self, *also: Any) -> None:
        """The end of close(): stops the I/O thread (`self._thread`, joined unless this is it),
        then each of `also` (anything with a stop()), the callback thread, and closes the wake
        pipe."""
        self._command(IoCommand.STOP)
        io_thread: threading.Thread = self._thread  # type: ignore[attr-defined]
        if threading.current_thread() is not io_thread:
            io_thread.join()
        for worker in also:
            worker.stop()
        self._abandon_threaded()

    def _abandon_threaded(self) -> None:
        """Undoes `_init_threaded`: stops the callback thread, closes the wake pipe. For a
        constructor that fails before its I/O thread started (nothing leaks from a refused
        transport), and the end of `_shutdown_io`."""
        self._callbacks.stop()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # ---- send window and staging pool (I/O thread) ----------------------------------------

    def _stage(self) -> np.ndarray:
        """A staging buffer of chunk_bytes from the pool (or a new one)."""
        return self._pool.pop() if self._pool else np.empty(self._chunk_bytes, np.uint8)

    def _unstage(self, stage: np.ndarray | None) -> None:
        """Returns a staging buffer to the pool (kept up to POOL_MAX)."""
        if stage is not None and stage.size == self._chunk_bytes and len(self._pool) < POOL_MAX:
            self._pool.append(stage)

    def _channel(self, op: Any) -> Any:
        """Subclass hook: the socket/endpoint that carries `op`'s chunks; None if gone."""
        raise NotImplementedError

    def _emit(self, channel: Any, op: Any, k: int, view: np.ndarray,
              stage: np.ndarray | None) -> None:
        """Subclass hook: puts chunk k of `op` (its bytes in `view`, staged in `stage` or
        straight from the registered buffer) on the wire."""
        raise NotImplementedError

    def _pump_sends(self) -> bool:
        """Posts chunks of the active sends while each op's window has room; whether any
        chunk was posted. A chunk inside one span goes straight from the registered buffer,
        any other is gathered into a staging buffer."""
        if not self._active_sends:
            return False
        sent = False
        still: list[Any] = []
        for op in self._active_sends:
            if op.finished:
                continue
            channel = self._channel(op)
            if channel is None:
                self._finish(op, f"peer {op.peer!r} is not connected")
                continue
            plan = op.plan
            while op.inflight < WINDOW and op.next_chunk < plan.nchunks:
                k = op.next_chunk
                op.next_chunk += 1
                op.inflight += 1
                n = plan.chunk_len(k)
                start = plan.direct(k)
                stage = None
                if start is not None:
                    view = op.buf[start:start + n]
                else:
                    stage = self._stage()
                    plan.gather(op.buf, k, stage)
                    view = stage[:n]
                self._emit(channel, op, k, view, stage)
                sent = True
            if op.next_chunk < plan.nchunks:
                still.append(op)
        self._active_sends = still
        return sent


def _call(fn: OnDone, exc: BaseException | None) -> Callable[[], None]:
    return lambda: fn(exc)
