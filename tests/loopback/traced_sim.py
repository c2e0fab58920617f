"""``python -m traced_sim prefill|decode '<json config>'``: `kvhandoff.engine_sim` with an
OpenTelemetry SDK `TracerProvider` whose exporter keeps the spans in memory; when the side is
done it prints them as one ``spans`` event (names, ids in hex, parent, links, attributes,
events, status), so a test sees both processes' spans of a handoff."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def as_json(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    assert ctx is not None
    return {
        "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "remote_parent": bool(s.parent is not None and s.parent.is_remote),
        "links": [{"trace_id": f"{lk.context.trace_id:032x}",
                   "span_id": f"{lk.context.span_id:016x}"} for lk in s.links],
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in s.events],
        "status": s.status.status_code.name, "start": s.start_time, "end": s.end_time,
    }


def main() -> int:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    from kvhandoff.engine_sim import engine as sim

    rc = sim.main(sys.argv[1:])
    provider.force_flush()
    spans = [as_json(s) for s in exporter.get_finished_spans()]
    sys.stdout.write(json.dumps({"event": "spans", "t": time.monotonic(), "spans": spans})
                     + "\n")
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
