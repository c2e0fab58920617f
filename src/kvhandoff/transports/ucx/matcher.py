# The UCX transport's receive matcher (I/O thread only).
#
# The receiver never pre-posts: it probes the worker for any arrived message and matches its
# UCX tag against the chunks of posted receives. A message for a receive not yet posted keeps
# its handle (held) until it is; a message of a cancelled receive is dropped (received into
# scratch by the caller), so the sender's op still completes. Probing is what makes cancel
# exact: ucxx exposes no per-request cancel, but a message that was not yet received is simply
# never received into user memory.
from __future__ import annotations

import collections
from typing import Any, Generic, Protocol, TypeVar


class _RecvOp(Protocol):
    base: int

    @property
    def plan(self) -> Any: ...


OpT = TypeVar("OpT", bound=_RecvOp)


class ReceiveMatcher(Generic[OpT]):
    """UCX tag -> posted receive chunk, held message handles, tags to drop."""

    __slots__ = ("_expect", "_held", "_discard", "_discard_max")

    def __init__(self, discard_max: int) -> None:
        self._expect: dict[int, tuple[OpT, int]] = {}  # UCX tag -> (recv op, chunk)
        self._held: dict[int, Any] = {}  # UCX tag -> probe result (message handle)
        self._discard: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._discard_max = discard_max

    def post(self, op: OpT) -> list[tuple[int, Any]]:
        """Expects every chunk of a posted receive; returns (chunk, handle) of those that
        already arrived (the caller starts their receives)."""
        ready = []
        for k in range(op.plan.nchunks):
            t = op.base ^ k
            self._discard.pop(t, None)
            probe = self._held.pop(t, None)
            if probe is None:
                self._expect[t] = (op, k)
            else:
                ready.append((k, probe))
        return ready

    def arrived(self, tag: int, probe: Any) -> tuple[OpT, int] | bool:
        """A probed message: its (op, chunk) to receive into, True to drop it (cancelled),
        False when it is held for a receive not yet posted."""
        entry = self._expect.pop(tag, None)
        if entry is not None:
            return entry
        if tag in self._discard:
            del self._discard[tag]
            return True
        self._held[tag] = probe
        return False

    def forget(self, op: OpT) -> list[Any]:
        """Stops expecting the chunks of `op` (cancelled / failed): the held handles of its
        chunks are returned to be dropped, messages still to come will be dropped."""
        drop = []
        for k in range(op.plan.nchunks):
            t = op.base ^ k
            if self._expect.get(t, (None,))[0] is op:
                del self._expect[t]
                probe = self._held.pop(t, None)
                if probe is not None:
                    drop.append(probe)
                else:
                    self._discard[t] = None
        while len(self._discard) > self._discard_max:
            self._discard.popitem(last=False)
        return drop

    def take_held(self) -> list[Any]:
        """Every held handle (shutdown: the caller drops them); expects nothing more."""
        self._expect.clear()
        held = list(self._held.values())
        self._held.clear()
        return held
