"""Span plans of a leg, sans-IO: what both sides of a leg compute from the same arguments
(its pages, the peer's pages, both layouts), and which regions of a layer a leg moves. Both
read (and `span_plans` advances) the leg's `rooms.LegPlan`, nothing else of the leg.

Rules:
- Both sides call `span_plans` with the same arguments and get the same plans: the order of
  the spans is the order the checksums hash, so nothing here may depend on the side.
- A region's plan is the same for every layer of the region (only the buffer differs).
- Regions of the same geometry over the same pages and token range (a model's K and V) share
  one plan: `span_plans` builds it once (`_geometry` lists what `build_spans` reads of a
  region when it is given no layer; the name is only in its error messages).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, RegionSpec, SpanPlan, build_spans, page_aligned
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.rooms import LegPlan, Unit


def span_plans(ctx: Context, plan: LegPlan, *, src_pages: Mapping[str, np.ndarray],
               src_ps: int, dst_pages: Mapping[str, np.ndarray], dst_ps: int,
               src_layout: LayoutSpec, dst_layout: LayoutSpec, end: int | None = None
               ) -> dict[str, SpanPlan]:
    """The span plan of each region this leg moves (the same for every layer of the
    region): both sides call this with the same arguments. Regions whose planes this leg
    does not bring (another leg does) are left out.

    Chunked prefill (`end` < seq_len, or a later chunk): each region moves from where its
    previous chunk stopped (`plan.covered`) up to `end` or as far as the source pages reach,
    whichever is less (on a row boundary); `plan.covered` is advanced and regions with
    nothing to move in this chunk are left out. The last chunk (`end` = seq_len) needs
    every region's pages to reach the end."""
    end = plan.seq_len if end is None else end
    chunked = end < plan.seq_len or bool(plan.chunk_ends)
    plans = {}
    made: dict[tuple[object, ...], SpanPlan] = {}  # one plan per distinct input (K and V)
    covered = dict(plan.covered)
    for reg in ctx.layout.regions:
        wanted = (plan.planes or {}).get(reg.name)
        if plan.planes is not None and not wanted:
            continue
        if reg.name not in src_pages or reg.name not in dst_pages:
            raise ConfigError(f"pages: region {reg.name!r} missing")
        first = plan.first_token(reg)
        start, stop = max(first, covered.get(reg.name, 0)), end
        if end < plan.seq_len:
            reach = page_aligned(first, src_ps) + len(src_pages[reg.name]) * src_ps
            k = src_layout.region(reg.name).tokens_per_row
            stop = min(end, reach) // k * k
        stop = max(start, stop)
        covered[reg.name] = stop
        if chunked and stop == start:
            continue
        src_reg, dst_reg = src_layout.region(reg.name), dst_layout.region(reg.name)
        sp, dp = src_pages[reg.name], dst_pages[reg.name]
        key = (_geometry(src_reg), _geometry(dst_reg), start, stop, first, _pages_key(sp),
               _pages_key(dp), None if wanted is None else tuple(wanted))
        built = made.get(key)
        if built is None:
            built = made[key] = build_spans(
                src_reg, token_start=start, token_end=stop, src_pages=sp, src_page_size=src_ps,
                src_first_token=page_aligned(first, src_ps), dst_pages=dp, dst_page_size=dst_ps,
                dst_first_token=page_aligned(first, dst_ps), dst_region=dst_reg, planes=wanted)
        plans[reg.name] = built
    plan.covered = covered
    return plans


def _geometry(region: RegionSpec) -> tuple[object, ...]:
    """What `build_spans` reads of a region when it is given no layer: its planes (names and
    bytes per token), rows, whole-page moves, token- or plane-major pages and its place in a
    packed row (the page stride). Two regions with the same geometry get the same plan from
    the same pages and tokens."""
    return (region.planes, region.tokens_per_row, region.whole_pages, region.token_major,
            region.placement)


def _pages_key(pages: object) -> bytes:
    return np.asarray(pages, dtype=np.int64).tobytes()


def regions_of(ctx: Context, plan: LegPlan, unit: Unit) -> list[str]:
    """The regions of `unit`'s layer the leg moves in its chunk."""
    plans = plan.plans_of(unit)
    return [name for name in ctx.layer_regions.get(unit.layer, ()) if name in plans]
