"""Live GQA pairs that need engines of their own (`make test-long`; the fleet starts them with
the default ones when a long test is selected): another page size on either side and the async
load mode, the other-weights prefill (the negative control: the same
layout, another model's KV) and `kvhandoff verify`'s FAIL, TTFT medians, the prefill SIGKILLed
with requests in flight. Same model, reference and checks as test_live_gqa.py.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from live_fleet import Fleet
from live_outputs import body, generate, prompt_of
from live_pairs import check_pair, idle
from test_live_gqa import D32, MODEL, P32, REF, bit_equal, prefill_only, verify

pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

D64, POTHER = "gqa-decode-b64", "gqa-other-prefill"
P64 = "gqa-prefill-b64"
ENGINES = (REF, P32, D32, D64, POTHER, P64)  # what this module needs of the fleet


def check(fleet: Fleet, http: httpx.Client, figures: list[str], prefill: str, decode: str,
          **kw: Any) -> dict[int, float]:
    return check_pair(http, figures, ref=fleet[REF], proxy=fleet.proxy(prefill, decode),
                      decode=fleet[decode], model=MODEL, **kw)


def test_page_32_to_64_async_bit_equal(fleet: Fleet, http: httpx.Client,
                                       figures: list[str]) -> None:
    # different page sizes (token-granular pairing) and the async load mode; async announces
    # every prompt token (the decode recomputes none of them)
    check(fleet, http, figures, P32, D64, lengths=(33, 40, 64, 65, 100), seed=2,
          label="GQA b32 -> b64 async", announced_per_prompt=0)


def test_page_64_to_32_bit_equal(fleet: Fleet, http: httpx.Client,
                                 figures: list[str]) -> None:
    check(fleet, http, figures, P64, D32, lengths=(33, 40, 64, 65, 100), seed=21,
          label="GQA b64 -> b32 layerwise")


def test_negative_control_other_weights_fail(fleet: Fleet, http: httpx.Client,
                                             figures: list[str]) -> None:
    # the same layout, another model's KV: the comparison must fail, so the test can fail
    with pytest.raises(AssertionError, match="not the engine's"):
        check(fleet, http, figures, POTHER, D32, lengths=(33, 40), seed=8,
              label="GQA negative control (other weights)")


def test_verify_fails_on_other_weights_and_ttft_medians(
        fleet: Fleet, ttft: list[dict[str, Any]]) -> None:
    import json

    bad = verify(fleet[POTHER], fleet[D32], "--tolerance", "0", "--lengths", "33,40,64")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert json.loads(bad.stdout)["verdict"] == "FAIL"
    # TTFT: pair vs the engine alone, per prompt length (medians over 3 runs)
    for _ in range(3):
        run = verify(fleet[P32], fleet[D32], "--tolerance", "0", "--lengths", "33,128,384")
        assert run.returncode == 0, run.stdout + run.stderr
        for p in json.loads(run.stdout)["probes"]:
            ttft.append({"model": MODEL, "prompt_tokens": p["prompt_tokens"],
                         "alone_s": p["ttft_alone_s"], "pair_s": p["ttft_pair_s"]})


def test_prefill_sigkilled_with_requests_in_flight(fleet: Fleet, http: httpx.Client,
                                                   figures: list[str]) -> None:
    # last in the module: it kills the negative-control prefill. Two requests are in flight
    # between the engines (the prefill computed them and holds their blocks for the decodes)
    # when it dies.
    victim = fleet[POTHER]
    p_fail = prompt_of(9000, 40)
    p_recompute = prompt_of(9001, 40)
    params = [prefill_only(http, victim, p) for p in (p_fail, p_recompute)]
    victim.kill()
    t0 = time.monotonic()
    # kv_load_failure_policy=fail: the request ends (an error, not a hang), bounded by the
    # decode's layer_timeout_s (10 s) and this client's timeout
    r = httpx.post(f"{fleet[D32].url}/v1/completions", timeout=60,
                   json={**body(MODEL, p_fail), "kv_transfer_params": params[0]})
    failed_s = time.monotonic() - t0
    figures.append(f"prefill SIGKILLed: the decode (fail) answered HTTP {r.status_code} "
                   f"after {failed_s:.1f} s")
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text
    # kv_load_failure_policy=recompute: the decode computes the prompt itself, right
    ref = generate(http, fleet[REF].url, body(MODEL, p_recompute))
    got = generate(http, fleet[D64].url, {**body(MODEL, p_recompute),
                                          "kv_transfer_params": params[1]})
    assert bit_equal(ref, got)
    # both decodes keep serving (bit-equal) and hold no blocks
    for d in (D32, D64):
        prompt = prompt_of(9100 + fleet[d].block_size, 40)
        ref = generate(http, fleet[REF].url, body(MODEL, prompt))
        got = generate(http, fleet.proxy(P32, d), body(MODEL, prompt))
        assert bit_equal(ref, got)
    idle(http, fleet[D32], fleet[D64], fleet[P32])
    # kvhandoff verify against the dead prefill: could not run (exit 2), not a verdict
    dead = verify(victim, fleet[D32])
    assert dead.returncode == 2 and "could not run" in dead.stderr, dead.stdout + dead.stderr
