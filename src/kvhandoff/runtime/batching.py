"""`PassBatch`: what the control loop gathers during one pass and hands on once, at its end.

A short prompt's layers are often ready together, and each of them costs the control thread a
session step, a transport job and a completion. One object, owned by the control thread, batches
the three:
- events in: consecutive `LayerReady` events of one room in the queue are fed as one
  `events.Batch` (`take_ready`);
- writes out: the one-sided writes (`PostWrite`) the pass's effects ask for are held
  (`hold`) and leave at the end of the pass (`flush`) as one transport job per (peer, room),
  of at most WRITE_BATCH_BYTES: one job, one copy call, one completion instead of one of each
  per layer, which for a 16-token Llama-8B room was most of the prefill's control-thread time;
- completions back: the `Written` events of a job of several writes come back as one
  `events.Batch`, once the job's completion handed each op its digests.

Rules: control thread only, except the completions (a transport's thread posts them); writes
leave in the order asked: a write over WRITE_BATCH_BYTES (a long prompt's layer, announced on
its own) first sends what is held, and so does anything that must find the writes posted
(`flush` before a cancel or a dropped peer); the loop flushes once per pass, before the outbox,
and the batch never holds more than a job's worth. A write held longer than `stale_s` (the
control thread stalled mid-pass: the process was stopped, or starved) is never posted: it
completes with an error instead. Its decode may have given the room's pages back meanwhile
(its write quarantine counts from its own failure, and the writer's bound from the post), and
a session that stalled that long takes its peers for having given it up anyway (found by the
simulator: a prefill stopped for 35 s between its accept and the end of that pass).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvhandoff.errors import KVHandoffError, TransportError
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import PostWrite
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.transports.base import OneSidedTransport, Transport, WriteResult

# One-sided writes of one room in a pass leave as one transport job while the job stays within
# this many bytes; a larger write leaves alone, so a long prompt's layers still land (and are
# announced) one by one.
WRITE_BATCH_BYTES = 2 << 20

_Queued = tuple[ev.Event | None, Any, Any]  # the loop's queue entries: (event, query, future)


class PassBatch:
    """The loop's batch of one pass (see the module doc). Keyword-only arguments."""

    def __init__(self, *, transport: Transport, hashing: Hasher,
                 post: Callable[[ev.Event], None], clock: Callable[[], float] = time.monotonic,
                 stale_s: float = float("inf")) -> None:
        self._transport = transport
        self._hashing = hashing
        self._post = post
        self._clock = clock
        self._stale_s = stale_s
        self._writes: list[PostWrite] = []
        self._held_bytes = 0
        self._held_at = 0.0  # when the first of the held writes was held

    @property
    def pending(self) -> bool:
        """Whether writes are held (the loop must not sleep before it flushes them)."""
        return bool(self._writes)

    def take_ready(self, first: ev.Event | None, queue: deque[_Queued], left: int
                   ) -> tuple[ev.Event | None, int]:
        """`first`, or with the room's `LayerReady` events right behind it in `queue` one
        `Batch` (taken off the queue); and how many of the `left` queued entries were taken."""
        if not isinstance(first, ev.LayerReady):
            return first, 0
        ready = [first]
        while len(ready) <= left:
            nxt = queue[0][0]
            if not (isinstance(nxt, ev.LayerReady) and nxt.room == first.room
                    and nxt.token is first.token):
                break
            queue.popleft()
            ready.append(nxt)
        taken = len(ready) - 1
        return (ev.Batch(tuple(ready)) if taken else first), taken

    def hold(self, eff: PostWrite) -> None:
        """Holds a write until `flush`; one of no room or over WRITE_BATCH_BYTES leaves now,
        after those held before it. What is held never exceeds a job's worth: a write that
        would take it over WRITE_BATCH_BYTES first sends what is held (one room's jobs are
        packed as `flush` packs them; under load, many rooms' messages read in one pass, the
        transport does not wait for the end of the pass with a full job ready)."""
        n = _write_bytes(eff)
        if eff.room is not None and n <= WRITE_BATCH_BYTES:
            if self._held_bytes + n > WRITE_BATCH_BYTES:
                self.flush()
            if not self._writes:
                self._held_at = self._clock()
            self._writes.append(eff)
            self._held_bytes += n
            return
        self.flush()
        self._post_job([eff])

    def flush(self) -> None:
        """Posts the held writes: those of one (peer, room) in order as jobs of at most
        WRITE_BATCH_BYTES."""
        if not self._writes:
            return
        writes, self._writes, self._held_bytes = self._writes, [], 0
        held = self._clock() - self._held_at
        if held > self._stale_s:
            for eff in writes:
                self._post(ev.Written(eff.op, f"held {held:.2f}s by a stalled control thread "
                                              f"(> {self._stale_s:g}s): never posted"))
            return
        jobs: dict[tuple[str, int | None], list[tuple[int, list[PostWrite]]]] = {}
        for eff in writes:
            runs = jobs.setdefault((eff.peer, eff.room), [])
            n = _write_bytes(eff)
            if runs and runs[-1][0] + n <= WRITE_BATCH_BYTES:
                total, run = runs[-1]
                runs[-1] = (total + n, run)
                run.append(eff)
            else:
                runs.append((n, [eff]))
        for runs in jobs.values():
            for _, run in runs:
                self._post_job(run)

    def _post_job(self, effs: list[PostWrite]) -> None:
        """`effs` (one peer's) as one `post_writes` job: every op's parts back to back, one
        completion that hands each op its own digests (runtime.hashing says how each is
        hashed: while copying, or after it landed). Ops whose hashing differs go as jobs of
        their own."""
        collect = _Collect(self._post) if len(effs) > 1 else None
        plans = [(eff, *self._hashing.write_plan(eff, collect)) for eff in effs]
        if len({fused for _, fused, _ in plans}) > 1:
            for one in plans:
                self._post_job([one[0]])
            return
        fused = plans[0][1]
        if collect is None:
            written = plans[0][2]
        else:
            def written(result: WriteResult) -> None:
                assert collect is not None
                at = 0
                for eff, _, done in plans:
                    n = len(eff.parts)
                    done(result.writes(at, at + n))
                    at += n
                collect.flush()  # the ops' Written events as one Batch
        tr = self._transport
        try:
            if not isinstance(tr, OneSidedTransport):
                raise TransportError(f"post_writes: the {tr.kind} transport has no "
                                     "one-sided writes")
            # a layer's regions (or several layers') as one job (a transport that cannot
            # splits it)
            tr.post_writes(effs[0].peer, [(x.tag, x.buffer, x.buffer, x.plan)
                                          for eff in effs for x in eff.parts],
                           written, checksum=fused)
        except KVHandoffError as e:
            for eff in effs:
                self._post(ev.Written(eff.op, str(e)))
            if collect is not None:
                collect.flush()


class _Collect:
    """The `Written` events of one job of several writes, posted as one `events.Batch` once
    the job's completion handed each op its digests (`flush`); an event that comes after that
    (a write hashed on the hasher pool once it landed) is posted on its own."""

    def __init__(self, post: Callable[[ev.Event], None]) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._events: list[ev.Written] | None = []

    def __call__(self, event: ev.Event) -> None:
        with self._lock:
            held = self._events
            if held is not None and isinstance(event, ev.Written):
                held.append(event)
                return
        self._post(event)

    def flush(self) -> None:
        with self._lock:
            held, self._events = self._events, None
        if held:
            self._post(held[0] if len(held) == 1 else ev.Batch(tuple(held)))


def _write_bytes(eff: PostWrite) -> int:
    return sum(x.plan.total_bytes for x in eff.parts)
