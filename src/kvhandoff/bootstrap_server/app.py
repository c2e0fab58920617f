"""`create_app(settings)`: the FastAPI app of the bootstrap server.

Rules: `create_app` only wires things — routers, middleware, error handlers, the state object,
the fast path of SGLang's ``GET /route`` (`fastpath`) — and holds no logic. Every error leaves
as JSON ``{"error", "detail", ...}`` with a 4xx/5xx status: a `KVHandoffError` by its
`http_status` (one handler), a validation error as 422 whose ``detail`` names each bad field,
an unknown route/method as 404/405. A 500 is a bug.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhandoff.bootstrap_server.access_log import AccessPolicy
from kvhandoff.bootstrap_server.deps import ServerState
from kvhandoff.bootstrap_server.fastpath import BootstrapApp, FastRoutes
from kvhandoff.bootstrap_server.metrics import Metrics
from kvhandoff.bootstrap_server.middleware import BodyLimitMiddleware, MetricsMiddleware
from kvhandoff.bootstrap_server.registry import Registry
from kvhandoff.bootstrap_server.routers.health import health
from kvhandoff.bootstrap_server.routers.ranks import engines, ranks
from kvhandoff.bootstrap_server.routers.rooms import rooms
from kvhandoff.bootstrap_server.routers.route import route
from kvhandoff.bootstrap_server.routers.sglang import sglang
from kvhandoff.bootstrap_server.sglang_answers import SglangRoutes
from kvhandoff.errors import KVHandoffError
from kvhandoff.settings import Settings, listener_auth

log = logging.getLogger("kvhandoff.bootstrap_server")

_HTTP_ERROR_NAMES = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed",
                     413: "PayloadTooLarge"}


def create_app(
    settings: Settings | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    registry: Registry | None = None,
    fast_path: bool = True,
) -> FastAPI:
    """Build the app.

    Args:
        settings: server settings (default: `Settings()` from the environment).
        clock: monotonic seconds for TTLs and retention (tests pass a fake one).
        registry: an existing registry (default: a new one from the settings and clock).
        fast_path: answer SGLang's ``GET /route`` from prepared bytes (`fastpath`); False
            leaves every request to the FastAPI stack (tests compare the two).

    Raises:
        ConfigError: `settings.host` is not a loopback address and `auth_token` is unset
            (unless `allow_unauthenticated`; then the app warns and says ``auth: off``).
    """
    settings = settings or Settings()
    auth = listener_auth(settings, what="bootstrap server", host_setting="host",
                         secret_setting="auth_token")
    registry = registry or Registry(
        clock=clock, rank_ttl_s=settings.rank_ttl_s, room_retention_s=settings.room_retention_s,
        max_live_rooms=settings.max_live_rooms, max_world_size=settings.max_world_size,
        max_engines=settings.max_engines, max_live_ranks=settings.max_live_ranks,
    )
    metrics = Metrics(registry)
    app = BootstrapApp(
        title="kvhandoff bootstrap server",
        version="1",
        description="Prefill ranks register; decode ranks ask where their prefill is. "
        "Native API under /v1, SGLang-compatible routes at /route, /register_dp_rank, "
        "/query_dp_ranks, /health.",
    )
    state = ServerState(settings=settings, registry=registry, metrics=metrics, clock=clock,
                        sglang_routes=SglangRoutes(registry), auth=auth)
    metrics.unauthenticated.set(1 if auth.value == "off" else 0)
    app.state.kvhandoff = state
    # the hot lookup, answered from prepared bytes in front of the stack below (fastpath)
    access = AccessPolicy.from_settings(settings)
    app.fast_routes = FastRoutes(state.sglang_routes, metrics,
                                 access=access) if fast_path else None
    for router in (health, ranks, engines, rooms, route, sglang):
        app.include_router(router)
    _add_error_handlers(app)
    # last added = outermost: metrics see the 413s of the body limit too
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics, access=access)
    return app


def _error(status: int, error: str, detail: str, **extra: Any) -> JSONResponse:
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status == 503:
        headers["Retry-After"] = "1"
    return JSONResponse({"error": error, "detail": detail, **extra}, status_code=status,
                        headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVHandoffError)
    async def kvhandoff_error(request: Request, exc: KVHandoffError) -> JSONResponse:
        if exc.http_status >= 500 and exc.http_status != 503:
            log.error("%s %s: %s", request.method, request.url.path, exc, exc_info=exc)
        extra: dict[str, Any] = {}
        diff = getattr(exc, "diff", None)
        if diff:
            extra["diff"] = list(diff)
        return _error(exc.http_status, type(exc).__name__, str(exc), **extra)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
             "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors) or "invalid"
        return _error(422, "ValidationError", detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        name = _HTTP_ERROR_NAMES.get(exc.status_code, "HTTPError")
        detail = str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        resp = _error(exc.status_code, name, detail)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
        return _error(500, "InternalError", f"{type(exc).__name__}: {exc}")
