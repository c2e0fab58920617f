"""A decode leaves and its users do not notice: `kvhandoff route` (`integrations.vllm.router`)
in front of one prefill and two decodes (vLLM serve, CPU build, tiny GQA model, greedy).

Four requests stream through the router, all on decode A (B is drained first and taken back
once they stream: the router's own API). Once every stream has `BEFORE` tokens, A is stopped
where it stands (SIGSTOP on its process group, so the slowest stream at least is mid-way
whatever the host's speed; nothing is timed), then:

- drain: ``POST /drain`` A; each of A's requests moves to B: the prefill offers its prompt's
  pages again (its prefix cache holds them: vLLM computes the last prompt token only), B loads
  them (``external_kv_transfer`` + the prompt length per move) and computes the generated
  tokens it is sent; every client's stream ends with exactly the engine alone's tokens, one
  completion id, nothing lost or repeated. A is continued after the drain (it aborts the
  moved requests, every block back).
- kill: SIGKILL A instead; the router sees the streams break and moves them the same way.

Prompt tokens recomputed: none on B; on the prefill, per move, the tokens of the prompt's last
block (`REOFFER`: vLLM's prefix cache hits whole blocks only and never the last prompt token;
8 of the 40 here, with 32-token blocks).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_fleet import Engine, Fleet, wait_until
from live_outputs import body, prompt_of
from live_pairs import EXT, external, idle
from live_proxy import serve_app

from kvhandoff.integrations.vllm.router import Router, make_app

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MODEL = "gqa"
REF, PREFILL, A, B = "gqa-ref", "gqa-prefill-b32", "gqa-mig-a", "gqa-mig-b"
ENGINES = (REF, PREFILL, A, B)
# long enough that A, stopped, has work left: at 128 tokens, beside a busy loop on every core,
# A finished every stream before the test (starved) stopped it, and nothing was left to move
N_REQ, PROMPT, MAX_TOKENS, BEFORE = 4, 40, 384, 4
BOUND_S = 300.0
BLOCK = 32  # the prefill's block size (gqa-prefill-b32)
REOFFER = PROMPT - (PROMPT - 1) // BLOCK * BLOCK  # the prefill computes these per move


class Streams:
    """Each client's stream through the router: token ids, completion ids, its end."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.ids: list[set[str]] = [set() for _ in range(n)]
        self.ends: list[str | None] = [None] * n
        self.cond = threading.Condition()

    def run(self, url: str, i: int, payload: dict[str, Any]) -> None:
        end = "no end"
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=payload,
                              timeout=BOUND_S) as r:
                end = f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "choices" not in data:
                        end = f"error {data}"
                        break
                    ch = data["choices"][0]
                    with self.cond:
                        self.ids[i].add(data["id"])
                        self.tokens[i].extend(ch.get("token_ids") or [])
                        self.cond.notify_all()
                    if ch.get("finish_reason"):
                        end = f"finish {ch['finish_reason']}"
        except httpx.HTTPError as e:
            end = f"{type(e).__name__}: {e}"
        with self.cond:
            self.ends[i] = end
            self.cond.notify_all()

    def wait(self, pred: Any, what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout=BOUND_S), (
                f"no {what} within {BOUND_S} s: {[len(t) for t in self.tokens]} {self.ends}")


def payload(i: int, seed: int) -> dict[str, Any]:
    return {**body(MODEL, prompt_of(seed + i, PROMPT), max_tokens=MAX_TOKENS),
            "stream": True, "return_token_ids": True}


def reference(http: httpx.Client, ref: Engine, seed: int) -> list[list[int]]:
    out = []
    for i in range(N_REQ):
        p = {**payload(i, seed), "stream": False}
        r = http.post(f"{ref.url}/v1/completions", json=p)
        assert r.status_code == 200, r.text
        out.append(list(r.json()["choices"][0]["token_ids"]))
    return out


@pytest.fixture
def routed(fleet: Fleet) -> Iterator[tuple[str, Router]]:
    box: list[Router] = []

    def factory(client: httpx.AsyncClient) -> Any:
        box.append(Router(fleet[PREFILL].url, [fleet[A].url, fleet[B].url], client,
                          on_lost="fail"))
        return make_app(box[0])

    with serve_app(factory) as url:
        yield url, box[0]


def start_streams(http: httpx.Client, url: str, fleet: Fleet, seed: int
                  ) -> tuple[Streams, list[threading.Thread]]:
    """Every stream on A, each with `BEFORE` tokens; B takes requests again."""
    assert http.post(f"{url}/drain", json={"decode": fleet[B].url}).json()["moved"] == 0
    st = Streams(N_REQ)
    threads = [threading.Thread(target=st.run, args=(url, i, payload(i, seed)), daemon=True)
               for i in range(N_REQ)]
    for t in threads:
        t.start()
    st.wait(lambda: all(len(t) >= BEFORE for t in st.tokens), f"{BEFORE} tokens on each stream")
    assert http.post(f"{url}/undrain", json={"decode": fleet[B].url}).status_code == 200
    return st, threads


def on_a(http: httpx.Client, url: str, fleet: Fleet) -> set[str]:
    return {r["id"] for r in http.get(f"{url}/routes").json() if r["decode"] == fleet[A].url}


def check_outputs(st: Streams, want: list[list[int]]) -> None:
    bad = [i for i in range(N_REQ) if st.tokens[i] != want[i] or st.ends[i] != "finish length"
           or len(st.ids[i]) != 1]
    assert not bad, "streams not equal to the engine alone's: " + "; ".join(
        f"#{i}: end {st.ends[i]}, ids {st.ids[i]}, {len(st.tokens[i])} tokens, first "
        f"difference at {next((j for j, (x, y) in enumerate(zip(st.tokens[i], want[i], strict=False)) if x != y), None)}"  # noqa: E501
        for i in bad)


def prefill_computed(http: httpx.Client, fleet: Fleet) -> int:
    return int(fleet[PREFILL].metric(http, EXT, source="local_compute"))


def test_client_gone_mid_stream_aborts_the_decode_request(
        fleet: Fleet, http: httpx.Client, routed: tuple[str, Router]) -> None:
    """A client that closes its stream: the router closes the decode's, vLLM aborts the
    request and frees its blocks; nothing stays in flight at the router."""
    url, router = routed
    with httpx.stream("POST", f"{url}/v1/completions", json=payload(0, seed=9400),
                      timeout=BOUND_S) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            if got >= BEFORE:
                break  # closes the client's stream mid-way (MAX_TOKENS asked)
    wait_until("the router has nothing in flight", lambda: not http.get(
        f"{url}/routes").json(), timeout_s=60)
    idle(http, fleet[A], fleet[B])
    assert router.counters["requests"] == 1 and not any(
        k.startswith("moved") for k in router.counters)


def test_drain_moves_running_requests_without_a_token_lost(
        fleet: Fleet, http: httpx.Client, routed: tuple[str, Router],
        figures: list[str]) -> None:
    url, router = routed
    want = reference(http, fleet[REF], seed=9500)
    st, threads = start_streams(http, url, fleet, seed=9500)
    pgid = os.getpgid(fleet[A].proc.pid)  # type: ignore[union-attr]
    os.killpg(pgid, signal.SIGSTOP)
    try:
        moving = on_a(http, url, fleet)
        computed0, ext0 = prefill_computed(http, fleet), external(http, fleet[B])
        r = http.post(f"{url}/drain", json={"decode": fleet[A].url}, timeout=BOUND_S)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    out = r.json()
    for t in threads:
        t.join(BOUND_S)
    check_outputs(st, want)
    # the streams still on A when it stopped: A may have generated a stream's last token
    # before the stop while the router (on a busy host) had not relayed it yet; such a stream
    # ends before the drain and is not moved (its tokens are checked above all the same)
    moved = [x for x in out["requests"] if x["to"] is not None]
    assert {x["id"] for x in out["requests"]} <= moving, (out, moving)
    assert moved and out["moved"] == len(moved) == router.counters["moved_drain"], out
    assert all(x["to"] == fleet[B].url for x in moved), out
    # B loaded each moved prompt's pages; the prefill computed its last block per move
    assert external(http, fleet[B]) - ext0 == PROMPT * len(moved)
    assert prefill_computed(http, fleet) - computed0 == REOFFER * len(moved)
    figures.append("drain (router, CPU build): " + "; ".join(
        f"{x['tokens_before']} tokens before, drain {x['drain_s'] * 1e3:.0f} ms, client gap "
        f"{x['gap_s'] * 1e3:.0f} ms" for x in moved))
    idle(http, fleet[A], fleet[B])


def test_killed_decode_requests_continue_on_the_other(
        fleet: Fleet, http: httpx.Client, routed: tuple[str, Router],
        figures: list[str]) -> None:
    url, router = routed
    want = reference(http, fleet[REF], seed=9600)
    st, threads = start_streams(http, url, fleet, seed=9600)
    pgid = os.getpgid(fleet[A].proc.pid)  # type: ignore[union-attr]
    os.killpg(pgid, signal.SIGSTOP)  # every stream on A mid-way, then A dies
    moving = on_a(http, url, fleet)
    computed0, ext0 = prefill_computed(http, fleet), external(http, fleet[B])
    fleet[A].kill()
    for t in threads:
        t.join(BOUND_S)
    check_outputs(st, want)
    moved = router.counters["moved_lost"]
    assert 1 <= moved <= len(moving), (moving, router.counters)
    assert external(http, fleet[B]) - ext0 == PROMPT * moved
    assert prefill_computed(http, fleet) - computed0 == REOFFER * moved
    status = http.get(f"{url}/status").json()
    assert {d["url"]: d["state"] for d in status["decodes"]}[fleet[A].url] == "lost"
    lost = [m for m in status["recent_moves"] if m["why"] == "lost"]
    assert len(lost) == moved and all(m["from"] == fleet[A].url and m["to"] == fleet[B].url
                                      for m in lost), lost
    figures.append(f"killed decode: {moved} requests moved to the other decode, prompt "
                   f"tokens recomputed 0 on the decode, {REOFFER} of {PROMPT} per move on the "
                   f"prefill (its last block); " + "; ".join(
                       f"{m['tokens_before']} tokens before, stream broken to first token on B "
                       f"{m['drain_s'] * 1e3:.0f} ms, client gap {m['gap_s'] * 1e3:.0f} ms"
                       for m in lost))
    idle(http, fleet[B])
