"""A decode killed mid-transfer must not take the prefill with it.

Over UCX, same-host peers default to shared-memory lanes without UCX error handling (a UCX
limitation: a peer dying mid-write aborts the writer). With `ucx_same_host_error_handling`
the endpoint has peer error handling: the prefill fails the room with a reason, frees its pages
and keeps running. Over tcp there is nothing to opt into.
"""

from __future__ import annotations

import signal

import pytest

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.engine_sim.process import spawn

SAFE = {"ucx": {"ucx_same_host_error_handling": True}, "tcp": {}}


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_decode_sigkill_mid_transfer_prefill_survives(transport: str) -> None:
    with run_server() as url:
        client = BootstrapClient(url)
        room = client.allocate_rooms(1)[0]
        st = {"transport": transport, "heartbeat_interval_s": 0.5, **SAFE[transport]}
        # the prefill hands over layers 0..5, then holds the rest until the room ended: the
        # kill lands mid-transfer however late the decode's events reach this test
        with spawn("prefill", {"rooms": [{"room": room, "seq_len": 3000}], "numpy_buffers": True,
                               "settings": {**st, "bootstrap_url": url}, "engine_id": "p",
                               "hold_after_layer": 5, "linger": True}) as p, \
             spawn("decode", {"rooms": [{"room": room, "seq_len": 3000, "prefix": 1000}],
                              "numpy_buffers": True, "settings": st,
                              "bootstrap_url": url}) as d:
            p.expect("ready", 60)
            p.expect("registered", 60)
            client.bind_room(room, "p", 0)
            d.expect("layer", 60, layer=5)  # decode is mid-transfer
            d.signal(signal.SIGKILL)
            done = p.expect("done", 30)
            assert done["state"] == "Failed"
            assert done["failure"]
            assert done["released"] is True
            pool = p.expect("pool", 10)
            assert pool["free"] == pool["total"]
            assert p.proc.poll() is None  # still alive, serving (linger)
