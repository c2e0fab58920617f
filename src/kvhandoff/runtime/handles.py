"""The handles engines hold (`Sender`, `Receiver`) and the room view behind them.

Rules:
- A handle never touches the session: its calls become events for the control thread
  (`layer_ready`, `init`, `abort`), and it reads the room through a `RoomView` that only the
  control thread writes (from the session's `RoomUpdate` / `Release` effects). The view is the
  engine's published copy of the room's `protocol.roomstate.RoomState`, never a second owner:
  nothing in it feeds back into the session.
- Each view has its own condition; the control thread notifies it, engine threads wait on it.
  It is the only lock an engine thread and the control thread share, and it guards nothing
  but the view's few fields.
- Names follow SGLang's KVSender/KVReceiver and vLLM's wait_for_layer_load / save_kv_layer.
  Blocking calls raise typed errors: a failed room raises its `RoomFailed` subclass, a wait
  that runs out raises `TransferTimeout`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from kvhandoff.errors import ConfigError, Failure, FailureKind, TransferTimeout
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.state_machine import KVPoll

log = logging.getLogger("kvhandoff.agent")


class RoomOps(Protocol):
    """What a handle asks of its agent, by room view (`TransferAgent` implements it)."""

    def layer_ready(self, v: RoomView, layer: int, event: Any = None) -> None: ...
    def layers_ready(self, v: RoomView, layers: tuple[int, ...], event: Any = None) -> None: ...
    def init_receiver(self, v: RoomView, dst_pages: Any, seq_len: int, prefix: int, *,
                      prompt_tokens: Any = None, prefix_tokens: Any = None,
                      free_pages: int | None = None,
                      region_starts: Mapping[str, int] | None = None) -> None: ...
    def abort_room(self, v: RoomView, reason: str) -> None: ...
    def room_stats(self, v: RoomView) -> dict[str, Any]: ...
    def add_chunk(self, v: RoomView, pages: Any, *, seq_len: int, chunk_end: int,
                  have: dict[str, int]) -> dict[str, np.ndarray]: ...


class RoomView:
    """What the engine side sees of one room (written by the control thread only): a copy of
    what the session published (`RoomUpdate`, `Release`), never read back by it."""

    __slots__ = ("room", "layers", "on_release", "state", "failure", "landed", "done",
                 "released", "inited", "_cond", "_waiting", "chunk", "_engine_lock", "t_seen")

    def __init__(self, room: int, layers: tuple[int, ...],
                 on_release: Callable[[int], None] | None) -> None:
        self.room = room
        self.layers = layers
        self.on_release = on_release
        self.state = KVPoll.Bootstrapping
        self.failure: Failure | None = None
        self.landed: frozenset[int] = frozenset()
        self.done = False
        self.released = False
        self.inited = False  # decode: init() was called (engine side only)
        self._cond = threading.Condition(threading.Lock())
        self._waiting: list[Callable[[], bool]] = []  # the predicates engine threads wait on
        self.chunk: ChunkState | None = None  # prefill, chunked: engine side only
        self._engine_lock = threading.Lock()
        # when the engine could first see a final state (monotonic; the session's own stamp,
        # `t_done`, is the start of the event that ended the room, before its handling)
        self.t_seen: float | None = None

    def update(self, state: KVPoll, failure: Failure | None, landed: frozenset[int],
               done: bool) -> None:
        """(control thread) The session's `RoomUpdate`. Waiters are woken only when one's
        predicate now holds: a wake-up is a cross-CPU futex wake and a GIL hand-off (tens of
        microseconds on a VM), and most updates (a layer landed, Transferring) are not what a
        waiter waits for."""
        with self._cond:
            self.state, self.failure, self.landed, self.done = state, failure, landed, done
            if self.t_seen is None and state.is_terminal:
                self.t_seen = time.monotonic()
            if any(pred() for pred in self._waiting):
                self._cond.notify_all()

    def release(self) -> None:
        """(control thread) The session's `Release`: wake waiters, call `on_release` once."""
        with self._cond:
            self.released = True
            self._cond.notify_all()
        cb, self.on_release = self.on_release, None  # once; and keep no engine state alive
        if cb is not None:
            try:
                cb(self.room)
            except Exception:  # an engine callback must not kill the control thread
                log.exception("on_release callback of room %d raised", self.room)

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Waits (bounded) until `pred()` holds; returns its last value. `pred` reads only
        the view's fields (the control thread evaluates it, under the view's lock, to decide
        whether to wake this waiter)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            if pred():
                return True
            self._waiting.append(pred)
            try:
                while not pred():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._waiting.remove(pred)


class ChunkState:
    """Engine side of a chunked prefill room: what the engine gave so far."""

    __slots__ = ("seq_len", "chunk_end", "npages", "ready")

    def __init__(self, seq_len: int, chunk_end: int, npages: dict[str, int]) -> None:
        self.seq_len, self.chunk_end, self.npages = seq_len, chunk_end, npages
        self.ready: set[int] = set()


def chunk_table(layout: LayoutSpec, capacity: Callable[[str], int], pages: Any, *,
                seq_len: int, chunk_end: int, have: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Per region, the new pages of a chunk of a chunked prefill, validated: page ids in
    range and not repeated within the chunk, a table never longer than the sequence's pages
    and, with the last chunk (`chunk_end == seq_len`), exactly that long. A region may lag
    behind `chunk_end` (its pages given later, e.g. with the last chunk only): it moves what
    its pages reach. `pages` is one table for every region or a dict per region (a region
    left out gets no page in this chunk); tables start at token 0."""
    if not 0 < chunk_end <= seq_len:
        raise ConfigError(f"chunk_end: expected 1..{seq_len}, got {chunk_end}")
    ps = layout.page_size_tokens
    total = -(-seq_len // ps)
    out: dict[str, np.ndarray] = {}
    for reg in layout.regions:
        raw = pages.get(reg.name, ()) if isinstance(pages, Mapping) else pages
        arr = np.asarray(raw, dtype=np.int64).reshape(-1) if len(raw) else np.zeros(0, np.int64)
        n = have.get(reg.name, 0) + len(arr)
        if n > total:
            raise ConfigError(f"pages[{reg.name}]: {n} pages given, more than the {total} "
                              f"pages of {seq_len} tokens")
        if chunk_end == seq_len and n < total:
            raise ConfigError(f"pages[{reg.name}]: the last chunk leaves {n} of the {total} "
                              f"pages of {seq_len} tokens")
        cap = capacity(reg.name)
        if len(arr) and (arr.min() < 0 or arr.max() >= cap):
            raise ConfigError(f"pages[{reg.name}]: page ids must be in [0, {cap}), got "
                              f"[{arr.min()}, {arr.max()}]")
        if len(np.unique(arr)) != len(arr):
            raise ConfigError(f"pages[{reg.name}]: a page id appears twice")
        out[reg.name] = arr
    return out


class _Handle:
    __slots__ = ("room", "_agent", "_v")

    def __init__(self, agent: RoomOps, view: RoomView) -> None:
        self.room = view.room
        self._agent = agent
        self._v = view

    def poll(self) -> KVPoll:
        """The room's state (KVPoll, the worst of its legs); Failed and Success are final."""
        return self._v.state

    @property
    def failure(self) -> str | None:
        """Why the room failed, in words (None unless `poll()` is Failed)."""
        f = self._v.failure
        return f.reason if f is not None else None

    @property
    def failure_kind(self) -> FailureKind | None:
        """What kind of failure ended the room (None unless `poll()` is Failed)."""
        f = self._v.failure
        return f.kind if f is not None else None

    @property
    def error(self) -> Failure | None:
        """The room's `Failure` (kind, reason, details), None unless it failed; its
        `.error()` is the typed exception the blocking calls raise."""
        return self._v.failure

    def raise_for_failure(self) -> None:
        """Raises the room's typed `RoomFailed` subclass if it failed; else nothing."""
        f = self._v.failure
        if f is not None:
            raise f.error(self.room)

    @property
    def released(self) -> bool:
        """Whether the room's pages may be reused: terminal AND nothing can write into them
        any more (no op in flight, no cancel unanswered, a one-sided writer that said it
        stopped or the write quarantine passed). A terminal `poll()` is not enough: hand
        pages back to the engine's allocator, or open the room id again, only once this is
        true (`wait_released`, or the `on_release` callback)."""
        return self._v.released

    def wait(self, timeout: float) -> KVPoll:
        """Blocks until the room is terminal or `timeout` seconds passed; returns the state
        (as `poll()`: Failed is a state here, `failure` / `error` say why)."""
        self._v.wait_until(lambda: self._v.done, timeout)
        return self._v.state

    def wait_released(self, timeout: float) -> bool:
        """Blocks until the pages are released (`released`; bounded by `timeout`); whether
        they are."""
        return self._v.wait_until(lambda: self._v.released, timeout)

    def wait_bootstrapped(self, timeout: float) -> KVPoll:
        """Blocks until the room left Bootstrapping (the peer's side is known: WaitingForInput,
        or a terminal state) or `timeout` seconds passed; returns the state. A prefill engine
        that runs its forward pass only once the decode's pages are known waits here instead
        of polling `poll()`."""
        v = self._v
        v.wait_until(lambda: v.state is not KVPoll.Bootstrapping, timeout)
        return v.state

    def abort(self, reason: str = "aborted by the engine") -> None:
        """Fails the room on both sides with `reason`; safe to call twice or after the end."""
        self._agent.abort_room(self._v, reason)

    def stats(self) -> dict[str, Any]:
        """Byte and timing figures of the room (for demo/bench output)."""
        return self._agent.room_stats(self._v)

    def __repr__(self) -> str:
        cls = type(self).__name__
        failure = f", failure={self.failure!r}" if self.failure else ""
        return f"{cls}(room={self.room}, state={self._v.state.name}{failure})"

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._v.done:
            self.abort("handle closed before the room finished")


class Sender(_Handle):
    """Prefill side of a room (cf. SGLang KVSender, vLLM save_kv_layer)."""

    __slots__ = ()

    def layer_ready(self, layer_id: int, event: Any = None) -> None:
        """Layer `layer_id`'s KV is written, or its kernels are queued: send it as soon as it
        is. For CUDA, pass an event recorded after the layer's kernels (`torch.cuda.Event`,
        anything with `query()`): this returns at once (never syncs the device); the agent's
        event waiter posts the layer when the event completed. Layers of a room are sent in
        the order they were marked. An event whose `query()` raises fails the room
        (ABORTED, the reason names the layer)."""
        self._agent.layer_ready(self._v, layer_id, event)
        c = self._v.chunk
        if c is not None:
            with self._v._engine_lock:
                c.ready.add(layer_id)

    def layers_ready(self, layer_ids: Iterable[int], event: Any = None) -> None:
        """Several layers written at once (an engine that hands a room over after its whole
        forward, as SGLang does): `layer_ready` of each, in order, as one mark. The agent
        gets them together, so it writes them as one job and announces them in one message;
        a loop of `layer_ready` calls may be started on after the first few. With a CUDA
        `event`, every layer is sent once it completed. A layer given twice counts once."""
        ids = tuple(dict.fromkeys(int(x) for x in layer_ids))
        self._agent.layers_ready(self._v, ids, event)
        c = self._v.chunk
        if c is not None:
            with self._v._engine_lock:
                c.ready.update(ids)

    def add_chunk(self, pages: Any, chunk_end: int) -> None:
        """Chunked prefill (a room opened with `sender(..., chunk_end=)`): the next chunk's
        pages (per region or one table, appended to what was given), which now cover
        `chunk_end` tokens; `chunk_end == seq_len` is the last chunk. Every layer of the
        previous chunk must have been marked ready; mark this chunk's layers ready again
        (`layer_ready`) as they are written: each one is sent at once."""
        v = self._v
        c = v.chunk
        if c is None:
            raise ConfigError("add_chunk: this room was not opened chunked "
                              "(sender(..., chunk_end=) with chunk_end < seq_len)")
        with v._engine_lock:
            if not c.chunk_end < chunk_end <= c.seq_len:
                raise ConfigError(f"chunk_end: expected {c.chunk_end + 1}..{c.seq_len}, got "
                                  f"{chunk_end}")
            missing = sorted(set(v.layers) - c.ready)
            if missing:
                raise ConfigError(f"add_chunk: layers {missing[:8]} of the previous chunk "
                                  f"(up to token {c.chunk_end}) were not marked ready")
            table = self._agent.add_chunk(v, pages, seq_len=c.seq_len, chunk_end=chunk_end,
                                          have=c.npages)
            for k, arr in table.items():
                c.npages[k] = c.npages.get(k, 0) + len(arr)
            c.chunk_end = chunk_end
            c.ready = set()


class Receiver(_Handle):
    """Decode side of a room (cf. SGLang KVReceiver, vLLM wait_for_layer_load)."""

    __slots__ = ()

    def init(
        self,
        dst_pages: np.ndarray | list[int] | dict[str, np.ndarray | list[int]],
        seq_len: int,
        decode_prefix_len: int = 0,
        *,
        prompt_tokens: Any = None,
        prefix_tokens: Any = None,
        free_pages: int | None = None,
        region_starts: Mapping[str, int] | None = None,
    ) -> None:
        """Offers destination pages: one page table covering the whole sequence from token 0
        (suffix-only regions use its pages from the page-aligned prefix on), or a dict per
        region. `decode_prefix_len` tokens are already held (their indexer rows stay).

        Admission and prefix agreement (checked by the prefill before any byte moves):
        `prompt_tokens` (the `seq_len` prompt token ids) and `prefix_tokens` (the ids the
        cached prefix holds; default: the prompt's) are hashed per page and compared with the
        prefill's prompt when it gave one too; `free_pages` is required under
        ``allocation_policy=prefill_complete`` (the pages this decode has free now).

        `region_starts`: per region, a later token than `decode_prefix_len` where the region
        starts (page-aligned down): a sliding-window region whose decode holds no page before
        its window. Its table (in a dict) then covers the sequence from that token on (or
        from token 0, cut there); the prefill sends its pages from there only."""
        self._agent.init_receiver(self._v, dst_pages, seq_len, decode_prefix_len,
                                  prompt_tokens=prompt_tokens, prefix_tokens=prefix_tokens,
                                  free_pages=free_pages, region_starts=region_starts)

    def wait_for_layer(self, layer_id: int, timeout: float) -> bool:
        """Blocks until `layer_id` landed and verified on every leg; returns True. The caller
        bounds the wait.

        Raises:
            RoomFailed: the room failed (before or while waiting): the subclass of its
                `FailureKind` (`ChecksumMismatch` naming layer and region, `LayoutMismatch`
                with the diff, `PeerLost`, `Aborted`, `DeadlineExpired`, ...).
            TransferTimeout: `timeout` seconds passed with the room still going.
            ConfigError: `layer_id` is not a layer of the layout.
        """
        v = self._v
        if layer_id not in v.layers:
            raise ConfigError(f"wait_for_layer({layer_id}): not a layer of this room's layout "
                              f"(layers {v.layers[0]}..{v.layers[-1]})")
        landed = v.wait_until(lambda: layer_id in v.landed or v.failure is not None, timeout)
        self.raise_for_failure()
        if not landed:
            raise TransferTimeout(f"room {self.room}: layer {layer_id} not landed within "
                                  f"{timeout:g}s (state {v.state.name})")
        return True
