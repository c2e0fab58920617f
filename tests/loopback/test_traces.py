"""One trace per handoff across two processes (the otel extra): a real bootstrap server, a
prefill and a decode process (`traced_sim`: `kvhandoff.engine_sim` with the OpenTelemetry SDK's
in-memory exporter) over tcp on 127.0.0.1. The span tree of a handoff and of a failed one,
and the per-request timings the processes report come from the same timelines. Without
opentelemetry installed, nothing of it is imported and rooms are still timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed "
                    "(pip install 'kvhandoff[otel]'; make setup installs it)")

from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.engine_sim.process import EngineProcess, spawn  # noqa: E402

HERE = Path(__file__).parent
START_S = DONE_S = 60.0
SEQ = 1000  # 16 pages of 64: 78 layers, more than LAYER_EVENTS: one summary event per side
CHILDREN = {"prefill": {"kvhandoff.handshake", "kvhandoff.layers", "kvhandoff.tail"},
            "decode": {"kvhandoff.bootstrap_lookup", "kvhandoff.handshake", "kvhandoff.layers",
                       "kvhandoff.tail"}}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture
def pair(bootstrap_server: Callable[..., str]) -> Iterator[Callable[..., tuple[EngineProcess,
                                                                             EngineProcess]]]:
    url = bootstrap_server()
    with ExitStack() as stack:
        client = BootstrapClient(url)
        stack.callback(client.close)

        def start(decode_room: dict[str, Any], *, layer_ms: int = 0
                  ) -> tuple[EngineProcess, EngineProcess]:
            (room,) = client.allocate_rooms(1)
            rooms = [{"room": room, "seq_len": SEQ, "request_id": "req-7"}]
            st = {"transport": "tcp", "heartbeat_interval_s": 1.0}
            p = stack.enter_context(spawn("prefill", {
                "rooms": rooms, "settings": {"bootstrap_url": url, **st}, "engine_id": "p",
                "timeout_s": DONE_S, "layer_ms": layer_ms}, env=_env(), module="traced_sim"))
            d = stack.enter_context(spawn("decode", {
                "rooms": [{**rooms[0], **decode_room}], "settings": st, "bootstrap_url": url,
                "timeout_s": DONE_S},
                env=_env(), module="traced_sim"))
            p.expect("ready", START_S)
            assert p.expect("registered", START_S)["ok"]
            client.bind_room(room, "p", 0)
            return p, d

        yield start


def _tree(proc: EngineProcess) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The process's one room span and its children."""
    spans = proc.expect("spans", DONE_S)["spans"]
    (room,) = [s for s in spans if s["name"] == "kvhandoff.room"]
    children = [s for s in spans if s["parent"] == room["span_id"]]
    assert len(children) == len(spans) - 1, "every other span is a child of the room's"
    assert {s["trace_id"] for s in spans} == {room["trace_id"]}
    return room, children


def _by_name(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {s["name"]: s for s in children}
    assert len(out) == len(children), [s["name"] for s in children]  # one leg: one each
    return out


def test_handoff_exports_one_trace_with_both_sides(pair: Callable[..., Any]) -> None:
    p, d = pair({})
    dd, pd = d.expect("done", DONE_S), p.expect("done", DONE_S)
    assert (pd["state"], dd["state"]) == ("Success", "Success"), (pd["failure"], dd["failure"])
    p_room, p_children = _tree(p)
    d_room, d_children = _tree(d)
    # one trace: the decode's room span is a child of the prefill's, across the processes
    assert d_room["trace_id"] == p_room["trace_id"]
    assert p_room["parent"] is None
    assert d_room["parent"] == p_room["span_id"] and d_room["remote_parent"]
    for role, room, children in (("prefill", p_room, p_children),
                                 ("decode", d_room, d_children)):
        a = room["attributes"]
        assert a["kvhandoff.role"] == role and a["kvhandoff.request_id"] == "req-7"
        assert a["kvhandoff.state"] == "Success" and a["kvhandoff.layers"] == 78
        assert a["kvhandoff.transport"] == "tcp" and room["status"] == "UNSET"
        assert a["kvhandoff.bytes"] == dd["stats"]["bytes"]
        kids = _by_name(children)
        assert set(kids) == CHILDREN[role]
        assert all(k["status"] == "UNSET" and room["start"] <= k["start"] <= k["end"]
                   <= room["end"] for k in children)
        (summary,) = kids["kvhandoff.layers"]["events"]
        assert summary["name"] == "kvhandoff.layers_summary"
        assert summary["attributes"]["kvhandoff.layers"] == 78
        assert not room["events"]  # no failure
    # the decode's leg names the prefill agent it asked (found through the bootstrap server)
    peer = _by_name(d_children)["kvhandoff.handshake"]["attributes"]["kvhandoff.peer"]
    assert peer == p.expect("status", DONE_S)["status"]["address"]
    # the processes' per-request timings are the spans' figures
    for proc_done, room, children in ((pd, p_room, p_children), (dd, d_room, d_children)):
        t = proc_done["timings"]
        assert t["request_id"] == "req-7" and t["state"] == "Success" and t["layers"] == 78
        assert t["total_ms"] == round((room["end"] - room["start"]) / 1e6, 3)
        tail = _by_name(children)["kvhandoff.tail"]
        assert t["tail_ms"] == round((tail["end"] - tail["start"]) / 1e6, 3)
    lookup = _by_name(d_children)["kvhandoff.bootstrap_lookup"]
    assert dd["timings"]["bootstrap_lookup_ms"] == round(
        (lookup["end"] - lookup["start"]) / 1e6, 3)


def test_failed_handoff_marks_both_sides_in_one_trace(pair: Callable[..., Any]) -> None:
    # the decode aborts at layer 8 (after the handshake, mid-transfer): both sides fail
    p, d = pair({"abort_at_layer": 8}, layer_ms=50)
    dd, pd = d.expect("done", DONE_S), p.expect("done", DONE_S)
    assert (pd["state"], dd["state"]) == ("Failed", "Failed")
    p_room, p_children = _tree(p)
    d_room, d_children = _tree(d)
    assert d_room["trace_id"] == p_room["trace_id"] and d_room["parent"] == p_room["span_id"]
    for room, children, proc_done in ((p_room, p_children, pd), (d_room, d_children, dd)):
        assert room["status"] == "ERROR"
        (failure,) = room["events"]
        assert failure["name"] == "kvhandoff.failure"
        fa = failure["attributes"]
        assert fa["kvhandoff.failure_kind"] == "aborted"
        assert "decode aborted the request" in fa["kvhandoff.reason"]
        assert room["attributes"]["kvhandoff.failure_kind"] == "aborted"
        assert room["attributes"]["kvhandoff.state"] == "Failed"
        kids = _by_name(children)
        assert "kvhandoff.handshake" in kids
        assert kids["kvhandoff.handshake"]["status"] == "UNSET"  # it completed
        if room is d_room:  # the decode stopped mid-way (the prefill, paced by its engine,
            # may have sent every layer before the abort reached it on a busy host)
            assert room["attributes"]["kvhandoff.layers"] < 78
        assert proc_done["timings"]["failure_kind"] == "aborted"


def test_without_opentelemetry_nothing_is_imported_and_rooms_are_timed() -> None:
    code = textwrap.dedent("""
        import importlib.abc, json, sys

        class NoOtel(importlib.abc.MetaPathFinder):  # as if the extra were not installed
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoOtel())
        import numpy as np
        import kvhandoff
        from kvhandoff.kv_layout import preset
        from kvhandoff.settings import Settings
        from kvhandoff.transfer import TransferAgent
        from kvhandoff.buffers.bufferset import allocate

        spec = preset("glm-5.3")
        s = Settings(transport="inproc", heartbeat_interval_s=2.0)
        with TransferAgent("prefill", spec, allocate(spec, 8), s) as pa, \\
                TransferAgent("decode", spec, allocate(spec, 8), s) as da:
            tx = pa.sender(1, pages=np.arange(2), seq_len=100, request_id="r1")
            rx = da.receiver(1, peer=pa.address, request_id="r1")
            rx.init(np.arange(2) + 4, 100, 0)
            for layer in range(spec.num_layers):
                tx.layer_ready(layer)
            rx.wait(30), tx.wait(30)
            out = {"timings": da.room_timings(1),
                   "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}
        print(json.dumps(out))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["otel"] == []
    t = got["timings"]
    assert (t["state"], t["request_id"], t["layers"]) == ("Success", "r1", 78)
    assert t["total_ms"] is not None and t["total_ms"] >= t["tail_ms"] >= 0


def test_trace_field_is_optional_and_ignored_by_older_peers() -> None:
    import msgspec

    from kvhandoff.protocol import wire as P

    class OldAccepted(msgspec.Struct, tag="transfer_accepted", tag_field="kind", frozen=True):
        """TransferAccepted as a peer from before the trace field declares it."""

        src: str
        gen: int
        room: int
        page_size: int
        src_pages: dict[str, list[int]]
        chunk_end: int = -1
        one_sided: bool = False

    ctx = P.TraceContext(1, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    new = P.TransferAccepted(src="[::1]:7000", gen=5, room=3, page_size=64,
                             src_pages={"main_kv": [1, 2]}, trace=ctx)
    old = msgspec.msgpack.decode(P.encode(new)[1], type=OldAccepted)  # an old decode reads it
    assert (old.room, old.src_pages) == (3, {"main_kv": [1, 2]})
    got = P.decode([P.HEADER, msgspec.msgpack.encode(old)], max_bytes=1 << 20)  # an old prefill
    assert isinstance(got, P.TransferAccepted) and got.trace is None and got.room == 3
    assert P.decode(P.encode(new), max_bytes=1 << 20) == new


def test_decode_reading_two_prefill_ranks_is_parented_and_linked(
        bootstrap_server: Callable[..., str]) -> None:
    """Llama-3.1-8B prefill TP 2 -> decode TP 1: the decode gathers its heads from two prefill
    rank processes. Each rank's room span is the root of its own trace (no engine span around
    them); the decode's room span is a child of the first rank's (in the route's rank order) and
    links to the other's: every prefill rank's span is reachable from the decode's."""
    url = bootstrap_server()
    st = {"transport": "tcp", "heartbeat_interval_s": 1.0}
    common = {"model": "llama-3.1-8b", "page_size": 16, "numpy_buffers": True,
              "timeout_s": DONE_S}
    with ExitStack() as stack:
        client = BootstrapClient(url)
        stack.callback(client.close)
        (room,) = client.allocate_rooms(1)
        rooms = [{"room": room, "seq_len": 100, "request_id": "req-9"}]
        prefill = [stack.enter_context(spawn("prefill", {
            **common, "rooms": rooms, "settings": {"bootstrap_url": url, **st},
            "engine_id": "p", "tp_rank": tp, "tp_size": 2}, env=_env(), module="traced_sim"))
            for tp in (0, 1)]
        addrs = [p.expect("ready", START_S)["address"] for p in prefill]
        assert all(p.expect("registered", START_S)["ok"] for p in prefill)
        client.bind_room(room, "p", 0)
        d = stack.enter_context(spawn("decode", {
            **common, "rooms": rooms, "settings": st, "bootstrap_url": url},
            env=_env(), module="traced_sim"))
        dd = d.expect("done", DONE_S)
        assert dd["state"] == "Success" and dd["verify"]["byte_exact"], dd
        assert dd["stats"]["peers"] == addrs
        assert [p.expect("done", DONE_S)["state"] for p in prefill] == ["Success"] * 2
        p_rooms = [_tree(p)[0] for p in prefill]
        d_room, d_children = _tree(d)
    assert all(r["parent"] is None for r in p_rooms)
    assert p_rooms[0]["trace_id"] != p_rooms[1]["trace_id"]  # two ranks, two roots
    assert (d_room["trace_id"], d_room["parent"]) == (p_rooms[0]["trace_id"],
                                                      p_rooms[0]["span_id"])
    assert d_room["remote_parent"]
    assert d_room["links"] == [{"trace_id": p_rooms[1]["trace_id"],
                                "span_id": p_rooms[1]["span_id"]}]
    assert all(r["links"] == [] for r in p_rooms)
    # one handshake per leg (the legs run concurrently: in no particular order)
    legs = [c["attributes"]["kvhandoff.peer"] for c in d_children
            if c["name"] == "kvhandoff.handshake"]
    assert sorted(legs) == sorted(addrs)
    for r in (*p_rooms, d_room):
        assert r["attributes"]["kvhandoff.request_id"] == "req-9"
