"""One side of a two-process handoff with the layouts of issue 17 (run by
`test_layouts_procs.py`, not collected by pytest).

``python tests/hetero/layouts_child.py prefill|decode '<json>'``: builds the layout from
``config["layout"]`` (`LayoutSpec.to_dict` form), its buffers (packed rows as one numpy buffer
per row, per-layer regions one per live layer, 0-row layers none), a real `TransferAgent` over
the `tcp` transport on 127.0.0.1, and moves one room. Prints one JSON object per line.

Memory starts as 0xFF. The prefill writes, through `LayoutSpec.address` of its own layout, the
pattern ``(row * 131 + byte * 7 + layer * 17 + salt(region, plane)) % 251`` (< 251) of every
row; the decode marks its cached-prefix pages of suffix-only regions with 0xFE, and afterwards
checks every row against the pattern at ITS addresses, that the marks are intact, and that the
number of bytes written anywhere in its memory is exactly what should land (nothing strays into
pads, 0-row layers, other layers or draft regions).
"""

from __future__ import annotations

import json
import sys
import zlib
from typing import Any

import numpy as np

from kvhandoff.kv_layout import LayoutSpec, SendFrom, page_aligned
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent

FILL, MARK = 0xFF, 0xFE


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"event": kind, **fields}), flush=True)


def salt(region: str, plane: str) -> int:
    return zlib.crc32(f"{region}/{plane}".encode()) % 200


def buffers(spec: LayoutSpec, pages: int) -> dict[str, Any]:
    ps = spec.page_size_tokens
    out: dict[str, Any] = {row.name: np.full(spec.region(row.regions[0]).page_stride(ps) * pages,
                                             FILL, dtype=np.uint8) for row in spec.rows}
    for reg in spec.regions:
        if reg.placement is None:
            out[reg.name] = {lid: np.full(0 if reg.is_empty(lid) else reg.page_nbytes(ps) * pages,
                                          FILL, dtype=np.uint8) for lid in reg.layer_ids}
    return out


def memories(raw: dict[str, Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for v in raw.values():
        out.extend(v.values() if isinstance(v, dict) else [v])
    return out


def positions(spec: LayoutSpec, region: str, table: np.ndarray, r0: int, r1: int,
              plane: int) -> np.ndarray:
    """Offsets in the (region, layer) view of rows [r0, r1) of one plane: (rows, bytes)."""
    reg = spec.region(region)
    ps = spec.page_size_tokens
    rpp, stride = reg.rows_per_page(ps), reg.page_stride(ps)
    b = reg.planes[plane].bytes_per_token
    rows = np.arange(r0, r1, dtype=np.int64)
    base = (table[rows // rpp] * stride + reg.plane_offsets()[plane] * rpp + (rows % rpp) * b)
    out: np.ndarray = base[:, None] + np.arange(b, dtype=np.int64)[None, :]
    return out


def pattern(region: str, plane: str, layer: int, r0: int, r1: int, b: int) -> np.ndarray:
    rows = np.arange(r0, r1, dtype=np.int64)[:, None]
    out: np.ndarray = ((rows * 131 + np.arange(b)[None, :] * 7 + layer * 17
                        + salt(region, plane)) % 251).astype(np.uint8)
    return out


def first_token(reg: Any, prefix: int, ps: int) -> int:
    return page_aligned(prefix, ps) if reg.send_from is SendFrom.DECODE_PREFIX else 0


def main() -> int:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    spec = LayoutSpec.from_dict(cfg["layout"])
    ps, seq, prefix = spec.page_size_tokens, int(cfg["seq_len"]), int(cfg.get("prefix", 0))
    npages = -(-seq // ps)
    pool = npages + 3
    rng = np.random.default_rng(cfg.get("seed", 0) + (role == "decode"))
    table = rng.permutation(pool)[:npages].astype(np.int64)
    raw = buffers(spec, pool)
    settings = Settings(transport="tcp", heartbeat_interval_s=1.0, bootstrap_timeout_s=60.0)
    with TransferAgent(role, spec, raw, settings) as agent:
        emit("ready", address=agent.address)
        if role == "prefill":
            for reg in spec.regions:
                for lid in reg.live_layer_ids:
                    view = agent.buffers.array(reg.name, lid)
                    for j, pl in enumerate(reg.planes):
                        r1 = reg.rows_for(seq)
                        view[positions(spec, reg.name, table, 0, r1, j)] = pattern(
                            reg.name, pl.name, lid, 0, r1, pl.bytes_per_token)
            s = agent.sender(1, pages=table, seq_len=seq)
            for lid in sorted({lid for reg in spec.regions for lid in reg.layer_ids}):
                s.layer_ready(lid)
            state = s.wait(60)
            emit("done", state=state.name, failure=s.failure, stats=s.stats())
            return 0
        marks = 0
        for reg in spec.regions:
            held = first_token(reg, prefix, ps) // ps
            for lid in reg.live_layer_ids:
                view = agent.buffers.array(reg.name, lid)
                n = reg.page_nbytes(ps)
                for p in table[:held]:
                    start = int(p) * reg.page_stride(ps)
                    view[start:start + n] = MARK
                    marks += n
        rv = agent.receiver(1, peer=cfg["peer"])
        rv.init(table, seq, prefix)
        state = rv.wait(60)
        bad = expected = 0
        if state.name == "Success":
            for reg in spec.regions:
                r0 = first_token(reg, prefix, ps) // reg.tokens_per_row
                r1 = reg.rows_for(seq)
                for lid in reg.live_layer_ids:
                    view = agent.buffers.array(reg.name, lid)
                    for j, pl in enumerate(reg.planes):
                        got = view[positions(spec, reg.name, table, r0, r1, j)]
                        want = pattern(reg.name, pl.name, lid, r0, r1, pl.bytes_per_token)
                        bad += int(np.count_nonzero(got != want))
                        expected += int(want.size)
        mem = memories(raw)
        written = sum(int(np.count_nonzero((m != FILL) & (m != MARK))) for m in mem)
        marks_left = sum(int(np.count_nonzero(m == MARK)) for m in mem)
        emit("done", state=state.name, failure=rv.failure, stats=rv.stats(), bad=bad,
             expected=expected, written=written, marks=marks, marks_left=marks_left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
