"""Heterogeneous topologies as processes (issue 8): every rank of both engines is its own
`kvhandoff.engine_sim` process with its own agent, over the real `tcp` transport on 127.0.0.1, and a
real bootstrap server (uvicorn) in the test process.

Prefill ranks register themselves (engine_id, dp/tp rank and sizes); rooms are bound to a dp
rank of the prefill engine through the client; decode ranks find their prefill ranks by route
lookup (the server's TP mapping). Each decode rank checks every landed byte against the
deterministic pattern (salted per plane: heads and key/scale planes are told apart) and that its
cached-prefix indexer pages kept their marker.

Two setups (a few, not all pairs: 14 processes in all on a 2-core CI machine):
- GLM-5.3 (MLA + indexer, replicated): prefill dp2 x tp2 (4 processes) -> decode tp4 (4): two
  rooms, one per prefill dp rank; each decode rank reads each room from exactly one prefill rank.
- Llama-3.1-8B (GQA): prefill tp4 (4 processes) -> decode tp2 (2): each decode rank gathers its
  four heads from two prefill ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from hetkit import one_copy_bytes

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks
from kvhandoff.engine_sim.process import EngineProcess, spawn
from kvhandoff.kv_layout.presets import glm53, llama31_8b
from kvhandoff.settings import Settings

START_S = 60.0  # process start (imports torch) with 8 processes on a loaded 2-core machine
DONE_S = 60.0


@pytest.fixture
def server() -> Iterator[tuple[str, BootstrapClient, ExitStack]]:
    with ExitStack() as stack:
        url = stack.enter_context(run_server(Settings(port=0, auth_token=None)))
        client = BootstrapClient(url)
        stack.callback(client.close)
        yield url, client, stack


def _common() -> dict[str, Any]:
    return {"plane_salt": True, "numpy_buffers": True, "timeout_s": DONE_S, "spare_pages": 2,
            "settings": {"transport": "tcp", "heartbeat_interval_s": 1.0}}


class Engines:
    """The processes of one run: prefill ranks by (dp, tp) with their agent addresses, decode
    ranks by tp rank, and the rooms with the prefill dp rank each is bound to."""

    def __init__(self) -> None:
        self.prefill: dict[tuple[int, int], EngineProcess] = {}
        self.prefill_addr: dict[tuple[int, int], str] = {}
        self.decode: list[EngineProcess] = []
        self.room_dp: dict[int, int] = {}


def run_engines(server: tuple[str, BootstrapClient, ExitStack], *, model: str, page: int,
                prefill_dp: int, prefill_tp: int, decode_tp: int, seq_len: int,
                prefix: int) -> Engines:
    """Starts the prefill ranks (one room per dp rank, bound through the client once they
    registered), then the decode ranks, each handling every room."""
    url, client, stack = server
    replicated = model != "llama-3.1-8b"
    e = Engines()
    e.room_dp = {room: dp for dp in range(prefill_dp) for room in client.allocate_rooms(1)}
    for dp in range(prefill_dp):
        for tp in range(prefill_tp):
            readers = sum(tp in prefill_tp_ranks(d, decode_tp, prefill_tp, replicated=replicated)
                          for d in range(decode_tp))
            cfg = _common()
            cfg["settings"] = {**cfg["settings"], "bootstrap_url": url}
            e.prefill[(dp, tp)] = stack.enter_context(spawn("prefill", {
                **cfg, "model": model, "page_size": page, "engine_id": "p",
                "dp_rank": dp, "dp_size": prefill_dp, "tp_rank": tp, "tp_size": prefill_tp,
                "rooms": [{"room": room, "seq_len": seq_len, "num_decode_ranks": readers}
                          for room, rdp in e.room_dp.items() if rdp == dp]}))
    for key, proc in e.prefill.items():
        e.prefill_addr[key] = proc.expect("ready", START_S)["address"]
        assert proc.expect("registered", START_S)["ok"]
    for room, dp in e.room_dp.items():
        client.bind_room(room, "p", dp)
    e.decode = [stack.enter_context(spawn("decode", {
        **_common(), "model": model, "page_size": page, "bootstrap_url": url,
        "tp_rank": d, "tp_size": decode_tp,
        "rooms": [{"room": room, "seq_len": seq_len, "prefix": prefix} for room in e.room_dp]}))
        for d in range(decode_tp)]
    return e


def test_glm_prefill_dp2_tp2_to_decode_tp4(
        server: tuple[str, BootstrapClient, ExitStack]) -> None:
    seq, prefix = 300, 100
    e = run_engines(server, model="glm-5.3", page=64, prefill_dp=2, prefill_tp=2, decode_tp=4,
                    seq_len=seq, prefix=prefix)
    copy = one_copy_bytes(glm53(), seq, prefix)
    for d, proc in enumerate(e.decode):
        for room, dp in e.room_dp.items():
            ev = proc.expect("done", DONE_S, room=room)
            assert ev["state"] == "Success", ev["failure"]
            assert ev["verify"]["byte_exact"], ev["verify"]
            assert ev["stats"]["bytes"] == copy
            # exactly one prefill rank: tp rank d % 2 of the dp rank the room is bound to
            assert ev["stats"]["peers"] == [e.prefill_addr[(dp, d % 2)]]
    for (dp, _tp), proc in e.prefill.items():
        room = next(r for r, rdp in e.room_dp.items() if rdp == dp)
        ev = proc.expect("done", DONE_S, room=room)
        assert ev["state"] == "Success", ev["failure"]
        assert ev["stats"]["legs"] == 2  # decode ranks tp and tp + 2
        assert ev["stats"]["bytes"] == 2 * copy  # two decode ranks, no byte twice
        assert ev["released"]


def test_llama_prefill_tp4_to_decode_tp2(
        server: tuple[str, BootstrapClient, ExitStack]) -> None:
    seq = 100
    e = run_engines(server, model="llama-3.1-8b", page=16, prefill_dp=1, prefill_tp=4,
                    decode_tp=2, seq_len=seq, prefix=0)
    (room,) = e.room_dp
    copies = []
    for d, proc in enumerate(e.decode):
        ev = proc.expect("done", DONE_S, room=room)
        assert ev["state"] == "Success", ev["failure"]
        assert ev["verify"]["byte_exact"], ev["verify"]
        # heads 4d..4d+3 from prefill ranks 2d (heads 4d, 4d+1) and 2d+1 (4d+2, 4d+3)
        assert ev["stats"]["peers"] == [e.prefill_addr[(0, 2 * d)], e.prefill_addr[(0, 2 * d + 1)]]
        copies.append(one_copy_bytes(llama31_8b(tp_size=2, tp_rank=d), seq, 0))
        assert ev["stats"]["bytes"] == copies[-1]
    for (_dp, tp), proc in e.prefill.items():
        ev = proc.expect("done", DONE_S, room=room)
        assert ev["state"] == "Success", ev["failure"]
        assert ev["stats"]["legs"] == 1
        # each prefill rank sends its two heads once: half of its decode rank's copy
        assert ev["stats"]["bytes"] == copies[tp // 2] // 2
        assert ev["released"]
