"""What a live engine generated, and how two generations compare.

Prompts are token ids (exact lengths: a full, a partial, a one-token last page), greedy,
``logprobs=1``, ``ignore_eos`` (every generation has the same length), tokens as ids.
Each call may carry a ``cache_salt``: requests with different salts share no prefix cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_TOKENS = 12
VOCAB = 380  # the tiny models' tokenizers have 384 ids


@dataclass
class Gen:
    tokens: list[str]
    logprobs: list[float]
    # per position, the top-k tokens' logprobs (``logprobs=k`` in the request)
    top: list[dict[str, float]] = field(default_factory=list)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def body(model: str, prompt: list[int], *, salt: str | None = None,
         max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
                           "return_tokens_as_token_ids": True, **extra}
    if salt is not None:
        out["cache_salt"] = salt
    return out


def generate(client: httpx.Client, url: str, payload: dict[str, Any]) -> Gen:
    r = client.post(f"{url}/v1/completions", json=payload)
    assert r.status_code == 200, f"{url}: HTTP {r.status_code}: {r.text[:500]}"
    lp = r.json()["choices"][0]["logprobs"]
    top = [{k: float(v) for k, v in d.items()} for d in lp.get("top_logprobs") or [] if d]
    return Gen(tokens=list(lp["tokens"]), logprobs=[float(x) for x in lp["token_logprobs"]],
               top=top)


def dist_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest |logprob difference| over the tokens both top-k lists hold (a token in one
    list only counts as its logprob against the other list's smallest)."""
    floor_a, floor_b = min(a.values()), min(b.values())
    return max(abs(a.get(t, floor_a) - b.get(t, floor_b)) for t in set(a) | set(b))


def max_diff(a: Gen, b: Gen) -> float:
    """Largest |logprob difference| (nats) over the generated positions."""
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
