"""vLLM's request ids on the room spans (the otel extra): a prefill and a decode request run
through vLLM 0.33's own `Scheduler` on each side (KVHandoffConnector loaded by module path), whose
`KVHandoffMetadata` drives two KVHandoffConnector workers in this process (vLLM allocated CPU
KV, the tcp transport, a real bootstrap server on 127.0.0.1 port 0). The request ids are vLLM's
(``Request.request_id``, as its front end makes them); nothing in this test hands them to the
workers but vLLM's scheduler output.

Each worker agent's spans go to an OpenTelemetry SDK provider of this test with an in-memory
exporter (the agent's tracer is pointed at it; the process's global provider stays unset, so the
other tests of this process trace nothing). Both room spans must carry their side's vLLM request
id as ``kvhandoff.request_id`` (not the room number, which is ``kvhandoff.room``), in one trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")
pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed "
                    "(pip install 'kvhandoff[otel]'; make setup installs it)")

import vllm_env as env  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from test_vllm_preempt import forward, worker  # noqa: E402  (two in-process workers, tcp)
from test_vllm_scheduler import request, scheduler, step_output  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

DONE_S = 60.0
# ids as vLLM's OpenAI front end makes them (cmpl-<hex>-<n>); each side has its own
P_RID, D_RID = "cmpl-5c0ffee1d00d4b8a-0", "cmpl-77aa01be9e3c4f21-0"


@pytest.fixture
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


def traced(conn: KVHandoffConnector, exporter: InMemorySpanExporter) -> None:
    """Points the worker agent's room tracer at a provider exporting to `exporter`."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel = conn.agent._timelines._otel
    assert otel is not None, "opentelemetry is installed: the agent traces its rooms"
    otel._tracer = provider.get_tracer("kvhandoff")


def room_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kvhandoff.room"]
    return span


def test_room_spans_carry_vllms_request_ids(bootstrap: str, tmp_path: Path) -> None:
    init_none_hash(sha256)
    mdir = env.model_dir(tmp_path)
    pre, pviews = worker(mdir, "kv_producer", {"bootstrap_url": bootstrap})
    dec, _ = worker(mdir, "kv_consumer", {"layer_timeout_s": DONE_S})
    p_spans, d_spans = InMemorySpanExporter(), InMemorySpanExporter()
    traced(pre, p_spans)
    traced(dec, d_spans)
    try:
        assert pre.agent.wait_registered(DONE_S)
        # the prefill engine: vLLM schedules the request's prompt, the worker sends it
        ps = scheduler(mdir, "kv_producer", extra={"bootstrap_url": bootstrap})
        ps.add_request(request(P_RID, {"do_remote_decode": True}))
        out = ps.schedule()
        pre.bind_connector_metadata(out.kv_connector_metadata)
        blocks = ps.kv_cache_manager.get_block_ids(P_RID)[0]
        forward(pre, pviews, blocks, salt=0)
        pre.wait_for_save()
        pre.clear_connector_metadata()
        outputs = ps.update_from_output(out, step_output(out, {P_RID: 7}))
        (params,) = [o.kv_transfer_params for eco in outputs.values() for o in eco.outputs
                     if o.request_id == P_RID]
        assert params is not None

        # the decode engine: its own request with the prefill's params, loaded layer by layer
        ds = scheduler(mdir, "kv_consumer", extra={"load_mode": "layerwise"})
        ds.add_request(request(D_RID, dict(params)))
        out = ds.schedule()
        assert D_RID in out.kv_connector_metadata.recvs
        dec.bind_connector_metadata(out.kv_connector_metadata)
        for name in env.layer_names():
            dec.wait_for_layer_load(name)
        assert dec.get_block_ids_with_load_errors() == set()
        dec.clear_connector_metadata()
        # the prefill's next step: vLLM passes the request it finished; once the decode has
        # read it, the worker reports it (its room ended)
        finished = ps.schedule().finished_req_ids
        assert finished == {P_RID}
        sent, _ = pre.get_finished(finished)
        assert (sent or env.finished_sending(pre, DONE_S)) == {P_RID}
    finally:
        pre.shutdown()
        dec.shutdown()

    room = room_of(env.ENGINE_P, P_RID)
    p_room, d_room = room_span(p_spans), room_span(d_spans)
    for span, role, rid in ((p_room, "prefill", P_RID), (d_room, "decode", D_RID)):
        a: dict[str, Any] = dict(span.attributes or {})
        assert (a["kvhandoff.role"], a["kvhandoff.state"]) == (role, "Success")
        assert a["kvhandoff.request_id"] == rid  # vLLM's id of this side's request ...
        assert a["kvhandoff.room"] == room and str(room) != rid  # ... not the room number
    # one trace: the decode's room span under the prefill's (its context crossed the wire)
    assert p_room.context is not None and d_room.parent is not None
    assert d_room.context is not None and d_room.context.trace_id == p_room.context.trace_id
    assert d_room.parent.span_id == p_room.context.span_id
