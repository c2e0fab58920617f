"""A stalled prefill must not stall the decode's other users (`make test-long`).

A request A decodes on the decode engine, streaming; a request B's prefill is computed, then its
prefill engine is stopped (SIGSTOP on its whole process group: API server, engine core, worker
and its agent), and B is sent to the decode with the prefill's ``kv_transfer_params``. While B
waits for KV nobody sends, A must keep getting tokens: with the default load mode (async) the
decode loads between steps, and A's stream gets at least `PROGRESS` tokens after B was sent and
before B's first token (87 in the run that added it). With the old default (layerwise) the
decode's forward waits for B's layers inside the step: a first run of the same schedule on the
layerwise decode gave A 19 tokens (those streamed before B reached the engine) and then none
until the prefill was continued.

Ordering only: events of both streams go into one list in arrival order; nothing is timed.

An error event in a stream (vLLM's ``{"error": ...}`` chunk, e.g. B's load failed under
``kv_load_failure_policy=fail``) is that stream's end. Before, `stream` died on it (KeyError
'choices') without recording an end, and the test waited its whole bound for B's end: the
"unexplained stall" seen with a layerwise decode. What that decode does (b32 `layerwise`/`fail`,
one run): A got 4 tokens after B came, then none until the decode declared the stopped prefill
lost (silent for 5.66 s > 2 heartbeats of 2 s) and failed B with HTTP 500 in its stream; then A
ran to its end.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx
import pytest
from live_fleet import Engine, Fleet
from live_outputs import body, prompt_of
from test_live_gqa import MODEL, prefill_only

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

VICTIM, DDEF = "gqa-prefill-stall", "gqa-decode-default"
ENGINES = (VICTIM, DDEF)
# tokens of A between B's sending and B's first token: a layerwise decode gave A 19 (streamed
# while the API server handed B to the engine) before its forward stopped for B's layers
PROGRESS = 50
BOUND_S = 120.0


class Log:
    """Events of both streams in arrival order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.cond = threading.Condition()

    def add(self, who: str, what: str) -> None:
        with self.cond:
            self.events.append((who, what))
            self.cond.notify_all()

    def wait(self, pred: Any, what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.events), timeout=BOUND_S), (
                f"no {what} within {BOUND_S} s: {self.events[-20:]}")


def stream(url: str, payload: dict[str, Any], who: str, log: Log) -> None:
    """Streams a completion; one ("A"/"B", "token") event per streamed chunk with text, then
    (who, "end <status> <finish_reason>")."""
    status, finish = 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**payload, "stream": True},
                          timeout=BOUND_S) as r:
            status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "choices" not in data:
                    # an error event in the stream (vLLM's {"error": ...}: a failed KV load
                    # under kv_load_failure_policy=fail): B's outcome, not a dead thread
                    finish = f"error: {str(data.get('error', data))[:120]}"
                    break
                choice = data["choices"][0]
                if choice.get("text"):
                    log.add(who, "token")
                finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        finish = f"{type(e).__name__}"
    log.add(who, f"end {status} {finish}")


def compact(events: list[tuple[str, str]]) -> str:
    """The order of events in one line: ``a`` a token of A, ``b`` of B, ``|`` B sent, ends."""
    return "".join("|" if e == "sent" else w.lower() if e == "token" else f" [{w} {e}] "
                   for w, e in events)


def a_tokens_before_b(events: list[tuple[str, str]]) -> int:
    """A's tokens after B was sent and before B's first token or end."""
    start = events.index(("B", "sent"))
    n = 0
    for who, _ in events[start + 1:]:
        if who == "B":
            break
        n += who == "A"
    return n


def stall_run(fleet: Fleet, http: httpx.Client, decode: Engine, seed: int) -> list[
        tuple[str, str]]:
    victim = fleet[VICTIM]
    assert victim.proc is not None
    log = Log()
    # B's prefill is computed first (it holds B's blocks for the decode), then it is stopped
    params = prefill_only(http, victim, prompt_of(seed + 1, 40))
    pgid = os.getpgid(victim.proc.pid)
    os.killpg(pgid, signal.SIGSTOP)
    a = threading.Thread(target=stream, args=(decode.url, body(
        MODEL, prompt_of(seed, 8), max_tokens=500), "A", log), daemon=True)
    a.start()
    try:
        log.wait(lambda ev: ("A", "token") in ev, "first token of A")
        log.add("B", "sent")
        b = threading.Thread(target=stream, args=(decode.url, {
            **body(MODEL, prompt_of(seed + 1, 40)), "kv_transfer_params": params}, "B", log),
            daemon=True)
        b.start()
        # until A has PROGRESS tokens since B came, or B has an outcome
        log.wait(lambda ev: a_tokens_before_b(ev) >= PROGRESS
                 or any(w == "B" and e != "sent" for w, e in ev), "progress of A or B")
    finally:
        os.killpg(pgid, signal.SIGCONT)
    log.wait(lambda ev: any(w == "B" and e.startswith("end") for w, e in ev), "end of B")
    log.wait(lambda ev: any(w == "A" and e.startswith("end") for w, e in ev), "end of A")
    a.join(BOUND_S)
    b.join(BOUND_S)
    return list(log.events)


def test_running_stream_continues_while_a_prefill_is_stopped(
        fleet: Fleet, http: httpx.Client, figures: list[str]) -> None:
    events = stall_run(fleet, http, fleet[DDEF], seed=9300)
    n = a_tokens_before_b(events)
    ends = [e for w, e in events if e.startswith("end")]
    figures.append(f"stalled prefill, default (async) decode: A got {n} tokens after B came "
                   f"and before B's first; ends: {ends}")
    assert n >= PROGRESS, compact(events)
    assert all(e.startswith("end 200") for e in ends), ends  # recompute, or loaded after CONT
