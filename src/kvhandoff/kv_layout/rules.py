"""Kernel page-size rules: the hard constraints attention kernels put on a region's physical
page (seed 004: refuse to start on a mismatch, never warn and go on).

A `PageRule` names a region, the kernel that imposes it and the rows its page must hold
(exactly, or a multiple). FlashMLA reads 64-token main-KV pages; the DSA indexer's paged-MQA
kernel reads 64-row indexer pages (with ``index_kpool`` = k a row holds k tokens, so the main
page is 64*k tokens). Rules are local: they describe this engine's kernels and are not part of
the layout hash. A layout without rules pairs with any page size (P != D pages pair token by
token).

- `check_page_rules(layout)`: every broken rule, as a line naming region, rule and value.
- `require_page_rules(layout)`: the same as a `ConfigError`: what an agent calls at start.
- `peer_page_problems(mine, theirs)`: the peer's physical pages against this side's rules (the
  handshake check).

Pure: no I/O.
"""

from __future__ import annotations

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.spec import LayoutSpec, PageRule, RuleKind


def _rows(layout: LayoutSpec, region: str) -> tuple[int | None, str]:
    reg = layout.region(region)
    ps, k = layout.page_size_tokens, reg.tokens_per_row
    if ps % k:
        return None, (f"region {region!r}: page_size_tokens={ps} is not a multiple of "
                      f"tokens_per_row={k} (index_kpool)")
    return ps // k, ""


def _broken(rule: PageRule, rows: int) -> bool:
    if rule.kind is RuleKind.EQ:
        return rows != rule.rows
    return rows % rule.rows != 0


def check_page_rules(layout: LayoutSpec, rules: tuple[PageRule, ...] | None = None) -> list[str]:
    """Each broken page rule of `layout` (its own rules unless `rules` is given) as
    ``region 'main_kv': rule FlashMLA: page == 64 rows; got 32 rows (page_size_tokens=32)``;
    also any region whose page is not a whole number of rows. [] when all hold."""
    out: list[str] = []
    for reg in layout.regions:
        rows, problem = _rows(layout, reg.name)
        if rows is None:
            out.append(problem)
    names = {r.name for r in layout.regions}
    for rule in layout.page_rules if rules is None else rules:
        if rule.region not in names:
            out.append(f"region {rule.region!r}: rule {rule.describe()} names a region the "
                       f"layout does not have ({', '.join(sorted(names))})")
            continue
        rows, _ = _rows(layout, rule.region)
        if rows is None:
            continue
        if _broken(rule, rows):
            k = layout.region(rule.region).tokens_per_row
            extra = f", tokens_per_row={k}" if k != 1 else ""
            out.append(f"region {rule.region!r}: rule {rule.describe()}; got {rows} rows "
                       f"(page_size_tokens={layout.page_size_tokens}{extra})")
    return out


def require_page_rules(layout: LayoutSpec) -> None:
    """Raises `ConfigError` listing every broken page rule of `layout` (the agent's start
    check)."""
    problems = check_page_rules(layout)
    if problems:
        raise ConfigError("page rules: " + "; ".join(problems))


def peer_page_problems(mine: LayoutSpec, theirs: LayoutSpec) -> list[str]:
    """The peer's physical pages against this side's rules (regions the peer lacks are a layout
    mismatch, reported by the layout check, not here)."""
    have = {r.name for r in theirs.regions}
    rules = tuple(r for r in mine.page_rules if r.region in have)
    return [f"peer {line}" for line in check_page_rules(theirs, rules)]
