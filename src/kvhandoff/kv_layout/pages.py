"""Page math, named after the seeds.

Rules: the cached prefix of decode is page-aligned DOWN (a partial last prefix page is sent
again); suffix pages are paired by position on both sides (the k-th suffix page of prefill goes
to the k-th suffix page of decode). Pure numpy, no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import ConfigError

IntArray = npt.NDArray[np.int64]


def page_aligned(n_tokens: int, page_size: int) -> int:
    """`n_tokens` rounded down to a multiple of `page_size`."""
    if page_size <= 0:
        raise ConfigError(f"page_size: expected > 0, got {page_size}")
    if n_tokens < 0:
        raise ConfigError(f"n_tokens: expected >= 0, got {n_tokens}")
    return (n_tokens // page_size) * page_size


def num_pages(n_tokens: int, page_size: int) -> int:
    """Pages needed to hold `n_tokens` (rounded up)."""
    if page_size <= 0:
        raise ConfigError(f"page_size: expected > 0, got {page_size}")
    return -(-n_tokens // page_size)


def kv_to_page_indices(kv_indices: npt.ArrayLike, page_size: int) -> IntArray:
    """Token slot indices (one per token, page-major as a paged pool hands them out) -> page ids.

    Takes every `page_size`-th slot and divides by the page size, as the seeds' helper of the
    same name does; the slots of one page must be contiguous and start at a page boundary.
    """
    if page_size <= 0:
        raise ConfigError(f"page_size: expected > 0, got {page_size}")
    slots = np.asarray(kv_indices, dtype=np.int64)
    if slots.ndim != 1:
        raise ConfigError(f"kv_indices: expected a 1-D array, got shape {slots.shape}")
    if page_size == 1:
        same: IntArray = slots.copy()
        return same
    first = slots[::page_size]
    if np.any(first % page_size):
        raise ConfigError("kv_indices: a page's first slot is not on a page boundary")
    pages: IntArray = first // page_size
    return pages


def suffix_page_indices(
    page_indices: npt.ArrayLike, prefix_tokens: int, page_size: int
) -> IntArray:
    """The pages of a sequence from its page-aligned-down prefix on (the suffix-only pages)."""
    pages = np.asarray(page_indices, dtype=np.int64)
    start = page_aligned(prefix_tokens, page_size) // page_size
    if start > len(pages):
        raise ConfigError(
            f"prefix_tokens: {prefix_tokens} tokens cover {start} pages, "
            f"but the sequence has only {len(pages)}"
        )
    out: IntArray = pages[start:]
    return out
