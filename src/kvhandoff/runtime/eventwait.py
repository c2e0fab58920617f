"""The event waiter: `Sender.layer_ready(layer, event)` returns at once; the wait for the
engine's device event (a `torch.cuda.Event` recorded after the layer's kernels, or anything
with the same `query()`) happens here, on one thread per agent, never on the engine thread and
never as a device-wide sync.

Rules:
- `submit(view, event, then)` queues `then` (a `LayerReady`, a `Batch` of them from
  `layers_ready`, or an `AddChunk` behind a chunk's layers) for the room of `view`. With no
  event and nothing queued for that room it is posted to the control loop at once; else it
  waits its turn: a room's posts keep the order of its submits, whatever order the events
  complete in.
- The thread starts with the first queued entry and ends after `idle_exit_s` with nothing
  queued (a later submit starts it again: at most one per agent). It polls `event.query()`
  of each room's first entry, sleeping with a bounded backoff (`min_sleep_s` doubling up to
  `max_sleep_s`, 200 us: about the most a layer waits past its event, scheduling aside)
  while nothing completes; a submit wakes it.
- An entry is posted only after its event reported completion; it leaves the queue after
  it was posted, so a direct post of a later submit never overtakes it.
- An event whose `query()` raises fails the room: an `AbortRoom` naming the layer and the
  error is posted (the room fails as ABORTED with that reason on both sides) and the room's
  later entries are dropped. A room that ended meanwhile (`view.done`: aborted, failed) has
  its entries dropped without waiting for their events.
- When `closed()` turns true (the agent closes) the thread drops every entry and ends; a
  close never waits for a device event.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from kvhandoff.protocol import events as ev

log = logging.getLogger("kvhandoff.agent")


class _Entry:
    __slots__ = ("layer", "event", "then")

    def __init__(self, layer: int | None, event: Any, then: ev.Event) -> None:
        self.layer, self.event, self.then = layer, event, then


class EventWaiter:
    """Waits for device events of marked layers off the engine thread (see module doc)."""

    def __init__(self, post: Callable[[ev.Event], None], *, closed: Callable[[], bool],
                 name: str = "kvh-events", min_sleep_s: float = 20e-6,
                 max_sleep_s: float = 2e-4, idle_exit_s: float = 2.0) -> None:
        self._post = post
        self._closed = closed
        self._name = name
        self._min, self._max, self._idle = min_sleep_s, max_sleep_s, idle_exit_s
        self._cond = threading.Condition(threading.Lock())
        self._rooms: dict[int, tuple[Any, deque[_Entry]]] = {}  # id(view) -> (view, entries)
        self._thread: threading.Thread | None = None
        self.posted = 0  # entries posted by the waiter thread (tests, stats)
        self.failed = 0  # rooms failed because an event's query raised

    # ------------------------------------------------------------------ engine threads

    def submit(self, view: Any, event: Any, then: ev.Event, *, layer: int | None = None
               ) -> None:
        """Posts `then` once `event` completed (None: at once) and every earlier submit of
        the same room was posted. Never blocks on the device."""
        if event is not None and not callable(getattr(event, "query", None)):
            from kvhandoff.errors import ConfigError

            raise ConfigError(f"layer_ready({layer}): event must have a query() method (a "
                              f"torch.cuda.Event), got {type(event).__name__}")
        with self._cond:
            slot = self._rooms.get(id(view))
            if slot is None and event is None:
                self._post(then)  # nothing of this room waits: in order already
                return
            if slot is None:
                slot = self._rooms[id(view)] = (view, deque())
            slot[1].append(_Entry(layer, event, then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """Entries queued (all rooms)."""
        with self._cond:
            return sum(len(q) for _, q in self._rooms.values())

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # ------------------------------------------------------------------ the waiter thread

    def _run(self) -> None:
        sleep = self._min
        while True:
            with self._cond:
                if self._closed():
                    self._rooms.clear()
                    self._thread = None
                    return
                if not self._rooms:
                    self._cond.wait(self._idle)
                    if not self._rooms:  # idle (or closing): end; a submit starts another
                        self._thread = None
                        return
                    sleep = self._min
                    continue
                heads = [(key, view, q[0]) for key, (view, q) in self._rooms.items()]
            progressed = False
            for key, view, head in heads:
                progressed |= self._advance(key, view, head)
            if progressed:
                sleep = self._min
                continue
            with self._cond:
                if not self._closed():
                    self._cond.wait(sleep)
            sleep = min(self._max, sleep * 2)

    def _advance(self, key: int, view: Any, head: _Entry) -> bool:
        """Posts the room's completed entries in order; whether any left the queue."""
        moved = False
        while True:
            if getattr(view, "done", False):
                with self._cond:
                    self._rooms.pop(key, None)  # the room ended: nothing to wait for
                return True
            if head.event is not None:
                try:
                    complete = bool(head.event.query())
                except Exception as e:  # noqa: BLE001  (any error of the device event)
                    self._fail(key, view, head, e)
                    return True
                if not complete:
                    return moved
            with self._cond:
                self.posted += 1  # counted before the post: a test that saw it sees this
            self._post(head.then)  # posted first, dequeued after: never overtaken
            with self._cond:
                q = self._rooms[key][1]
                q.popleft()
                if not q:
                    del self._rooms[key]
                    return True
                head = q[0]
            moved = True

    def _fail(self, key: int, view: Any, head: _Entry, err: BaseException) -> None:
        marks = head.then.events if isinstance(head.then, ev.Batch) else ()
        what = (f"layers {', '.join(str(m.layer) for m in marks[:8])}"  # type: ignore[union-attr]
                f"{', ...' if len(marks) > 8 else ''}" if marks
                else f"layer {head.layer}" if head.layer is not None else "a chunk")
        reason = (f"{what}: waiting for its device event failed: "
                  f"{type(err).__name__}: {err}")
        log.error("room %s: %s", getattr(view, "room", "?"), reason)
        with self._cond:
            self._rooms.pop(key, None)
            self.failed += 1
        self._post(ev.AbortRoom(view.room, view, reason))
