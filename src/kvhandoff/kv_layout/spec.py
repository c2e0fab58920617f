"""What the bytes are: planes, regions, packed rows and the layout of a rank's KV cache.

Rules:
- A layout is a value, never configuration: both sides of a handoff exchange it and compare its
  hash; `compare.layout_diff` names every differing field so a mismatch is something a person
  can act on.
- A page of a region holds, for each plane in order, all rows of that plane
  (`page_nbytes = sum(bytes_per_token) * rows_per_page`); plane k of row i of page p lives at
  ``p * page_stride + plane_offset_k * rows_per_page + i * plane_bytes_k`` of the layer's bytes.
  A row is one token unless the region compresses (`tokens_per_row`, the indexer's
  ``index_kpool``: one row holds the state of `tokens_per_row` tokens, a page holds
  ``page_size_tokens // tokens_per_row`` rows and covers the same tokens as a main-KV page).
- Memory: by default each (region, layer) is its own buffer (``page_stride == page_nbytes``).
  A `PackedRow` puts several regions' layers into ONE buffer whose block p is a full row of
  every member layer's page p (vLLM's BLHNC rows): page p of layer L lives at
  ``p * row_stride + layer_offset[L]``. `LayoutSpec.address` is that mapping.
- Per-layer item lengths: a region's `empty_layers` hold 0 rows on this rank (skip-topk
  placeholders, CP layer split); their item length is 0, they own no memory and move nothing.
- Whole pages (`RegionSpec.whole_pages`): where both sides use one page size, such a region moves
  whole pages, the partly filled last page included, so what moves is right whatever the kernel
  keeps inside a page; where page sizes differ it pairs token by token through its planes.
- Draft (MTP) regions are kept apart: their layer ids follow the target model's `num_layers`,
  and no layer id is both a target and a draft layer.
- Kernel page rules (`PageRule`) are local constraints of this engine's kernels: they are NOT
  part of the layout's hash (see `kv_layout.rules`).
- Layer ids are explicit: nothing assumes a region's layers are contiguous or start at 0.
- Pure: standard library only (no I/O, no clock). Fields added after version 1 are written by
  `to_dict` only when they differ from their default, so older layouts keep their hash.

Why this file is a little over 600 lines: it is one data model (planes, regions, packed rows
and the layout that holds them), each class with its own validation and (de)serialisation, which
must change together when a field is added; how two layouts compare is `compare`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvhandoff.errors import ConfigError

LAYOUT_VERSION = 1


class SendFrom(str, Enum):
    """Where a region's transfer starts in the sequence."""

    START = "start"  # whole sequence (main KV)
    DECODE_PREFIX = "decode_prefix"  # suffix only: decode holds its cached prefix already


class TPSplit(str, Enum):
    """How a region is split across tensor-parallel ranks."""

    REPLICATED = "replicated"  # every TP rank holds all of it (MLA latent, indexer K)
    HEAD_SHARDED = "head_sharded"  # each TP rank holds a slice of the KV heads (GQA)


class RuleKind(str, Enum):
    """How a kernel constrains the physical page of a region (in rows)."""

    EQ = "eq"  # the page must hold exactly `rows` rows (FlashMLA: 64)
    MULTIPLE_OF = "multiple_of"  # the page must hold a multiple of `rows` rows


@dataclass(frozen=True, slots=True)
class PageRule:
    """A kernel's hard rule on the physical page of one region (rows per page)."""

    region: str
    kernel: str  # who imposes it, e.g. "FlashMLA", "DSA indexer paged-MQA"
    kind: RuleKind
    rows: int

    def __post_init__(self) -> None:
        if not self.region:
            raise ConfigError("page_rule.region: must not be empty")
        if not self.kernel:
            raise ConfigError(f"page_rule[{self.region}].kernel: must not be empty")
        if self.rows <= 0:
            raise ConfigError(f"page_rule[{self.region}].rows: expected > 0, got {self.rows}")

    def describe(self) -> str:
        op = "==" if self.kind is RuleKind.EQ else "a multiple of"
        return f"{self.kernel}: page {op} {self.rows} rows"


@dataclass(frozen=True, slots=True)
class Plane:
    """One plane of a page: `bytes_per_token` bytes per row; planes follow one another."""

    name: str
    bytes_per_token: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("plane.name: must not be empty")
        if self.bytes_per_token <= 0:
            raise ConfigError(
                f"plane {self.name!r}.bytes_per_token: expected > 0, got {self.bytes_per_token}"
            )


@dataclass(frozen=True, slots=True)
class PackedRow:
    """One buffer holding, per block, the pages of every live layer of `regions` in order
    (region by region as listed, each region's layers ascending, 0-row layers skipped; with
    `layer_major` layer by layer ascending, the listed regions' pages of each layer in turn),
    then `pad_bytes` of padding. The block stride is the sum of the member pages plus the
    pad."""

    name: str
    regions: tuple[str, ...]
    pad_bytes: int = 0
    layer_major: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("row.name: must not be empty")
        if not self.regions:
            raise ConfigError(f"row {self.name!r}.regions: must name at least one region")
        if len(set(self.regions)) != len(self.regions):
            raise ConfigError(f"row {self.name!r}.regions: duplicate region names")
        if self.pad_bytes < 0:
            raise ConfigError(f"row {self.name!r}.pad_bytes: expected >= 0, got {self.pad_bytes}")


@dataclass(frozen=True, slots=True)
class _Member:
    region: str
    layer: int
    bytes_per_row: int
    tokens_per_row: int

    def page_nbytes(self, page_size_tokens: int) -> int:
        return self.bytes_per_row * (page_size_tokens // self.tokens_per_row)


@dataclass(frozen=True, slots=True)
class RowPlacement:
    """Where a region lives inside a packed row (set by `LayoutSpec`, derived, not serialized)."""

    row: str
    members: tuple[_Member, ...]
    pad_bytes: int

    def stride(self, page_size_tokens: int) -> int:
        return sum(m.page_nbytes(page_size_tokens) for m in self.members) + self.pad_bytes

    def layer_offset(self, region: str, layer: int, page_size_tokens: int) -> int:
        off = 0
        for m in self.members:
            if m.region == region and m.layer == layer:
                return off
            off += m.page_nbytes(page_size_tokens)
        raise ConfigError(f"row {self.row!r}: layer {layer} of region {region!r} is not a member")


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """A cache region: one buffer per layer id (or a share of a packed row), pages of the given
    planes."""

    name: str
    layer_ids: tuple[int, ...]
    planes: tuple[Plane, ...]
    send_from: SendFrom = SendFrom.START
    tp_split: TPSplit = TPSplit.REPLICATED
    num_heads: int = 1  # KV heads this rank holds (head_sharded regions)
    tokens_per_row: int = 1  # index_kpool: tokens whose state one row holds
    empty_layers: tuple[int, ...] = ()  # layers holding 0 rows on this rank (item length 0)
    draft: bool = False  # a draft (MTP) model's region, layer ids after the target model's
    # equal page sizes on both sides: move whole pages (the last one too, partly filled)
    whole_pages: bool = False
    # token-major pages: a row holds every plane in order (row i of page p, plane k at
    # ``p * page_stride + i * bytes_per_row + plane_offset_k``), as SGLang's MHA pools keep a
    # token's heads side by side; default plane-major (each plane's rows together)
    token_major: bool = False
    placement: RowPlacement | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("region.name: must not be empty")
        if not self.layer_ids:
            raise ConfigError(f"region {self.name!r}.layer_ids: must name at least one layer")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"region {self.name!r}.layer_ids: duplicate layer ids")
        if any(lid < 0 for lid in self.layer_ids):
            raise ConfigError(f"region {self.name!r}.layer_ids: ids must be >= 0")
        if list(self.layer_ids) != sorted(self.layer_ids):
            raise ConfigError(f"region {self.name!r}.layer_ids: must be sorted ascending")
        if not self.planes:
            raise ConfigError(f"region {self.name!r}.planes: must hold at least one plane")
        if len({p.name for p in self.planes}) != len(self.planes):
            raise ConfigError(f"region {self.name!r}.planes: duplicate plane names")
        if self.num_heads <= 0:
            raise ConfigError(f"region {self.name!r}.num_heads: expected > 0, got {self.num_heads}")
        if self.tokens_per_row <= 0:
            raise ConfigError(f"region {self.name!r}.tokens_per_row: expected > 0, got "
                              f"{self.tokens_per_row}")
        extra = sorted(set(self.empty_layers) - set(self.layer_ids))
        if extra:
            raise ConfigError(f"region {self.name!r}.empty_layers: {extra} are not layers of "
                              "the region")
        if list(self.empty_layers) != sorted(set(self.empty_layers)):
            raise ConfigError(f"region {self.name!r}.empty_layers: must be sorted ascending, "
                              "without duplicates")
        if self.token_major and self.tokens_per_row != 1:
            raise ConfigError(f"region {self.name!r}.token_major: a token-major region holds "
                              f"one token a row, got tokens_per_row={self.tokens_per_row}")
        if self.tp_split is TPSplit.HEAD_SHARDED and len(self.planes) == 1:
            # one plane holding every local head (token-major pages): heads slice it evenly
            for p in self.planes:
                if p.bytes_per_token % self.num_heads:
                    raise ConfigError(
                        f"region {self.name!r}.planes[{p.name}].bytes_per_token: "
                        f"{p.bytes_per_token} is not a multiple of num_heads={self.num_heads}"
                    )

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one row of one layer (all planes); a row is one token unless
        `tokens_per_row` > 1."""
        return sum(p.bytes_per_token for p in self.planes)

    @property
    def bytes_per_row(self) -> int:
        return self.bytes_per_token

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def live_layer_ids(self) -> tuple[int, ...]:
        """The layers holding rows on this rank (item length > 0)."""
        if not self.empty_layers:
            return self.layer_ids
        empty = set(self.empty_layers)
        return tuple(lid for lid in self.layer_ids if lid not in empty)

    @property
    def num_live_layers(self) -> int:
        return len(self.layer_ids) - len(self.empty_layers)

    def is_empty(self, layer_id: int) -> bool:
        """Whether `layer_id` holds 0 rows here (it then moves nothing)."""
        return layer_id in self.empty_layers

    def rows_per_page(self, page_size_tokens: int) -> int:
        """Rows of one physical page (tokens per page when a row is one token)."""
        if page_size_tokens <= 0 or page_size_tokens % self.tokens_per_row:
            raise ConfigError(
                f"region {self.name!r}: page_size_tokens={page_size_tokens} is not a positive "
                f"multiple of tokens_per_row={self.tokens_per_row}"
            )
        return page_size_tokens // self.tokens_per_row

    def rows_for(self, n_tokens: int) -> int:
        """Rows holding `n_tokens` tokens from a row boundary (a partial last row counts)."""
        return -(-n_tokens // self.tokens_per_row)

    def nbytes_for(self, n_tokens: int) -> int:
        """Bytes of `n_tokens` tokens of one layer."""
        return self.rows_for(n_tokens) * self.bytes_per_token

    def page_nbytes(self, page_size_tokens: int) -> int:
        """Bytes of one page of one layer (its item length)."""
        return self.bytes_per_token * self.rows_per_page(page_size_tokens)

    def item_len(self, layer_id: int, page_size_tokens: int) -> int:
        """Bytes of one page of `layer_id` here: 0 for an empty layer."""
        if layer_id not in self.layer_ids:
            raise ConfigError(f"region {self.name!r}: {layer_id} is not one of its layers")
        return 0 if layer_id in self.empty_layers else self.page_nbytes(page_size_tokens)

    def page_stride(self, page_size_tokens: int) -> int:
        """Bytes from page p to page p+1 of one layer: the item length, or the block stride of
        the packed row the region lives in."""
        if self.placement is not None:
            return self.placement.stride(page_size_tokens)
        return self.page_nbytes(page_size_tokens)

    def plane_offsets(self) -> tuple[int, ...]:
        """Per plane, the sum of the bytes_per_token of the planes before it."""
        out: list[int] = []
        acc = 0
        for p in self.planes:
            out.append(acc)
            acc += p.bytes_per_token
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "layer_ids": list(self.layer_ids),
            "planes": [{"name": p.name, "bytes_per_token": p.bytes_per_token}
                       for p in self.planes],
            "send_from": self.send_from.value,
            "tp_split": self.tp_split.value,
            "num_heads": self.num_heads,
        }
        # fields after version 1: written only when not the default (older hashes stay)
        if self.tokens_per_row != 1:
            d["tokens_per_row"] = self.tokens_per_row
        if self.empty_layers:
            d["empty_layers"] = list(self.empty_layers)
        if self.draft:
            d["draft"] = True
        if self.whole_pages:
            d["whole_pages"] = True
        if self.token_major:
            d["token_major"] = True
        return d


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The KV layout of one rank: page size, dtype label, regions and packed rows."""

    page_size_tokens: int
    kv_dtype: str
    regions: tuple[RegionSpec, ...]
    model: str = ""
    num_layers: int = field(default=0)  # target-model layers (0 = max target layer id + 1)
    rows: tuple[PackedRow, ...] = ()
    page_rules: tuple[PageRule, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.page_size_tokens <= 0:
            raise ConfigError(
                f"page_size_tokens: expected > 0, got {self.page_size_tokens}"
            )
        if not self.regions:
            raise ConfigError("regions: a layout needs at least one region")
        if len({r.name for r in self.regions}) != len(self.regions):
            raise ConfigError("regions: duplicate region names")
        target = [r for r in self.regions if not r.draft]
        if not target:
            raise ConfigError("regions: a layout needs at least one target-model (non-draft) "
                              "region")
        top = max(max(r.layer_ids) for r in target) + 1
        if self.num_layers == 0:
            object.__setattr__(self, "num_layers", top)
        elif self.num_layers < top:
            raise ConfigError(
                f"num_layers: {self.num_layers} is smaller than the highest layer id + 1 ({top})"
            )
        target_ids = {lid for r in target for lid in r.layer_ids}
        for r in self.regions:
            if not r.draft:
                continue
            low = [lid for lid in r.layer_ids if lid < self.num_layers or lid in target_ids]
            if low:
                raise ConfigError(
                    f"region {r.name!r}.layer_ids: draft layers {low} collide with the target "
                    f"model's layers (draft layer ids start at num_layers={self.num_layers})"
                )
        self._place_rows()

    def _place_rows(self) -> None:
        names = {r.name for r in self.regions}
        seen: dict[str, str] = {}
        row_names: set[str] = set()
        placed: dict[str, RowPlacement] = {}
        by_name = {r.name: r for r in self.regions}
        for row in self.rows:
            if row.name in row_names:
                raise ConfigError(f"rows: duplicate row name {row.name!r}")
            if row.name in names:
                raise ConfigError(f"rows[{row.name}].name: clashes with a region name (buffers "
                                  "are keyed by region or row name)")
            row_names.add(row.name)
            members: list[_Member] = []
            for rn in row.regions:
                if rn not in names:
                    raise ConfigError(f"rows[{row.name}].regions: {rn!r} is not a region of the "
                                      "layout")
                if rn in seen:
                    raise ConfigError(f"rows[{row.name}].regions: {rn!r} is already in row "
                                      f"{seen[rn]!r}")
                seen[rn] = row.name
                reg = by_name[rn]
                members.extend(_Member(rn, lid, reg.bytes_per_token, reg.tokens_per_row)
                               for lid in reg.live_layer_ids)
            if row.layer_major:  # stable: the listed region order within a layer
                members.sort(key=lambda m: m.layer)
            pl = RowPlacement(row=row.name, members=tuple(members), pad_bytes=row.pad_bytes)
            for rn in row.regions:
                placed[rn] = pl
        regions = tuple(
            r if placed.get(r.name) == r.placement and r.placement is None
            else dataclasses.replace(r, placement=placed.get(r.name))
            for r in self.regions
        )
        object.__setattr__(self, "regions", regions)

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise ConfigError(
            f"region {name!r}: not in layout (regions: {', '.join(r.name for r in self.regions)})"
        )

    def row_of(self, region: str) -> PackedRow | None:
        """The packed row `region` lives in, or None (one buffer per layer)."""
        for row in self.rows:
            if region in row.regions:
                return row
        return None

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over all live layers of all regions (compressed regions count
        their rows per token, rounded down; `bytes_per_page` is exact)."""
        return sum(r.bytes_per_token * r.num_live_layers // r.tokens_per_row
                   for r in self.regions)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page (block) over all live layers of all regions, without row padding:
        the allocation unit of a request (a vLLM block, `page_size` SGLang cells)."""
        ps = self.page_size_tokens
        return sum(r.page_nbytes(ps) * r.num_live_layers for r in self.regions)

    @property
    def draft_layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted({lid for r in self.regions if r.draft for lid in r.layer_ids}))

    def regions_of_layer(self, layer_id: int) -> tuple[RegionSpec, ...]:
        """The regions holding rows of `layer_id` (a region where it is empty is left out:
        a 0-row layer moves nothing)."""
        return tuple(r for r in self.regions
                     if layer_id in r.layer_ids and layer_id not in r.empty_layers)

    def layer_offset(self, region: str, layer_id: int) -> int:
        """Byte offset of page 0 of `layer_id` in its buffer: 0 for a per-layer buffer, the
        member offset inside the block for a packed row."""
        reg = self.region(region)
        if reg.is_empty(layer_id):
            raise ConfigError(f"region {region!r}: layer {layer_id} holds 0 rows here")
        if reg.placement is None:
            if layer_id not in reg.layer_ids:
                raise ConfigError(f"region {region!r}: {layer_id} is not one of its layers")
            return 0
        return reg.placement.layer_offset(region, layer_id, self.page_size_tokens)

    def address(self, region: str, layer_id: int, page: int) -> tuple[str, int]:
        """Where page `page` of (`region`, `layer_id`) starts: (buffer key, byte offset). The
        buffer key is the region's name, or its packed row's name (one buffer per row); a
        per-layer buffer is keyed by the region name and the layer."""
        if page < 0:
            raise ConfigError(f"page: expected >= 0, got {page}")
        reg = self.region(region)
        off = self.layer_offset(region, layer_id)
        key = reg.placement.row if reg.placement is not None else region
        return key, off + page * reg.page_stride(self.page_size_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-data form (JSON/msgpack friendly). Page rules are local and left out."""
        d: dict[str, Any] = {
            "model": self.model,
            "page_size_tokens": self.page_size_tokens,
            "kv_dtype": self.kv_dtype,
            "num_layers": self.num_layers,
            "regions": [r.to_dict() for r in self.regions],
        }
        if self.rows:
            d["rows"] = [{"name": w.name, "regions": list(w.regions), "pad_bytes": w.pad_bytes,
                          **({"layer_major": True} if w.layer_major else {})}
                         for w in self.rows]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> LayoutSpec:
        """Build from `to_dict()` output; a bad field raises `ConfigError` naming it."""
        if not isinstance(d, dict):
            raise ConfigError(f"layout: expected an object, got {type(d).__name__}")
        regions_raw = _get(d, "regions", list, "layout")
        regions = []
        for i, rd in enumerate(regions_raw):
            where = f"regions[{i}]"
            if not isinstance(rd, dict):
                raise ConfigError(f"{where}: expected an object, got {type(rd).__name__}")
            planes = []
            for j, pd in enumerate(_get(rd, "planes", list, where)):
                pw = f"{where}.planes[{j}]"
                if not isinstance(pd, dict):
                    raise ConfigError(f"{pw}: expected an object, got {type(pd).__name__}")
                planes.append(
                    Plane(_get(pd, "name", str, pw), _get(pd, "bytes_per_token", int, pw))
                )
            layer_ids = _int_list(_get(rd, "layer_ids", list, where), f"{where}.layer_ids")
            empty = _int_list(_opt(rd, "empty_layers", list, where, []), f"{where}.empty_layers")
            try:
                send_from = SendFrom(rd.get("send_from", "start"))
                tp_split = TPSplit(rd.get("tp_split", "replicated"))
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e
            regions.append(
                RegionSpec(
                    name=_get(rd, "name", str, where),
                    layer_ids=tuple(layer_ids),
                    planes=tuple(planes),
                    send_from=send_from,
                    tp_split=tp_split,
                    num_heads=_opt(rd, "num_heads", int, where, 1),
                    tokens_per_row=_opt(rd, "tokens_per_row", int, where, 1),
                    empty_layers=tuple(empty),
                    draft=_opt(rd, "draft", bool, where, False),
                    whole_pages=_opt(rd, "whole_pages", bool, where, False),
                    token_major=_opt(rd, "token_major", bool, where, False),
                )
            )
        rows = []
        for i, wd in enumerate(_opt(d, "rows", list, "layout", [])):
            where = f"rows[{i}]"
            if not isinstance(wd, dict):
                raise ConfigError(f"{where}: expected an object, got {type(wd).__name__}")
            names = _get(wd, "regions", list, where)
            if not all(isinstance(x, str) for x in names):
                raise ConfigError(f"{where}.regions: expected a list of region names")
            rows.append(PackedRow(name=_get(wd, "name", str, where), regions=tuple(names),
                                  pad_bytes=_opt(wd, "pad_bytes", int, where, 0),
                                  layer_major=_opt(wd, "layer_major", bool, where, False)))
        return cls(
            page_size_tokens=_get(d, "page_size_tokens", int, "layout"),
            kv_dtype=_get(d, "kv_dtype", str, "layout"),
            regions=tuple(regions),
            model=str(d.get("model", "")),
            num_layers=_opt(d, "num_layers", int, "layout", 0),
            rows=tuple(rows),
        )

    def _replace(self, **changes: Any) -> LayoutSpec:
        fields: dict[str, Any] = {
            "page_size_tokens": self.page_size_tokens, "kv_dtype": self.kv_dtype,
            "regions": tuple(dataclasses.replace(r, placement=None) for r in self.regions),
            "model": self.model, "num_layers": self.num_layers, "rows": self.rows,
            "page_rules": self.page_rules,
        }
        fields.update(changes)
        return LayoutSpec(**fields)

    def tp_invariant(self) -> LayoutSpec:
        """What every TP rank of one engine shares: head-sharded regions keep one plane per
        distinct head size (named ``head``) instead of this rank's heads. Ranks of one engine
        register this form, so their hashes agree. Packed rows stay: a peer needs them to
        know where this side's bytes are."""
        regions = []
        for r in self.regions:
            if r.tp_split is TPSplit.HEAD_SHARDED:
                sizes = sorted({p.bytes_per_token for p in r.planes})
                planes = tuple(Plane(f"head{i}" if i else "head", b) for i, b in enumerate(sizes))
                r = dataclasses.replace(r, planes=planes, num_heads=1)
            regions.append(dataclasses.replace(r, placement=None))
        return self._replace(regions=tuple(regions))

    def with_page_size(self, page_size_tokens: int) -> LayoutSpec:
        """The same layout with another page size."""
        return self._replace(page_size_tokens=page_size_tokens)

    def with_page_rules(self, *rules: PageRule) -> LayoutSpec:
        """The same layout with these kernel page rules (none: no rule, any page size)."""
        return self._replace(page_rules=tuple(rules))

    def without_page_rules(self) -> LayoutSpec:
        return self._replace(page_rules=())

    def unpacked(self) -> LayoutSpec:
        """The same layout with one buffer per (region, layer): no packed rows."""
        return self._replace(rows=())

    def compat_form(self) -> LayoutSpec:
        """What two sides of a handoff must agree on: the layout with page size, TP rank and
        memory organisation (packed rows, token- or plane-major pages) factored out. The span
        builder pairs pages token by token, planes by name, and addresses each side's memory
        through its own layout."""
        out = self.with_page_size(1).tp_invariant().unpacked()
        if any(r.token_major for r in out.regions):
            out = out._replace(regions=tuple(dataclasses.replace(r, token_major=False)
                                             for r in out.regions))
        return out


def _int_list(v: list[Any], where: str) -> list[int]:
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{where}: expected a list of integers")
    return v


def _get(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}.{key}: missing")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ConfigError(f"{where}.{key}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _opt(d: dict[str, Any], key: str, typ: type, where: str, default: Any) -> Any:
    return _get(d, key, typ, where) if key in d else default


def infer_packed_row(layout: LayoutSpec, name: str, regions: tuple[str, ...], *,
                     offsets: dict[tuple[str, int], int], block_stride: int) -> PackedRow:
    """The `PackedRow` of `regions` whose member offsets inside a block and block stride are the
    observed ones (an engine's per-layer tensors that are views into one block-outermost
    tensor: ``offsets[(region, layer)] = layer.data_ptr() - base``). Tries every order of the
    regions, region-major and layer-major; the pad is what the stride leaves.

    Raises:
        ConfigError: a live member layer without an offset, a stride smaller than the members,
            or offsets no packing explains (the message shows the first differing member of
            the region-major reading).
    """
    import itertools

    if len(regions) > 4:
        raise ConfigError(f"rows[{name}].regions: at most 4 regions can be inferred")
    base = layout._replace(rows=tuple(w for w in layout.rows
                                      if not set(w.regions) & set(regions)))
    ps = layout.page_size_tokens
    members = [(rn, lid) for rn in regions for lid in base.region(rn).live_layer_ids]
    missing = [m for m in members if m not in offsets]
    if missing:
        raise ConfigError(f"rows[{name}]: no offset for {missing[:4]}")
    used = sum(base.region(rn).page_nbytes(ps) for rn, _ in members)
    if block_stride < used:
        raise ConfigError(f"rows[{name}].block_stride: {block_stride} is smaller than the "
                          f"{used} bytes of its member pages")
    first_miss = ""
    for order in itertools.permutations(regions):
        for layer_major in (False, True):
            row = PackedRow(name, tuple(order), block_stride - used, layer_major)
            trial = base._replace(rows=(*base.rows, row))
            bad = [(m, offsets[m], trial.layer_offset(*m)) for m in members
                   if trial.layer_offset(*m) != offsets[m]]
            if not bad:
                return row
            if not first_miss:
                (rn, lid), got, want = bad[0]
                first_miss = (f"{rn} layer {lid} is at {got}, a region-major row of "
                              f"{list(regions)} puts it at {want}")
    raise ConfigError(f"rows[{name}]: the observed offsets match no packing of "
                      f"{list(regions)} ({first_miss})")
