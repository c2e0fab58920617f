"""`kvhandoff route`'s refusals: what the router cannot carry is refused with 4xx naming the
field, before any engine is asked (the engines' URLs here listen nowhere: a request that
reached them would answer 502). Moves over real sockets with toy engines:
test_vllm_router_moves.py; on vLLM: tests/live/vllm/test_live_drain.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvhandoff.integrations.vllm.router import Router, make_app

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers


async def _call(method: str, path: str, body: Any = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5.0) as engines:
        router = Router(NOWHERE, [NOWHERE + "1", NOWHERE + "2"], engines)
        transport = httpx.ASGITransport(app=make_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, json=body)


def call(method: str, path: str, body: Any = None) -> httpx.Response:
    return asyncio.run(_call(method, path, body))


@pytest.mark.parametrize("body,field", [
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": "hi", "n": 2}, "n/best_of"),
    ({"model": "m", "prompt": "hi", "echo": True}, "echo"),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
])
def test_refused_before_any_engine(body: dict[str, Any], field: str) -> None:
    r = call("POST", "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field)


def test_prefill_unreachable_is_502_naming_it() -> None:
    r = call("POST", "/v1/completions", {"model": "m", "prompt": "hi"})
    assert r.status_code == 502
    assert NOWHERE in r.json()["error"]["message"]


def test_drain_of_an_unknown_decode_is_404() -> None:
    r = call("POST", "/drain", {"decode": "http://elsewhere:1"})
    assert r.status_code == 404 and "not one of" in r.json()["error"]["message"]
    assert call("POST", "/drain", ["x"]).status_code == 400


def test_drain_with_nothing_in_flight_marks_the_decode_draining() -> None:
    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=5.0) as engines:
            router = Router(NOWHERE, [NOWHERE + "1", NOWHERE + "2"], engines)
            transport = httpx.ASGITransport(app=make_app(router))
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
                out = (await c.post("/drain", json={"decode": NOWHERE + "1"})).json()
                status = (await c.get("/status")).json()
                assert router.pick() is router.decodes[1]  # only the other one takes requests
                return out, status

    out, status = asyncio.run(run())
    assert out == {"decode": NOWHERE + "1", "moved": 0, "requests": []}
    assert [d["state"] for d in status["decodes"]] == ["draining", "up"]
    assert status["recent_moves"] == [] and status["counters"] == {"drains": 1}


@pytest.mark.parametrize("body,field", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "include_reasoning": False}, "include_reasoning"),
])
def test_chat_refused_before_any_engine(body: dict[str, Any], field: str) -> None:
    """What a moved chat request (a completion) could not carry is refused with 400."""
    r = call("POST", "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field)


def test_chat_prefill_unreachable_is_502_naming_it() -> None:
    r = call("POST", "/v1/chat/completions",
             {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 502
    assert NOWHERE in r.json()["error"]["message"]
