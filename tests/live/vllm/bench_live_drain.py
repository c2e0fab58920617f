"""What a move through `kvhandoff route` costs on the CPU build (`make bench-live-drain`; not
part of any test run: the file name keeps pytest from collecting it otherwise).

One prefill and two decodes of the GQA model (those of test_live_drain). `N` requests, all on
decode A (B drained first, then taken back: the router's own API), prompts of `PROMPT` tokens
streaming `MAX_TOKENS` tokens; once each has `BEFORE` tokens, ``POST /drain`` A. For each moved
request the router gives drain_s (from the stop to its first token on B) and gap_s (the
client's time between the last token before the move and the first after). Two ways of
moving on the same engines: ``resume`` (the prefill offers the prompt's pages again, B loads
them and computes the generated tokens) and ``replay`` (B computes prompt and generated
tokens: what a router without kvhandoff does). Medians over `RUNS` drains per row; every
stream must end with the engine alone's tokens (greedy).
"""

from __future__ import annotations

import statistics
import threading
import uuid
from typing import Any

import httpx
import pytest
from live_fleet import Fleet
from live_outputs import body, prompt_of
from live_proxy import serve_app
from test_live_drain import BOUND_S, Streams

from kvhandoff.integrations.vllm.router import Router, make_app

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(1800)]

MODEL = "gqa"
REF, PREFILL, A, B = "gqa-ref", "gqa-prefill-b32", "gqa-mig-a", "gqa-mig-b"
ENGINES = (REF, PREFILL, A, B)
PROMPT, MAX_TOKENS, BEFORE, RUNS = 160, 64, 16, 3  # 8 x 224 tokens fit a decode (2,048)


def one_drain(fleet: Fleet, http: httpx.Client, move: str, n: int, seed: int
              ) -> list[dict[str, Any]]:
    box: list[Router] = []

    def factory(client: httpx.AsyncClient) -> Any:
        box.append(Router(fleet[PREFILL].url, [fleet[A].url, fleet[B].url], client,
                          move=move))
        return make_app(box[0])

    salt = uuid.uuid4().hex  # no prefix-cache hit from an earlier run on any engine
    pay = [{**body(MODEL, prompt_of(seed + i, PROMPT), max_tokens=MAX_TOKENS, salt=salt),
            "stream": True, "return_token_ids": True} for i in range(n)]
    want = []
    for p in pay:
        r = http.post(f"{fleet[REF].url}/v1/completions", json={**p, "stream": False})
        want.append(r.json()["choices"][0]["token_ids"])
    with serve_app(factory) as url:
        http.post(f"{url}/drain", json={"decode": fleet[B].url})  # all requests on A
        st = Streams(n)
        threads = [threading.Thread(target=st.run, args=(url, i, pay[i]), daemon=True)
                   for i in range(n)]
        for t in threads:
            t.start()
        st.wait(lambda: all(len(t) >= BEFORE for t in st.tokens), "tokens before the drain")
        http.post(f"{url}/undrain", json={"decode": fleet[B].url})
        out = http.post(f"{url}/drain", json={"decode": fleet[A].url}, timeout=BOUND_S).json()
        for t in threads:
            t.join(BOUND_S)
        http.post(f"{url}/undrain", json={"decode": fleet[A].url})
    assert st.tokens == want, "a moved stream is not the engine alone's"
    rows: list[dict[str, Any]] = out["requests"]
    return rows


def test_drain_figures(fleet: Fleet, http: httpx.Client) -> None:
    lines = [f"moves through kvhandoff route, CPU build, GQA tiny model, prompt {PROMPT} "
             f"tokens, drained after >= {BEFORE} of {MAX_TOKENS} tokens; medians over {RUNS} "
             "drains (ms)"]
    for n in (1, 8):
        for move in ("resume", "replay"):
            drain, gap, before = [], [], []
            for run in range(RUNS):
                rows = one_drain(fleet, http, move, n, seed=20000 + 100 * run)
                moved = [r for r in rows if r["to"] is not None]
                drain += [r["drain_s"] * 1e3 for r in moved]
                gap += [r["gap_s"] * 1e3 for r in moved]
                before += [r["tokens_before"] for r in moved]
            lines.append(f"  {n} at once, {move:6}: drain {statistics.median(drain):7.1f}  "
                         f"client gap {statistics.median(gap):7.1f}  (max {max(gap):7.1f}; "
                         f"tokens before the move: median {statistics.median(before):.0f}; "
                         f"{len(drain)} moves)")
    print("\n" + "\n".join(lines))
