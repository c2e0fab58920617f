"""How two layouts are compared: a layout's identity (`layout_hash`, what a handshake exchanges)
and its differences (`layout_diff`, every differing field named with both sides' values, so a
mismatch is something a person can act on; `layout_compat_diff`, the differences that make two
layouts unable to hand off). Pure: standard library only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvhandoff.kv_layout.spec import LAYOUT_VERSION, LayoutSpec


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


def layout_compat_diff(mine: LayoutSpec, theirs: LayoutSpec,
                       names: tuple[str, str] = ("prefill", "decode")) -> list[str]:
    """`layout_diff` of the `compat_form`s: what makes two layouts unable to hand off."""
    return layout_diff(mine.compat_form(), theirs.compat_form(), names)
