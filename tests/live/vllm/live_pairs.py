"""Checks on a live pair: its output against a reference engine, what the decode loaded, and
that engines end idle with every KV block back."""

from __future__ import annotations

import httpx
from live_fleet import Engine, wait_until
from live_outputs import body, generate, max_diff, prompt_of

EXT = "vllm:prompt_tokens_by_source_total"
ROOMS_DONE = "vllm:kvhandoff_rooms_done_total"  # kvhandoff's own figures in vLLM's /metrics
USAGE = "vllm:kv_cache_usage_perc"


def external(http: httpx.Client, decode: Engine) -> int:
    """The decode's prompt tokens that came from the prefill (external_kv_transfer)."""
    return int(decode.metric(http, EXT, source="external_kv_transfer"))


def check_pair(http: httpx.Client, figures: list[str], *, ref: Engine, proxy: str,
               decode: Engine, model: str, lengths: tuple[int, ...], seed: int, label: str,
               tol: float = 0.0, announced_per_prompt: int = -1) -> dict[int, float]:
    """Each prompt through `ref` and through the pair (`proxy`); tokens equal and logprobs
    within `tol` (0: bit-equal); the decode's external tokens grew by the prompt lengths plus
    `announced_per_prompt` each (layerwise: -1, the decode computes the last prompt token;
    async: 0). Returns the max |dlogprob| per prompt length and notes it in `figures`."""
    before = external(http, decode)
    rooms_before = decode.metric(http, ROOMS_DONE, role="decode")
    diffs: dict[int, float] = {}
    bad = []
    for n in lengths:
        prompt = prompt_of(seed * 1000 + n, n)
        want = generate(http, ref.url, body(model, prompt))
        got = generate(http, proxy, body(model, prompt))
        diffs[n] = max_diff(want, got)
        if got.tokens != want.tokens or diffs[n] > tol:
            bad.append(f"{n} tokens: max |dlogprob| {diffs[n]:.3g} nats, first "
                       f"{abs(want.logprobs[0] - got.logprobs[0]):.3g}, tokens "
                       f"{'equal' if got.tokens == want.tokens else 'DIFFER'}")
    moved = external(http, decode) - before
    figures.append(f"{label}: max |dlogprob| per prompt length (nats): "
                   + ", ".join(f"{n}: {d:.3g}" for n, d in diffs.items())
                   + f"; decode external_kv_transfer +{moved}")
    assert not bad, f"{label}: the decode's output is not the engine's: " + "; ".join(bad)
    assert moved == sum(n + announced_per_prompt for n in lengths), \
        f"{label}: the decode loaded {moved} prompt tokens from the prefill"
    # the connector's stats reach vLLM's /metrics through its own stats API, a step later
    # (at least one room per request: a decode of another TP size has one per prefill rank)
    wait_until(f"{label}: {ROOMS_DONE}{{role=decode}} +{len(lengths)} on the decode",
               lambda: decode.metric(http, ROOMS_DONE, role="decode") - rooms_before
               >= len(lengths), timeout_s=30)
    return diffs


def idle(http: httpx.Client, *engines: Engine) -> None:
    """Every engine has no request left and every KV block back (bounded wait)."""
    for e in engines:
        wait_until(f"{e.name} idle with all KV blocks free",
                   lambda e=e: e.metric(http, USAGE) == 0.0
                   and e.metric(http, "vllm:num_requests_running") == 0.0, timeout_s=30)
