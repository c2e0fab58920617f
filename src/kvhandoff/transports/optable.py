# The op table of a transport with two-sided ops (tcp, ucx, shm): registered host buffers,
# connected peers, pending ops, the checks of post_send / post_recv, and completion delivery.
#
# Rules:
# - `lock` guards `buffers`, `peers`, `ops`, `closed` and every op's `finished` flag (a
#   transport may guard fields of its own ops with it too: it is the one lock of its op
#   lifecycle). An op is finished exactly once (`finish_locked`); its on_done runs on the
#   table's CallbackThread (or where the transport's `deliver` hook sends it), never under
#   the lock.
# - The table never touches the network: `post` validates, enters the op and hands it to the
#   transport's `start_send` / `start_recv` (outside the lock: they queue it for the I/O
#   thread); ending a tag, a peer or everything (`end_tag`,
#   `end_peer`, `close`) finishes and delivers the ops and returns them, and the transport
#   then stops whatever of them is still moving.
# - Hooks, given at construction, are the transport's policy: `make_op` (its op type),
#   `check_plan` (a plan it cannot carry), `hold` (a completion held back while memory may
#   still be written: ucx), `deliver` (shm's held receives).
# - `TableTransport` is the one base the three share: their address, register / post_send /
#   post_recv are the table's, and close() ends the table, then stops the I/O thread (shm adds
#   its workers). It holds no state (each transport builds and owns its table, thread and
#   address).
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvhandoff.buffers.devsum import refuse_device_memory
from kvhandoff.errors import TransportError
from kvhandoff.transports.base import OnDone, Transport
from kvhandoff.transports.callbacks import CallbackThread
from kvhandoff.transports.iothread import IoThread
from kvhandoff.transports.streams import ChunkPlan, check_buffer, check_tag, normalise_spans

#: (op, error or None) pairs whose on_done is due.
Done = list[tuple[Any, BaseException | None]]


class TransportOp(Protocol):
    """What the table needs of a transport's op."""

    peer: str
    tag: int
    is_send: bool
    on_done: OnDone
    finished: bool


class OpTable:
    """Buffers, peers and pending ops of one transport (see module comment)."""

    __slots__ = ("kind", "lock", "buffers", "peers", "ops", "closed", "callbacks",
                 "_chunk_bytes", "_make_op", "_start", "_check_plan", "_hold", "_deliver")

    def __init__(self, kind: str, *, chunk_bytes: int, callback_thread: str,
                 make_op: Callable[[bool, str, bytes, int, np.ndarray, ChunkPlan, OnDone], Any],
                 start_send: Callable[[Any], None], start_recv: Callable[[Any], None],
                 check_plan: Callable[[str, ChunkPlan], None] | None = None,
                 hold: Callable[[Any, BaseException | None], bool] | None = None,
                 deliver: Callable[[Done], None] | None = None) -> None:
        self.kind = kind
        self.lock = threading.Lock()
        self.buffers: dict[str, np.ndarray] = {}
        self.peers: dict[str, bytes] = {}
        self.ops: dict[tuple[str, int, bool], Any] = {}
        self.closed = False
        self.callbacks = CallbackThread(callback_thread)
        self._chunk_bytes = int(chunk_bytes)
        self._make_op = make_op
        self._start = (start_recv, start_send)
        self._check_plan = check_plan
        self._hold = hold
        self._deliver = deliver

    def check_open(self) -> None:
        if self.closed:
            raise TransportError(f"{self.kind} transport is closed")

    def register(self, name: str, buf: np.ndarray) -> None:
        """A host buffer under a unique name (CUDA memory is refused, saying which transports
        take it)."""
        refuse_device_memory(self.kind, name, buf)
        arr = check_buffer(name, buf)
        with self.lock:
            self.check_open()
            if name in self.buffers:
                raise TransportError(f"register: a buffer named {name!r} is already registered")
            self.buffers[name] = arr

    def known_peer(self, peer: str, address: bytes) -> bool:
        """(lock held) Whether `peer` is connected at `address` already (connect is then a
        no-op); raises when it is connected at another one, or the transport is closed."""
        self.check_open()
        known = self.peers.get(peer)
        if known is not None and known != address:
            raise TransportError(f"connect {peer!r}: already connected at another address; "
                                 "disconnect first")
        return known is not None

    def post(self, is_send: bool, peer: str, tag: int, name: str, offsets: np.ndarray,
             nbytes: np.ndarray, on_done: OnDone) -> None:
        """post_send / post_recv: checks the arguments (TransportError naming the field),
        enters the op and hands it to `start`; an empty span list completes at once."""
        what = "post_send" if is_send else "post_recv"
        tag = check_tag(tag)
        if not callable(on_done):
            raise TransportError(f"{what}: on_done must be callable")
        buf = self.buffers.get(name)
        if buf is None:
            raise TransportError(f"{what}: no buffer registered as {name!r}")
        off, nb = normalise_spans(offsets, nbytes, buf.size, what=f"{what} {name!r}")
        plan = ChunkPlan(off, nb, self._chunk_bytes)
        if self._check_plan is not None:
            self._check_plan(what, plan)
        with self.lock:
            self.check_open()
            address = self.peers.get(peer)
            if address is None:
                raise TransportError(f"{what}: peer {peer!r} is not connected; call connect "
                                     "first")
            key = (peer, tag, is_send)
            if key in self.ops:
                raise TransportError(f"{what}: tag {tag} with peer {peer!r} is already pending")
            op = self._make_op(is_send, peer, address, tag, buf, plan, on_done)
            if plan.nchunks == 0:  # nothing to move: complete without a message
                op.finished = True
                self.callbacks.submit(lambda: on_done(None))
                return
            self.ops[key] = op
        self._start[is_send](op)

    def finish_locked(self, ops: list[Any], reason: str | None) -> Done:
        """(lock held) Marks each op of `ops` not yet finished as finished (an error when
        `reason`) and takes it out of the table; the completions to deliver (those the
        `hold` hook keeps back are left out)."""
        out: Done = []
        for op in ops:
            if op.finished:
                continue
            op.finished = True
            self.ops.pop((op.peer, op.tag, op.is_send), None)
            exc = None if reason is None else TransportError(reason)
            if self._hold is None or not self._hold(op, exc):
                out.append((op, exc))
        return out

    def deliver(self, done: Done) -> None:
        """Hands each completion to the callback thread (or the `deliver` hook)."""
        if self._deliver is not None:
            self._deliver(done)
            return
        for op, exc in done:
            self.callbacks.submit(_call(op.on_done, exc))

    def finish(self, op: Any, reason: str | None) -> bool:
        """Finishes `op` (error when `reason`) and delivers it; whether this call did it."""
        with self.lock:
            done = self.finish_locked([op], reason)
        self.deliver(done)
        return bool(done)

    def end_tag(self, peer: str, tag: int) -> list[Any]:
        """cancel(peer, tag): this side's pending ops of the tag, ended with an error."""
        tag = check_tag(tag)
        with self.lock:
            ops = [op for k in ((peer, tag, True), (peer, tag, False))
                   if (op := self.ops.get(k)) is not None]
            done = self.finish_locked(ops, f"cancelled: tag {tag} peer {peer!r}")
        self.deliver(done)
        return ops

    def end_peer(self, peer: str, reason: str) -> tuple[list[Any], bytes | None]:
        """disconnect(peer) / the peer's death: its pending ops ended with `reason` and the
        peer forgotten; (the ops, the address it was connected at or None)."""
        with self.lock:
            ops = [op for op in self.ops.values() if op.peer == peer]
            done = self.finish_locked(ops, reason)
            known = self.peers.pop(peer, None)
        self.deliver(done)
        return ops, known

    def close(self, reason: str) -> list[Any] | None:
        """Closes the table: every pending op ended with `reason`; the ops, or None when it
        was closed already (close() is then a no-op)."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            ops = list(self.ops.values())
            done = self.finish_locked(ops, reason)
        self.deliver(done)
        return ops

    def stop(self) -> None:
        """The end of close(): the callback thread runs what is queued, then stops."""
        self.callbacks.stop()


class TableTransport(Transport):
    """A transport whose register / post_send / post_recv are its op table's (see module
    comment); the subclass builds `_table` and `_io` in its constructor."""

    _table: OpTable
    _io: IoThread
    _address: bytes

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, name: str, buf: np.ndarray) -> None:
        self._table.register(name, buf)

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._table.post(True, peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._table.post(False, peer, tag, name, offsets, nbytes, on_done)

    def close(self) -> None:
        if self._table.close(f"{self.kind} transport closed") is not None:
            self._io.stop(self._table)


def _call(fn: OnDone, exc: BaseException | None) -> Callable[[], None]:
    return lambda: fn(exc)
