"""A page pool: hands out page ids of a paged KV buffer and takes them back exactly once.

Engines bring their own allocator; this one serves the demo, the bench and the tests, and makes
leaks visible (`free_count` returns to its start when nothing leaked; a double free raises).
"""

from __future__ import annotations

import threading

import numpy as np

from kvhandoff.errors import ConfigError, KVHandoffError


class PagePool:
    """Page ids ``0 .. num_pages-1``; `alloc` takes `n` (random order by default, as a
    fragmented pool hands them out), `free` returns them."""

    __slots__ = ("num_pages", "_free", "_used", "_lock", "_rng")

    def __init__(self, num_pages: int, *, seed: int | None = 0, shuffle: bool = True) -> None:
        if num_pages <= 0:
            raise ConfigError(f"num_pages: expected > 0, got {num_pages}")
        self.num_pages = num_pages
        ids = np.arange(num_pages, dtype=np.int64)
        self._rng = np.random.default_rng(seed)
        if shuffle:
            self._rng.shuffle(ids)
        self._free: list[int] = ids.tolist()
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        with self._lock:
            if n > len(self._free):
                raise KVHandoffError(
                    f"page pool exhausted: {n} pages asked, {len(self._free)} free")
            out, self._free = self._free[:n], self._free[n:]
            self._used.update(out)
        return np.asarray(out, dtype=np.int64)

    def free(self, pages: np.ndarray | list[int]) -> None:
        ids = [int(p) for p in pages]
        with self._lock:
            bad = [p for p in ids if p not in self._used]
            if bad or len(set(ids)) != len(ids):
                raise KVHandoffError(f"page pool: double free or foreign pages {bad[:8]}")
            self._used.difference_update(ids)
            self._free.extend(ids)

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self.num_pages}, free={self.free_count})"
