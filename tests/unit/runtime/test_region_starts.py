"""Per-region starts (`Receiver.init(..., region_starts=)`): a hybrid model's sliding-window
region moves only from its window on, beside a full-attention region that moves from the
decode's prefix, in one room. Two real agents (in-process transport, control on real ZMQ
sockets), each region with its own page table, as vLLM's KV cache groups give them.

Asserted: every byte of the full region from token 0 and of the window region from its start
lands as the prefill wrote it; the decode's window pages are exactly its table from the start
(nothing before it exists on the decode, nothing else is written); the bytes moved are the
pages of both; the default admission (``early``) accepts a window table shorter than the
sequence; the same works across page sizes (prefill 16, decode 32). Refused before anything
moves: a start of an unknown region, a start past the sequence, and (the old behaviour) a
short window table without its start.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom, TPSplit

from .conftest import SEED, WAIT_S, Pair

FULL_LAYERS, SWA_LAYERS = (2, 5), (0, 1, 3, 4)


def hybrid_layout(page: int) -> LayoutSpec:
    def region(name: str, layers: tuple[int, ...]) -> RegionSpec:
        return RegionSpec(name=name, layer_ids=layers, planes=(Plane("h0", 64), Plane("h1", 64)),
                          send_from=SendFrom.DECODE_PREFIX, tp_split=TPSplit.HEAD_SHARDED,
                          num_heads=2, whole_pages=True)
    return LayoutSpec(page_size_tokens=page, kv_dtype="bf16", model="tiny-hybrid",
                      regions=(region("full", FULL_LAYERS), region("swa", SWA_LAYERS)))


def _handoff(pr: Pair, room: int, seq: int, start: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Prefill: both regions' tables from token 0 (the window region's own pages); decode: the
    full region from 0, the window region from `start` only. Returns the decode's tables and
    the bytes its room moved."""
    p, d = pr.prefill, pr.decode
    ps_p, ps_d = p.layout.page_size_tokens, d.layout.page_size_tokens
    src = {"full": p.pool.alloc(-(-seq // ps_p)), "swa": p.pool.alloc(-(-seq // ps_p))}
    for ri, reg in enumerate(p.layout.regions):
        for lid in reg.layer_ids:
            write_tokens(p.agent.buffers.array(reg.name, lid), p.layout, ri, lid,
                         src[reg.name], 0, seq, SEED)
    s = p.agent.sender(room, pages=src, seq_len=seq)
    dfull = d.pool.alloc(-(-seq // ps_d))
    dswa = d.pool.alloc(-(-seq // ps_d) - start // ps_d)
    rv = d.agent.receiver(room, peer=p.agent.address)
    rv.init({"full": dfull, "swa": dswa}, seq, 0, region_starts={"swa": start})
    for lid in sorted(FULL_LAYERS + SWA_LAYERS):
        s.layer_ready(lid)
    for lid in sorted(FULL_LAYERS + SWA_LAYERS):
        assert rv.wait_for_layer(lid, WAIT_S)
    assert rv.wait_released(WAIT_S) and s.wait_released(WAIT_S)
    return dfull, dswa, int(rv.stats()["bytes"])


@pytest.mark.parametrize(("p_page", "d_page"), [(16, 16), (16, 32)])
def test_window_region_moves_from_its_start_full_region_whole(pair, p_page: int,  # type: ignore[no-untyped-def]
                                                              d_page: int) -> None:
    pr = pair(hybrid_layout(p_page), decode_layout=hybrid_layout(d_page))
    seq, start = 150, 64  # the decode holds the window's pages from token 64 on
    dfull, dswa, moved = _handoff(pr, 7, seq, start)
    d = pr.decode
    bad = 0
    for ri, reg in enumerate(d.layout.regions):
        for lid in reg.layer_ids:
            buf = d.agent.buffers.array(reg.name, lid)
            if reg.name == "full":
                bad += check_tokens(buf, d.layout, ri, lid, dfull, 0, seq, SEED)
            else:
                bad += check_tokens(buf, d.layout, ri, lid, dswa, start, seq, SEED)
    assert bad == 0
    # every decode page not in a table is untouched (the buffers start zeroed)
    used = set(dfull.tolist()) | set(dswa.tolist())
    for reg in d.layout.regions:
        for lid in reg.layer_ids:
            view = d.agent.buffers.array(reg.name, lid).reshape(-1, reg.page_nbytes(d_page))
            others = [i for i in range(len(view)) if i not in used]
            assert not np.any(view[others])
    per_token = 128
    want = (len(FULL_LAYERS) * seq + len(SWA_LAYERS) * (seq - start)) * per_token
    if p_page == d_page:  # whole pages: the partly filled last page moves whole
        pages_full = -(-seq // d_page)
        want = (len(FULL_LAYERS) * pages_full + len(SWA_LAYERS)
                * (pages_full - start // d_page)) * d_page * per_token
    assert moved == want


def test_region_starts_refused_before_anything_moves(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair(hybrid_layout(16))
    d = pr.decode
    full, swa = d.pool.alloc(10), d.pool.alloc(6)
    with pytest.raises(ConfigError, match=r"region_starts\['nope'\]: not a region"):
        d.agent.receiver(1, peer=pr.prefill.agent.address).init(
            {"full": full, "swa": swa}, 150, 0, region_starts={"nope": 64})
    with pytest.raises(ConfigError, match=r"region_starts\['swa'\]: expected 0..150"):
        d.agent.receiver(2, peer=pr.prefill.agent.address).init(
            {"full": full, "swa": swa}, 150, 0, region_starts={"swa": 151})
    # without its start, a window table short of the sequence is refused, as before
    with pytest.raises(ConfigError, match=r"dst_pages\[swa\]: 150 tokens from token 0 need "
                                          r"10 pages of 16, got 6"):
        d.agent.receiver(3, peer=pr.prefill.agent.address).init(
            {"full": full, "swa": swa}, 150, 0)
