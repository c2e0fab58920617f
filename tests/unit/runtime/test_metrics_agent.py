"""The agent's Prometheus metrics: degraded transports are visible, counters move."""

from __future__ import annotations

import httpx
import numpy as np

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.kv_layout import preset
from kvhandoff.runtime.metrics import metrics_text
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_tcp_fallback_is_visible_and_served_over_http():
    spec = preset("glm-5.3")
    s = Settings(transport="tcp", agent_metrics_port=0)
    with TransferAgent("prefill", spec, allocate(spec, 2), s) as agent:
        assert agent.metrics_address is not None
        text = httpx.get(f"http://{agent.metrics_address}/metrics", timeout=5).text
        assert _value(text, "kvhandoff_agent_transport_degraded") == 1.0
        assert 'kind="tcp"' in text
    assert agent.status()["transport"]["degraded"] is True


def test_counters_follow_a_handoff():
    spec = preset("glm-5.3")
    s = Settings(transport="inproc")
    with TransferAgent("prefill", spec, allocate(spec, 8), s) as pa, \
            TransferAgent("decode", spec, allocate(spec, 8), s) as da:
        assert _value(metrics_text(pa), "kvhandoff_agent_transport_degraded") == 0.0
        sender = pa.sender(1, pages=np.arange(2), seq_len=100)
        receiver = da.receiver(1, peer=pa.address)
        receiver.init(np.arange(2) + 4, 100, 0)
        for layer in range(spec.num_layers):
            sender.layer_ready(layer)
        assert receiver.wait(30) is KVPoll.Success
        assert sender.wait(30) is KVPoll.Success
        text = metrics_text(da)
        assert _value(text, "kvhandoff_agent_checksums_verified_total") == 99
        assert _value(text, "kvhandoff_agent_bytes_received_total") == 100 * 53_940
        assert _value(text, 'kvhandoff_agent_rooms{state="Success"}') == 1


def test_region_bytes_descriptors_and_tail_are_exported():
    spec = preset("glm-5.3")
    s = Settings(transport="inproc")
    with TransferAgent("prefill", spec, allocate(spec, 8), s) as pa, \
            TransferAgent("decode", spec, allocate(spec, 8), s) as da:
        sender = pa.sender(2, pages=np.array([0, 1, 2]), seq_len=150)
        receiver = da.receiver(2, peer=pa.address)
        receiver.init(np.array([5, 3, 4]), 150, 0)  # 5 | 3,4: two spans per layer at most
        for layer in range(spec.num_layers):
            sender.layer_ready(layer)
        assert receiver.wait(30) is KVPoll.Success
        assert sender.wait(30) is KVPoll.Success
        stats = receiver.stats()
        pt, dt = metrics_text(pa), metrics_text(da)
        for region, moved in stats["bytes_per_region"].items():
            assert _value(dt, f'kvhandoff_agent_region_bytes_total{{direction="received",'
                              f'region="{region}"}}') == moved
            assert _value(pt, f'kvhandoff_agent_region_bytes_total{{direction="sent",'
                              f'region="{region}"}}') == moved
            assert _value(dt, f'kvhandoff_agent_region_descriptors_total{{direction="received",'
                              f'region="{region}"}}') == stats["descriptors"][region]
        # one successful prefill room: one tail observation; the decode side records none
        assert _value(pt, "kvhandoff_agent_tail_seconds_count") == 1
        assert _value(pt, 'kvhandoff_agent_tail_seconds_bucket{le="+Inf"}') == 1
        assert _value(dt, "kvhandoff_agent_tail_seconds_count") == 0
