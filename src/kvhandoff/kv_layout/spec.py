"""What the bytes are: planes, regions and the layout of a rank's KV cache.

Rules:
- A layout is a value, never configuration: both sides of a handoff exchange it and compare its
  hash; `layout_diff` names every differing field so a mismatch is something a person can act on.
- A page of a region holds, for each plane in order, all tokens of that plane
  (`page_nbytes = sum(bytes_per_token) * page_size_tokens`); plane k of token i of page p lives at
  ``p * page_nbytes + plane_offset_k * page_size_tokens + i * plane_bytes_k``. The indexer page
  (all keys, then all scales) is two planes; whole pages copy as bytes, partial pages per plane.
- Layer ids are explicit: nothing assumes a region's layers are contiguous or start at 0.
- Pure: standard library only (no I/O, no clock).
"""

from __future__ import annotations

import hashlib
import json
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


@dataclass(frozen=True, slots=True)
class Plane:
    """One plane of a page: `bytes_per_token` bytes per token; planes follow one another."""

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
class RegionSpec:
    """A cache region: one buffer per layer id, pages of the given planes."""

    name: str
    layer_ids: tuple[int, ...]
    planes: tuple[Plane, ...]
    send_from: SendFrom = SendFrom.START
    tp_split: TPSplit = TPSplit.REPLICATED
    num_heads: int = 1  # KV heads this rank holds (head_sharded regions)

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
        if self.tp_split is TPSplit.HEAD_SHARDED:
            for p in self.planes:
                if p.bytes_per_token % self.num_heads:
                    raise ConfigError(
                        f"region {self.name!r}.planes[{p.name}].bytes_per_token: "
                        f"{p.bytes_per_token} is not a multiple of num_heads={self.num_heads}"
                    )

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token of one layer (all planes)."""
        return sum(p.bytes_per_token for p in self.planes)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def page_nbytes(self, page_size_tokens: int) -> int:
        """Bytes of one page of one layer."""
        return self.bytes_per_token * page_size_tokens

    def plane_offsets(self) -> tuple[int, ...]:
        """Per plane, the sum of the bytes_per_token of the planes before it."""
        out: list[int] = []
        acc = 0
        for p in self.planes:
            out.append(acc)
            acc += p.bytes_per_token
        return tuple(out)


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The KV layout of one rank: page size, dtype label and regions."""

    page_size_tokens: int
    kv_dtype: str
    regions: tuple[RegionSpec, ...]
    model: str = ""
    num_layers: int = field(default=0)  # model layers (0 = max layer id + 1)

    def __post_init__(self) -> None:
        if self.page_size_tokens <= 0:
            raise ConfigError(
                f"page_size_tokens: expected > 0, got {self.page_size_tokens}"
            )
        if not self.regions:
            raise ConfigError("regions: a layout needs at least one region")
        if len({r.name for r in self.regions}) != len(self.regions):
            raise ConfigError("regions: duplicate region names")
        top = max(max(r.layer_ids) for r in self.regions) + 1
        if self.num_layers == 0:
            object.__setattr__(self, "num_layers", top)
        elif self.num_layers < top:
            raise ConfigError(
                f"num_layers: {self.num_layers} is smaller than the highest layer id + 1 ({top})"
            )

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise ConfigError(
            f"region {name!r}: not in layout (regions: {', '.join(r.name for r in self.regions)})"
        )

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over all layers of all regions."""
        return sum(r.bytes_per_token * r.num_layers for r in self.regions)

    def regions_of_layer(self, layer_id: int) -> tuple[RegionSpec, ...]:
        return tuple(r for r in self.regions if layer_id in r.layer_ids)

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-data form (JSON/msgpack friendly)."""
        return {
            "model": self.model,
            "page_size_tokens": self.page_size_tokens,
            "kv_dtype": self.kv_dtype,
            "num_layers": self.num_layers,
            "regions": [
                {
                    "name": r.name,
                    "layer_ids": list(r.layer_ids),
                    "planes": [
                        {"name": p.name, "bytes_per_token": p.bytes_per_token} for p in r.planes
                    ],
                    "send_from": r.send_from.value,
                    "tp_split": r.tp_split.value,
                    "num_heads": r.num_heads,
                }
                for r in self.regions
            ],
        }

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
            layer_ids = _get(rd, "layer_ids", list, where)
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in layer_ids):
                raise ConfigError(f"{where}.layer_ids: expected a list of integers")
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
                    num_heads=int(rd.get("num_heads", 1)),
                )
            )
        return cls(
            page_size_tokens=_get(d, "page_size_tokens", int, "layout"),
            kv_dtype=_get(d, "kv_dtype", str, "layout"),
            regions=tuple(regions),
            model=str(d.get("model", "")),
            num_layers=int(d.get("num_layers", 0)),
        )

    def tp_invariant(self) -> LayoutSpec:
        """What every TP rank of one engine shares: head-sharded regions keep one plane per
        distinct head size (named ``head``) instead of this rank's heads. Ranks of one engine
        register this form, so their hashes agree."""
        regions = []
        for r in self.regions:
            if r.tp_split is TPSplit.HEAD_SHARDED:
                sizes = sorted({p.bytes_per_token for p in r.planes})
                planes = tuple(Plane(f"head{i}" if i else "head", b) for i, b in enumerate(sizes))
                r = RegionSpec(name=r.name, layer_ids=r.layer_ids, planes=planes,
                               send_from=r.send_from, tp_split=r.tp_split, num_heads=1)
            regions.append(r)
        return LayoutSpec(page_size_tokens=self.page_size_tokens, kv_dtype=self.kv_dtype,
                          regions=tuple(regions), model=self.model, num_layers=self.num_layers)

    def with_page_size(self, page_size_tokens: int) -> LayoutSpec:
        """The same layout with another page size."""
        return LayoutSpec(
            page_size_tokens=page_size_tokens,
            kv_dtype=self.kv_dtype,
            regions=self.regions,
            model=self.model,
            num_layers=self.num_layers,
        )


def _get(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}.{key}: missing")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ConfigError(f"{where}.{key}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def layout_hash(spec: LayoutSpec) -> str:
    """`LAYOUT_VERSION` + sha256 of the canonical JSON of the layout (``"v1:<hex>"``)."""
    canon = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{LAYOUT_VERSION}\n{canon}".encode()).hexdigest()
    return f"v{LAYOUT_VERSION}:{digest}"


def layout_diff(
    a: LayoutSpec, b: LayoutSpec, names: tuple[str, str] = ("prefill", "decode")
) -> list[str]:
    """Each field that differs, as ``path: <a-name>=<value> <b-name>=<value>``; [] when equal."""
    out: list[str] = []
    _diff(a.to_dict(), b.to_dict(), "", names, out)
    return out


def _diff(x: Any, y: Any, path: str, names: tuple[str, str], out: list[str]) -> None:
    na, nb = names
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            sub = f"{path}.{k}" if path else k
            if k not in x or k not in y:
                out.append(f"{sub}: {na}={x.get(k, '<absent>')!r} {nb}={y.get(k, '<absent>')!r}")
            else:
                _diff(x[k], y[k], sub, names, out)
        return
    if isinstance(x, list) and isinstance(y, list):
        if path.endswith("regions") or path.endswith("planes"):
            # name-keyed lists: compare by name so one missing region is one line, not many
            xa = {e["name"]: e for e in x if isinstance(e, dict)}
            ya = {e["name"]: e for e in y if isinstance(e, dict)}
            if [e["name"] for e in x] != [e["name"] for e in y]:
                if set(xa) != set(ya):
                    out.append(f"{path}: {na}={sorted(xa)} {nb}={sorted(ya)}")
                else:
                    out.append(f"{path} order: {na}={list(xa)} {nb}={list(ya)}")
            for k in [n for n in xa if n in ya]:
                idx = list(xa).index(k)
                # regions are named by their name alone: "indexer_k.planes[1].bytes_per_token"
                sub = f"{path}[{idx}]" if path.endswith("planes") else k
                _diff(xa[k], ya[k], sub, names, out)
            return
        if x != y:
            out.append(f"{path}: {na}={_short(x)} {nb}={_short(y)}")
        return
    if x != y:
        out.append(f"{path}: {na}={x!r} {nb}={y!r}")


def _short(v: list[Any]) -> str:
    if len(v) <= 12:
        return repr(v)
    return f"[{', '.join(map(repr, v[:6]))}, ... {len(v)} items]"
