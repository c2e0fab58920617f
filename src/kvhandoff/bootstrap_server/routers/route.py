"""`GET /v1/route`: the prefill ranks a decode rank must talk to."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvhandoff.bootstrap_server.deps import MetricsDep, RegistryDep
from kvhandoff.bootstrap_server.routing import route as route_of
from kvhandoff.bootstrap_server.schemas import RouteAnswer, RouteQuery
from kvhandoff.bootstrap_server.views import prefill_rank_info
from kvhandoff.errors import KVHandoffError

route = APIRouter(prefix="/v1", tags=["route"])

OUTCOMES = {400: "bad_request", 404: "not_found", 409: "conflict", 503: "unavailable"}


@route.get("/route", responses={
    400: {"description": "Missing or contradicting inputs, sizes that cannot map."},
    404: {"description": "Unknown room or engine."},
    409: {"description": "Room aborted (the detail says why) or bound elsewhere."},
    503: {"description": "Room not bound yet or prefill ranks not registered yet: retry."},
})
async def lookup_route(q: Annotated[RouteQuery, Query()], registry: RegistryDep,
                       metrics: MetricsDep) -> RouteAnswer:
    """TP mapping: equal sizes 1:1; decode TP D > prefill TP P: `d*P//D`; D < P: the P/D
    ranks `d*P/D ... (d+1)*P/D-1`; `replicated=true`: exactly one rank, `d % P`. CP and PP:
    equal sizes 1:1, a decode size of 1 reads all prefill ranks of that axis."""
    try:
        target = route_of(
            registry, engine_id=q.engine_id, room=q.room, dp_rank=q.dp_rank,
            tp_rank=q.tp_rank, tp_size=q.tp_size, cp_rank=q.cp_rank, cp_size=q.cp_size,
            pp_rank=q.pp_rank, pp_size=q.pp_size, replicated=q.replicated,
        )
    except KVHandoffError as e:
        metrics.route_lookups.labels("native", OUTCOMES.get(e.http_status, "error")).inc()
        raise
    metrics.route_lookups.labels("native", "ok").inc()
    return RouteAnswer(engine_id=target.engine_id, dp_rank=target.dp_rank,
                       ranks=[prefill_rank_info(r) for r in target.ranks])
