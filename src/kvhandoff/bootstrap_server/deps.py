"""Dependencies shared by the routers: the app's state, settings, registry, metrics and the
write-route bearer-token check.

Rules: dependencies are ``async def`` so they run on the event loop (a plain ``def`` would hop
to the thread pool on every request). Everything a route needs comes through `Depends` from
`app.state.kvhandoff` (set by `create_app`), never from a module global, so several apps can
live in one process. The token check fails closed and compares in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from kvhandoff.bootstrap_server.metrics import Metrics
from kvhandoff.bootstrap_server.registry import Registry
from kvhandoff.bootstrap_server.sglang_answers import SglangRoutes
from kvhandoff.bootstrap_server.views import ReadyCache
from kvhandoff.errors import BootstrapUnauthorized
from kvhandoff.settings import AuthMode, Settings


@dataclass(slots=True)
class ServerState:
    settings: Settings
    registry: Registry
    metrics: Metrics
    clock: Callable[[], float]
    sglang_routes: SglangRoutes
    auth: AuthMode = AuthMode.SECRET
    ready_cache: ReadyCache = field(default_factory=ReadyCache)
    sweeping: bool = False  # an expiry sweep is scheduled on the loop (`sweep_soon`)

    def sweep_soon(self) -> None:
        """Schedules the registry's bounded expiry passes on the event loop, one per loop
        turn (`call_soon`: requests, `/health` and `/ready` included, run between them), while
        a mass expiry is pending; called on the loop by every routed request."""
        if self.sweeping or not self.registry.expiry_pending():
            return
        self.sweeping = True
        asyncio.get_running_loop().call_soon(self._sweep)

    def _sweep(self) -> None:
        more = False
        try:
            more = self.registry.expire_step()
        finally:
            if more:
                asyncio.get_running_loop().call_soon(self._sweep)
            else:
                self.sweeping = False


async def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvhandoff
    state.sweep_soon()
    return state


StateDep = Annotated[ServerState, Depends(get_state)]


async def get_registry(state: StateDep) -> Registry:
    return state.registry


async def get_settings(state: StateDep) -> Settings:
    return state.settings


async def get_metrics(state: StateDep) -> Metrics:
    return state.metrics


RegistryDep = Annotated[Registry, Depends(get_registry)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def require_write_token(request: Request, settings: SettingsDep) -> None:
    """When `settings.auth_token` is set, a write needs ``Authorization: Bearer <token>``."""
    if settings.auth_token is None:
        return
    expected = settings.auth_token.get_secret_value().encode()
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise BootstrapUnauthorized(
            "Authorization: this write route needs 'Authorization: Bearer <token>' "
            "(KVHANDOFF_AUTH_TOKEN)"
        )
    if not hmac.compare_digest(given.strip().encode(), expected):
        raise BootstrapUnauthorized("Authorization: bearer token does not match")


WriteAuth = Depends(require_write_token)
