"""Host staging (runtime.staging) on a machine without a GPU: two real agents over the tcp
transport (real sockets, threads, session) whose KV buffers are device memory as far as
kvhandoff can tell, handing off a room through pinned-host-style staging buffers on both sides.

What stands in for CUDA: CPU torch tensors that `BufferSet` keeps as tensors (the fixture
replaces `bufferset.as_bytes`, which would turn them into numpy arrays), so the agent takes them
for device memory exactly as it takes CUDA tensors (`view_memory` says "cuda", the rooms hash
with devsum, the tcp transport would refuse them). The staging copies run the very torch ops
they run on a GPU, on CPU tensors. The same handoff with real CUDA tensors is
tests/unit/gpu/test_staging_cuda.py (marked gpu)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.buffers import bufferset
from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.staging import ALIGN, ARENA, StagingPool
from kvhandoff.errors import ConfigError, TransportError
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.runtime import staging
from kvhandoff.runtime.metrics import metrics_text
from kvhandoff.runtime.staging import StagedTransport, staging_choice
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

WAIT_S = 60.0
PS = 16


def tiny_layout() -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=6, indexer_layer_ids=(0, 3, 5),
                          page_size_tokens=PS).without_page_rules()


@pytest.fixture
def cuda_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU torch tensors given as KV buffers stay tensors in the agent's `BufferSet`, which
    then takes them for CUDA memory (as it does CUDA tensors)."""
    real = bufferset.as_bytes

    def as_bytes(buf: Any, where: str) -> Any:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu":
            return buf.reshape(-1).view(torch.uint8)
        return real(buf, where)

    monkeypatch.setattr(bufferset, "as_bytes", as_bytes)
    yield


def _random(bufs: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for per in bufs.values():
        for b in per.values() if isinstance(per, dict) else [per]:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def _page(agent: TransferAgent, region: str, layer: int, page: int) -> bytes:
    lay = agent.layout
    reg = lay.region(region)
    view = agent.buffers.array(region, layer)
    at = page * reg.page_stride(PS)
    return bytes(view[at:at + reg.page_nbytes(PS)].numpy())


def _handoff(pa: TransferAgent, da: TransferAgent, room: int, src: list[int], dst: list[int],
             seq_len: int) -> dict[str, Any]:
    sender = pa.sender(room, pages=np.array(src), seq_len=seq_len)
    receiver = da.receiver(room, peer=pa.address)
    receiver.init(np.array(dst), seq_len, 0)
    for layer in range(pa.layout.num_layers):
        sender.layer_ready(layer)
    got = receiver.wait(WAIT_S)
    stats = receiver.stats()
    assert got is KVPoll.Success, stats
    assert sender.wait(WAIT_S) is KVPoll.Success
    return stats


def test_device_pages_move_byte_exact_through_host_staging_over_tcp(
        cuda_standin: None, caplog: pytest.LogCaptureFixture) -> None:
    lay = tiny_layout()
    pbufs, dbufs = allocate(lay, 8), allocate(lay, 8)
    _random(pbufs, 1)
    s = Settings(transport="tcp", host_staging_mib=64)  # host_staging left at auto
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        pa = TransferAgent("prefill", lay, pbufs, s)
        da = TransferAgent("decode", lay, dbufs, s)
    try:
        assert pa.buffers.memory == da.buffers.memory == "cuda"  # what the stand-in is for
        assert any("move through host staging: settings.transport=tcp cannot reach device "
                   "memory (host_staging=auto)" in r.getMessage() for r in caplog.records)
        for agent in (pa, da):
            st = agent.status()
            assert st["staging"] == "host"
            assert "host-staging" in st["transport"]["lanes"]
            assert st["transport"]["degraded"] is True
            assert "device memory staged through host memory" in st["transport"]["reason"]
            assert isinstance(agent.transport, StagedTransport)
        src, dst = [0, 1, 2], [5, 3, 4]
        stats = _handoff(pa, da, 1, src, dst, seq_len=3 * PS)  # whole pages
        moved = sum(stats["bytes_per_region"].values())
        assert moved > 0
        for reg in lay.regions:
            for lid in reg.live_layer_ids:
                for sp, dp in zip(src, dst, strict=True):
                    assert _page(da, reg.name, lid, dp) == _page(pa, reg.name, lid, sp), \
                        (reg.name, lid, sp)
                for untouched in (0, 1, 2, 6, 7):
                    assert not any(_page(da, reg.name, lid, untouched))
        # every byte that landed was copied out of device pages and into device pages, once
        pt, dt = metrics_text(pa), metrics_text(da)
        assert _metric(pt, "kvhandoff_agent_staged_bytes_out_total") == moved
        assert _metric(dt, "kvhandoff_agent_staged_bytes_in_total") == moved
        assert _metric(dt, "kvhandoff_agent_staged_bytes_out_total") == 0
        assert da.status()["counters"]["checksums_verified"] > 0
        # leases all returned; a second room reuses the same arena
        _handoff(pa, da, 2, [3, 4], [0, 1], seq_len=2 * PS)
        for a in (pa, da):
            pool = a.transport.pool  # type: ignore[attr-defined]
            assert pool.in_use() == 0 and pool.held_bytes == s.host_staging_mib << 20
        assert _metric(metrics_text(da), "kvhandoff_agent_staged_bytes_in_total") > moved
    finally:
        da.close()
        pa.close()


def test_the_checksum_covers_the_device_pages_not_the_staging(
        cuda_standin: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy into the device pages that goes wrong after the bytes landed in host staging
    intact: the room fails on its checksum (the decode hashes its device pages)."""
    real = staging.copy_in

    def bad_copy_in(host: Any, lease: Any, dev: Any, offsets: Any, nbytes: Any) -> None:
        real(host, lease, dev, offsets, nbytes)
        dev[int(offsets[0])] ^= 0xFF

    monkeypatch.setattr(staging, "copy_in", bad_copy_in)
    lay = tiny_layout()
    pbufs, dbufs = allocate(lay, 8), allocate(lay, 8)
    _random(pbufs, 2)
    s = Settings(transport="tcp", host_staging_mib=64)
    with TransferAgent("prefill", lay, pbufs, s) as pa, \
            TransferAgent("decode", lay, dbufs, s) as da:
        sender = pa.sender(1, pages=np.array([0, 1]), seq_len=20)
        receiver = da.receiver(1, peer=pa.address)
        receiver.init(np.array([2, 3]), 20, 0)
        for layer in range(lay.num_layers):
            sender.layer_ready(layer)
        assert receiver.wait(WAIT_S) is KVPoll.Failed
        stats = receiver.stats()
        assert stats["failure_kind"] == "checksum", stats
        assert "checksum mismatch" in stats["failure"], stats


def test_host_staging_off_refuses_naming_the_setting(cuda_standin: None) -> None:
    lay = tiny_layout()
    s = Settings(transport="tcp", host_staging="off")
    with pytest.raises(ConfigError) as e:
        TransferAgent("prefill", lay, allocate(lay, 4), s)
    msg = str(e.value)
    assert msg.startswith("settings.host_staging=off: the KV caches are CUDA memory and "
                          "settings.transport=tcp moves host memory only"), msg
    assert "host_staging=auto" in msg


def test_the_choice() -> None:
    for given in ({"transport": "tcp"}, {"transport": "ucx"}, {"auto_cross_host": "tcp"},
                  {"auto_cross_host": "ucx"}):
        why = staging_choice(Settings(**given), "cuda")
        assert why is not None and "cannot reach device memory (host_staging=auto)" in why
        assert staging_choice(Settings(**given), "host") is None  # host caches never stage
    for direct in ({"transport": "shm"}, {"transport": "nixl"}, {"auto_cross_host": "nixl"}):
        assert staging_choice(Settings(**direct), "cuda") is None
        # forced on: a host without GPUDirect RDMA, where nixl cannot reach device memory
        why = staging_choice(Settings(**direct, host_staging="on"), "cuda")
        assert why is not None and why.startswith("settings.host_staging=on")
    with pytest.raises(ConfigError, match=r"^settings\.host_staging=off: .*settings\.transport="
                       r"auto with settings\.auto_cross_host=ucx moves host memory only"):
        staging_choice(Settings(host_staging="off"), "cuda")
    with pytest.raises(ValueError, match="host_staging must be auto, on or off"):
        Settings(host_staging="maybe")


def test_the_pool_reuses_its_arena_and_refuses_past_its_bound() -> None:
    registered: list[tuple[str, int]] = []
    pool = StagingPool(lambda n, a: registered.append((n, len(a))), limit_bytes=64 * ALIGN,
                       pinned=False)
    assert registered == []  # made on first use
    a = pool.take(100)
    b = pool.take(20 * ALIGN + 4)
    assert a is not None and b is not None
    assert (a.offsets.tolist(), a.lengths.tolist(), a.nbytes) == ([0], [100], 100)
    assert (b.offsets.tolist(), b.lengths.tolist()) == ([ALIGN], [20 * ALIGN + 4])
    assert registered == [(ARENA, 64 * ALIGN)]
    c = pool.take(30 * ALIGN)
    assert c is not None and c.offsets.tolist() == [22 * ALIGN]
    assert pool.take(13 * ALIGN) is None and not pool.fits(13 * ALIGN)  # 12 units free
    pool.give(b)
    # 21 units free before c, 12 after: one lease of two ranges, in stream order
    d = pool.take(30 * ALIGN)
    assert d is not None
    assert d.offsets.tolist() == [ALIGN, 52 * ALIGN]
    assert d.lengths.tolist() == [21 * ALIGN, 9 * ALIGN] and d.nbytes == 30 * ALIGN
    with pytest.raises(TransportError, match=r"exceed settings\.host_staging_mib=0 \(the "
                       r"whole staging arena\); raise host_staging_mib"):
        pool.take(64 * ALIGN + 1)
    for lease in (a, c, d):
        pool.give(lease)
    assert pool.in_use() == 0 and pool.fits(64 * ALIGN)
    assert len(registered) == 1  # one registration, reused


def test_a_room_larger_than_the_arena_passes_its_layers_through_it(
        cuda_standin: None) -> None:
    """The decode posts a room's every layer at once: the receives that do not fit wait
    (in order) for the ones before to land and return their memory."""
    lay = tiny_layout()
    pbufs, dbufs = allocate(lay, 160), allocate(lay, 160)
    _random(pbufs, 4)
    s = Settings(transport="tcp", host_staging_mib=1)
    with TransferAgent("prefill", lay, pbufs, s) as pa, \
            TransferAgent("decode", lay, dbufs, s) as da:
        src = list(range(0, 90))
        dst = list(range(160 - 1, 160 - 91, -1))
        stats = _handoff(pa, da, 1, src, dst, seq_len=90 * PS)
        moved = sum(stats["bytes_per_region"].values())
        assert moved > 3 << 20  # three arenas' worth
        for reg in lay.regions:
            for lid in reg.live_layer_ids:
                for sp, dp in zip(src, dst, strict=True):
                    assert _page(da, reg.name, lid, dp) == _page(pa, reg.name, lid, sp)
        counters = da.status()["counters"]
        assert counters["staged_bytes_in"] == moved
        assert counters["staging_waits"] > 0
        assert da.transport.pool.in_use() == 0  # type: ignore[attr-defined]


def test_the_integrations_lane_choice_says_host_staging() -> None:
    """The lane choice of the SGLang backend and the vLLM connector (`integrations.lanes`)
    takes the host-only lane for CUDA caches through host staging, as the agent then does."""
    from kvhandoff.integrations.lanes import choose_lane

    s, line = choose_lane(Settings(transport="tcp"), "cuda", missing=lambda: None)
    assert s.transport.value == "tcp"
    assert line.startswith("KV caches in CUDA memory: transport tcp, through HOST STAGING "
                           "(the transport cannot reach device memory (host_staging=auto))")
    assert staging_choice(s, "cuda") is not None  # the agent's own choice agrees
    s, line = choose_lane(Settings(host_staging="on"), "cuda", missing=lambda: None)
    assert "nixl with other hosts), through HOST STAGING (settings.host_staging=on)" in line
    assert staging_choice(s, "cuda") is not None
    with pytest.raises(ConfigError, match=r"^settings\.auto_cross_host=tcp: .*"
                       r"settings\.host_staging=off"):
        choose_lane(Settings(auto_cross_host="tcp", host_staging="off"), "cuda",
                    missing=lambda: None)


def test_an_aborted_room_frees_its_staging_memory_and_waiting_ops(cuda_standin: None) -> None:
    """The decode aborts a room after its first layer landed while later layers wait for
    the arena (or sit posted): every op of it ends, the arena is whole again and the next
    room moves."""
    lay = tiny_layout()
    pbufs, dbufs = allocate(lay, 160), allocate(lay, 160)
    _random(pbufs, 5)
    s = Settings(transport="tcp", host_staging_mib=1)
    with TransferAgent("prefill", lay, pbufs, s) as pa, \
            TransferAgent("decode", lay, dbufs, s) as da:
        sender = pa.sender(1, pages=np.arange(90), seq_len=90 * PS)
        receiver = da.receiver(1, peer=pa.address)
        receiver.init(np.arange(90) + 70, 90 * PS, 0)
        sender.layer_ready(0)  # only layer 0: the others' receives stay waiting or posted
        assert receiver.wait_for_layer(0, WAIT_S)
        assert da.status()["counters"]["staging_waits"] > 0  # more than the arena posted
        receiver.abort("test: the engine dropped the request")
        assert receiver.poll() is KVPoll.Failed
        assert receiver.wait_released(WAIT_S)
        assert da.transport.pool.in_use() == 0  # type: ignore[attr-defined]
        assert not da.transport._waiting and not da.transport._ops  # type: ignore[attr-defined]
        sender.abort("test: done")
        assert sender.wait_released(WAIT_S)
        stats = _handoff(pa, da, 2, list(range(90)), list(range(70, 160)), seq_len=90 * PS)
        assert stats["state"] == "Success"
        for a in (pa, da):
            assert a.transport.pool.in_use() == 0  # type: ignore[attr-defined]


def test_ready_lists_a_staged_rank_as_degraded(cuda_standin: None) -> None:
    """The bootstrap server's /ready (a real server): the staged prefill registers as
    ``tcp-staged``, counted and listed among the degraded ranks."""
    import httpx

    from kvhandoff.bootstrap_server.background import run_server

    lay = tiny_layout()
    with run_server(Settings(port=0, auth_token=None)) as url:
        s = Settings(transport="tcp", host_staging_mib=64, bootstrap_url=url)
        with TransferAgent("prefill", lay, allocate(lay, 4), s, engine_id="staged") as pa:
            assert pa.wait_registered(WAIT_S)
            ready = httpx.get(url + "/ready", timeout=10).json()
    assert ready["degraded_ranks"] == 1, ready
    assert ready["degraded"] == ["staged/dp0/cp0/tp0/pp0 (tcp-staged)"], ready


class _Done:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.errors: list[BaseException | None] = []

    def __call__(self, exc: BaseException | None) -> None:
        self.errors.append(exc)
        self.event.set()

    def wait(self) -> BaseException | None:
        assert self.event.wait(WAIT_S), "on_done was not called in time"
        assert len(self.errors) == 1, self.errors
        return self.errors[0]


def _staged_pair() -> tuple[StagedTransport, StagedTransport]:
    from kvhandoff.transports.base import load_transport

    s = Settings(transport="tcp", host_staging_mib=1)
    a = StagedTransport(load_transport("tcp", s), s, reason="test", pinned=False)
    b = StagedTransport(load_transport("tcp", s), s, reason="test", pinned=False)
    a.connect("b", b.address)
    b.connect("a", a.address)
    return a, b


def test_the_transport_moves_spans_through_leases_of_several_ranges() -> None:
    """CPU tensors registered as the device buffers (what `BufferSet` hands it under the
    stand-in); the decode's arena fragmented first, so its lease is several ranges and the
    copies cut the stream at other places than the device spans."""
    a, b = _staged_pair()
    try:
        g = torch.Generator().manual_seed(9)
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        a.register("kv/0", src)
        b.register("kv/0", dst)
        held = [b.pool.take(100 * ALIGN), b.pool.take(7 * ALIGN), b.pool.take(50 * ALIGN)]
        b.pool.give(held[0])  # 100 units free, 7 held, then free again past 157
        s_off, s_nb = np.array([5000, 300_000, 700_004]), np.array([200_000, 123_456, 4])
        d_off, d_nb = np.array([900_000, 0]), np.array([100_000, 223_460])
        recv, sent = _Done(), _Done()
        b.post_recv("a", 7, "kv/0", d_off, d_nb, recv)
        a.post_send("b", 7, "kv/0", s_off, s_nb, sent)
        assert sent.wait() is None and recv.wait() is None
        stream = torch.cat([src[o:o + n] for o, n in zip(s_off, s_nb, strict=True)])
        landed = torch.cat([dst[o:o + n] for o, n in zip(d_off, d_nb, strict=True)])
        assert torch.equal(stream, landed)
        assert int(dst[223_460:900_000].count_nonzero()) == 0  # nothing outside the spans
        assert b.status().counters["staged_bytes_in"] == int(s_nb.sum())
        assert a.status().counters["staged_bytes_out"] == int(s_nb.sum())
        for lease in held[1:]:
            b.pool.give(lease)
        assert a.pool.in_use() == 0 and b.pool.in_use() == 0
    finally:
        a.close()
        b.close()


def test_cancel_and_close_complete_waiting_and_posted_ops() -> None:
    a, b = _staged_pair()
    try:
        b.register("kv/0", torch.zeros(1 << 20, dtype=torch.uint8))
        posted, waiting, late = _Done(), _Done(), _Done()
        b.post_recv("a", 1, "kv/0", np.array([0]), np.array([600 << 10]), posted)
        b.post_recv("a", 2, "kv/0", np.array([0]), np.array([600 << 10]), waiting)
        b.post_recv("a", 3, "kv/0", np.array([0]), np.array([ALIGN]), late)  # behind tag 2
        assert b.status().counters["staging_waits"] == 2
        b.cancel("a", 2)
        err = waiting.wait()
        assert isinstance(err, TransportError) and "tag 2 cancelled" in str(err)
    finally:
        b.close()
        a.close()
    for done in (posted, late):  # posted on tcp (tag 3 once tag 2 left), or still waiting
        err = done.wait()
        assert isinstance(err, TransportError), err
    assert not b._ops and not b._waiting  # every op ended
    assert b.pool.in_use() == 0
