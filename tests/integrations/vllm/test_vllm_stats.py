"""kvhandoff's figures through vLLM's connector-stats API: two KVHandoffConnector workers in
this process (each with its own agent over vLLM allocated CPU KV, the tcp transport, a real
bootstrap server on 127.0.0.1 port 0) hand off real rooms; each worker's
``get_kv_connector_stats()`` must carry exactly the rooms that ended, and vLLM's own code must
carry them on: its serializer (the payload crosses to the front end), ``aggregate`` over two
workers, the "KV Transfer metrics" log line (`KVConnectorLogging`) and ``/metrics``
(`PrometheusStatLogger`, which calls ``build_prom_metrics``, into vLLM's Prometheus registry).

The byte figures are checked against vLLM's own page size (``FullAttentionSpec.page_size_bytes``)
and the agent's own transport counters, not against numbers written here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402
from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_vllm_preempt import forward, worker  # noqa: E402  (two in-process workers, tcp)

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.connector import RecvReq, SendReq  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.integrations.vllm.stats import KVHandoffStats  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

SEQ = 40  # 3 blocks of 16
DONE_S = 60.0
P_BLOCKS, D_BLOCKS = [1, 2, 3], [11, 5, 13]


def step_until(conn: KVHandoffConnector, n: int, finished: set[str]) -> list[KVHandoffStats]:
    """Engine steps (get_finished, then get_kv_connector_stats, as vLLM's model runner calls
    them) until `n` room records came out; the per-step stats objects."""
    got: list[KVHandoffStats] = []
    deadline = time.monotonic() + DONE_S
    while sum(len(s.rooms) for s in got) < n:
        assert time.monotonic() < deadline, f"{len(got)} stats objects, wanted {n} rooms"
        conn.get_finished(finished)
        st = conn.get_kv_connector_stats()
        if st is not None:
            assert isinstance(st, KVHandoffStats) and not st.is_empty()
            got.append(st)
        else:
            time.sleep(0.02)  # one engine step
    return got


def region_received(conn: KVHandoffConnector) -> dict[str, int]:
    """The decode agent's own counter of verified bytes per region (its status)."""
    return {r: n for d, r, n in conn.agent.status()["region_bytes"] if d == "received"}


def handoffs(bootstrap: str, tmp_path: Path) -> dict[str, Any]:
    """Room A lands (layerwise load), room B is aborted by the prefill before any layer, room C
    names A's room again on the decode (a duplicate request id: the agent refuses to open it).
    Returns each side's step stats and the page size vLLM plans for one block of one layer."""
    mdir = env.model_dir(tmp_path)
    pre, pviews = worker(mdir, "kv_producer", {"bootstrap_url": bootstrap})
    dec, _ = worker(mdir, "kv_consumer", {"layer_timeout_s": DONE_S})
    # the decode's config and vLLM's plan for it, as `worker` builds them
    dcfg = env.vllm_config(mdir, role="kv_consumer", engine_id=env.ENGINE_D)
    dkcc = env.kv_cache_config(dcfg)
    try:
        assert pre.agent.wait_registered(DONE_S)
        room_a, room_b = room_of(env.ENGINE_P, "a"), room_of(env.ENGINE_P, "b")
        with BootstrapClient(bootstrap) as c:
            c.bind_room(room_a, env.ENGINE_P, 0)
            c.bind_room(room_b, env.ENGINE_P, 0)
        assert pre.get_kv_connector_stats() is None  # nothing ended yet
        # step 1: b's last chunk (no layer goes out: its forward is not driven); step 2: b
        # is aborted (the client went away) and a's last chunk runs, layer by layer
        pre.bind_connector_metadata(KVHandoffMetadata(sends={
            "b": SendReq(room=room_b, block_ids=[4, 5, 6], num_tokens=SEQ)}))
        pre.clear_connector_metadata()
        pre.bind_connector_metadata(KVHandoffMetadata(
            aborts={"b": "client went away"},
            sends={"a": SendReq(room=room_a, block_ids=P_BLOCKS, num_tokens=SEQ)}))
        forward(pre, pviews, P_BLOCKS, salt=0)
        pre.clear_connector_metadata()

        host, port = split_addr(bootstrap)
        addr = f"{host}:{port}"
        dec.bind_connector_metadata(KVHandoffMetadata(recvs={
            "a": RecvReq(room=room_a, bootstrap_addr=addr, block_ids=D_BLOCKS, num_tokens=SEQ,
                         local_tokens=0, load_tokens=SEQ - 1, sync=True),
            "c": RecvReq(room=room_a, bootstrap_addr=addr, block_ids=[21, 22, 23],
                         num_tokens=SEQ, local_tokens=0, load_tokens=SEQ, sync=False)}))
        for name in env.layer_names():
            dec.wait_for_layer_load(name)
        assert dec.get_block_ids_with_load_errors() == {21, 22, 23}  # c's, not a's
        dec.clear_connector_metadata()
        d_stats = step_until(dec, 2, set())
        p_stats = step_until(pre, 2, {"a", "b"})
        assert dec.get_kv_connector_stats() is None  # reported once
        assert pre.get_kv_connector_stats() is None
        return {"d": d_stats, "p": p_stats, "d_region": region_received(dec), "d_cfg": dcfg,
                "page_nbytes": dkcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes}
    finally:
        pre.shutdown()
        dec.shutdown()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield handoffs(url, tmp_path_factory.mktemp("stats"))


def merged(stats: list[KVHandoffStats]) -> KVHandoffStats:
    out = KVHandoffStats()
    for s in stats:
        m = out.aggregate(s)
        assert isinstance(m, KVHandoffStats)
        out = m
    return out


def test_each_worker_reports_the_rooms_that_ended(ran: dict[str, Any]) -> None:
    dec, pre = merged(ran["d"]), merged(ran["p"])
    by_ok = {r["ok"]: r for r in dec.rooms}
    assert sorted(r["ok"] for r in dec.rooms) == [False, True]
    a, c = by_ok[True], by_ok[False]
    # whole pages move: the 40 tokens' 3 blocks on each layer, at vLLM's page size
    whole = 3 * env.NUM_LAYERS * ran["page_nbytes"]
    assert a["role"] == "decode" and a["transport"] == "tcp" and a["lane"] == "two_sided"
    assert sum(a["region_bytes"].values()) == a["bytes"]
    assert a["region_bytes"] == ran["d_region"]  # the agent's own transport counters
    assert a["bytes"] == whole
    assert a["transfer_s"] is not None and a["transfer_s"] >= 0
    assert a["tail_s"] is None  # a tail is the prefill's (last layer handed over -> Success)
    assert c == {**c, "reason": "not_opened", "bytes": 0, "region_bytes": {}}

    assert sorted(r["ok"] for r in pre.rooms) == [False, True]
    pa = next(r for r in pre.rooms if r["ok"])
    pb = next(r for r in pre.rooms if not r["ok"])
    assert pa["role"] == "prefill" and pa["bytes"] == a["bytes"]
    assert pa["region_bytes"] == a["region_bytes"]
    assert pa["tail_s"] is not None and pa["transfer_s"] is not None
    assert pa["transfer_s"] >= pa["tail_s"] >= 0
    assert pb["reason"] == "aborted" and pb["bytes"] == 0


def test_aggregate_over_two_workers_sums_and_reduce_is_the_log_line(ran: dict[str, Any]
                                                                     ) -> None:
    """vLLM's own aggregator (the executor's, over three workers' step outputs, one with
    nothing to report) sums them."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    dec, pre = merged(ran["d"]), merged(ran["p"])
    outs: list[ModelRunnerOutput | None] = [
        ModelRunnerOutput(req_ids=[], req_id_to_index={},
                          kv_connector_output=KVConnectorOutput(kv_connector_stats=s))
        for s in (dec, None, pre)]
    agg = KVOutputAggregator(expected_finished_count=3).aggregate(outs)
    assert agg is not None and agg.kv_connector_output is not None
    both = agg.kv_connector_output.kv_connector_stats
    assert isinstance(both, KVHandoffStats)
    assert len(both.rooms) == len(dec.rooms) + len(pre.rooms) == 4
    assert len(dec.rooms) == 2  # aggregate made a new object: its inputs are unchanged
    red = both.reduce()
    moved = sum(r["bytes"] for r in both.rooms if r["ok"])
    assert red["Rooms done"] == 2 and red["Rooms failed"] == 2
    assert red["Failed aborted"] == 1 and red["Failed not_opened"] == 1
    assert red["Rooms two-sided"] == 2 and red["Rooms one-sided"] == 0
    assert red["Rooms over tcp"] == 2
    assert red["MB moved"] == round(moved / 2**20, 3)
    assert red["Retransmits"] == 0
    for key in ("Avg transfer (ms)", "P90 transfer (ms)", "Max transfer (ms)", "Avg tail (ms)"):
        assert red[key] >= 0, key
    assert all(isinstance(v, (int, float)) for v in red.values())
    empty = KVHandoffStats()
    assert empty.is_empty() and empty.aggregate(KVHandoffStats()).is_empty()
    both.reset()
    assert both.is_empty()


def test_vllm_serializes_logs_and_exports_the_stats(ran: dict[str, Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    cfg = ran["d_cfg"]
    dec = merged(ran["d"])
    # the scheduler sends to_dict() to the front end inside SchedulerStats, msgpack-encoded
    wire = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=dec.to_dict()))
    got = MsgpackDecoder(SchedulerStats).decode(wire)
    assert got.kv_connector_stats == dec.to_dict()

    lines: list[str] = []
    logging = KVConnectorLogging(cfg.kv_transfer_config)  # resolves our class by module path
    for s in ran["d"]:
        logging.observe(MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(
            SchedulerStats(kv_connector_stats=s.to_dict()))).kv_connector_stats)
    logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: Rooms done=1, "), lines
    assert "Failed not_opened=1" in lines[0] and "Rooms over tcp=1" in lines[0]

    unregister_vllm_metrics()
    try:
        prom = PrometheusStatLogger(cfg, engine_indexes=[0])
        for s in [*ran["d"], *ran["p"]]:
            prom.record(scheduler_stats=SchedulerStats(kv_connector_stats=s.to_dict()),
                        iteration_stats=None, engine_idx=0)
        text = generate_latest(REGISTRY).decode()
    finally:
        unregister_vllm_metrics()
    assert "vllm:kvhandoff_" in text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("vllm:kvhandoff_"):
                labels = {k: v for k, v in smp.labels.items() if k not in ("model_name",)}
                samples[(smp.name, tuple(sorted(labels.items())))] = smp.value

    def val(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"engine": "0", **labels}.items())))]

    a = next(r for r in dec.rooms if r["ok"])
    for role in ("decode", "prefill"):
        assert val("vllm:kvhandoff_rooms_done_total", role=role, lane="two_sided",
                   transport="tcp") == 1
        for region, n in a["region_bytes"].items():
            assert val("vllm:kvhandoff_bytes_total", role=role, region=region) == n
        assert val("vllm:kvhandoff_transfer_time_seconds_count", role=role) == 1
        assert val("vllm:kvhandoff_room_bytes_sum", role=role) == a["bytes"]
    assert val("vllm:kvhandoff_rooms_failed_total", role="decode", reason="not_opened") == 1
    assert val("vllm:kvhandoff_rooms_failed_total", role="prefill", reason="aborted") == 1
    assert val("vllm:kvhandoff_tail_seconds_count", role="prefill") == 1
    assert ("vllm:kvhandoff_tail_seconds_count",
            (("engine", "0"), ("role", "decode"))) not in samples


def test_reduce_quantiles_failures_only_and_bad_payloads() -> None:
    """The log line's percentiles match numpy's; an interval of failures only still reports
    them (no timing keys); a payload of another shape is refused naming what it lacks."""
    import numpy as np

    from kvhandoff.integrations.vllm.stats import refused_record

    times = [0.004, 0.001, 0.009, 0.002, 0.030, 0.007, 0.005]
    recs = [{**refused_record(role="decode", transport="shm"), "ok": True, "reason": None,
             "bytes": 1 << 20, "region_bytes": {"kv": 3 << 18, "indexer": 1 << 18},
             "transfer_s": t} for t in times]
    red = KVHandoffStats(data={"rooms": recs}).reduce()
    assert red["P90 transfer (ms)"] == round(1e3 * float(np.percentile(times, 90)), 3)
    assert red["Avg transfer (ms)"] == round(1e3 * float(np.mean(times)), 3)
    assert red["Max transfer (ms)"] == 30.0
    assert red["MB moved"] == 7 and red["MB kv"] == 5.25 and red["MB indexer"] == 1.75
    assert "Avg tail (ms)" not in red  # no tail samples (decode records)

    only_failed = KVHandoffConnector.build_kv_connector_stats(
        {"rooms": [refused_record(role="prefill", transport="tcp")] * 2})
    assert not only_failed.is_empty()
    assert only_failed.reduce() == {"Rooms done": 0, "Rooms failed": 2, "Failed not_opened": 2}
    assert KVHandoffConnector.build_kv_connector_stats(None).is_empty()
    with pytest.raises(ValueError, match="rooms"):
        KVHandoffConnector.build_kv_connector_stats({"transfer_duration": []})

