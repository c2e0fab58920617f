# What the threaded transports (tcp, ucx) share: the table of pending ops, argument checks of
# post_*, completion delivery, and the command queue that wakes their I/O thread.
#
# Rules: `_lock` guards `_ops` and every op's `finished` flag; an op is finished exactly once
# (`_finish_locked`), and its callback runs on the CallbackThread, outside the lock. Only the
# I/O thread touches the network; other threads append to `_commands` and write a byte to the
# wake pipe.
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvhandoff.errors import TransportError

from ._chunks import ChunkPlan, check_buffer, check_tag, normalise_spans
from ._worker import CallbackThread
from .base import OnDone, Transport


class _OpLike(Protocol):
    peer: str
    tag: int
    is_send: bool
    on_done: OnDone
    finished: bool


class ThreadedTransport(Transport):
    """Base of transports driven by one I/O thread (see module comment). Subclasses call
    `_init_threaded` in their constructor and implement `_make_op` and the I/O thread."""

    kind = "threaded"

    def _init_threaded(self, chunk_bytes: int, callback_thread_name: str) -> None:
        self._chunk_bytes = int(chunk_bytes)
        self._lock = threading.Lock()
        self._buffers: dict[str, np.ndarray] = {}
        self._peers: dict[str, bytes] = {}
        self._ops: dict[tuple[str, int, bool], Any] = {}
        self._closed = False
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._callbacks = CallbackThread(callback_thread_name)

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
        self._command("send" if is_send else "recv", op)

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

    def _command(self, *cmd: Any) -> None:
        self._commands.append(cmd)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the I/O thread is awake anyway


def _call(fn: OnDone, exc: BaseException | None) -> Callable[[], None]:
    return lambda: fn(exc)
