"""The span builder: which bytes of a source layer buffer go where in a destination buffer.

Rules:
- ONE function, `build_spans`, used by both sides of a transfer: it is deterministic (same
  inputs, same spans in the same order), so the sender and the receiver agree on the plan and
  on the order in which checksums see the bytes.
- Order is token order of each span's first byte (segment by segment, planes in order within a
  segment), so both sides see the bytes in the same order for checksums.
- Coalescing is maximal: any two pieces contiguous on BOTH sides become one span, even when the
  pages were handed out of order.
  Whole equal-size consecutive pages (all planes) collapse into one span; partial pages and
  different page sizes go token-granular per plane through the same path.
- Planes are paired by name, so a destination may take a subset of the source's planes (GQA head
  slices are per-head planes) and a source may feed a subset of the destination's.
- Each side's memory is its own region's: page p of a layer starts at ``p * page_stride`` of
  that layer's bytes (the item length for one buffer per layer, the block stride of a packed
  row), so a packed side and a per-layer side pair like any two. Offsets are relative to page 0
  of the layer (`LayoutSpec.layer_offset` adds the member offset inside a packed row).
- A compressed region (`tokens_per_row` > 1, the indexer's index_kpool) moves rows: tokens
  ``[start, end)`` are rows ``[start/k, ceil(end/k))``; both sides must compress alike.
- A layer holding 0 rows on either side (`empty_layers`) moves nothing.
- Vectorised numpy: no Python loop per page or per token.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.spec import RegionSpec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class SpanPlan:
    """Spans `(src_offset, dst_offset, nbytes)` of one layer buffer, in token order."""

    src_offsets: IntArray
    dst_offsets: IntArray
    nbytes: IntArray
    descriptors_before: int  # page-granular pieces before coalescing consecutive pages

    @property
    def count(self) -> int:
        """Descriptors after coalescing."""
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(
            self.src_offsets.tolist(), self.dst_offsets.tolist(), self.nbytes.tolist(),
            strict=True,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpanPlan):
            return NotImplemented
        return (
            np.array_equal(self.src_offsets, other.src_offsets)
            and np.array_equal(self.dst_offsets, other.dst_offsets)
            and np.array_equal(self.nbytes, other.nbytes)
        )

    def __repr__(self) -> str:
        return (
            f"SpanPlan(count={self.count}, total_bytes={self.total_bytes}, "
            f"descriptors_before={self.descriptors_before})"
        )

    @staticmethod
    def empty() -> SpanPlan:
        z = np.zeros(0, dtype=np.int64)
        return SpanPlan(z, z.copy(), z.copy(), 0)


def _as_pages(pages: npt.ArrayLike, what: str) -> IntArray:
    arr = np.asarray(pages, dtype=np.int64)
    if arr.ndim != 1:
        raise ConfigError(f"{what}: expected a 1-D list of page ids, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ConfigError(f"{what}: page ids must be >= 0")
    return arr


def _plane_pairs(src: RegionSpec, dst: RegionSpec,
                 only: Collection[str] | None = None) -> list[tuple[int, int]]:
    if src.planes == dst.planes and only is None:
        return [(i, i) for i in range(len(src.planes))]
    dst_idx = {p.name: i for i, p in enumerate(dst.planes)}
    pairs: list[tuple[int, int]] = []
    for i, p in enumerate(src.planes):
        j = dst_idx.get(p.name)
        if j is None or (only is not None and p.name not in only):
            continue
        if dst.planes[j].bytes_per_token != p.bytes_per_token:
            raise ConfigError(
                f"{src.name}.planes[{p.name}].bytes_per_token: source={p.bytes_per_token} "
                f"destination={dst.planes[j].bytes_per_token}"
            )
        pairs.append((i, j))
    if not pairs:
        raise ConfigError(
            f"{src.name}.planes: source planes {[p.name for p in src.planes]} and destination "
            f"planes {[p.name for p in dst.planes]} share none"
        )
    return pairs


def build_spans(
    region: RegionSpec,
    *,
    token_start: int,
    token_end: int,
    src_pages: npt.ArrayLike,
    src_page_size: int,
    dst_pages: npt.ArrayLike,
    dst_page_size: int,
    src_first_token: int = 0,
    dst_first_token: int = 0,
    dst_region: RegionSpec | None = None,
    planes: Collection[str] | None = None,
    layer: int | None = None,
) -> SpanPlan:
    """Spans moving tokens ``[token_start, token_end)`` of one layer buffer of `region`.

    Args:
        region: the source region (and the destination's, unless `dst_region` is given).
        token_start, token_end: the token range of the sequence to move.
        src_pages: source page ids; ``src_pages[k]`` holds tokens
            ``src_first_token + k*src_page_size ...`` of the sequence.
        src_page_size: tokens per source page.
        dst_pages, dst_page_size, dst_first_token: the same for the destination.
        dst_region: the destination region when its planes differ (planes pair by name).
        planes: move only the planes of these names (a head slice); offsets stay those of the
            full regions.
        layer: the layer the plan is for; a layer holding 0 rows on either side gets an empty
            plan (without it, the plan is the one of every live layer of the region).

    Returns:
        The coalesced `SpanPlan` (offsets in bytes into one layer buffer of each side).
    """
    if src_page_size <= 0 or dst_page_size <= 0:
        raise ConfigError(
            f"page_size: expected > 0, got source={src_page_size} destination={dst_page_size}"
        )
    if token_start < 0 or token_end < token_start:
        raise ConfigError(f"token range: invalid [{token_start}, {token_end})")
    for first, size, side in (
        (src_first_token, src_page_size, "src"),
        (dst_first_token, dst_page_size, "dst"),
    ):
        if first % size:
            raise ConfigError(f"{side}_first_token: {first} is not a multiple of page {size}")
    sp = _as_pages(src_pages, "src_pages")
    dp = _as_pages(dst_pages, "dst_pages")
    dst_reg = dst_region if dst_region is not None else region
    if region.tokens_per_row != dst_reg.tokens_per_row:
        raise ConfigError(
            f"{region.name}.tokens_per_row: source={region.tokens_per_row} "
            f"destination={dst_reg.tokens_per_row}"
        )
    if layer is not None:
        for reg, side in ((region, "source"), (dst_reg, "destination")):
            if layer not in reg.layer_ids:
                raise ConfigError(f"layer: {layer} is not a layer of the {side} region "
                                  f"{reg.name!r}")
        if region.is_empty(layer) or dst_reg.is_empty(layer):
            return SpanPlan.empty()
    if token_start == token_end:
        return SpanPlan.empty()
    for first, size, pages, side in (
        (src_first_token, src_page_size, sp, "src"),
        (dst_first_token, dst_page_size, dp, "dst"),
    ):
        if token_start < first:
            raise ConfigError(f"{side}_pages: start at token {first}, after token {token_start}")
        have = first + len(pages) * size
        if token_end > have:
            raise ConfigError(
                f"{side}_pages: {len(pages)} pages of {size} from token {first} cover up to "
                f"token {have}, but the range ends at {token_end}"
            )
    # A compressed region moves rows: everything below is in rows (a row is a token when k=1).
    k = region.tokens_per_row
    s_rows_pp = region.rows_per_page(src_page_size)
    d_rows_pp = dst_reg.rows_per_page(dst_page_size)
    if token_start % k:
        raise ConfigError(f"token_start: {token_start} is not on a row boundary "
                          f"(tokens_per_row={k})")
    token_start, token_end = token_start // k, -(-token_end // k)
    src_first_token, dst_first_token = src_first_token // k, dst_first_token // k
    src_page_size, dst_page_size = s_rows_pp, d_rows_pp
    s_pnb = region.page_stride(src_page_size * k)
    d_pnb = dst_reg.page_stride(dst_page_size * k)

    pairs = _plane_pairs(region, dst_reg, planes)

    # Segment boundaries: the range ends plus every page boundary of either side inside it.
    def bounds(first: int, size: int) -> IntArray:
        lo = first + (-(-(token_start - first) // size)) * size
        b: IntArray = np.arange(lo, token_end, size, dtype=np.int64)
        return b

    cuts = np.union1d(
        np.union1d(bounds(src_first_token, src_page_size), bounds(dst_first_token, dst_page_size)),
        np.array([token_start, token_end], dtype=np.int64),
    )
    seg_start = cuts[:-1]
    seg_len = np.diff(cuts)
    s_rel = seg_start - src_first_token
    d_rel = seg_start - dst_first_token
    s_page = sp[s_rel // src_page_size]
    d_page = dp[d_rel // dst_page_size]
    s_tok = s_rel % src_page_size
    d_tok = d_rel % dst_page_size

    s_poff = region.plane_offsets()
    d_poff = dst_reg.plane_offsets()
    n_seg, n_pl = seg_start.shape[0], len(pairs)
    src_off = np.empty((n_seg, n_pl), dtype=np.int64)
    dst_off = np.empty((n_seg, n_pl), dtype=np.int64)
    nb = np.empty((n_seg, n_pl), dtype=np.int64)
    for k, (si, di) in enumerate(pairs):  # loop over planes (1-2, or heads), not tokens
        b = region.planes[si].bytes_per_token
        src_off[:, k] = s_page * s_pnb + s_poff[si] * src_page_size + s_tok * b
        dst_off[:, k] = d_page * d_pnb + d_poff[di] * dst_page_size + d_tok * b
        nb[:, k] = seg_len * b
    src_f, dst_f, nb_f = src_off.ravel(), dst_off.ravel(), nb.ravel()

    joins = (src_f[:-1] + nb_f[:-1] == src_f[1:]) & (dst_f[:-1] + nb_f[:-1] == dst_f[1:])
    # "before": joins inside one segment only (a whole page's planes are one page descriptor)
    same_seg = np.zeros_like(joins)
    if n_pl > 1:
        idx = np.arange(joins.shape[0])
        same_seg = (idx // n_pl) == ((idx + 1) // n_pl)
    before = int(nb_f.shape[0] - np.count_nonzero(joins & same_seg))
    # Maximal coalescing: pieces adjacent in source memory may be far apart in token order
    # (pages handed out out of order), so merge in source-offset order, then put the merged
    # spans back in token order of their first piece. Deterministic: stable sorts only.
    order = np.argsort(src_f, kind="stable")
    s_o, d_o, n_o = src_f[order], dst_f[order], nb_f[order]
    j = (s_o[:-1] + n_o[:-1] == s_o[1:]) & (d_o[:-1] + n_o[:-1] == d_o[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~j)))
    first_piece = np.minimum.reduceat(order, starts)
    back = np.argsort(first_piece, kind="stable")
    return SpanPlan(
        src_offsets=s_o[starts][back],
        dst_offsets=d_o[starts][back],
        nbytes=np.add.reduceat(n_o, starts)[back],
        descriptors_before=before,
    )
