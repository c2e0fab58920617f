"""Pure ASGI middleware: request body size limit (413) and request metrics.

Rules: the body limit is enforced before any route sees the body, on the declared
Content-Length and on the bytes actually streamed (chunked bodies lie about nothing but can be
endless); the answer is a JSON 413 naming the limit. Metrics label requests by route template,
never by raw path, so unknown paths cannot blow up the label set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvhandoff.bootstrap_server.access_log import AccessPolicy
from kvhandoff.bootstrap_server.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class BodyLimitMiddleware:
    """Answer 413 to a request whose body exceeds ``max_body_bytes``."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"error": "BadRequest",
                                                 "detail": "content-length: not an integer"})
                    return
                if declared > limit:
                    await self._too_large(send, declared)
                    return
        # read the (bounded) body now, then replay it to the app
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                # client went away: let the app see the disconnect
                await self.app(scope, _replay([], msg, receive), send)
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > limit:
                await self._too_large(send, None)
                return
            chunks.append(body)
            more = msg.get("more_body", False)
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _too_large(self, send: Send, declared: int | None) -> None:
        got = f"{declared} bytes declared" if declared is not None else "more was sent"
        await _send_json(
            send,
            413,
            {"error": "PayloadTooLarge",
             "detail": f"request body: limit is {self.max_body_bytes} bytes "
                       f"(max_body_bytes), {got}"},
        )


def _replay(chunks: list[bytes], final: Message | None, receive: Receive) -> Receive:
    body = b"".join(chunks)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if final is not None:
                return final
            return {"type": "http.request", "body": body, "more_body": False}
        # after the body, the server's own receive reports the disconnect when it comes
        return await receive()

    return replay


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class MetricsMiddleware:
    """Count requests and time them by (method, route template); warn about slow ones."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics,
                 access: AccessPolicy | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.access = access or AccessPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "?")
            if method not in _METHODS:
                method = "other"
            seconds = time.perf_counter() - start
            self.metrics.latency.labels(method, template).observe(seconds)
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.access.check_slow(method, scope.get("path", "?"), status, seconds)
