"""A decode killed mid-transfer over the shm transport (default settings) must not take the
prefill with it, on both lanes: the decode's pool in a kvhandoff shared segment (the prefill
maps it: shm/map) or in plain memory (process_vm_writev: shm/cma). The prefill fails the room
with a reason, frees its pages and keeps running."""

from __future__ import annotations

import signal

import pytest

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.engine_sim.process import spawn


@pytest.mark.parametrize("lane", ["shm/map", "shm/cma"])
def test_decode_sigkill_mid_transfer_prefill_survives(lane: str) -> None:
    pool = {"shared_buffers": True} if lane == "shm/map" else {"numpy_buffers": True}
    with run_server() as url:
        client = BootstrapClient(url)
        room = client.allocate_rooms(1)[0]
        st = {"transport": "shm", "heartbeat_interval_s": 0.5}
        # the prefill hands over layers 0..5, then holds the rest until the room ended: the
        # kill lands mid-transfer however late the decode's events reach this test (unheld, a
        # loaded host let the decode land every layer and exit before the SIGKILL)
        with spawn("prefill", {"rooms": [{"room": room, "seq_len": 3000}], "numpy_buffers": True,
                               "settings": {**st, "bootstrap_url": url}, "engine_id": "p",
                               "hold_after_layer": 5, "linger": True}) as p, \
             spawn("decode", {"rooms": [{"room": room, "seq_len": 3000, "prefix": 1000}],
                              **pool, "settings": st, "bootstrap_url": url}) as d:
            p.expect("ready", 60)
            p.expect("registered", 60)
            client.bind_room(room, "p", 0)
            d.expect("layer", 60, layer=5)  # decode is mid-transfer
            d.signal(signal.SIGKILL)
            done = p.expect("done", 30)
            assert done["state"] == "Failed"
            assert done["failure"]
            assert done["released"] is True
            pool_ev = p.expect("pool", 10)
            assert pool_ev["free"] == pool_ev["total"]
            assert p.proc.poll() is None  # still alive, serving (linger)
