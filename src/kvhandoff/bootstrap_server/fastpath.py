"""The fast path of the hot lookup: SGLang's ``GET /route`` answered in front of FastAPI.

Rules: every decode request asks ``GET /route`` for its prefill rank, and the answer changes
only when a rank registers or leaves, so `SglangRoutes` prepares it once per change and this
layer sends the prepared bytes without routing, dependency injection, validation or
serialisation. It answers only a plain ``GET /route`` without a body; anything else (another
path or method, a body, a query the prepared answers do not cover, e.g. a parameter too long)
goes to the FastAPI app unchanged, so validation, auth, body limits and the 4xx answers stay
what they are. The answers are the same bytes the FastAPI route sends (both come from
`SglangRoutes`), and the metrics count them the same way: ``requests`` and ``request_seconds``
under the route template ``/route``, ``route_lookups`` under ``api="sglang"``.

Two layers do it. `BootstrapApp` (the FastAPI app itself) answers before its middleware stack
runs, under any ASGI server. `http_protocol()` gives uvicorn, when ``httptools`` is installed,
a protocol that answers at the parser callback: no ASGI scope, task or per-request objects,
just the prepared bytes written to the socket with uvicorn's own default headers (date,
server) and keep-alive. It takes the request only when nothing else is in flight on the
connection (so pipelined answers stay in order) and hands everything else to uvicorn's own code
path. Its access line and slow-request warning follow `access_log.AccessPolicy`: by default a
``GET /route`` answer gets an access line only when it is an error (and a warning only when
slow), so the hot lookup makes no log call at all.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from kvhandoff.bootstrap_server.access_log import ACCESS_FORMAT, AccessPolicy
from kvhandoff.bootstrap_server.metrics import Metrics
from kvhandoff.bootstrap_server.middleware import Receive, Scope, Send
from kvhandoff.bootstrap_server.sglang_answers import Answer, SglangRoutes

_NO_BODY = (b"", b"0")


class FastRoutes:
    """Answers SGLang's ``GET /route`` from prepared bytes (see the module rules)."""

    def __init__(self, routes: SglangRoutes, metrics: Metrics, *,
                 access: AccessPolicy | None = None) -> None:
        self._routes = routes
        self.access = access or AccessPolicy()
        self._latency = metrics.latency.labels("GET", "/route")
        self._requests = metrics.requests
        self._lookups = metrics.route_lookups
        self._by_status: dict[int, Any] = {}
        self._by_outcome: dict[str, Any] = {}

    async def handle(self, scope: Scope, send: Send) -> bool:
        """Answer the request when it is a plain ``GET /route``; False: not handled."""
        if scope["path"] != "/route" or scope["method"] != "GET":
            return False
        for name, value in scope["headers"]:
            if (name == b"content-length" and value.strip() not in _NO_BODY) \
                    or name == b"transfer-encoding":
                return False  # a GET with a body: the full stack applies the body limit
        start = time.perf_counter()
        answer = self._routes.for_query_string(scope["query_string"])
        if answer is None:
            return False
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": answer.headers})
        await send({"type": "http.response.body", "body": answer.body})
        seconds = time.perf_counter() - start
        self.count(answer, seconds)
        if seconds >= self.access.slow_request_s:
            query = scope["query_string"].decode("ascii", "replace")
            self.access.check_slow("GET", f"/route?{query}", answer.status, seconds)
        return True

    def answer_query(self, query: bytes) -> Answer | None:
        """The prepared answer of ``GET /route?<query>``, or None (not a plain query)."""
        return self._routes.for_query_string(query)

    def count(self, answer: Answer, seconds: float) -> None:
        """Metrics of one answered request, as the middleware would count it."""
        counter = self._by_status.get(answer.status)
        if counter is None:
            counter = self._by_status[answer.status] = self._requests.labels(
                "GET", "/route", str(answer.status))
        counter.inc()
        lookups = self._by_outcome.get(answer.outcome)
        if lookups is None:
            lookups = self._by_outcome[answer.outcome] = self._lookups.labels(
                "sglang", answer.outcome)
        lookups.inc()
        self._latency.observe(seconds)


class BootstrapApp(FastAPI):
    """The FastAPI app with `FastRoutes` in front (set ``fast_routes`` after construction)."""

    fast_routes: FastRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_routes
        if fast is not None and scope["type"] == "http" and await fast.handle(scope, send):
            return
        await super().__call__(scope, receive, send)


_default_lines: tuple[object, bytes] = (None, b"")


def _default_header_lines(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (date, server) as header lines; uvicorn replaces the list each
    second (new date), so the bytes are cached against the list itself."""
    global _default_lines
    src, lines = _default_lines
    if src is not default_headers:
        lines = b"".join(b"%s: %s\r\n" % h for h in default_headers)
        _default_lines = (default_headers, lines)
    return lines


def http_protocol() -> Any:
    """The ``http`` setting for `uvicorn.Config`: the fast protocol when ``httptools`` is
    installed, else ``"auto"`` (the app-level fast path still applies)."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:
        return "auto"

    class FastHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol answering SGLang's ``GET /route`` at the parser."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._fast: FastRoutes | None = getattr(self.config.app, "fast_routes", None)
            self._answered = False

        def on_message_begin(self) -> None:
            self._answered = False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            if self._fast is None or not self._try_fast():
                super().on_headers_complete()

        def _try_fast(self) -> bool:
            parser = self.parser
            if parser.get_method() != b"GET" or parser.should_upgrade() or self.pipeline \
                    or (self.cycle is not None and not self.cycle.response_complete) \
                    or self.expect_100_continue:
                return False
            try:
                url = httptools.parse_url(self.url)
            except httptools.HttpParserInvalidURLError:
                return False
            if url.path != b"/route":
                return False
            for name, value in self.headers:
                if (name == b"content-length" and value.strip() not in _NO_BODY) \
                        or name == b"transfer-encoding":
                    return False
            assert self._fast is not None
            start = time.perf_counter()
            answer = self._fast.answer_query(url.query or b"")
            if answer is None:
                return False
            http_version = parser.get_http_version()
            keep_alive = http_version != "1.0" and parser.should_keep_alive()
            self._answered = True
            self.transport.write(b"".join((
                STATUS_LINE[answer.status],
                _default_header_lines(self.server_state.default_headers),
                answer.header_lines,
                b"" if keep_alive else b"connection: close\r\n",
                b"\r\n", answer.body)))
            fast = self._fast
            if self.access_log and fast.access.logs_route(answer.status):
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
                self.access_logger.info(ACCESS_FORMAT, client, "GET",
                                        self.url.decode("ascii", "replace"), http_version,
                                        answer.status)
            self.server_state.total_requests += 1
            if not keep_alive:
                self.transport.close()
            elif not self.transport.is_closing():
                if self.timeout_keep_alive_task is not None:  # pipelined: one timer at a time
                    self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)
            seconds = time.perf_counter() - start
            fast.count(answer, seconds)
            if seconds >= fast.access.slow_request_s:
                fast.access.check_slow("GET", self.url.decode("ascii", "replace"),
                                       answer.status, seconds)
            return True

        def on_body(self, body: bytes) -> None:
            if not self._answered:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._answered:
                super().on_message_complete()

    return FastHttpToolsProtocol
