"""The hybrid pair (test_live_hybrid.py) with sides of another shape (`make test-long`:
engines of their own): a prefill with 64-token blocks to the 32-token decode, and a TP 2 decode
(the prefill is TP 1). Each KV cache group is a region of its own, so the page pairing and the
head split work per group as for one group. (A 16-token decode is not a case on the CPU build:
its hybrid allocator raises every group's block to 32, "kv lcm block sizes 32".)

- prefill block 64 -> decode block 32: pages pair token by token; the sliding-window groups
  start at the decode's own first block (32-aligned, so never before the prefill's 64-aligned
  window start), the bytes moved are exactly the full layers' tokens plus the window's from
  there; output bit-equal to the b64 prefill alone.
- TP 2: each decode rank takes its KV head of every group from the one prefill rank; the bytes
  moved (both ranks) are the TP 1 pair's; output within the all-reduce tolerance of
  test_live_tp.py (a TP 2 engine alone differs from TP 1 alone by ~2e-6 nats).
"""

from __future__ import annotations

import httpx
import pytest
from live_fleet import Fleet
from live_pairs import idle
from test_live_hybrid import FULL_LAYERS, SWA_LAYERS, WINDOW, D, P, run_pair

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

P64, DTP2 = "hybrid-prefill-b64", "hybrid-decode-tp2"
ENGINES = (P, D, P64, DTP2)
TOKEN_BYTES = 2 * 32 * 2 * 4  # KV heads x head dim x (K, V) x float32
TP_TOL = 1e-4  # test_live_tp.TP_TOL


def test_hybrid_prefill_block_64_to_decode_32_bit_equal(fleet: Fleet, http: httpx.Client,
                                                        figures: list[str]) -> None:
    def moved(n: int) -> int:  # token-granular pairing: the tokens of each region
        start = max(0, n - WINDOW + 1) // 32 * 32
        return (FULL_LAYERS * n + SWA_LAYERS * (n - start)) * TOKEN_BYTES

    run_pair(http, figures, prefill=fleet[P64], decode=fleet[D], proxy=fleet.proxy(P64, D),
             label="hybrid b64 -> b32 async", computed_at_load=0, seed=61_000,
             expected=moved)
    idle(http, fleet[P64], fleet[D])


def test_hybrid_tp1_prefill_to_tp2_decode(fleet: Fleet, http: httpx.Client,
                                          figures: list[str]) -> None:
    run_pair(http, figures, prefill=fleet[P], decode=fleet[DTP2], proxy=fleet.proxy(P, DTP2),
             label="hybrid TP1 -> TP2 async", computed_at_load=0, seed=67_000, tol=TP_TOL)
    idle(http, fleet[P], fleet[DTP2])
