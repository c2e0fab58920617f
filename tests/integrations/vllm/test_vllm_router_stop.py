"""The router's stop strings (`router.StopText`) against vLLM's own: the same token texts go
through vLLM's incremental detokenizer (`BaseIncrementalDetokenizer.update` and its streamed
deltas, vLLM's code with a stand-in vocabulary) and through `StopText`; each step's forwarded
text and the stop string found are equal (the stop that ends first, `min_tokens`,
`include_stop_str_in_output`, the held-back text). The router feeds `StopText` the chunks of
every decode a request streams from, so this is also what its client gets across a move."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvhandoff.integrations.vllm.router import StopText

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer  # noqa: E402


class Pieces(BaseIncrementalDetokenizer):
    """vLLM's incremental detokenizer over a vocabulary where token i's text is pieces[i]."""

    def __init__(self, params: SamplingParams, pieces: list[str]) -> None:
        super().__init__(SimpleNamespace(sampling_params=params))  # type: ignore[arg-type]
        self.pieces = pieces

    def decode_next(self, next_token_id: int) -> str:
        return self.pieces[next_token_id]


def vllm_stream(pieces: list[str], stop: Any, include: bool, min_tokens: int
                ) -> tuple[list[str], str | None]:
    d = Pieces(SamplingParams(stop=stop, include_stop_str_in_output=include,
                              min_tokens=min_tokens, max_tokens=len(pieces) + 3), pieces)
    out: list[str] = []
    for i in range(len(pieces)):
        hit = d.update([i], stop_terminated=False)
        out.append(d.get_next_output_text(hit is not None or i == len(pieces) - 1, delta=True))
        if hit is not None:
            return out, hit
    return out, None


def router_stream(pieces: list[str], stop: Any, include: bool, min_tokens: int
                  ) -> tuple[list[str], str | None]:
    st = StopText(stop, include=include, min_tokens=min_tokens)
    out: list[str] = []
    for i, p in enumerate(pieces):
        text, hit = st.feed(p, i + 1, final=i == len(pieces) - 1)
        out.append(text)
        if hit is not None:
            return out, hit
    return out, None


def test_stop_strings_as_vllm_applies_them() -> None:
    rng = random.Random(4921)
    hits = 0
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.7 else "abc"
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 4)))
                  for _ in range(rng.randrange(1, 12))]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(1, 4))]
        stop: Any = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
        include, min_tokens = rng.random() < 0.3, rng.choice([0, 0, 1, 3])
        want = vllm_stream(pieces, stop, include, min_tokens)
        got = router_stream(pieces, stop, include, min_tokens)
        assert got == want, (pieces, stop, include, min_tokens)
        hits += want[1] is not None
    assert hits > 1000  # most cases meet a stop string


def test_no_stop_forwards_every_piece_at_once() -> None:
    pieces = ["ab", "", "c", "de"]
    assert router_stream(pieces, None, False, 0) == (pieces, None)
