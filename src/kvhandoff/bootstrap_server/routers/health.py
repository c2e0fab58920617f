"""`/health` (alive), `/ready` (every expected rank live), `/metrics` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from kvhandoff.bootstrap_server.deps import MetricsDep, RegistryDep, SettingsDep, StateDep
from kvhandoff.bootstrap_server.metrics import CONTENT_TYPE
from kvhandoff.bootstrap_server.schemas import ReadyStatus

health = APIRouter(tags=["health"])


@health.get("/health", response_class=PlainTextResponse)
async def alive() -> str:
    """200 "OK" while the process serves (SGLang's health check answers the same)."""
    return "OK"


@health.get("/ready", response_model=ReadyStatus,
            responses={503: {"model": ReadyStatus, "description": "Ranks missing."}})
async def ready(registry: RegistryDep, settings: SettingsDep, state: StateDep) -> JSONResponse:
    """200 only when an engine is known and every expected rank (dp x tp x cp x pp of each
    known engine, by unique identity) is registered and live; else 503 with what is missing
    (exact counts, samples of at most 16; an engine is known while it has a live rank).
    ``auth`` says how the server authenticates writes (``off``: no token on a non-loopback host)."""
    st = state.ready_cache.get(registry, require_rdma=settings.require_rdma).model_copy(
        update={"auth": state.auth.value})
    return JSONResponse(st.model_dump(mode="json"), status_code=200 if st.ready else 503)


@health.get("/metrics", response_class=Response)
async def metrics(m: MetricsDep) -> Response:
    """Prometheus text format."""
    return Response(m.render(), media_type=CONTENT_TYPE)
