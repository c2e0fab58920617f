"""The sliding-window pair with a layerwise decode (`make test-long`: an engine of its own).

A layerwise decode computes the last prompt token itself, so its window reaches one token
further back than the prefill's, which vLLM freed at the end of the prefill. Where that token
is the last of a block the prefill dropped (``(n - 48 + 1) % 32 == 0``: 79 tokens), the decode
declines the room before announcing a token and computes the prompt itself: the output is still
the engine's, nothing came by ``external_kv_transfer``, and the prefill's room is aborted at
once (both engines end idle). The other prompts load and are bit-equal, as with the async
decode (test_live_swa.py).
"""

from __future__ import annotations

import httpx
import pytest
from live_fleet import Fleet
from live_outputs import body, generate, max_diff, prompt_of
from live_pairs import external, idle
from test_live_swa import MODEL, P, one_page_size, run_pair

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

DL = "swa-decode-layerwise"
ENGINES = (P, DL)


def test_sliding_window_layerwise_bit_equal(fleet: Fleet, http: httpx.Client,
                                            figures: list[str]) -> None:
    moved = run_pair(http, figures, prefill=fleet[P], decode=fleet[DL],
                     proxy=fleet.proxy(P, DL), lengths=(20, 49, 80, 161), seed=43,
                     label="SWA (window 48, block 32) layerwise", computed_at_load=1)
    one_page_size(moved)
    idle(http, fleet[P], fleet[DL])


def test_window_before_the_prefills_pages_declined(fleet: Fleet, http: httpx.Client) -> None:
    prompt = prompt_of(4379, 79)
    want = generate(http, fleet[P].url, body(MODEL, prompt, salt="alone-79"))
    before = external(http, fleet[DL])
    got = generate(http, fleet.proxy(P, DL), body(MODEL, prompt))
    assert got.tokens == want.tokens and max_diff(want, got) == 0.0
    assert external(http, fleet[DL]) == before  # computed by the decode, not loaded
    idle(http, fleet[P], fleet[DL])  # the prefill's blocks came back: its room was aborted
