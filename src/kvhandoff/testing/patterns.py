"""Deterministic page contents the tests share, so a receiver checks what landed without seeing
the sender's memory.

The per-plane pattern (`plane_pattern`, `write_pattern`, `check_pattern`): salted by the region
and plane *names*, so a head or key/scale mix-up shows, and a GQA head keeps its bytes on every
TP rank. The simulated engines' pattern (`write_tokens` / `check_tokens`, `PREFIX_MARKER`) is
`kvhandoff.engine_sim.pattern`'s, imported from there.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np

from kvhandoff.kv_layout import LayoutSpec

__all__ = ["check_pattern", "plane_pattern", "write_pattern"]


def plane_pattern(t: np.ndarray, nbytes: int, layer: int, region: str, plane: str,
                  seed: int) -> np.ndarray:
    """The bytes of tokens `t` (rows) of one plane: distinct per token, byte, layer, region and
    plane name (names, not positions: a GQA head keeps its bytes on every TP rank)."""
    salt = zlib.crc32(f"{region}/{plane}".encode()) % 241
    b = np.arange(nbytes, dtype=np.int64)
    v = t.astype(np.int64)[:, None] * 131 + b[None, :] * 7 + layer * 17 + salt + seed
    out: np.ndarray = (v % 251).astype(np.uint8)
    return out


def _planes(buf: np.ndarray, layout: LayoutSpec, reg_i: int
            ) -> Iterator[tuple[str, int, np.ndarray]]:
    """Per plane of the region: its name, bytes per token, and a (pages, page_size * bytes)
    view of that plane in every page of `buf`."""
    reg = layout.regions[reg_i]
    ps = layout.page_size_tokens
    rows = buf.reshape(-1, reg.page_nbytes(ps))
    for off, pl in zip(reg.plane_offsets(), reg.planes, strict=True):
        lo = off * ps
        yield pl.name, pl.bytes_per_token, rows[:, lo:lo + ps * pl.bytes_per_token]


def write_pattern(buf: np.ndarray, layout: LayoutSpec, reg_i: int, layer: int,
                  pages: np.ndarray, end_tok: int, seed: int) -> None:
    """Writes the per-plane pattern of tokens [0, end_tok) into `pages` of `buf`."""
    ps = layout.page_size_tokens
    n = -(-end_tok // ps)
    t = np.arange(n * ps)
    reg = layout.regions[reg_i]
    for name, nb, view in _planes(buf, layout, reg_i):
        view[pages[:n]] = plane_pattern(t, nb, layer, reg.name, name, seed).reshape(n, ps * nb)


def check_pattern(buf: np.ndarray, layout: LayoutSpec, reg_i: int, layer: int,
                  pages: np.ndarray, first_tok: int, end_tok: int, seed: int) -> int:
    """Bytes of tokens [first_tok, end_tok) (held by `pages`, page k from first_tok on) that
    differ from the per-plane pattern."""
    ps = layout.page_size_tokens
    n = -(-(end_tok - first_tok) // ps)
    t = np.arange(first_tok, first_tok + n * ps)
    valid = (t < end_tok).reshape(n, ps)
    reg = layout.regions[reg_i]
    bad = 0
    for name, nb, view in _planes(buf, layout, reg_i):
        want = plane_pattern(t, nb, layer, reg.name, name, seed).reshape(n, ps, nb)
        got = view[pages[:n]].reshape(n, ps, nb)
        bad += int(np.count_nonzero((got != want) & valid[:, :, None]))
    return bad
