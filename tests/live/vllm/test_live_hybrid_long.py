"""The hybrid pair with a layerwise decode (`make test-long`: an engine of its own).

A layerwise decode computes the last prompt token itself in the step that loads the rest, each
layer waited for inside the forward (`wait_for_layer_load`): the layers of the three groups
(one full-attention, two sliding-window regions) arrive per layer in one room. Its window
reaches one token further back than the prefill's, so its sliding-window groups start one
token earlier; the prompts here (20, 49, 80, 161 tokens, window 48, block 32) all load. The
same assertions as the async pair (test_live_hybrid.py): bit-equal output, every prompt token
but the last external, the bytes moved exactly the full layers' pages plus the window's.
"""

from __future__ import annotations

import httpx
import pytest
from live_fleet import Fleet
from live_pairs import idle
from test_live_hybrid import P, run_pair

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

DL = "hybrid-decode-layerwise"
ENGINES = (P, DL)


def test_hybrid_layerwise_bit_equal(fleet: Fleet, http: httpx.Client,
                                    figures: list[str]) -> None:
    run_pair(http, figures, prefill=fleet[P], decode=fleet[DL], proxy=fleet.proxy(P, DL),
             label="hybrid (S S F S S F, window 48, block 32) layerwise", computed_at_load=1,
             seed=53_000)
    idle(http, fleet[P], fleet[DL])
