# The send window of a chunked two-sided transport (tcp, ucx): the sends with chunks left to
# post, at most WINDOW chunks of each in flight, each chunk either a view of the registered
# buffer (a chunk inside one span) or gathered into a staging buffer from a small pool.
#
# Rules: the window belongs to the I/O thread (every method is called there). The transport
# gives the wire: `channel(op)` (what carries the op's chunks, None when the peer is gone),
# `emit(channel, op, k, view, stage)` (puts chunk k on it) and `fail(op, reason)`; it calls
# `credit(op, stage)` when the receiver confirmed a chunk, which frees a slot of the op's
# window and returns the staging buffer.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.transports.base import OnDone
from kvhandoff.transports.streams import ChunkPlan

WINDOW = 8  # chunks of one send op in flight (not yet confirmed / completed)
POOL_MAX = 16  # free staging buffers kept


class ChunkOp:
    """A send or receive on the chunk grid (tcp, ucx): the fields the op table and the send
    window read; a transport's op adds its own."""

    __slots__ = ("peer", "tag", "is_send", "buf", "plan", "on_done", "finished", "next_chunk",
                 "inflight", "landed")

    def __init__(self, peer: str, tag: int, is_send: bool, buf: np.ndarray, plan: ChunkPlan,
                 on_done: OnDone) -> None:
        self.peer = peer
        self.tag = tag
        self.is_send = is_send
        self.buf = buf
        self.plan = plan
        self.on_done = on_done
        self.finished = False
        self.next_chunk = 0  # send: the next chunk to post
        self.inflight = 0  # send: chunks posted, not yet confirmed
        self.landed = 0  # chunks that arrived (receive) or completed (ucx send)


class SendWindow:
    """The active sends of one I/O thread and their staging pool (see module comment)."""

    __slots__ = ("_chunk_bytes", "_channel", "_emit", "_fail", "_active", "_pool")

    def __init__(self, chunk_bytes: int, *, channel: Callable[[Any], Any],
                 emit: Callable[[Any, Any, int, np.ndarray, np.ndarray | None], None],
                 fail: Callable[[Any, str], object]) -> None:
        self._chunk_bytes = int(chunk_bytes)
        self._channel = channel
        self._emit = emit
        self._fail = fail
        self._active: list[Any] = []
        self._pool: list[np.ndarray] = []

    def add(self, op: Any) -> None:
        """A send whose chunks are to be posted (its `next_chunk` and `inflight` at 0)."""
        self._active.append(op)

    def stage(self) -> np.ndarray:
        """A staging buffer of chunk_bytes from the pool (or a new one)."""
        return self._pool.pop() if self._pool else np.empty(self._chunk_bytes, np.uint8)

    def unstage(self, stage: np.ndarray | None) -> None:
        """Returns a staging buffer to the pool (kept up to POOL_MAX)."""
        if stage is not None and stage.size == self._chunk_bytes and len(self._pool) < POOL_MAX:
            self._pool.append(stage)

    def credit(self, op: Any, stage: np.ndarray | None) -> None:
        """The receiver confirmed a chunk of `op`: one more may fly; `stage` (its staging
        buffer, if any) goes back to the pool."""
        op.inflight -= 1
        self.unstage(stage)

    def pump(self) -> bool:
        """Posts chunks of the active sends while each op's window has room; whether any
        chunk was posted."""
        if not self._active:
            return False
        sent = False
        still: list[Any] = []
        for op in self._active:
            if op.finished:
                continue
            channel = self._channel(op)
            if channel is None:
                self._fail(op, f"peer {op.peer!r} is not connected")
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
                    stage = self.stage()
                    plan.gather(op.buf, k, stage)
                    view = stage[:n]
                self._emit(channel, op, k, view, stage)
                sent = True
            if op.next_chunk < plan.nchunks:
                still.append(op)
        self._active = still
        return sent
