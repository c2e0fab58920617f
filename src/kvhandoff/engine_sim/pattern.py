"""The deterministic page contents of the simulated engines (and of tests that pair with them).

Byte b of token t of layer L of region index R is ``(t * 131 + b * 7 + L * 17 + R * 29 + seed)
% 251``, so a decode checks what landed without seeing the prefill's memory. With ``salt``
each plane's bytes also depend on its name (`plane_salt`), so a head or key/scale mix-up is
caught; GQA head planes (``h<global id>``) get the same bytes on every rank that holds the head.
`PREFIX_MARKER` fills a decode's cached-prefix pages, so a test sees that a handoff left them
alone.

Rules: numpy and the layout's plane geometry only (no agent, no I/O); the formula never
changes (processes of different ages pair in tests).
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Any

import numpy as np

PREFIX_MARKER = 0xA5


@functools.lru_cache(maxsize=8)
def _base(first: int, count: int, nbytes: int) -> np.ndarray:
    """``(t * 131 + b * 7) % 251`` for tokens first..first+count, as uint8 (cached: every layer
    of a request shares it, only the offset differs)."""
    t = np.arange(first, first + count, dtype=np.int64)
    b = np.arange(nbytes, dtype=np.int64)
    out: np.ndarray = ((t[:, None] * 131 + b[None, :] * 7) % 251).astype(np.uint8)
    out.flags.writeable = False
    return out


def pattern(t: np.ndarray, nbytes: int, layer: int, region: int, seed: int) -> np.ndarray:
    """The deterministic bytes of tokens `t` (rows) of one plane of `nbytes` per token:
    ``(t * 131 + b * 7 + layer * 17 + region * 29 + seed) % 251``."""
    c = (layer * 17 + region * 29 + seed) % 251
    contiguous = t.size and t[-1] - t[0] + 1 == t.size and np.all(np.diff(t) == 1)
    if contiguous:
        base = _base(int(t[0]), int(t.size), nbytes)
    else:
        tt = t.astype(np.int64)[:, None]
        base = ((tt * 131 + np.arange(nbytes, dtype=np.int64)[None, :] * 7) % 251).astype(
            np.uint8)
    lut = ((np.arange(256, dtype=np.int64) + c) % 251).astype(np.uint8)
    out: np.ndarray = lut[base]  # (base + c) % 251 in one uint8 table lookup
    return out


def plane_salt(name: str) -> int:
    """A per-plane offset of the pattern (``plane_salt`` mode): head planes ``h<id>`` get
    ``3 * id + 1`` (distinct below 100 heads), other planes ``100 + crc32(name) % 150``."""
    m = re.fullmatch(r"h(\d+)", name)
    if m:
        return 3 * int(m[1]) + 1
    return 100 + zlib.crc32(name.encode()) % 150


def _plane_view(buf: np.ndarray, page_size: int, page_nbytes: int, plane_off: int,
                plane_bytes: int) -> np.ndarray:
    """(pages, page_size * plane_bytes) view of one plane of every page."""
    pages = buf.reshape(-1, page_nbytes)
    lo = plane_off * page_size
    return pages[:, lo:lo + page_size * plane_bytes]


def write_tokens(buf: np.ndarray, spec: Any, reg_i: int, layer: int, pages: np.ndarray,
                 first_tok: int, end_tok: int, seed: int, *, salt: bool = False) -> None:
    """Writes the pattern of tokens [first_tok, end_tok) into `pages` (page k holds tokens
    first_tok + k*page_size ...). `salt`: offset each plane's pattern by `plane_salt`."""
    reg = spec.regions[reg_i]
    ps = spec.page_size_tokens
    n_pages = -(-(end_tok - first_tok) // ps)
    t = np.arange(first_tok, first_tok + n_pages * ps)
    for off, pl in zip(reg.plane_offsets(), reg.planes, strict=True):
        data = pattern(t, pl.bytes_per_token, layer, reg_i,
                       seed + (plane_salt(pl.name) if salt else 0))
        view = _plane_view(buf, ps, reg.page_nbytes(ps), off, pl.bytes_per_token)
        view[pages[:n_pages]] = data.reshape(n_pages, ps * pl.bytes_per_token)


def check_tokens(buf: np.ndarray, spec: Any, reg_i: int, layer: int, pages: np.ndarray,
                 first_tok: int, end_tok: int, seed: int, *, salt: bool = False) -> int:
    """How many bytes of tokens [first_tok, end_tok) differ from the pattern."""
    reg = spec.regions[reg_i]
    ps = spec.page_size_tokens
    n_pages = -(-(end_tok - first_tok) // ps)
    t = np.arange(first_tok, first_tok + n_pages * ps)
    valid = (t < end_tok).reshape(n_pages, ps)
    bad = 0
    for off, pl in zip(reg.plane_offsets(), reg.planes, strict=True):
        want = pattern(t, pl.bytes_per_token, layer, reg_i,
                       seed + (plane_salt(pl.name) if salt else 0)).reshape(
            n_pages, ps, pl.bytes_per_token)
        view = _plane_view(buf, ps, reg.page_nbytes(ps), off, pl.bytes_per_token)
        got = view[pages[:n_pages]].reshape(n_pages, ps, pl.bytes_per_token)
        bad += int(np.count_nonzero((got != want) & valid[:, :, None]))
    return bad

