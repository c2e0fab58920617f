"""TTFT on the CPU build: the engine alone against a kvhandoff pair (`make bench-live`; not part
of any test run: the file name keeps pytest from collecting it otherwise).

Three engines of the GQA model (the reference engine, a prefill and a decode with the
connector's defaults: `async` load, `auto` transport), started together; prompts of 33, 128,
512 and 1,024 tokens, each run a fresh prompt with a fresh ``cache_salt`` (no prefix-cache hit
anywhere). TTFT alone: the request to the first streamed token. TTFT of the pair, as
`kvhandoff verify` takes it: the prefill request (``max_tokens=1``, ``do_remote_decode``) plus
the decode's request to its first streamed token. Medians of `RUNS` runs per length, printed
with the live run's figures. The decode's ``external_kv_transfer`` must grow by every prompt
token (async: the decode computes none of them), so the pair's figure is a handoff's.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from typing import Any

import httpx
import pytest
from live_fleet import Engine, Fleet
from live_outputs import body, prompt_of
from live_pairs import external

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(1800)]

REF, PRE, DEC = "gqa-ref-1k", "gqa-prefill-1k", "gqa-decode-1k"
ENGINES = (REF, PRE, DEC)
MODEL = "gqa"
LENGTHS = (33, 128, 512, 1024)
RUNS = 5


def first_token_s(http: httpx.Client, engine: Engine, payload: dict[str, Any]) -> float:
    """Seconds from sending `payload` (streamed) to its first token."""
    t0 = time.perf_counter()
    with http.stream("POST", f"{engine.url}/v1/completions",
                     json={**payload, "stream": True}) as r:
        assert r.status_code == 200, r.read()[:500]
        for line in r.iter_lines():
            # the first chunk is the first token (its text may be empty: a partial character)
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise AssertionError(f"{engine.name}: no token streamed")


def test_ttft_alone_and_pair(fleet: Fleet, http: httpx.Client, figures: list[str]) -> None:
    rows = []
    before = external(http, fleet[DEC])
    for n in LENGTHS:
        alone, pair = [], []
        for i in range(RUNS):
            prompt = prompt_of(700_000 + 100 * n + i, n)
            alone.append(first_token_s(http, fleet[REF], body(
                MODEL, prompt, salt=uuid.uuid4().hex, max_tokens=4)))
            salt = uuid.uuid4().hex
            t0 = time.perf_counter()
            r = http.post(f"{fleet[PRE].url}/v1/completions", json={
                **body(MODEL, prompt, salt=salt), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}})
            assert r.status_code == 200, r.text[:500]
            prefill_s = time.perf_counter() - t0
            params = r.json()["kv_transfer_params"]
            pair.append(prefill_s + first_token_s(http, fleet[DEC], {
                **body(MODEL, prompt, salt=salt, max_tokens=4), "kv_transfer_params": params}))
        rows.append((n, statistics.median(alone) * 1e3, statistics.median(pair) * 1e3))
    moved = external(http, fleet[DEC]) - before
    assert moved == RUNS * sum(LENGTHS), f"the decode loaded {moved} prompt tokens"
    figures.append(f"TTFT medians of {RUNS} runs (ms), engine alone | kvhandoff pair: "
                   + "; ".join(f"{n}: {a:.0f} | {p:.0f}" for n, a, p in rows))
