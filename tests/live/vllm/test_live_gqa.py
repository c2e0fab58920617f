"""Live GQA pairs in the default run: a real prefill `vllm serve` hands its KV to a real decode
`vllm serve` through KVHandoffConnector, and the decode must generate exactly what the engine
alone generates: the same tokens and bit-equal logprobs (float32; vLLM's CPU engine is
deterministic: a prefix-cache hit, the decode's exact path, gives bit-identical logprobs).

Engines (the run's shared fleet, conftest.py): the reference (a plain `vllm serve`), a prefill
and a decode with 32-token blocks (layerwise, ``kv_load_failure_policy=fail``), through our
proxy. Model: Llama-like, 4 layers, 8 heads, 2 KV heads, head 32 (make_models.py).

Asserted per case: tokens equal and logprobs bit-equal to the reference, the decode's
``external_kv_transfer`` prompt tokens grew by exactly what the pair moved, kvhandoff's own
figures in the decode's ``/metrics``; every connector engine logged "layout verified against"
at start (the fleet checks it). The negative control here is a wrong KV of the same layout:
another prompt's room, of the same length, given to the decode (no extra engine; the
other-weights prefill, SIGKILL, other page sizes, the async load mode and TP changes are in
test_live_gqa_long.py, `make test-long`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
from live_fleet import Engine, Fleet
from live_outputs import Gen, body, generate, max_diff, prompt_of
from live_pairs import check_pair, external, idle

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MODEL = "gqa"
REF, P32, D32 = "gqa-ref", "gqa-prefill-b32", "gqa-decode-b32"
ENGINES = (REF, P32, D32)  # what this module needs of the run's fleet
# 32-token blocks; layerwise moves all but the last prompt token, so the moved part ends in a
# full page (33, 65), a one-token page (34), a partial page (40, 50, 64)
LENGTHS = (33, 34, 40, 50, 64, 65)


def bit_equal(want: Gen, got: Gen) -> bool:
    return got.tokens == want.tokens and max_diff(want, got) == 0.0


def test_equal_pages_layerwise_bit_equal(fleet: Fleet, http: httpx.Client,
                                         figures: list[str]) -> None:
    check_pair(http, figures, ref=fleet[REF], proxy=fleet.proxy(P32, D32), decode=fleet[D32],
               model=MODEL, lengths=LENGTHS, seed=1, label="GQA b32 -> b32 layerwise")


def test_decode_side_prefix_hit(fleet: Fleet, http: httpx.Client) -> None:
    # the second prompt extends the first: the decode has the first's full pages cached and
    # loads only the rest
    proxy, d32 = fleet.proxy(P32, D32), fleet[D32]
    first = prompt_of(4000, 70)
    second = first + prompt_of(4001, 30)
    generate(http, proxy, body(MODEL, first))
    before = external(http, d32)
    got = generate(http, proxy, body(MODEL, second))
    moved = external(http, d32) - before
    ref = generate(http, fleet[REF].url, body(MODEL, second))
    assert bit_equal(ref, got), max_diff(ref, got)
    # 64 tokens (two full 32-token pages) were a local hit; 100 - 1 - 64 came from the prefill
    assert moved == len(second) - 1 - 64


def test_prefill_side_prefix_hit(fleet: Fleet, http: httpx.Client) -> None:
    # the prefill has the prompt's first pages cached from an earlier request of its own:
    # it still sends the whole page table from token 0
    proxy, d32 = fleet.proxy(P32, D32), fleet[D32]
    head = prompt_of(5000, 64)
    generate(http, fleet[P32].url, body(MODEL, head))
    prompt = head + prompt_of(5001, 10)
    before = external(http, d32)
    got = generate(http, proxy, body(MODEL, prompt))
    ref = generate(http, fleet[REF].url, body(MODEL, prompt))
    assert bit_equal(ref, got), max_diff(ref, got)
    assert external(http, d32) - before == len(prompt) - 1


def test_four_requests_at_once(fleet: Fleet, http: httpx.Client) -> None:
    proxy = fleet.proxy(P32, D32)
    prompts = [prompt_of(6000 + i, n) for i, n in enumerate((33, 40, 57, 64))]
    refs = [generate(http, fleet[REF].url, body(MODEL, p)) for p in prompts]
    got: list[Gen | BaseException | None] = [None] * 4
    barrier = threading.Barrier(4)

    def one(i: int) -> None:
        try:
            barrier.wait(10)
            with httpx.Client(timeout=120) as c:
                got[i] = generate(c, proxy, body(MODEL, prompts[i]))
        except BaseException as e:  # reported below
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (r, g) in enumerate(zip(refs, got, strict=True)):
        assert isinstance(g, Gen), f"request {i}: {g!r}"
        assert bit_equal(r, g), (i, max_diff(r, g))


def test_client_disconnects_mid_decode(fleet: Fleet, http: httpx.Client) -> None:
    proxy = fleet.proxy(P32, D32)
    payload = body(MODEL, prompt_of(7000, 40), max_tokens=400, stream=True)
    chunks = 0
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{proxy}/v1/completions",
                                                  json=payload) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                chunks += 1
            if chunks == 3:
                break  # leave: the connection closes mid-decode
    assert chunks == 3
    idle(http, fleet[D32], fleet[P32])
    # the decode keeps serving, bit-equal
    prompt = prompt_of(7001, 40)
    ref = generate(http, fleet[REF].url, body(MODEL, prompt))
    got = generate(http, proxy, body(MODEL, prompt))
    assert bit_equal(ref, got)


def prefill_only(http: httpx.Client, prefill: Engine, prompt: list[int]) -> dict[str, Any]:
    """The proxy's first leg by hand: the prefill computes `prompt` and returns the params."""
    r = http.post(f"{prefill.url}/v1/completions",
                  json={**body(MODEL, prompt), "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert isinstance(params, dict)
    return params


def test_negative_control_swapped_kv_fails(fleet: Fleet, http: httpx.Client,
                                           figures: list[str]) -> None:
    # the decode gets the room of another prompt of the same length: the same layout and
    # model, the wrong KV. The comparison must fail, so the test can fail.
    a, b = prompt_of(8000, 40), prompt_of(8001, 40)
    pa, pb = prefill_only(http, fleet[P32], a), prefill_only(http, fleet[P32], b)
    diffs = []
    for prompt, params in ((a, pb), (b, pa)):
        got = generate(http, fleet[D32].url, {**body(MODEL, prompt),
                                              "kv_transfer_params": params})
        ref = generate(http, fleet[REF].url, body(MODEL, prompt))
        diffs.append(max_diff(ref, got))
        assert not bit_equal(ref, got), "another prompt's KV gave the engine's own output"
    figures.append("GQA negative control (another prompt's KV, same length): max |dlogprob| "
                   + ", ".join(f"{d:.3g}" for d in diffs) + " nats")
    idle(http, fleet[D32], fleet[P32])


def verify(prefill: Engine, decode: Engine, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", "verify", "--prefill", prefill.url,
         "--decode", decode.url, "--json", *extra], capture_output=True, text=True,
        timeout=300)


def test_verify_command_passes(fleet: Fleet, ttft: list[dict[str, Any]]) -> None:
    lengths = (33, 40, 64, 128, 384)
    ok = verify(fleet[P32], fleet[D32], "--tolerance", "0",
                "--lengths", ",".join(map(str, lengths)))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout)
    assert report["verdict"] == "PASS"
    assert report["external_tokens_moved"] == report["external_tokens_expected"] == sum(
        n - 1 for n in lengths)
    # TTFT: pair vs the engine alone, per prompt length (medians over 3 runs: make test-long)
    for p in report["probes"]:
        ttft.append({"model": MODEL, "prompt_tokens": p["prompt_tokens"],
                     "alone_s": p["ttft_alone_s"], "pair_s": p["ttft_pair_s"]})
