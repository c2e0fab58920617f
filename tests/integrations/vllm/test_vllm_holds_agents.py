"""A decode worker's holds (`integrations.vllm.holds.RoomHolds`) with two real agents and a real
bootstrap server (127.0.0.1, port 0): the rooms of queued requests are looked up at the server,
as the worker's receiver would, and held at the prefill agent this rank reads them from. The
prefill's bound is 1 s: a room the worker stops holding (its request was aborted while queued)
fails there once the hold lapses (``holds_expired``); the room still held has outlived the same
bound, and moves byte-exact when its receiver opens. A room the server has no route for is not
held, and says so (``failed_lookups``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.buffers.bufferset import allocate  # noqa: E402
from kvhandoff.engine_sim.pattern import check_tokens, write_tokens  # noqa: E402
from kvhandoff.integrations.vllm.config import HoldReq  # noqa: E402
from kvhandoff.integrations.vllm.holds import RoomHolds  # noqa: E402
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402
from kvhandoff.state_machine import KVPoll  # noqa: E402
from kvhandoff.transfer import TransferAgent  # noqa: E402

BOUND = 1.0  # the prefill's bootstrap_timeout_s
WAIT_S = 30.0
SEQ = 40
PAGES = 3
SEED = 5
ENGINE = "holds-prefill"
LAYOUT = LayoutSpec(page_size_tokens=16, kv_dtype="bf16", model="holds", regions=(
    RegionSpec("kv", (0, 1), (Plane("k", 64), Plane("v", 64))),))


def _until(pred: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < end, f"{what}: not within {WAIT_S} s"
        time.sleep(0.02)  # polling interval of a bounded wait


def _counter(agent: TransferAgent, name: str) -> int:
    return int(agent.status()["counters"].get(name, 0))


@pytest.fixture
def agents() -> Iterator[tuple[str, TransferAgent, TransferAgent]]:
    common = {"transport": "inproc", "heartbeat_interval_s": 0.2, "auth_token": None}
    with run_server(Settings(port=0, auth_token=None)) as url:
        prefill = TransferAgent("prefill", LAYOUT, allocate(LAYOUT, 16), Settings(
            **common, bootstrap_url=url, bootstrap_timeout_s=BOUND), engine_id=ENGINE)
        decode = TransferAgent("decode", LAYOUT, allocate(LAYOUT, 16), Settings(
            **common, bootstrap_timeout_s=BOUND), engine_id="holds-decode")
        try:
            assert prefill.wait_registered(WAIT_S)
            yield url, prefill, decode
        finally:
            decode.close()
            prefill.close()


def _sender(url: str, prefill: TransferAgent, room: int, pages: np.ndarray) -> Any:
    """A prefill room bound at the server, its pages written with the pattern."""
    with BootstrapClient(url) as c:
        c.bind_room(room, ENGINE, 0)
    for ri, reg in enumerate(LAYOUT.regions):
        for lid in reg.layer_ids:
            write_tokens(prefill.buffers.array(reg.name, lid), LAYOUT, ri, lid, pages, 0, SEQ,
                         SEED + room)
    return prefill.sender(room, pages=pages, seq_len=SEQ)


def _read(url: str, decode: TransferAgent, room: int, sender: Any, dst: np.ndarray) -> None:
    """The decode reads `room` (found through the server), byte-exact."""
    rcv = decode.receiver(room, url)
    rcv.init(dst, SEQ, 0)
    for lid in (0, 1):
        sender.layer_ready(lid)
    assert rcv.wait(WAIT_S) is KVPoll.Success, rcv.failure
    assert sender.wait(WAIT_S) is KVPoll.Success, sender.failure
    for ri, reg in enumerate(LAYOUT.regions):
        for lid in reg.layer_ids:
            assert check_tokens(decode.buffers.array(reg.name, lid), LAYOUT, ri, lid, dst, 0,
                                SEQ, SEED + room) == 0


def test_held_rooms_outlive_the_bound_and_an_unheld_one_lapses(
        agents: tuple[str, TransferAgent, TransferAgent]) -> None:
    url, prefill, decode = agents
    pg = np.arange(PAGES * 4, dtype=np.int64).reshape(4, PAGES)
    # a first request read: the decode's agent talks to the prefill's (as under a backlog)
    _read(url, decode, 1, _sender(url, prefill, 1, pg[0]), pg[0])
    # two requests queued on the decode: the prefill finished them (rooms 2 and 3)
    s2, s3 = _sender(url, prefill, 2, pg[1]), _sender(url, prefill, 3, pg[2])
    holds = RoomHolds(decode)
    try:
        holds.update({"r2": HoldReq(2, url), "r3": HoldReq(3, url)}, [])
        # each looked up at the server: held with the prefill agent this rank reads
        _until(lambda: holds.held() == {"r2": (prefill.address,), "r3": (prefill.address,)},
               "the rooms' routes")
        _until(lambda: _counter(prefill, "holds_renewed") >= 2, "a hold at the prefill")
        # r3's request is aborted while queued: the worker stops holding it
        holds.update({}, ["r3"])
        assert s3.wait(WAIT_S) is KVPoll.Failed
        assert "hold lapsed" in (s3.failure or ""), s3.failure
        assert _counter(prefill, "holds_expired") == 1
        # room 2 is as old as room 3 was, past the bound, and still waits for its decode
        assert s2.poll() is KVPoll.Bootstrapping, s2.failure
        # its request gets a slot: no longer held, its receiver opens, the room moves
        holds.update({}, ["r2"])
        assert holds.held() == {}
        _read(url, decode, 2, s2, pg[3])
        assert _counter(prefill, "holds_expired") == 1
    finally:
        holds.close()


def test_a_room_without_a_route_is_not_held(
        agents: tuple[str, TransferAgent, TransferAgent]) -> None:
    url, prefill, decode = agents
    holds = RoomHolds(decode)
    try:
        holds.update({"r9": HoldReq(99, url)}, [])  # never bound at the server
        _until(lambda: holds.failed_lookups == 1, "the failed lookup")
        assert holds.held() == {"r9": ()}
        holds.update({}, ["r9"])
        assert holds.held() == {}
    finally:
        holds.close()
    assert _counter(prefill, "holds_renewed") == 0
