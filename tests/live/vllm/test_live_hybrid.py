"""A live hybrid pair in the default run: a Gemma-3-like model (make_models.py ``hybrid``: 6
layers, ``S S F S S F``, sliding window 48 beside full attention), 32-token blocks, a prefill
and a decode (async load) through our proxy, vLLM's hybrid allocator ON (no
``--disable-hybrid-kv-cache-manager``): it makes three KV cache groups of two layers (one
full-attention, two sliding-window), each with its own block table, and the connector moves
all three in one room per request.

Asserted per prompt (shorter than the window, one past it, past a dropped block, several
windows long): the decode's tokens equal and its logprobs bit-equal to the engine alone
(float32; the prefill engine itself, the request without ``kv_transfer_params`` and with its
own ``cache_salt``, so it shares no cached page with the pair's request); the decode announced
every prompt token as ``external_kv_transfer``; the bytes its room moved
(``vllm:kvhandoff_bytes``) are exactly the full-attention layers' pages of the whole prompt
plus the sliding-window layers' pages inside the window (``ceil(n / 32) - max(0, n - 48 + 1)
// 32`` of them, the blocks vLLM's sliding-window manager keeps), so no page out of the window
moved and none was written on the decode. Memory: both engines start with vLLM's hybrid
allocator on, so the decode's KV memory per request is the engine alone's: its "Maximum
concurrency" line equals the prefill's (an engine with the allocator off would hold every
sliding-window layer whole, fewer requests at once); its log names the three groups moved.

Before: the connector refused the model at start ("KVHandoffConnector moves one KV cache
group, vLLM's hybrid allocator made 3 ..."); the only way to run it was
``--disable-hybrid-kv-cache-manager`` (full allocation of the window layers).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from live_fleet import Engine, Fleet, wait_until
from live_outputs import body, generate, max_diff, prompt_of
from live_pairs import ROOMS_DONE, external, idle

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MODEL = "hybrid"
P, D = "hybrid-prefill", "hybrid-decode"
ENGINES = (P, D)  # what this module needs of the run's fleet
WINDOW, BLOCK = 48, 32  # make_models.SWA_WINDOW_TOKENS, the engines' --block-size
FULL_LAYERS, SWA_LAYERS = 2, 4  # make_models.HYBRID_LAYER_TYPES
PAGE_BYTES = BLOCK * 2 * 32 * 2 * 4  # tokens x KV heads x head dim x (K, V) x float32
BYTES = "vllm:kvhandoff_bytes_total"
CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")


def window_pages(n: int, computed: int) -> int:
    """The blocks vLLM keeps for a sliding-window layer of an `n`-token request with
    `computed` tokens computed: its sliding-window manager drops the blocks before
    ``computed - window + 1``."""
    return -(-n // BLOCK) - max(0, computed - WINDOW + 1) // BLOCK


def concurrency(e: Engine) -> str:
    found = CONCURRENCY.findall(e.log.read_text(errors="replace"))
    assert found, f"{e.name}: no 'Maximum concurrency' line in its log"
    return str(found[-1])


def run_pair(http: httpx.Client, figures: list[str], *, prefill: Engine, decode: Engine,
             proxy: str, label: str, computed_at_load: int, seed: int, tol: float = 0.0,
             expected: Callable[[int], int] | None = None) -> None:
    """Prompts of 20, 49, 80, 161 tokens alone (the prefill engine, its own cache salt) and
    through the pair: tokens equal, logprobs within `tol` (0: bit-equal), every prompt token
    but `computed_at_load` external, the bytes moved `expected(n)` (default: the full layers'
    pages plus the window's, module docstring)."""
    log = decode.log.read_text(errors="replace")
    assert "3 KV cache groups" in log and "swa48_g1" in log, decode.tail()
    if decode.block_size == prefill.block_size and decode.tp == prefill.tp:
        assert concurrency(decode) == concurrency(prefill)
    moved: dict[int, tuple[int, int]] = {}
    bad = []
    worst = 0.0
    for n in (20, 49, 80, 161):
        prompt = prompt_of(seed + n, n)
        want = generate(http, prefill.url, body(MODEL, prompt, salt=f"alone-{seed}-{n}"))
        rooms = decode.metric(http, ROOMS_DONE, role="decode")
        nbytes = decode.metric(http, BYTES, role="decode")
        ext = external(http, decode)
        got = generate(http, proxy, body(MODEL, prompt))
        worst = max(worst, max_diff(want, got))
        if got.tokens != want.tokens or max_diff(want, got) > tol:
            bad.append(f"{n} tokens: max |dlogprob| {max_diff(want, got):.3g} nats, tokens "
                       f"{'equal' if got.tokens == want.tokens else 'DIFFER'}")
        wait_until(f"{label}: a room of the {n}-token prompt done on the decode",
                   lambda r=rooms: decode.metric(http, ROOMS_DONE, role="decode") > r,
                   timeout_s=30)
        assert external(http, decode) - ext == n - computed_at_load, n
        pages = (FULL_LAYERS * -(-n // BLOCK)
                 + SWA_LAYERS * window_pages(n, n - computed_at_load))
        want_bytes = expected(n) if expected is not None else pages * PAGE_BYTES
        moved[n] = (want_bytes, int(decode.metric(http, BYTES, role="decode") - nbytes))
    figures.append(f"{label}: (bytes of the full layers' pages + the window's, bytes moved) "
                   "per prompt length: "
                   + ", ".join(f"{n}: {w}, {b}" for n, (w, b) in moved.items())
                   + f"; max |dlogprob| {worst:.3g} nats; max concurrency "
                   f"{concurrency(decode)}x")
    assert not bad, f"{label}: the decode's output is not the engine's: " + "; ".join(bad)
    assert all(w == b for w, b in moved.values()), moved


def test_hybrid_all_groups_async_bit_equal(fleet: Fleet, http: httpx.Client,
                                           figures: list[str]) -> None:
    run_pair(http, figures, prefill=fleet[P], decode=fleet[D], proxy=fleet.proxy(P, D),
             label="hybrid (S S F S S F, window 48, block 32) async", computed_at_load=0,
             seed=47_000)
    # the long prompts moved fewer sliding-window pages than their table holds
    assert window_pages(80, 80) == 2 and window_pages(161, 161) == 3
    idle(http, fleet[P], fleet[D])


def test_hybrid_decode_prefix_hit(fleet: Fleet, http: httpx.Client, figures: list[str]) -> None:
    """A 161-token prompt extending a 100-token one the decode loaded before: vLLM's hybrid
    prefix cache gives the decode a local hit on every group; the room moves the full layers'
    pages from the hit on and the sliding-window layers' from their window, and the output is
    still the engine's, bit for bit."""
    prefill, decode, proxy = fleet[P], fleet[D], fleet.proxy(P, D)
    first = prompt_of(4_711, 100)
    second = first + prompt_of(4_712, 61)
    generate(http, proxy, body(MODEL, first))  # the decode now caches the first prompt
    want = generate(http, prefill.url, body(MODEL, second, salt="alone-prefix"))
    rooms = decode.metric(http, ROOMS_DONE, role="decode")
    nbytes = decode.metric(http, BYTES, role="decode")
    ext = external(http, decode)
    got = generate(http, proxy, body(MODEL, second))
    wait_until("the extended prompt's room done on the decode",
               lambda: decode.metric(http, ROOMS_DONE, role="decode") > rooms, timeout_s=30)
    n = len(second)
    local = n - int(external(http, decode) - ext)  # the decode's own prefix hit
    moved = int(decode.metric(http, BYTES, role="decode") - nbytes)
    kept = max(local, max(0, n - WINDOW + 1) // BLOCK * BLOCK)
    pages = (FULL_LAYERS * (-(-n // BLOCK) - local // BLOCK)
             + SWA_LAYERS * (-(-n // BLOCK) - kept // BLOCK))
    figures.append(f"hybrid decode prefix hit: {n} tokens, {local} cached on the decode, "
                   f"{moved} bytes moved ({pages} pages), max |dlogprob| "
                   f"{max_diff(want, got):.3g}")
    assert got.tokens == want.tokens and max_diff(want, got) == 0.0
    assert local > 0 and local % BLOCK == 0, local
    assert moved == pages * PAGE_BYTES
    idle(http, prefill, decode)
