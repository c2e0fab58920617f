"""A small proxy of our own for the live tests: the flow vLLM's toy proxy runs.

``POST /v1/completions``: the prompt goes to the prefill with ``max_tokens=1``, ``stream=false``
and ``kv_transfer_params={"do_remote_decode": true}`` (plus ``decode_tp_size`` when the
decode's TP size is given: the prefill opens the room for that many decode ranks); the original
request then goes to the decode with the ``kv_transfer_params`` the prefill returned, and the
decode's answer (JSON, or the SSE stream when ``stream`` is set) is relayed as it comes. A
client that goes away mid-stream closes the decode request, so vLLM aborts it (the disconnect
case).

`run_proxy(prefill_url, decode_url, decode_tp=None)` serves it on 127.0.0.1 (a socket bound on
port 0 before uvicorn starts) in a background thread and yields its URL (`serve_app`: any
app).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvhandoff.bootstrap_server.sockets import bind_socket


def make_app(prefill_url: str, decode_url: str, client: httpx.AsyncClient,
             decode_tp: int | None = None) -> Starlette:
    ask: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if decode_tp is not None:
        ask["decode_tp_size"] = decode_tp

    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": ask}
        try:
            pre = await client.post(f"{prefill_url}/v1/completions", json=first)
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"prefill {prefill_url}: {e!r}"}, 502)
        if pre.status_code != 200:
            return Response(pre.content, status_code=pre.status_code,
                            media_type="application/json")
        params = pre.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return JSONResponse({"error": "the prefill returned no kv_transfer_params"}, 502)
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            r = await client.post(f"{decode_url}/v1/completions", json=second)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        req = client.build_request("POST", f"{decode_url}/v1/completions", json=second)
        upstream = await client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: closing tells the decode to abort
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@contextmanager
def run_proxy(prefill_url: str, decode_url: str, decode_tp: int | None = None
              ) -> Iterator[str]:
    with serve_app(lambda client: make_app(prefill_url, decode_url, client, decode_tp)) as url:
        yield url


@contextmanager
def serve_app(factory: Callable[[httpx.AsyncClient], Starlette]) -> Iterator[str]:
    """Serves ``factory(client)`` on 127.0.0.1 (a free port) in a background thread; yields
    its URL."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    started = threading.Event()
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    async def serve() -> None:
        nonlocal server
        async with httpx.AsyncClient(timeout=120.0) as client:
            config = uvicorn.Config(factory(client), log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=2)
            server = uvicorn.Server(config)
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            started.set()
            await task

    def target() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # reported to the waiting thread
            failed.append(e)
            started.set()

    thread = threading.Thread(target=target, name="live-proxy", daemon=True)
    thread.start()
    if not started.wait(15.0) or failed or server is None or not server.started:
        raise RuntimeError(f"the proxy did not start: {failed}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)
        sock.close()
