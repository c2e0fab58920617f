"""Chunked prefill through two real agents in one process (control on real ZMQ sockets on
127.0.0.1, data over the tcp transport on loopback, and over the in-process one): the prefill
opens the room with its first chunk (`sender(..., chunk_end=)`), adds the others
(`Sender.add_chunk`), and writes each chunk's tokens only when that chunk is computed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvhandoff.engine_sim.pattern import PREFIX_MARKER, write_tokens
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, SendFrom
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

from .conftest import SEED, WAIT_S, Pair, layers_of
from .test_agent_inproc import expected_bytes

MakePair = Callable[..., Pair]

PS = 16
SEQ = 200  # 12.5 pages
PREFIX = 64  # the decode's cached prefix (indexer: suffix-only)


def layout() -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=6, indexer_layer_ids=(0, 3, 5),
                          page_size_tokens=PS).without_page_rules()


def compute(lay: LayoutSpec, agent: TransferAgent, src: np.ndarray, start: int, end: int
            ) -> None:
    """The prefill's forward of tokens [start, end): their bytes appear in the pages."""
    first = start // PS * PS
    for ri, reg in enumerate(lay.regions):
        for lid in reg.layer_ids:
            write_tokens(agent.buffers.array(reg.name, lid), lay, ri, lid, src[first // PS:],
                         first, end, SEED)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_chunked_prefill_lands_byte_exact_each_byte_once(pair: MakePair, transport: str
                                                         ) -> None:
    pr = pair(layout(), num_pages=32, transport=transport)
    p, d = pr.prefill, pr.decode
    lay = p.layout
    src = p.pool.alloc(-(-SEQ // PS))
    dst = d.pool.alloc(-(-SEQ // PS))
    for reg in d.layout.regions:  # the cached prefix's indexer rows: a marker that must stay
        if reg.send_from is SendFrom.DECODE_PREFIX:
            for lid in reg.layer_ids:
                view = d.agent.buffers.array(reg.name, lid).reshape(-1, reg.page_nbytes(PS))
                view[dst[:PREFIX // PS]] = PREFIX_MARKER
    receiver = d.agent.receiver(21, peer=p.agent.address, on_release=d.releases.callback(dst))
    receiver.init(dst, SEQ, PREFIX)
    ends = [64, 130, SEQ]  # 130: a chunk boundary inside a page
    sender = p.agent.sender(21, pages=src[:4], seq_len=SEQ, chunk_end=ends[0],
                            on_release=p.releases.callback(src))
    start = 0
    for i, end in enumerate(ends):
        if i:
            sender.add_chunk(src[-(-start // PS):-(-end // PS)], end)
        compute(lay, p.agent, src, start, end)
        for lid in layers_of(lay):
            sender.layer_ready(lid)
        if end < SEQ:  # nothing lands before the last chunk's layers did
            assert not receiver._v.landed and receiver.poll() is not KVPoll.Success
        start = end
    assert receiver.wait(WAIT_S) is KVPoll.Success, receiver.failure
    assert sender.wait(WAIT_S) is KVPoll.Success, sender.failure
    assert receiver.wait_released(WAIT_S) and sender.wait_released(WAIT_S)
    bad, touched = pr.verify(dst, SEQ, PREFIX)
    assert bad == 0, "landed bytes differ from the prefill's"
    assert touched == 0, "the handoff wrote into decode's cached-prefix indexer pages"
    # each byte once: main KV and the indexer from the page-aligned prefix on
    want = expected_bytes(pr, SEQ, PREFIX)  # every region from where it is sent
    assert receiver.stats()["bytes"] == want and sender.stats()["bytes"] == want
    # every (layer, region) verified at least once; chunks added before the decode's request
    # reached the prefill travel as one unit (one checksum each), so no more can be required
    assert receiver.stats()["checksums_verified"] >= sum(len(r.layer_ids) for r in lay.regions)
    assert d.releases.calls == {21: 1} and p.releases.calls == {21: 1}


def test_add_chunk_is_refused_with_the_reason(pair: MakePair) -> None:
    pr = pair(layout(), num_pages=32)
    p = pr.prefill
    src = p.pool.alloc(-(-SEQ // PS))
    plain = p.agent.sender(30, pages=src, seq_len=SEQ)
    with pytest.raises(ConfigError, match="not opened chunked"):
        plain.add_chunk(src[:1], SEQ)
    plain.abort("test done")
    s = p.agent.sender(31, pages=src[:4], seq_len=SEQ, chunk_end=64)
    s.layer_ready(0)
    with pytest.raises(ConfigError, match=r"layers \[1, 2, 3, 4, 5\] of the previous chunk"):
        s.add_chunk(src[4:], SEQ)
    for lid in range(1, 6):
        s.layer_ready(lid)
    with pytest.raises(ConfigError, match="chunk_end: expected 65..200, got 64"):
        s.add_chunk(src[4:], 64)
    with pytest.raises(ConfigError, match=r"the last chunk leaves 12 of the 13 pages"):
        s.add_chunk(src[4:12], SEQ)
    with pytest.raises(ConfigError, match=r"page ids must be in \[0, 32\)"):
        s.add_chunk(np.array([40]), 100)
    s.add_chunk(src[4:], SEQ)  # the room goes on
    s.abort("test done")
