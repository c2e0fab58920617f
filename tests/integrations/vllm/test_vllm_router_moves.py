"""`kvhandoff route` moving requests over real sockets: the router (its Starlette app on
uvicorn) in front of toy engines with vLLM's HTTP API (`router_toy`: a prefill, decodes A and
B on 127.0.0.1; requests parsed and answers built by vLLM's own protocol classes).

Chat requests are routed and moved (the moved request continues as a completion of the
prefill's rendering of the messages plus the tokens generated so far, its chunks back in the
chat format under one id), and the request's stop strings are applied by the router to the
whole stream, also where one straddles a move. Each output is compared with the toy engine's
own run of the request. Moves of completions on vLLM itself: tests/live/vllm/test_live_drain.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvhandoff.integrations.vllm.router import Router, make_app

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

from router_toy import Toy, ids_of, render, served, text_of  # noqa: E402

BOUND_S = 30.0
MESSAGES = [{"role": "user", "content": "hello"}]


class Client:
    """One client's stream through the router: its chunks, and an event once it holds
    `want` token ids."""

    def __init__(self, want: int) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.tokens = 0
        self.want = want
        self.got = asyncio.Event()

    async def run(self, c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, (await r.aread()).decode()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                self.chunks.append(data)
                if "choices" in data:
                    self.tokens += len(data["choices"][0].get("token_ids") or [])
                if self.tokens >= self.want:
                    self.got.set()

    def text(self, chat: bool) -> str:
        ch = [c["choices"][0] for c in self.chunks]
        if chat:
            return "".join((x.get("delta") or {}).get("content") or "" for x in ch)
        return "".join(x.get("text") or "" for x in ch)

    def finish(self) -> tuple[str | None, Any]:
        last = self.chunks[-1]["choices"][0]
        return last.get("finish_reason"), last.get("stop_reason")


Scenario = Callable[[httpx.AsyncClient, Router, Toy, Toy, Toy], Awaitable[Any]]


def fleet(scenario: Scenario, *, a: Toy, move: str = "resume",
          router_cls: type[Router] = Router) -> Any:
    async def main() -> Any:
        pre, b = Toy("prefill"), Toy("b")
        async with served(pre.app()) as pu, served(a.app()) as au, served(b.app()) as bu, \
                httpx.AsyncClient(timeout=BOUND_S) as engines:
            router = router_cls(pu, [au, bu], engines, on_lost="fail", move=move)
            router.decodes[1].state = "draining"  # every request starts on A
            async with served(make_app(router)) as ru, \
                    httpx.AsyncClient(base_url=ru, timeout=BOUND_S) as c:
                return await asyncio.wait_for(scenario(c, router, pre, a, b), BOUND_S)
    return asyncio.run(main())


async def drain_a_after(c: httpx.AsyncClient, router: Router, a: Toy, client: Client,
                        task: asyncio.Task[None]) -> dict[str, Any]:
    for ev in (a.held, client.got):  # A streamed `hold_after` tokens and stops there, and
        waiter = asyncio.ensure_future(ev.wait())  # the client has them (or its stream ended)
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            await task  # raises what the client saw
            raise AssertionError(f"the stream ended before the move: {client.chunks}")
    router.decodes[1].state = "up"
    r = await c.post("/drain", json={"decode": router.decodes[0].url})
    assert r.status_code == 200, r.text
    await task
    return dict(r.json())


def reference_text(prompt_last: int, n: int) -> str:
    """What the toy engine generates after a prompt ending in token `prompt_last`."""
    return text_of([(prompt_last + 1 + i) % 26 for i in range(n)])


def test_chat_stream_moves_on_drain_as_a_completion_of_the_rendered_prompt() -> None:
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> None:
        client = Client(want=3)
        body = {"model": "toy", "messages": MESSAGES, "max_tokens": 8, "stream": True,
                "return_token_ids": True, "stop": "zzz"}  # never met: text held back, then out
        task = asyncio.create_task(client.run(c, "/v1/chat/completions", body))
        out = await drain_a_after(c, router, a, client, task)
        assert out["moved"] == 1 and out["requests"][0]["tokens_before"] == 3, out
        # the prefill answered the chat (vLLM's chat endpoint, max_tokens=1, a room asked),
        # then rendered the messages for the move through /tokenize
        first = pre.bodies("/v1/chat/completions")
        assert len(first) == 1 and first[0]["max_tokens"] == 1
        assert first[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert pre.bodies("/tokenize") == [{"model": "toy", "messages": MESSAGES}]
        # A had the chat; B a completion of the rendered prompt + the 3 tokens, resumed
        prompt = render(MESSAGES)
        assert len(a.bodies("/v1/chat/completions")) == 1 and not b.bodies(
            "/v1/chat/completions")
        [moved] = b.bodies("/v1/completions")
        gen = [(prompt[-1] + 1 + i) % 26 for i in range(3)]
        assert moved["prompt"] == prompt + gen and moved["max_tokens"] == 5
        assert moved["kv_transfer_params"]["kvhandoff_resume"] is True
        assert "stop" not in moved and "messages" not in moved
        # the client: chat chunks, one id, the engine's own run of the chat, nothing repeated
        assert {x["object"] for x in client.chunks} == {"chat.completion.chunk"}
        assert len({x["id"] for x in client.chunks}) == 1
        assert client.text(chat=True) == reference_text(prompt[-1], 8)
        assert client.tokens == 8 and client.finish()[0] == "length"
        assert client.chunks[0]["prompt_token_ids"] == prompt
        assert router.counters["moved_drain"] == 1

    fleet(scenario, a=Toy("a", hold_after=3))


def test_chat_without_streaming_survives_a_dead_decode() -> None:
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> dict[str, Any]:
        router.decodes[1].state = "up"  # round robin: the first request goes to A
        r = await c.post("/v1/chat/completions", json={
            "model": "toy", "messages": MESSAGES, "max_completion_tokens": 6})
        assert r.status_code == 200, r.text
        assert router.counters["moved_lost"] == 1 and router.decodes[0].state == "lost"
        return dict(r.json())

    out = fleet(scenario, a=Toy("a", die_after=2))
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-route-")
    ch = out["choices"][0]
    assert ch["message"] == {"role": "assistant",
                             "content": reference_text(render(MESSAGES)[-1], 6)}
    assert ch["finish_reason"] == "length" and "token_ids" not in ch


def test_chat_without_max_tokens_moves_with_the_model_length_left() -> None:
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> None:
        client = Client(want=2)
        body = {"model": "toy", "messages": MESSAGES, "stream": True, "return_token_ids": True,
                "stop": ["kl"]}
        task = asyncio.create_task(client.run(c, "/v1/chat/completions", body))
        await drain_a_after(c, router, a, client, task)
        [moved] = b.bodies("/v1/completions")
        assert moved["max_tokens"] == 200 - len(render(MESSAGES)) - 2
        assert client.text(chat=True) == "rstuvwxyzabcdefghij"  # up to the stop string
        assert client.finish() == ("stop", "kl")

    fleet(scenario, a=Toy("a", hold_after=2))


@pytest.mark.parametrize("stop,include,want", [
    ("de", False, "bc"),            # "d" streamed from A, "e" from B
    (["zzz", "de"], False, "bc"),   # the longest stop holds back two characters
    ("cdef", False, "b"),           # begins two tokens before the move
    ("de", True, "bcde"),           # include_stop_str_in_output
])
def test_a_stop_string_straddling_a_drain_ends_the_stream(
        stop: Any, include: bool, want: str) -> None:
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> None:
        client = Client(want=3)
        body = {"model": "toy", "prompt": "a", "max_tokens": 12, "stream": True,
                "return_token_ids": True, "stop": stop, "include_stop_str_in_output": include}
        task = asyncio.create_task(client.run(c, "/v1/completions", body))
        out = await drain_a_after(c, router, a, client, task)
        assert out["requests"][0]["tokens_before"] == 3  # A streamed "bcd"
        assert client.text(chat=False) == want  # nothing past it, nothing lost or repeated
        assert client.finish() == ("stop", "de" if stop != "cdef" else "cdef")
        assert "stop" not in a.bodies("/v1/completions")[0]  # the router applies it
        assert len({x["id"] for x in client.chunks}) == 1

    fleet(scenario, a=Toy("a", hold_after=3))


def test_a_stop_string_straddling_a_chat_move_ends_the_stream() -> None:
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> None:
        client = Client(want=4)
        body = {"model": "toy", "messages": MESSAGES, "max_tokens": 12, "stream": True,
                "return_token_ids": True, "stop": ["uv"]}
        task = asyncio.create_task(client.run(c, "/v1/chat/completions", body))
        await drain_a_after(c, router, a, client, task)
        assert client.text(chat=True) == "rst"  # A streamed "rstu", B goes on from "v"
        assert client.finish() == ("stop", "uv")
        assert {x["object"] for x in client.chunks} == {"chat.completion.chunk"}

    fleet(scenario, a=Toy("a", hold_after=4))


class RacingRouter(Router):
    """The router with a drain of A racing a chunk of A's: once A's `RACE_AT`-th chunk is in
    the router's hands, `drain(A)` begins (its stop, up to its first await), then the chunk
    goes on to the client."""

    RACE_AT = 3
    drained: asyncio.Task[dict[str, Any]] | None = None

    async def _one_decode(self, f: Any, params: dict[str, Any] | None) -> Any:
        n = 0
        async for chunk in super()._one_decode(f, params):
            n += 1
            if self.drained is None and n == self.RACE_AT:
                self.drained = asyncio.ensure_future(self.drain(f.decode.url))
                await asyncio.sleep(0)  # one turn of the loop: the drain's stop, not a wait
                assert f.move.is_set() and f.stop_t
            yield chunk


def test_a_chunk_of_the_old_decode_after_the_stop_is_not_the_landing() -> None:
    """The drain answers once each request streams from its new decode: a token of the old
    decode that the router read before the stop and handed on after it is the client's, and
    counts in `tokens_before`, but it is not the move's landing (the drain answered at it, with
    the old decode as `to`, before B had the request)."""
    async def scenario(c: httpx.AsyncClient, router: Router, pre: Toy, a: Toy, b: Toy
                       ) -> None:
        assert isinstance(router, RacingRouter)
        router.decodes[1].state = "up"  # B takes the moved request
        client = Client(want=8)
        body = {"model": "toy", "prompt": "a", "max_tokens": 8, "stream": True,
                "return_token_ids": True}
        await client.run(c, "/v1/completions", body)
        assert router.drained is not None
        out = await router.drained
        [row] = out["requests"]
        assert out["moved"] == 1 and row["to"] == router.decodes[1].url, out
        assert row["tokens_before"] == RacingRouter.RACE_AT, out
        [moved] = b.bodies("/v1/completions")  # B went on after A's 3 tokens
        assert moved["max_tokens"] == 8 - RacingRouter.RACE_AT
        assert client.text(chat=False) == reference_text(ids_of("a")[-1], 8)
        assert client.tokens == 8 and len({x["id"] for x in client.chunks}) == 1

    fleet(scenario, a=Toy("a", hold_after=RacingRouter.RACE_AT), router_cls=RacingRouter)
