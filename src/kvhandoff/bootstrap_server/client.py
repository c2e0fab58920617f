"""`BootstrapClient` (sync) and `AsyncBootstrapClient`: what transfer agents call.

Stable signatures (both clients; the async one's methods are coroutines)::

    BootstrapClient(base_url, *, token=None, request_timeout_s=5.0, total_wait_s=30.0,
                    backoff_initial_s=0.05, backoff_max_s=1.0, transport=None)
    BootstrapClient.from_settings(settings, **kw)        # bootstrap_url + auth_token
    register_rank(*, engine_id, role, agent_address, generation, layout,
                  dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, cp_rank=0, cp_size=1,
                  pp_rank=0, pp_size=1, transport="ucx", layout_hash=None) -> RankRegistered
    heartbeat(*, engine_id, dp_rank=0, tp_rank=0, cp_rank=0, pp_rank=0,
              generation=None) -> HeartbeatAck           # BootstrapNotFound: register again
    deregister(*, engine_id, dp_rank=0, tp_rank=0, cp_rank=0, pp_rank=0,
               generation=None) -> RankPublic
    topology(engine_id) -> EngineTopology
    allocate_rooms(count=1) -> list[int]
    bind_room(room, engine_id, dp_rank) -> RoomPublic
    lookup_route(*, engine_id=None, room=None, dp_rank=None, tp_rank=0, tp_size=1,
                 cp_rank=0, cp_size=1, pp_rank=0, pp_size=1,
                 replicated=False) -> list[PrefillRankInfo]
    abort_room(room, reason) -> RoomPublic
    room(room) -> RoomPublic
    ready() -> ReadyStatus                               # 200 or 503 alike; no retry
    close()                                              # also a context manager

Rules: connect errors and 503 answers are retried with exponential backoff (jittered, capped
at ``backoff_max_s``) until ``total_wait_s`` has passed since the call began; then
`BootstrapUnavailable`. Other error statuses raise at once, by class: 401
`BootstrapUnauthorized`, 404 `BootstrapNotFound`, 409 `BootstrapConflict` (with ``diff``),
400/413/422 `BootstrapBadRequest`, anything else `BootstrapError`. Every message names the
method, the URL and the server's detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from kvhandoff.bootstrap_server.schemas import (
    EngineTopology,
    HeartbeatAck,
    PrefillRankInfo,
    RankPublic,
    RankRegistered,
    ReadyStatus,
    RoomPublic,
    RoomsAllocated,
    RouteAnswer,
)
from kvhandoff.errors import (
    BootstrapBadRequest,
    BootstrapConflict,
    BootstrapError,
    BootstrapNotFound,
    BootstrapUnauthorized,
    BootstrapUnavailable,
    ConfigError,
)
from kvhandoff.settings import Settings

T = TypeVar("T")

_STATUS_ERRORS: dict[int, type[BootstrapError]] = {
    400: BootstrapBadRequest,
    401: BootstrapUnauthorized,
    404: BootstrapNotFound,
    413: BootstrapBadRequest,
    422: BootstrapBadRequest,
    503: BootstrapUnavailable,
}


@dataclass(slots=True)
class _Req:
    method: str
    path: str
    parse: Callable[[Any], Any]
    json: Any = None
    params: dict[str, Any] | None = None
    retry_unavailable: bool = True
    accept: frozenset[int] = field(default_factory=frozenset)  # extra statuses that parse


def _identity(engine_id: str, dp_rank: int, tp_rank: int, cp_rank: int, pp_rank: int
              ) -> dict[str, Any]:
    return {"engine_id": engine_id, "dp_rank": dp_rank, "tp_rank": tp_rank,
            "cp_rank": cp_rank, "pp_rank": pp_rank}


def _layout_dict(layout: Any) -> dict[str, Any]:
    if isinstance(layout, dict):
        return layout
    to_dict = getattr(layout, "to_dict", None)
    if to_dict is None:
        raise ConfigError(f"layout: expected a LayoutSpec or dict, got {type(layout).__name__}")
    out: dict[str, Any] = to_dict()
    return out


class _Requests:
    """Builds the request of each API call (shared by the sync and async clients)."""

    @staticmethod
    def register_rank(*, engine_id: str, role: Any, agent_address: str, generation: str,
                      layout: Any, dp_rank: int, dp_size: int, tp_rank: int, tp_size: int,
                      cp_rank: int, cp_size: int, pp_rank: int, pp_size: int,
                      transport: str, layout_hash: str | None) -> _Req:
        body = {
            **_identity(engine_id, dp_rank, tp_rank, cp_rank, pp_rank),
            "role": getattr(role, "value", role),
            "dp_size": dp_size, "tp_size": tp_size, "cp_size": cp_size, "pp_size": pp_size,
            "agent_address": agent_address, "generation": generation,
            "layout": _layout_dict(layout), "transport": transport,
        }
        if layout_hash is not None:
            body["layout_hash"] = layout_hash
        return _Req("POST", "/v1/ranks", RankRegistered.model_validate, json=body)

    @staticmethod
    def lookup_route(*, engine_id: str | None, room: int | None, dp_rank: int | None,
                     tp_rank: int, tp_size: int, cp_rank: int, cp_size: int, pp_rank: int,
                     pp_size: int, replicated: bool) -> _Req:
        params: dict[str, Any] = {"tp_rank": tp_rank, "tp_size": tp_size, "cp_rank": cp_rank,
                                  "cp_size": cp_size, "pp_rank": pp_rank, "pp_size": pp_size,
                                  "replicated": "true" if replicated else "false"}
        for k, v in (("engine_id", engine_id), ("room", room), ("dp_rank", dp_rank)):
            if v is not None:
                params[k] = v
        return _Req("GET", "/v1/route", lambda d: RouteAnswer.model_validate(d).ranks,
                    params=params)


_ClientT = TypeVar("_ClientT", bound="_Base")
_tls_lock = threading.Lock()
_tls: ssl.SSLContext | None = None  # the process's one TLS context (`tls_context`)


def tls_context() -> ssl.SSLContext:
    """The TLS context every bootstrap client of this process shares (httpx's default: the
    certifi bundle), built on first use. httpx builds one per client otherwise, whatever the
    URL's scheme: 30 ms of CPU alone, and 0.6-1 s each when three threads built theirs at
    once on a loaded 2-core host (OpenSSL 3.0). A prefill agent built two (its registration,
    its deregistration), a decode agent one (its route lookups), as agents start and stop
    beside others whose control loops need the CPU then. The context verifies certificates
    as httpx's own does (`SSL_CERT_FILE` / `SSL_CERT_DIR` read once)."""
    global _tls
    with _tls_lock:
        if _tls is None:
            _tls = httpx.create_ssl_context()
        return _tls


class _Base:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        request_timeout_s: float = 5.0,
        total_wait_s: float = 30.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 1.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"bootstrap_url: expected http://host:port, got {base_url!r}")
        if total_wait_s < 0 or backoff_initial_s <= 0 or backoff_max_s <= 0:
            raise ConfigError("total_wait_s must be >= 0 and the backoffs > 0")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._request_timeout_s = request_timeout_s
        self.total_wait_s = total_wait_s
        self._backoff = (backoff_initial_s, backoff_max_s)

    @classmethod
    def from_settings(cls: type[_ClientT], settings: Settings, **kw: Any) -> _ClientT:
        """A client of ``settings.bootstrap_url`` with its token (`ConfigError` when unset)."""
        if not settings.bootstrap_url:
            raise ConfigError("bootstrap_url: not set (KVHANDOFF_BOOTSTRAP_URL)")
        token = settings.auth_token.get_secret_value() if settings.auth_token else None
        return cls(settings.bootstrap_url, token=token, **kw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def _where(self, req: _Req) -> str:
        return f"{req.method} {self.base_url}{req.path}"

    def _next_delay(self, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before the next try, or None when the total wait is spent."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        first, cap = self._backoff
        delay = min(cap, first * float(1 << min(attempt, 30))) * (0.5 + random.random() / 2)
        return min(delay, left)

    def _outcome(self, req: _Req, resp: httpx.Response) -> tuple[bool, Any]:
        """(done, value-or-error). Not done = retry (503 on a retrying call)."""
        if resp.status_code < 300 or resp.status_code in req.accept:
            try:
                return True, req.parse(resp.json())
            except ValueError as e:
                return True, BootstrapError(f"{self._where(req)}: unreadable answer: {e}")
        detail, diff = _detail(resp)
        cls = _STATUS_ERRORS.get(resp.status_code, BootstrapError)
        msg = f"{self._where(req)}: {resp.status_code} {detail}"
        err: BootstrapError = (BootstrapConflict(msg, diff) if resp.status_code == 409
                               else cls(msg))
        if resp.status_code == 503 and req.retry_unavailable:
            return False, err
        return True, err

    def _gave_up(self, req: _Req, tries: int, last: BaseException | None) -> BootstrapError:
        if isinstance(last, BootstrapUnavailable):
            return BootstrapUnavailable(
                f"{last} (still unavailable after {self.total_wait_s:g} s, {tries} tries)")
        return BootstrapUnavailable(
            f"{self._where(req)}: server unreachable after {self.total_wait_s:g} s, "
            f"{tries} tries: {type(last).__name__}: {last}")


def _detail(resp: httpx.Response) -> tuple[str, list[str]]:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500], []
    if isinstance(body, dict):
        diff = body.get("diff") or []
        return str(body.get("detail", body))[:2000], [str(x) for x in diff]
    return str(body)[:500], []


class BootstrapClient(_Base):
    """Synchronous client (httpx). See the module docstring for the methods."""

    def __init__(self, base_url: str, *, transport: httpx.BaseTransport | None = None,
                 stop: threading.Event | None = None, **kw: Any) -> None:
        """`stop`: once set, a call in its retries gives up at once (`BootstrapUnavailable`),
        so the thread making it can be joined before the client is closed."""
        super().__init__(base_url, **kw)
        self._stop = stop
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers,
                                  timeout=self._request_timeout_s, transport=transport,
                                  verify=tls_context())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, req: _Req) -> Any:
        deadline = time.monotonic() + self.total_wait_s
        tries = 0
        last: BaseException | None = None
        while True:
            tries += 1
            try:
                resp = self._http.request(req.method, req.path, json=req.json,
                                          params=req.params)
            except httpx.TransportError as e:
                last = e
            else:
                done, value = self._outcome(req, resp)
                if done:
                    if isinstance(value, BaseException):
                        raise value
                    return value
                last = value
            delay = self._next_delay(tries, deadline)
            if delay is None:
                raise self._gave_up(req, tries, last) from last
            if self._stop is None:
                time.sleep(delay)
            elif self._stop.wait(delay):
                raise BootstrapUnavailable(f"{self._where(req)}: stopped after {tries} tries"
                                           ) from last

    # -- ranks ----------------------------------------------------------------------------

    def register_rank(self, *, engine_id: str, role: Any, agent_address: str, generation: str,
                      layout: Any, dp_rank: int = 0, dp_size: int = 1, tp_rank: int = 0,
                      tp_size: int = 1, cp_rank: int = 0, cp_size: int = 1, pp_rank: int = 0,
                      pp_size: int = 1, transport: str = "ucx",
                      layout_hash: str | None = None) -> RankRegistered:
        """Register (or replace) a rank. `layout` is a LayoutSpec or its dict."""
        out: RankRegistered = self._call(_Requests.register_rank(
            engine_id=engine_id, role=role, agent_address=agent_address, generation=generation,
            layout=layout, dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size,
            cp_rank=cp_rank, cp_size=cp_size, pp_rank=pp_rank, pp_size=pp_size,
            transport=transport, layout_hash=layout_hash))
        return out

    def heartbeat(self, *, engine_id: str, dp_rank: int = 0, tp_rank: int = 0,
                  cp_rank: int = 0, pp_rank: int = 0,
                  generation: str | None = None) -> HeartbeatAck:
        """Keep the rank live. `BootstrapNotFound`: the server dropped it; register again."""
        body = {**_identity(engine_id, dp_rank, tp_rank, cp_rank, pp_rank),
                "generation": generation}
        out: HeartbeatAck = self._call(
            _Req("POST", "/v1/ranks/heartbeat", HeartbeatAck.model_validate, json=body))
        return out

    def deregister(self, *, engine_id: str, dp_rank: int = 0, tp_rank: int = 0,
                   cp_rank: int = 0, pp_rank: int = 0,
                   generation: str | None = None) -> RankPublic:
        body = {**_identity(engine_id, dp_rank, tp_rank, cp_rank, pp_rank),
                "generation": generation}
        out: RankPublic = self._call(
            _Req("POST", "/v1/ranks/deregister", RankPublic.model_validate, json=body))
        return out

    def topology(self, engine_id: str) -> EngineTopology:
        out: EngineTopology = self._call(
            _Req("GET", f"/v1/engines/{engine_id}", EngineTopology.model_validate))
        return out

    # -- rooms ----------------------------------------------------------------------------

    def allocate_rooms(self, count: int = 1) -> list[int]:
        out: list[int] = self._call(_Req("POST", "/v1/rooms",
                                         lambda d: RoomsAllocated.model_validate(d).rooms,
                                         json={"count": count}))
        return out

    def bind_room(self, room: int, engine_id: str, dp_rank: int) -> RoomPublic:
        out: RoomPublic = self._call(_Req("POST", f"/v1/rooms/{room}/bind",
                                          RoomPublic.model_validate,
                                          json={"engine_id": engine_id, "dp_rank": dp_rank}))
        return out

    def abort_room(self, room: int, reason: str) -> RoomPublic:
        out: RoomPublic = self._call(_Req("POST", f"/v1/rooms/{room}/abort",
                                          RoomPublic.model_validate, json={"reason": reason}))
        return out

    def room(self, room: int) -> RoomPublic:
        out: RoomPublic = self._call(_Req("GET", f"/v1/rooms/{room}", RoomPublic.model_validate))
        return out

    # -- routes and readiness -------------------------------------------------------------

    def lookup_route(self, *, engine_id: str | None = None, room: int | None = None,
                     dp_rank: int | None = None, tp_rank: int = 0, tp_size: int = 1,
                     cp_rank: int = 0, cp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                     replicated: bool = False) -> list[PrefillRankInfo]:
        """The prefill ranks to talk to; retries while the room is unbound or ranks missing."""
        out: list[PrefillRankInfo] = self._call(_Requests.lookup_route(
            engine_id=engine_id, room=room, dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size,
            cp_rank=cp_rank, cp_size=cp_size, pp_rank=pp_rank, pp_size=pp_size,
            replicated=replicated))
        return out

    def ready(self) -> ReadyStatus:
        """The server's readiness (ready or not); no retry on 503."""
        out: ReadyStatus = self._call(_Req("GET", "/ready", ReadyStatus.model_validate,
                                           retry_unavailable=False, accept=frozenset({503})))
        return out


class AsyncBootstrapClient(_Base):
    """Asynchronous client (httpx.AsyncClient); same methods as `BootstrapClient`, awaited."""

    def __init__(self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None,
                 gate: asyncio.Semaphore | None = None, **kw: Any) -> None:
        """`gate`: held around each request on the wire (not across the waits between
        retries), so a caller bounds how many are in flight at once."""
        super().__init__(base_url, **kw)
        self._gate = gate
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                       timeout=self._request_timeout_s, transport=transport,
                                       verify=tls_context())

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBootstrapClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, req: _Req) -> Any:
        deadline = time.monotonic() + self.total_wait_s
        tries = 0
        last: BaseException | None = None
        while True:
            tries += 1
            try:
                async with self._gate or contextlib.nullcontext():
                    resp = await self._http.request(req.method, req.path, json=req.json,
                                                    params=req.params)
            except httpx.TransportError as e:
                last = e
            else:
                done, value = self._outcome(req, resp)
                if done:
                    if isinstance(value, BaseException):
                        raise value
                    return value
                last = value
            delay = self._next_delay(tries, deadline)
            if delay is None:
                raise self._gave_up(req, tries, last) from last
            await asyncio.sleep(delay)

    async def register_rank(self, *, engine_id: str, role: Any, agent_address: str,
                            generation: str, layout: Any, dp_rank: int = 0, dp_size: int = 1,
                            tp_rank: int = 0, tp_size: int = 1, cp_rank: int = 0,
                            cp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                            transport: str = "ucx",
                            layout_hash: str | None = None) -> RankRegistered:
        out: RankRegistered = await self._call(_Requests.register_rank(
            engine_id=engine_id, role=role, agent_address=agent_address, generation=generation,
            layout=layout, dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size,
            cp_rank=cp_rank, cp_size=cp_size, pp_rank=pp_rank, pp_size=pp_size,
            transport=transport, layout_hash=layout_hash))
        return out

    async def heartbeat(self, *, engine_id: str, dp_rank: int = 0, tp_rank: int = 0,
                        cp_rank: int = 0, pp_rank: int = 0,
                        generation: str | None = None) -> HeartbeatAck:
        body = {**_identity(engine_id, dp_rank, tp_rank, cp_rank, pp_rank),
                "generation": generation}
        out: HeartbeatAck = await self._call(
            _Req("POST", "/v1/ranks/heartbeat", HeartbeatAck.model_validate, json=body))
        return out

    async def deregister(self, *, engine_id: str, dp_rank: int = 0, tp_rank: int = 0,
                         cp_rank: int = 0, pp_rank: int = 0,
                         generation: str | None = None) -> RankPublic:
        body = {**_identity(engine_id, dp_rank, tp_rank, cp_rank, pp_rank),
                "generation": generation}
        out: RankPublic = await self._call(
            _Req("POST", "/v1/ranks/deregister", RankPublic.model_validate, json=body))
        return out

    async def topology(self, engine_id: str) -> EngineTopology:
        out: EngineTopology = await self._call(
            _Req("GET", f"/v1/engines/{engine_id}", EngineTopology.model_validate))
        return out

    async def allocate_rooms(self, count: int = 1) -> list[int]:
        out: list[int] = await self._call(_Req("POST", "/v1/rooms",
                                               lambda d: RoomsAllocated.model_validate(d).rooms,
                                               json={"count": count}))
        return out

    async def bind_room(self, room: int, engine_id: str, dp_rank: int) -> RoomPublic:
        out: RoomPublic = await self._call(_Req(
            "POST", f"/v1/rooms/{room}/bind", RoomPublic.model_validate,
            json={"engine_id": engine_id, "dp_rank": dp_rank}))
        return out

    async def abort_room(self, room: int, reason: str) -> RoomPublic:
        out: RoomPublic = await self._call(_Req("POST", f"/v1/rooms/{room}/abort",
                                                RoomPublic.model_validate,
                                                json={"reason": reason}))
        return out

    async def room(self, room: int) -> RoomPublic:
        out: RoomPublic = await self._call(
            _Req("GET", f"/v1/rooms/{room}", RoomPublic.model_validate))
        return out

    async def lookup_route(self, *, engine_id: str | None = None, room: int | None = None,
                           dp_rank: int | None = None, tp_rank: int = 0, tp_size: int = 1,
                           cp_rank: int = 0, cp_size: int = 1, pp_rank: int = 0,
                           pp_size: int = 1,
                           replicated: bool = False) -> list[PrefillRankInfo]:
        out: list[PrefillRankInfo] = await self._call(_Requests.lookup_route(
            engine_id=engine_id, room=room, dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size,
            cp_rank=cp_rank, cp_size=cp_size, pp_rank=pp_rank, pp_size=pp_size,
            replicated=replicated))
        return out

    async def ready(self) -> ReadyStatus:
        out: ReadyStatus = await self._call(_Req("GET", "/ready", ReadyStatus.model_validate,
                                                 retry_unavailable=False,
                                                 accept=frozenset({503})))
        return out
