# Early data: what a two-sided transport's receiver holds for receives not posted yet.
#
# A sender may start a stream before the receiver posts its receive (the decode posts when its
# engine gives the pages; the prefill sends when a layer is ready), so the receiver holds what
# came early and hands it over when the receive is posted. Anyone who can reach the data plane
# can send such data too, for receives that will never be posted, so what is held is bounded:
# in bytes per source (`peer_bytes`; the tcp transport: per peer connection's transport id, the
# ucx transport: per stream, as a UCX tag does not name its sender), in bytes in total
# (`total_bytes`), and in age (`keep_s`, `expire`). Over a bound, the key's held data is
# dropped and counted (`data_early_dropped`), and the key is marked (`overflowed`, the last
# OVERFLOWED_MAX remembered) so the receive posted for it later fails at once instead of
# waiting for data that was thrown away.
#
# Used by both the tcp transport (tcp.py) and the ucx transport (ucx/matcher.py); each store
# belongs to its transport's I/O thread.
from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

OVERFLOWED_MAX = 4096  # keys whose early data went over a bound (or aged), remembered

#: a held key: (source bounded by `peer_bytes`, stream within it)
Key = tuple[Hashable, int]


class EarlyStore:
    """Data that came before its receive was posted, per key (source, stream), bounded in bytes
    per source (`peer_bytes`) and in total (`total_bytes`). Each item is held with the order it
    came in (`order`), so a disconnect drops only what came before it."""

    def __init__(self, *, peer_bytes: int, total_bytes: int, counters: dict[str, int],
                 keep_s: float = 30.0) -> None:
        self.peer_bytes = peer_bytes
        self.total_bytes = total_bytes
        self.keep_s = keep_s
        self.counters = counters
        counters.setdefault("data_early_dropped", 0)
        # each held key's first arrival, oldest first (`expire`)
        self._since: collections.OrderedDict[Key, float] = collections.OrderedDict()
        self._items: dict[Key, list[Any]] = {}
        self._order: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._peer: collections.Counter[Hashable] = collections.Counter()
        self.total = 0
        self.peak = 0  # the most bytes held at once
        # key -> why it was marked: "bound" (over a byte bound) or "aged" (held past keep_s)
        self._overflowed: collections.OrderedDict[Key, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())

    def overflowed(self, key: Key) -> bool:
        return key in self._overflowed

    def why(self, key: Key) -> str | None:
        """Why `key` is marked: "bound", "aged", or None (not marked)."""
        return self._overflowed.get(key)

    def fits(self, key: Key, nbytes: int) -> bool:
        """Whether `nbytes` more for `key` stay within both bounds (and `key` is not marked)."""
        return (key not in self._overflowed and self._peer[key[0]] + nbytes <= self.peer_bytes
                and self.total + nbytes <= self.total_bytes)

    def spill(self, key: Key, extra: int = 0) -> list[Any]:
        """Drops what was held for `key` (and `extra` items never held), counted, and marks
        `key` overflowed; returns what it held (the caller releases it)."""
        items = self._items.get(key, [])
        self.counters["data_early_dropped"] += extra + len(items)
        self.discard(key)
        self._mark(key, "bound")
        return items

    def hold(self, key: Key, item: Any, nbytes: int, order: int, *, now: float = 0.0) -> bool:
        """Holds `item` (`nbytes` of payload) for `key`; False when that would go over a bound:
        then what was held for `key` is dropped too, and `key` is marked overflowed."""
        if not self.fits(key, nbytes):
            self.spill(key, 1)
            return False
        if key not in self._items:
            self._since[key] = now
            self._order[key] = order
            self._items[key] = []
            self._size[key] = 0
        self._items[key].append(item)
        self._size[key] += nbytes
        self._peer[key[0]] += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        return True

    def _mark(self, key: Key, why: str) -> None:
        self._overflowed[key] = why
        while len(self._overflowed) > OVERFLOWED_MAX:
            self._overflowed.popitem(last=False)

    def oldest(self) -> float | None:
        """When the oldest held key was first held (None: nothing held)."""
        return next(iter(self._since.values()), None)

    def expire(self, now: float) -> list[tuple[Key, list[Any]]]:
        """Drops the keys first held more than `keep_s` before `now` (their receive was never
        posted), counted and marked overflowed like a key over the bound; returns each with
        what it held (to tell its senders)."""
        out = []
        while self._since:
            key, t = next(iter(self._since.items()))
            if now - t <= self.keep_s:
                break
            items = self._items.get(key, [])
            self.counters["data_early_dropped"] += len(items)
            self.discard(key)
            self._mark(key, "aged")
            out.append((key, items))
        return out

    def take(self, key: Key) -> list[Any]:
        """What was held for `key`, now handed over (its receive was posted)."""
        items = self._items.get(key, [])
        self.discard(key)
        return items

    def take_all(self) -> list[Any]:
        """Everything held (shutdown: the caller releases it)."""
        items = [item for held in self._items.values() for item in held]
        for key in list(self._items):
            self.discard(key)
        return items

    def held_bytes(self, source: Hashable) -> int:
        """Bytes held for `source` (key[0])."""
        return self._peer.get(source, 0)

    def discard(self, key: Key) -> None:
        self._since.pop(key, None)
        self._items.pop(key, None)
        self._order.pop(key, None)
        size = self._size.pop(key, 0)
        self._peer[key[0]] -= size
        if self._peer[key[0]] <= 0:
            del self._peer[key[0]]
        self.total -= size

    def unmark(self, key: Key) -> None:
        self._overflowed.pop(key, None)

    def drop_peer(self, ident: Hashable, before: int) -> None:
        """Drops what source `ident` sent before order `before` (a disconnect)."""
        for key in [k for k in self._items if k[0] == ident and self._order[k] < before]:
            self.discard(key)
