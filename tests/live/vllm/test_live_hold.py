"""A decode's queue longer than the prefill's bootstrap bound costs no request (issue 50).

A prefill's room waits `bootstrap_timeout_s` for its decode, then fails; a vLLM decode opens
its receiver only once it has a slot for the request. Here the prefill's bound is 3 s (its
heartbeat 2 s: a room nobody holds fails by 5 s) and the decode runs one sequence at a time
(``--max-num-seqs 1``, async load, ``kv_load_failure_policy=fail``). Long local requests (the
blockers) keep its slot while the prefill computes `HELD` prompts and they are sent to the
decode with their ``kv_transfer_params``: they queue, and the decode holds their rooms at the
prefill (the connector's holds). Once the prefill counts enough renewals (several heartbeats
of the decode), the blockers are cancelled by their clients and the queued requests run.

Asserted: every queued request generates exactly the tokens the engine alone does (gqa-ref;
the decode's external prompt tokens grew by every prompt: each loaded, none computed); the
prefill counted renewals (``holds_renewed`` in its agent's metrics) and its rooms outlived what
the bound allows without a hold (the prefill's own transfer-time histogram: rooms of more than
5 s); none expired. Then a request queued, held, and aborted by its client: the decode stops
holding it, and the prefill fails its room when the hold lapses (``holds_expired``) and gives
its blocks back.

Without the connector's holds (run before this change): the queued requests fail with the
prefill's "bootstrap deadline expired" (HTTP 500 under the ``fail`` policy).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from live_fleet import Engine, Fleet, wait_until
from live_outputs import body, generate, prompt_of
from live_pairs import external, idle
from test_live_gqa import MODEL, prefill_only

# `make test-long`: two engines of their own and about 3 minutes on a 2-core host; `make test`
# covers the same holds with real agents, a real bootstrap server and vLLM's own scheduler
# (tests/integrations/vllm/test_vllm_hold.py, test_vllm_holds_agents.py)
pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

REF, PREFILL, DECODE = "gqa-ref", "gqa-prefill-hold", "gqa-decode-queue"
ENGINES = (REF, PREFILL, DECODE)
HELD = 2  # queued requests of the prefill
PROMPT = 40
# holds_renewed counts each room named in each Hold: the first ones go out as each room's
# route comes back (at most 1 + 2 for two rooms), then one per room per decode heartbeat (2 s).
# Waiting for 6 per room means several heartbeats passed: the rooms are past 3 s + 2 s
RENEWALS = 6 * HELD
BLOCKERS = 3  # local requests of 1,980 tokens each, cancelled once the renewals are counted
BLOCKER_TOKENS = 1980
NO_HOLD_S = 5.0  # bound + one prefill heartbeat: the longest a room nobody holds waits
BOUND_S = 300.0
TRANSFER = "vllm:kvhandoff_transfer_time_seconds"


def agent_counter(http: httpx.Client, prefill: Engine, name: str) -> float:
    """A counter of the prefill's agent (the metrics port its settings name)."""
    assert prefill.kv_config is not None
    port = json.loads(prefill.kv_config)["kv_connector_extra_config"]["settings"][
        "agent_metrics_port"]
    r = http.get(f"http://127.0.0.1:{port}/metrics")
    r.raise_for_status()
    for line in r.text.splitlines():
        if line.startswith(f"kvhandoff_agent_{name}_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def rooms_longer_than(http: httpx.Client, prefill: Engine, seconds: float) -> float:
    """Rooms of the prefill whose transfer time (opened -> ended, its own clock) exceeded
    `seconds` (a bucket bound of the histogram)."""
    count = prefill.metric(http, f"{TRANSFER}_count", role="prefill")
    within = prefill.metric(http, f"{TRANSFER}_bucket", role="prefill", le=str(seconds))
    return count - within


def warm_up(http: httpx.Client, prefill: Engine, decode: Engine) -> None:
    """A first handoff, so that the decode's agent has a handshake with the prefill's (a hold
    goes to a prefill agent it talks to). A fresh engine's first requests pay one-time costs
    before its scheduler sees them (a loaded host: 12 s seen), which no hold covers and a 3 s
    bound may not: a local request first, then up to 3 tries of the handoff."""
    generate(http, decode.url, body(MODEL, prompt_of(9400, 8)))
    for i in range(3):
        p = prompt_of(9500 + i, PROMPT)
        r = http.post(f"{decode.url}/v1/completions", json={
            **body(MODEL, p), "kv_transfer_params": prefill_only(http, prefill, p)})
        if r.status_code == 200:
            return
    raise AssertionError(f"no first handoff in 3 tries: HTTP {r.status_code}: {r.text[:300]}")


async def _stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                  started: asyncio.Event) -> None:
    """A streamed completion; `started` set at its first token. Cancelled: the client hangs
    up, and vLLM aborts the request."""
    async with client.stream("POST", f"{url}/v1/completions",
                             json={**payload, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                started.set()


async def _until(pred: Any, what: str, tasks: tuple[asyncio.Task[Any], ...] = ()) -> None:
    """Polls `pred()` (a blocking metrics read, off the loop) until true, bounded; fails at
    once when one of `tasks` (queued requests) ended meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND_S
    while not await asyncio.to_thread(pred):
        ended = [t for t in tasks if t.done()]
        if ended:
            r = ended[0].result()
            raise AssertionError(f"{what}: a queued request ended first: HTTP {r.status_code}: "
                                 f"{r.text[:300]}")
        assert loop.time() < deadline, f"{what}: not within {BOUND_S} s"
        await asyncio.sleep(0.2)  # polling interval of a bounded wait


async def _blocked(url: str, seed: int, then: Any) -> Any:
    """Runs `then(client)` while `BLOCKERS` long local requests keep the decode's one slot
    (the first one streaming); cancels them after."""
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        started = asyncio.Event()
        blockers = [asyncio.create_task(_stream(client, url, body(
            MODEL, prompt_of(seed + i, 8), max_tokens=BLOCKER_TOKENS, logprobs=None),
            started)) for i in range(BLOCKERS)]
        try:
            await asyncio.wait_for(started.wait(), BOUND_S)
            return await then(client, blockers)
        finally:
            for t in blockers:
                t.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)


def test_a_queue_longer_than_the_bound_costs_no_request(fleet: Fleet, http: httpx.Client,
                                                         figures: list[str]) -> None:
    ref, prefill, decode = fleet[REF], fleet[PREFILL], fleet[DECODE]
    warm_up(http, prefill, decode)
    renewed0 = agent_counter(http, prefill, "holds_renewed")
    expired0 = agent_counter(http, prefill, "holds_expired")
    long0 = rooms_longer_than(http, prefill, NO_HOLD_S)
    ext0 = external(http, decode)
    prompts = [prompt_of(9600 + i, PROMPT) for i in range(HELD)]

    async def queue(client: httpx.AsyncClient, blockers: list[Any]) -> list[Any]:
        # the slot is taken: each prompt's prefill runs, then its decode request queues
        sent = []
        for p in prompts:
            params = await asyncio.to_thread(prefill_only, http, prefill, p)
            sent.append(asyncio.create_task(client.post(
                f"{decode.url}/v1/completions",
                json={**body(MODEL, p), "kv_transfer_params": params})))
        await _until(lambda: agent_counter(http, prefill, "holds_renewed") - renewed0 >= RENEWALS,
                     f"{RENEWALS} hold renewals at the prefill", tuple(sent))
        for t in blockers:  # their clients hang up: the queue moves
            t.cancel()
        return list(await asyncio.gather(*sent))

    replies = asyncio.run(_blocked(decode.url, 9700, queue))
    for p, r in zip(prompts, replies, strict=True):
        assert r.status_code == 200, r.text[:500]
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == generate(http, ref.url, body(MODEL, p)).tokens
    renewed = agent_counter(http, prefill, "holds_renewed") - renewed0
    assert external(http, decode) - ext0 == HELD * PROMPT  # every prompt loaded (async)
    # the prefill's own clock: rooms lived past what its bound allows a room nobody holds
    wait_until("the held rooms in the prefill's transfer times",
               lambda: rooms_longer_than(http, prefill, NO_HOLD_S) - long0 >= HELD)
    assert agent_counter(http, prefill, "holds_expired") == expired0
    figures.append(f"queued decode: {HELD} requests held past the prefill's 3 s bound, "
                   f"{renewed:.0f} renewals, all loaded")

    # a queued request aborted by its client: its hold lapses, the prefill fails the room
    lone = prompt_of(9800, PROMPT)

    async def abort(client: httpx.AsyncClient, blockers: list[Any]) -> None:
        params = await asyncio.to_thread(prefill_only, http, prefill, lone)
        before = agent_counter(http, prefill, "holds_renewed")
        queued = asyncio.create_task(_stream(client, decode.url, {
            **body(MODEL, lone), "kv_transfer_params": params}, asyncio.Event()))
        await _until(lambda: agent_counter(http, prefill, "holds_renewed") > before,
                     "the aborted request's room held")
        queued.cancel()  # the client hangs up while queued
        await asyncio.gather(queued, return_exceptions=True)
        await _until(lambda: agent_counter(http, prefill, "holds_expired") > expired0,
                     "the prefill's hold on the aborted request's room lapsed")

    asyncio.run(_blocked(decode.url, 9900, abort))
    assert agent_counter(http, prefill, "holds_expired") == expired0 + 1
    idle(http, prefill, decode)  # the failed room's blocks went back to the prefill's vLLM
