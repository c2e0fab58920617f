"""Chunked prefill in the transfer session, without threads or sockets: two `TransferSession`s
wired in memory (`kvhandoff.testing.memory.MemoryWire`). The prefill's pages come in chunks
(`events.AddChunk`); each chunk's tokens are written into the source buffers only when that
chunk is marked ready, so a byte read before its chunk was written would land wrong.

Room ids double as the engine's tokens (the session compares tokens by identity)."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import FailureKind
from kvhandoff.kv_layout import LayoutSpec, SendFrom
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side


@pytest.fixture(autouse=True, params=[False, True], ids=["two-sided", "one-sided"])
def one_sided(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each test runs on both data paths: sends and receives, and one-sided writes (the
    prefill writes into the decode's pages, the decode posts nothing)."""
    monkeypatch.setattr(MemoryWire, "writes", request.param)
    return bool(request.param)

PS = 16
SEQ = 40  # 2.5 pages
DST_OFF = 5  # destination page ids are the source ones + 5


def layout() -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=4, indexer_layer_ids=(1, 3),
                          page_size_tokens=PS).without_page_rules()


def pair() -> tuple[MemoryWire, Side, Side]:
    w = MemoryWire()
    s = Settings(transport="inproc", heartbeat_interval_s=0.5, lease_s=5.0)
    return (w, w.add("prefill:1", Role.PREFILL, layout(), settings=s),
            w.add("decode:1", Role.DECODE, layout(), settings=s))


def layer_ids(lay: LayoutSpec) -> list[int]:
    return sorted({lid for r in lay.regions for lid in r.layer_ids})


def npages(tokens: int) -> int:
    return -(-tokens // PS)


def write_chunk(p: Side, start: int, end: int) -> None:
    """The engine's forward of tokens [start, end): their bytes appear in the source pages."""
    lay = p.session.layout
    src = np.arange(npages(SEQ), dtype=np.int64)
    first = start // PS * PS
    for ri, reg in enumerate(lay.regions):
        for lid in reg.layer_ids:
            # (tokens [first, start) of the first page get the values they already have)
            write_tokens(p.buffers[f"{reg.name}/{lid}"], lay, ri, lid, src[first // PS:],
                         first, end, 7)


def bad_bytes(d: Side, prefix: int) -> int:
    lay = d.session.layout
    bad = 0
    for ri, reg in enumerate(lay.regions):
        first = prefix if reg.send_from is SendFrom.DECODE_PREFIX else 0
        dst = np.arange(npages(SEQ), dtype=np.int64)[first // PS:] + DST_OFF
        for lid in reg.layer_ids:
            bad += check_tokens(d.buffers[f"{reg.name}/{lid}"], lay, ri, lid, dst, first, SEQ, 7)
    return bad


def run_chunked(ends: list[int], *, prefix: int = 0, indexer_last: bool = False,
                ready_before_request: bool = False) -> tuple[MemoryWire, Side, Side]:
    """One room whose prefill gives its pages in chunks ending at `ends` (the last = SEQ);
    `indexer_last`: the indexer's pages come with the last chunk only (as SGLang gives them).
    """
    w, p, d = pair()
    lay = p.session.layout
    src = np.arange(npages(SEQ), dtype=np.int64)
    given = {r.name: 0 for r in lay.regions}

    def chunk_pages(end: int) -> dict[str, np.ndarray]:
        out = {}
        for r in lay.regions:
            upto = npages(SEQ) if (r.name == "indexer_k" and indexer_last) else npages(end)
            if r.name == "indexer_k" and indexer_last and end < SEQ:
                upto = 0
            out[r.name] = src[given[r.name]:upto]
            given[r.name] = max(given[r.name], upto)
        return out

    def mark_ready() -> None:
        for lid in layer_ids(lay):
            w.feed(p, ev.LayerReady(1, 1, lid))

    def decode_side() -> None:
        w.feed(d, ev.OpenReceiver(1, 1, (("prefill:1", 0),)))
        dst = np.arange(npages(SEQ), dtype=np.int64) + DST_OFF
        suffix = dst[prefix // PS:]  # both regions are suffix-only
        w.feed(d, ev.ReceiverInit(1, 1, {"main_kv": suffix, "indexer_k": suffix}, SEQ, prefix))

    if not ready_before_request:
        decode_side()
    start = 0
    for i, end in enumerate(ends):
        if i == 0:
            w.feed(p, ev.OpenSender(1, 1, chunk_pages(end), SEQ, 1, chunk_end=end))
        else:
            w.feed(p, ev.AddChunk(1, 1, chunk_pages(end), end))
        w.run()
        write_chunk(p, start, end)
        mark_ready()
        w.run()
        if end < SEQ and not ready_before_request:
            assert d.views[1].state not in (KVPoll.Success, KVPoll.Failed), "ended early"
            assert not d.views[1].landed  # a layer lands only once its last chunk did
        start = end
    if ready_before_request:
        decode_side()
    w.run()
    return w, p, d


def reference_bytes(prefix: int) -> int:
    """bytes_received of the same room moved in one piece."""
    w, p, d = run_chunked([SEQ], prefix=prefix)
    assert d.views[1].state is KVPoll.Success
    return d.session.counters["bytes_received"]


@pytest.mark.parametrize("ends", [[SEQ], [16, SEQ], [16, 32, SEQ], [10, 27, SEQ], [3, SEQ]],
                         ids=["1", "2-aligned", "3-aligned", "3-unaligned", "2-tiny-first"])
@pytest.mark.parametrize("prefix", [0, 16], ids=["no-prefix", "cached-prefix-16"])
def test_chunks_land_byte_exact_each_byte_once(ends: list[int], prefix: int) -> None:
    w, p, d = run_chunked(ends, prefix=prefix)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d, prefix) == 0
    c = d.session.counters
    assert c["bytes_received"] == reference_bytes(prefix)  # no byte moved twice
    assert p.session.counters["bytes_sent"] == c["bytes_received"]
    assert c["checksum_failures"] == 0 and c["checksums_verified"] > 0
    assert d.views[1].landed == frozenset(layer_ids(d.session.layout))
    assert p.views[1].releases == 1 and d.views[1].releases == 1
    sent = [m for f, _, m in w.sent if f == "prefill:1" and isinstance(m, P.ChunkAdded)]
    assert [m.chunk for m in sent] == list(range(1, len(ends)))
    # every (chunk, layer) was announced with its checksums
    infos = [i for f, _, m in w.sent if isinstance(m, P.LayerDone) for i in m.layers]
    assert {(i.chunk, i.layer) for i in infos} == {
        (c, lid) for c in range(len(ends)) for lid in layer_ids(d.session.layout)}


def test_indexer_pages_with_the_last_chunk_only() -> None:
    """SGLang gives the indexer's pages with the last chunk: it moves all at once then."""
    w, p, d = run_chunked([16, 32, SEQ], prefix=16, indexer_last=True)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d, 16) == 0
    assert d.session.counters["bytes_received"] == reference_bytes(16)
    infos = [i for f, _, m in w.sent if isinstance(m, P.LayerDone) for i in m.layers]
    idx = {(i.chunk, i.layer) for i in infos if any(r.region == "indexer_k" for r in i.regions)}
    assert idx == {(2, 1), (2, 3)}


def test_chunks_given_before_the_decode_asked_go_as_one() -> None:
    w, p, d = run_chunked([16, 32, SEQ], ready_before_request=True)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d, 0) == 0
    assert not [m for _, _, m in w.sent if isinstance(m, P.ChunkAdded)]


def test_checksum_mismatch_in_a_middle_chunk_is_retransmitted() -> None:
    w, p, d = pair()
    lay = p.session.layout
    src = np.arange(npages(SEQ), dtype=np.int64)
    w.feed(d, ev.OpenReceiver(1, 1, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(1, 1, {r.name: src + DST_OFF for r in lay.regions}, SEQ, 0))
    w.feed(p, ev.OpenSender(1, 1, {r.name: src[:1] for r in lay.regions}, SEQ, 1,
                            chunk_end=16))
    w.run()
    write_chunk(p, 0, 16)
    for lid in layer_ids(lay):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    w.feed(p, ev.AddChunk(1, 1, {r.name: src[1:] for r in lay.regions}, SEQ))
    w.run()
    w.corrupt_next(2, "main_kv")
    write_chunk(p, 16, SEQ)
    for lid in layer_ids(lay):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d, 0) == 0
    nacks = [m for _, _, m in w.sent if isinstance(m, P.LayerNack)]
    assert [(m.chunk, m.layer) for m in nacks] == [(1, 2)]
    assert d.session.counters["retransmits"] == 1


def test_add_chunk_before_the_previous_chunk_was_ready_fails_the_room() -> None:
    w, p, d = pair()
    lay = p.session.layout
    src = np.arange(npages(SEQ), dtype=np.int64)
    w.feed(p, ev.OpenSender(1, 1, {r.name: src[:1] for r in lay.regions}, SEQ, 1,
                            chunk_end=16))
    w.feed(p, ev.LayerReady(1, 1, 0))
    w.feed(p, ev.AddChunk(1, 1, {r.name: src[1:] for r in lay.regions}, SEQ))
    f = p.views[1].failure
    assert p.views[1].state is KVPoll.Failed and f is not None
    assert f.kind is FailureKind.INVALID_REQUEST and "1 of 4 layers ready" in f.reason


def test_decode_refuses_a_chunk_out_of_order() -> None:
    w, p, d = pair()
    lay = p.session.layout
    src = np.arange(npages(SEQ), dtype=np.int64)
    w.feed(d, ev.OpenReceiver(1, 1, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(1, 1, {r.name: src + DST_OFF for r in lay.regions}, SEQ, 0))
    w.feed(p, ev.OpenSender(1, 1, {r.name: src[:1] for r in lay.regions}, SEQ, 1,
                            chunk_end=16))
    w.run()
    d_addr = "prefill:1"
    w.feed(d, ev.MessageReceived(P.ChunkAdded(
        src=d_addr, gen=p.session.me.generation, room=1, chunk=2, chunk_end=SEQ,
        src_pages={"main_kv": [1, 2]})))
    f = d.views[1].failure
    assert d.views[1].state is KVPoll.Failed and f is not None
    assert f.kind is FailureKind.INVALID_REQUEST and "chunk: 2 out of order" in f.reason
