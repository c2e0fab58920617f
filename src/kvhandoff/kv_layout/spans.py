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
- A `whole_pages` region (either side) with one page size on both sides moves whole pages: the
  range widens to the page boundaries around it, as far as both sides' pages reach (a partly
  filled last page goes whole, whatever the kernel keeps inside it).
- Vectorised numpy: no Python loop per page or per token.
- A `SpanPlan` is THE paired form of spans everywhere: built once (`build_spans` per region and
  layer), handed as is through the session's effects to a transport's `post_writes`, whose copy
  engines take its arrays as their pieces. The only other way to pair is `pair_spans`: two span
  lists of one stream that two processes cut on their own (the two sides of a two-sided
  transfer). `cut_plan` cuts a plan at a transport's chunk grid.
- A plan is immutable once built (its arrays are never written), so what a transport checks
  of it (`bounds`: dtypes, signs, how far it reaches on each side), the plan without its empty
  pieces (`nonempty`) and its `digest` are computed once per plan and kept on it: a region's
  plan is the same object for every layer of a room, so a room's writes check it once, not per
  write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

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
    # computed on first use (see the module doc): the sum of nbytes, bounds(), nonempty()
    _total: int | None = field(default=None, init=False, repr=False)
    _bounds: PlanBounds | None = field(default=None, init=False, repr=False)
    _nonempty: SpanPlan | None = field(default=None, init=False, repr=False)
    _digest: int | None = field(default=None, init=False, repr=False)

    @property
    def count(self) -> int:
        """Descriptors after coalescing."""
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        total = self._total
        if total is None:
            total = int(self.nbytes.sum())
            object.__setattr__(self, "_total", total)
        return total

    def bounds(self) -> PlanBounds:
        """What a transport checks of the plan before it copies (computed once per plan)."""
        b = self._bounds
        if b is None:
            b = PlanBounds.of(self)
            object.__setattr__(self, "_bounds", b)
        return b

    def digest(self) -> int:
        """A 64-bit digest of the plan's pieces (src offsets, dst offsets, nbytes, as
        little-endian int64, in order; computed once): two sides that built the same plan
        have the same digest, so a one-sided writer can say which plan it wrote by."""
        d = self._digest
        if d is None:
            h = hashlib.blake2b(digest_size=8)
            for arr in (self.src_offsets, self.dst_offsets, self.nbytes):
                h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
            d = int.from_bytes(h.digest(), "little")
            object.__setattr__(self, "_digest", d)
        return d

    def nonempty(self) -> SpanPlan:
        """The plan without its zero-length pieces (itself when it has none; computed once)."""
        plan = self._nonempty
        if plan is None:
            keep = self.nbytes > 0
            plan = self if keep.all() else SpanPlan(
                self.src_offsets[keep], self.dst_offsets[keep], self.nbytes[keep],
                self.descriptors_before)
            object.__setattr__(self, "_nonempty", plan)
        return plan

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


@dataclass(frozen=True, slots=True)
class PlanBounds:
    """A plan's shape as a transport checks it: `well_formed` (three 1-D integer arrays of one
    length, no negative item), and how far its pieces reach into the source and the
    destination buffer (`src_end`, `dst_end`: the largest offset + nbytes, 0 if none)."""

    well_formed: bool
    src_end: int
    dst_end: int

    @staticmethod
    def of(plan: SpanPlan) -> PlanBounds:
        so, do, nb = plan.src_offsets, plan.dst_offsets, plan.nbytes
        arrays = (so, do, nb)
        if any(a.ndim != 1 or a.shape != nb.shape or (a.size and a.dtype.kind not in "iu")
               for a in arrays):
            return PlanBounds(False, 0, 0)
        if not nb.size:
            return PlanBounds(True, 0, 0)
        if min(int(a.min()) for a in arrays) < 0:
            return PlanBounds(False, 0, 0)
        return PlanBounds(True, int((so + nb).max()), int((do + nb).max()))


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
    if ((region.whole_pages or dst_reg.whole_pages) and src_page_size == dst_page_size
            and src_first_token == dst_first_token):
        ps, first = src_page_size, src_first_token
        reach = first + min(len(sp), len(dp)) * ps
        token_start = first + (token_start - first) // ps * ps
        token_end = min(reach, first - (-(token_end - first) // ps) * ps)
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
    # Token-major pages (a row holds every plane): a plane's bytes of consecutive rows are a
    # row apart, so such a side moves row by row, unless the pairs take whole rows on both
    # sides (every plane, same order and offsets): a whole row then acts as one plane.
    s_tm = region.token_major and len(region.planes) > 1
    d_tm = dst_reg.token_major and len(dst_reg.planes) > 1
    s_row, d_row = region.bytes_per_row, dst_reg.bytes_per_row
    s_poff = region.plane_offsets()
    d_poff = dst_reg.plane_offsets()
    plane_bytes = [region.planes[si].bytes_per_token for si, _ in pairs]
    if (s_tm or d_tm) and s_tm == d_tm and region.planes == dst_reg.planes \
            and pairs == [(i, i) for i in range(len(region.planes))]:
        pairs, plane_bytes, s_poff, d_poff = [(0, 0)], [s_row], (0,), (0,)
        s_tm = d_tm = False
    elif s_tm and d_tm and len(pairs) > 1:
        # planes next to each other in a row on both sides (a run of heads) are one piece
        runs: list[tuple[int, int]] = []
        run_bytes: list[int] = []
        prev = (-2, -2)
        for (si, di), b in zip(pairs, plane_bytes, strict=True):
            if (si, di) == (prev[0] + 1, prev[1] + 1):
                run_bytes[-1] += b
            else:
                runs.append((si, di))
                run_bytes.append(b)
            prev = (si, di)
        pairs, plane_bytes = runs, run_bytes
    per_row = s_tm or d_tm

    # Segment boundaries: the range ends plus every page boundary of either side inside it
    # (every row boundary where a side moves row by row).
    def bounds(first: int, size: int) -> IntArray:
        lo = first + (-(-(token_start - first) // size)) * size
        b: IntArray = np.arange(lo, token_end, size, dtype=np.int64)
        return b

    cuts = np.union1d(
        np.union1d(bounds(src_first_token, src_page_size), bounds(dst_first_token, dst_page_size)),
        np.array([token_start, token_end], dtype=np.int64),
    )
    if per_row:
        cuts = np.arange(token_start, token_end + 1, dtype=np.int64)
    seg_start = cuts[:-1]
    seg_len = np.diff(cuts)
    s_rel = seg_start - src_first_token
    d_rel = seg_start - dst_first_token
    s_page = sp[s_rel // src_page_size]
    d_page = dp[d_rel // dst_page_size]
    s_tok = s_rel % src_page_size
    d_tok = d_rel % dst_page_size

    n_seg, n_pl = seg_start.shape[0], len(pairs)
    src_off = np.empty((n_seg, n_pl), dtype=np.int64)
    dst_off = np.empty((n_seg, n_pl), dtype=np.int64)
    nb = np.empty((n_seg, n_pl), dtype=np.int64)
    for k, (si, di) in enumerate(pairs):  # loop over planes (1-2, or heads), not tokens
        b = plane_bytes[k]
        src_off[:, k] = s_page * s_pnb + (s_tok * s_row + s_poff[si] if s_tm
                                          else s_poff[si] * src_page_size + s_tok * b)
        dst_off[:, k] = d_page * d_pnb + (d_tok * d_row + d_poff[di] if d_tm
                                          else d_poff[di] * dst_page_size + d_tok * b)
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


def plan_of(src_offsets: npt.ArrayLike, dst_offsets: npt.ArrayLike,
            nbytes: npt.ArrayLike) -> SpanPlan:
    """A plan from its three arrays as they are (int64, equal length; no pairing, no
    coalescing): for a caller that already holds paired spans, e.g. one whole buffer."""
    s, d, n = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (src_offsets, dst_offsets,
                                                                   nbytes))
    if not s.shape == d.shape == n.shape:
        raise ConfigError(f"span plan: src_offsets, dst_offsets and nbytes must have equal "
                          f"length, got {s.size}, {d.size} and {n.size}")
    return SpanPlan(s, d, n, int(n.size))


def cut_spans(off: IntArray, nb: IntArray,
              cuts: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Cuts spans (no empty ones) at every stream position in `cuts` and at their own starts;
    (buffer offsets, lengths, stream positions) of the pieces."""
    total = int(nb.sum())
    starts = np.cumsum(nb) - nb
    inner = cuts[(cuts > 0) & (cuts < total)]
    bounds: IntArray = np.union1d(starts, inner)
    idx = np.searchsorted(starts, bounds, side="right") - 1
    poff: IntArray = off[idx] + (bounds - starts[idx])
    plen: IntArray = np.diff(np.append(bounds, total))
    return poff, plen, bounds


def _nonempty(off: IntArray, nb: IntArray) -> tuple[IntArray, IntArray]:
    keep = nb > 0
    return (off, nb) if keep.all() else (off[keep], nb[keep])


def pair_spans(src_offsets: npt.ArrayLike, src_nbytes: npt.ArrayLike,
               dst_offsets: npt.ArrayLike, dst_nbytes: npt.ArrayLike) -> SpanPlan:
    """Pairs two span lists that carry one byte stream, cut at different places (the two
    sides of a two-sided transfer, each side's list coming from its own process): the plan's
    pieces are cut wherever either side cuts, pieces contiguous on both sides merged, empty
    spans ignored. The one place two independent span lists are paired.

    Raises:
        ConfigError: the lists are not 1-D of equal lengths each, a value is negative, or the
            two totals differ.
    """
    sides = []
    for what, o, n in (("src", src_offsets, src_nbytes), ("dst", dst_offsets, dst_nbytes)):
        off = np.asarray(o, dtype=np.int64).reshape(-1)
        nb = np.asarray(n, dtype=np.int64).reshape(-1)
        if off.shape != nb.shape:
            raise ConfigError(f"pair_spans ({what}): {off.size} offsets but {nb.size} lengths")
        if nb.size and (int(nb.min()) < 0 or int(off.min()) < 0):
            raise ConfigError(f"pair_spans ({what}): offsets and lengths must be >= 0")
        sides.append(_nonempty(off, nb))
    (so, sn), (do, dn) = sides
    total = int(sn.sum())
    if total != int(dn.sum()):
        raise ConfigError(f"pair_spans: the source carries {total} bytes, the destination "
                          f"{int(dn.sum())}")
    if total == 0:
        return SpanPlan.empty()
    cuts: IntArray = np.union1d(np.cumsum(sn), np.cumsum(dn))
    ps, lens, _ = cut_spans(so, sn, cuts)
    pd, _, _ = cut_spans(do, dn, cuts)
    joins = (ps[1:] == ps[:-1] + lens[:-1]) & (pd[1:] == pd[:-1] + lens[:-1])
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return SpanPlan(ps[heads], pd[heads], np.add.reduceat(lens, heads), int(lens.size))


def cut_plan(plan: SpanPlan, step_bytes: int) -> tuple[SpanPlan, IntArray]:
    """`plan` with its pieces also cut at every multiple of `step_bytes` of the stream (a
    transport's chunk grid); returns the cut plan and the grid step of each piece."""
    if step_bytes <= 0:
        raise ConfigError(f"cut_plan: step_bytes must be > 0, got {step_bytes}")
    keep = plan.nbytes > 0
    so, do, nb = plan.src_offsets[keep], plan.dst_offsets[keep], plan.nbytes[keep]
    total = int(nb.sum())
    if total == 0:
        return SpanPlan.empty(), np.zeros(0, dtype=np.int64)
    grid: IntArray = np.arange(step_bytes, total, step_bytes, dtype=np.int64)
    ps, lens, pos = cut_spans(so, nb, grid)
    pd, _, _ = cut_spans(do, nb, grid)
    step: IntArray = pos // step_bytes
    return SpanPlan(ps, pd, lens, plan.descriptors_before), step
