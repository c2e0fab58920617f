"""Live GQA pairs of different TP sizes on the CPU build (`make test-long`: two TP 2 engines of
their own), through vLLM's own proxy flow: the prefill request says nothing about the decode
(no ``decode_tp_size``), each decode rank tells the prefill rank it reads how many decode ranks
read it. TP 2 -> 1 and 1 -> 2: the decode's tokens equal the engine's alone, every prompt token
but the last came from the prefill, and both engines end idle with every block back.

Before (the prefill opened each room for its own TP size): TP 1 -> 2 moved nothing (the decode
declined the room and computed the prompt itself: 0 tokens by external_kv_transfer) and the
prefill held the request's blocks until the room's deadline. The fast check of the same flow
is tests/integrations/vllm/test_vllm_decode_tp.py (in `make test`).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from live_fleet import Fleet
from live_outputs import body, generate, max_diff, prompt_of
from live_pairs import check_pair, idle
from test_live_gqa import D32, MODEL, P32, REF

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

PTP2, DTP2 = "gqa-prefill-tp2", "gqa-decode-tp2"
ENGINES = (REF, P32, D32, PTP2, DTP2)  # what this module needs of the fleet
TP_TOL = 1e-4  # nats; TP 2 alone vs TP 1 alone: ~2e-6 (the all-reduce sums in another order)


def check(fleet: Fleet, http: httpx.Client, figures: list[str], prefill: str, decode: str,
          **kw: Any) -> dict[int, float]:
    return check_pair(http, figures, ref=fleet[REF], proxy=fleet.proxy(prefill, decode),
                      decode=fleet[decode], model=MODEL, **kw)


def tp_alone(fleet: Fleet, http: httpx.Client, figures: list[str], tp2: str) -> None:
    """The TP 2 engine alone against the TP 1 reference: the size of an all-reduce
    difference, which the cross-TP pair may show too."""
    prompt = prompt_of(77, 40)
    alone = max_diff(generate(http, fleet[REF].url, body(MODEL, prompt)),
                     generate(http, fleet[tp2].url, body(MODEL, prompt)))
    figures.append(f"GQA {tp2} alone vs TP 1 alone: {alone:.3g} nats (tolerance {TP_TOL:g})")
    assert alone < TP_TOL


def test_tp2_prefill_to_tp1_decode(fleet: Fleet, http: httpx.Client,
                                   figures: list[str]) -> None:
    tp_alone(fleet, http, figures, PTP2)
    check(fleet, http, figures, PTP2, D32, lengths=(33, 40), seed=3,
          label="GQA prefill TP2 -> decode TP1", tol=TP_TOL)
    idle(http, fleet[PTP2], fleet[D32])


def test_tp1_prefill_to_tp2_decode(fleet: Fleet, http: httpx.Client,
                                   figures: list[str]) -> None:
    # the one prefill rank's room is opened without a reader count; both decode ranks say 2
    tp_alone(fleet, http, figures, DTP2)
    check(fleet, http, figures, P32, DTP2, lengths=(33, 40, 64), seed=22,
          label="GQA prefill TP1 -> decode TP2", tol=TP_TOL)
    idle(http, fleet[P32], fleet[DTP2])
