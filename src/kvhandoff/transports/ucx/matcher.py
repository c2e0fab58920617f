# The UCX transport's receive matcher (I/O thread only).
#
# The receiver never pre-posts: it probes the worker for any arrived message and matches its
# UCX tag against the chunks of posted receives. A message for a receive not yet posted keeps
# its handle (held) until it is; a message of a cancelled receive is dropped (received into
# scratch by the caller), so the sender's op still completes. Probing is what makes cancel
# exact: ucxx exposes no per-request cancel, but a message that was not yet received is simply
# never received into user memory.
#
# What is held is bounded (early.EarlyStore), as anyone who can reach the worker can send
# messages for receives that are never posted. A UCX tag does not name its sender, so held
# messages are keyed and bounded per stream (the tag with its chunk bits masked off: the
# chunk-0 tag of one (sender, data tag), keyed by the control session when it has a key):
# `tcp_early_bytes` per stream, 4 times that in all, each message counted at its length plus
# HELD_OVERHEAD (a zero-length flood is not free), and held at most `keep_s`
# (stall_timeout_s; `expire`, called on each of the I/O thread's passes). A message over a
# bound is dropped at once with what its stream held, and the stream is marked: the receive
# posted for it later fails at once, naming the setting (`post`), instead of waiting for
# data that was thrown away. Dropped messages are counted in `data_early_dropped`.
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from kvhandoff.errors import TransportError
from kvhandoff.transports.early import EarlyStore

HELD_OVERHEAD = 1024  # bytes a held message is counted at beyond its length (its handle)


class _RecvOp(Protocol):
    base: int
    tag: int

    @property
    def plan(self) -> Any: ...


OpT = TypeVar("OpT", bound=_RecvOp)


class ReceiveMatcher(Generic[OpT]):
    """UCX tag -> posted receive chunk, held message handles (bounded), streams to drop."""

    __slots__ = ("_expect", "early", "_discard", "_discard_max", "_chunk_mask", "_now")

    def __init__(self, discard_max: int, *, chunk_bits: int, early_bytes: int, keep_s: float,
                 counters: dict[str, int], now: Callable[[], float] = time.monotonic) -> None:
        self._expect: dict[int, tuple[OpT, int]] = {}  # UCX tag -> (recv op, chunk)
        # held messages: key (stream, 0) -> [(UCX tag, probe result (message handle))]
        self.early = EarlyStore(peer_bytes=early_bytes, total_bytes=4 * early_bytes,
                                counters=counters, keep_s=keep_s)
        # streams (chunk-0 tags) of cancelled receives whose late messages are dropped
        self._discard: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._discard_max = discard_max
        self._chunk_mask = (1 << chunk_bits) - 1
        self._now = now

    def stream(self, tag: int) -> int:
        """The stream of a UCX tag: its chunk-0 tag."""
        return tag & ~self._chunk_mask

    def post(self, op: OpT) -> tuple[list[tuple[int, Any]], list[Any]]:
        """Expects every chunk of a posted receive; returns (chunk, handle) of those that
        already arrived (the caller starts their receives) and the held handles to drop (not
        a chunk of this receive: its plan has fewer chunks, or a chunk came twice).
        TransportError when messages of its stream were dropped before it was posted (over
        the bound, or held too long): it would wait for them for ever."""
        stream = op.base
        key = (stream, 0)
        self._discard.pop(stream, None)
        why = self.early.why(key)
        if why is not None:
            self.early.unmark(key)
            self._forget_stream(stream)  # what still comes of it is dropped
            if why == "aged":
                raise TransportError(
                    f"ucx: tag {op.tag}: messages that came before this receive was posted "
                    f"were held {self.early.keep_s:g} s (stall_timeout_s) without it and "
                    "were dropped")
            raise TransportError(
                f"ucx: tag {op.tag}: messages that came before this receive was posted went "
                f"over the bound (tcp_early_bytes: {self.early.peer_bytes} bytes per stream, "
                f"{self.early.total_bytes} in all) and were dropped")
        nchunks = op.plan.nchunks
        came: dict[int, Any] = {}
        drop = []
        for tag, probe in self.early.take(key):
            k = tag ^ stream
            if k < nchunks and k not in came:
                came[k] = probe
            else:
                drop.append(probe)
        for k in range(nchunks):
            if k not in came:
                self._expect[stream ^ k] = (op, k)
        return sorted(came.items(), key=lambda kp: kp[0]), drop

    def arrived(self, tag: int, probe: Any, length: int) -> tuple[OpT, int] | list[Any]:
        """A probed message of `length` bytes: its (op, chunk) to receive into, or the handles
        to drop (itself, when its receive was cancelled or it goes over a bound: then with
        what its stream held; none: it is held for a receive not yet posted)."""
        entry = self._expect.pop(tag, None)
        if entry is not None:
            return entry
        stream = self.stream(tag)
        if stream in self._discard:
            return [probe]
        key = (stream, 0)
        nbytes = length + HELD_OVERHEAD
        if not self.early.fits(key, nbytes):
            return [p for _, p in self.early.spill(key, 1)] + [probe]
        self.early.hold(key, (tag, probe), nbytes, 0, now=self._now())
        return []

    def expire(self) -> list[Any]:
        """The held handles of streams held longer than `keep_s` (to drop); their streams are
        marked, so their receives fail when posted."""
        return [p for _, items in self.early.expire(self._now()) for _, p in items]

    def next_expiry(self) -> float | None:
        """Seconds until the oldest held stream expires (None: nothing held)."""
        oldest = self.early.oldest()
        if oldest is None:
            return None
        return max(0.0, oldest + self.early.keep_s - self._now())

    def forget(self, op: OpT) -> list[Any]:
        """Stops expecting the chunks of `op` (cancelled / failed): the held handles of its
        stream are returned to be dropped, messages still to come will be dropped."""
        for k in range(op.plan.nchunks):
            t = op.base ^ k
            if self._expect.get(t, (None,))[0] is op:
                del self._expect[t]
        return self._forget_stream(op.base)

    def _forget_stream(self, stream: int) -> list[Any]:
        self._discard[stream] = None
        self._discard.move_to_end(stream)
        while len(self._discard) > self._discard_max:
            self._discard.popitem(last=False)
        return [p for _, p in self.early.take((stream, 0))]

    def take_held(self) -> list[Any]:
        """Every held handle (shutdown: the caller drops them); expects nothing more."""
        self._expect.clear()
        return [p for _, p in self.early.take_all()]
