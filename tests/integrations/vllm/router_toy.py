"""A toy engine with the HTTP API `kvhandoff route` uses of `vllm serve`, served by real uvicorn
on 127.0.0.1 port 0, so the router's moves run over real sockets without a model. Each request
is parsed by vLLM's own request class (`CompletionRequest`, `ChatCompletionRequest`,
`TokenizeChatRequest`: what vLLM would refuse, the toy refuses with 400), and each answer and
stream chunk is vLLM's response class, serialized as vLLM's server does.

The model: tokens 0..25 are the letters a..z; the next token is the last one plus one (mod 26),
so a continuation from a prompt plus the tokens generated so far equals the engine's own run.
The chat template (the engine's, which the router must not know): each message's content after
an "s", then "q" (the generation prompt). Like vLLM, a decode applies the `stop` strings it is
sent to its own text.

An engine can stop mid-stream: `hold_after` tokens, then it waits until its client goes away
(a decode the router drains); `die_after` tokens, then the connection breaks (a dead decode).
`seen` records each request (path, body); `held` is set once a stream is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeResponse

from kvhandoff.bootstrap_server.sockets import bind_socket

MAX_MODEL_LEN = 200


def ids_of(text: str) -> list[int]:
    return [(ord(c) - ord("a")) % 26 for c in text]


def text_of(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def render(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    return ids_of("".join("s" + str(m.get("content", "")) for m in messages)
                  + ("q" if add_generation_prompt else ""))


class Toy:
    def __init__(self, name: str, *, hold_after: int | None = None,
                 die_after: int | None = None) -> None:
        self.name = name
        self.hold_after = hold_after
        self.die_after = die_after
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.held = asyncio.Event()
        self.rooms = 0

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.seen if p == path]

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen.append(("/v1/completions", body))
            if (bad := _invalid(CompletionRequest, body)) is not None:
                return bad
            p = body["prompt"]
            ids = ids_of(p) if isinstance(p, str) else list(p)
            return self._answer(body, ids, chat=False)

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.seen.append(("/v1/chat/completions", body))
            if (bad := _invalid(ChatCompletionRequest, body)) is not None:
                return bad
            ids = render(body["messages"], body.get("add_generation_prompt", True))
            return self._answer(body, ids, chat=True)

        async def tokenize(request: Request) -> Response:
            body = await request.json()
            self.seen.append(("/tokenize", body))
            if (bad := _invalid(TokenizeChatRequest, body)) is not None:
                return bad
            ids = render(body["messages"], body.get("add_generation_prompt", True))
            return _json(TokenizeResponse(count=len(ids), max_model_len=MAX_MODEL_LEN,
                                          tokens=ids))

        return Starlette(routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
        ])

    def _answer(self, body: dict[str, Any], prompt: list[int], *, chat: bool) -> Response:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is None:
            limit = MAX_MODEL_LEN - len(prompt) if chat else 16
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        kv = body.get("kv_transfer_params") or {}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{len(self.seen)}"
        created = int(time.time())
        model = body.get("model", "toy")

        def gen() -> list[tuple[int, str | None]]:  # (token, finish) with the engine's stop
            out: list[tuple[int, str | None]] = []
            last, text = prompt[-1], ""
            for i in range(limit):
                last = (last + 1) % 26
                text += text_of([last])
                hit = next((s for s in stops if s in text), None)
                out.append((last, "stop" if hit else "length" if i == limit - 1 else None))
                if hit:
                    break
            return out

        if kv.get("do_remote_decode"):  # the prefill: one token, a room
            self.rooms += 1
            t0 = gen()[0][0]
            params = {"room": self.rooms, "engine": self.name}
            if chat:
                return _json(ChatCompletionResponse(
                    id=rid, created=created, model=model, usage=_usage(prompt, 1),
                    choices=[ChatCompletionResponseChoice(
                        index=0, message={"role": "assistant", "content": text_of([t0])},
                        finish_reason="length", token_ids=[t0])],
                    prompt_token_ids=prompt, kv_transfer_params=params))
            return _json(CompletionResponse(
                id=rid, created=created, model=model, usage=_usage(prompt, 1),
                choices=[CompletionResponseChoice(
                    index=0, text=text_of([t0]), finish_reason="length", token_ids=[t0],
                    prompt_token_ids=prompt)],
                kv_transfer_params=params))

        def chunk(t: int | None, fin: str | None, first: bool, piece: str | None = None
                  ) -> str:
            text = (text_of([t]) if t is not None else "") if piece is None else piece
            ids = [t] if t is not None else None
            if chat:
                delta = (DeltaMessage(content=text) if t is not None
                         else DeltaMessage(role="assistant", content=""))
                c = ChatCompletionStreamResponse(
                    id=rid, object="chat.completion.chunk", created=created, model=model,
                    choices=[
                        ChatCompletionResponseStreamChoice(
                            index=0, delta=delta, logprobs=None, finish_reason=fin,
                            token_ids=ids)],
                    prompt_token_ids=prompt if first else None)
                return c.model_dump_json(exclude_unset=True, exclude_none=not c.choices)
            choice = CompletionResponseStreamChoice(
                index=0, text=text, logprobs=None, finish_reason=fin, token_ids=ids,
                prompt_token_ids=prompt if first else None)
            return CompletionStreamResponse(id=rid, object="text_completion", created=created,
                                            model=model, choices=[choice]).model_dump_json(
                                                exclude_unset=True)

        toks = gen()

        async def sse() -> AsyncIterator[bytes]:
            first = True
            if chat:
                yield _sse(chunk(None, None, True))
                first = False
            text = ""
            for n, (t, fin) in enumerate(toks):
                if self.die_after is not None and n == self.die_after:
                    raise ConnectionError(f"toy {self.name}: dies after {n} tokens")
                if self.hold_after is not None and n == self.hold_after:
                    self.held.set()
                    await asyncio.Event().wait()  # until the client goes away
                piece = None
                text += text_of([t])
                if fin == "stop":  # vLLM: the text up to the stop string
                    hit = next(s for s in stops if s in text)
                    cut = len(text) - text.index(hit)
                    piece = text_of([t])[:max(1 - cut, 0)]
                yield _sse(chunk(t, fin, first, piece))
                first = False
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


def _usage(prompt: list[int], n: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=len(prompt), completion_tokens=n,
                     total_tokens=len(prompt) + n)


def _invalid(model: Any, body: dict[str, Any]) -> Response | None:
    try:
        model.model_validate(body)
    except ValueError as e:  # pydantic's ValidationError: vLLM answers 400
        return JSONResponse({"error": {"message": str(e), "code": 400}}, 400)
    return None


def _json(obj: Any) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


@asynccontextmanager
async def served(app: Starlette) -> AsyncIterator[str]:
    """`app` on real uvicorn at 127.0.0.1 (port 0) in this event loop; yields its URL."""
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False,
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(1000):  # bounded: uvicorn sets `started` once it listens
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, f"uvicorn did not start: {task}"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15.0)
        sock.close()

