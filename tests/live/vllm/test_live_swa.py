"""A live sliding-window pair (`make test-long`): a Mistral-like model whose every layer has a
48-token window (make_models.py ``swa``), 32-token blocks, a prefill and a decode (the default,
async load) through our proxy. vLLM's hybrid allocator stays on (the connector implements
``SupportsHMA``): it frees a request's blocks that fell out of the window on both engines, and
only the pages in the window move.

Asserted per prompt (shorter than the window, one past it, past a dropped block, several
windows long): the decode's tokens equal and its logprobs bit-equal to the engine alone
(float32; the prefill engine itself, the request without ``kv_transfer_params`` and with its
own ``cache_salt``, so it shares no cached page with the pair's request); the decode announced
every prompt token as external; the bytes the decode's rooms moved (``vllm:kvhandoff_bytes``)
are the pages in the window and no more: ``ceil(n / 32) - max(0, n - 48 + 1) // 32`` pages of
one size (a 161-token prompt: 3 of its 6 pages).

Before: the connector refused the model at start ("kv_cache_groups[0]: ... got
SlidingWindowSpec"), with or without vLLM's hybrid allocator.
"""

from __future__ import annotations

import httpx
import pytest
from live_fleet import Engine, Fleet, wait_until
from live_outputs import body, generate, max_diff, prompt_of
from live_pairs import ROOMS_DONE, external, idle

# `make test-long`: the sliding-window layers of `make test` are test_live_hybrid's (vLLM's
# hybrid allocator, window groups beside full ones); this single-group pair's two engines do
# not fit beside the rest of that fleet on a 24 GiB host (about 1.5 GiB an engine)
pytestmark = [pytest.mark.live, pytest.mark.long, pytest.mark.timeout(900)]

MODEL = "swa"
P, D = "swa-prefill", "swa-decode"
ENGINES = (P, D)  # what this module needs of the run's fleet
WINDOW, BLOCK = 48, 32  # make_models.SWA_WINDOW_TOKENS, the engines' --block-size
BYTES = "vllm:kvhandoff_bytes_total"


def window_pages(n: int, computed: int) -> int:
    """The blocks vLLM keeps for a decode that has `computed` of `n` prompt tokens computed:
    its sliding-window manager drops the blocks before ``computed - window + 1``."""
    return -(-n // BLOCK) - max(0, computed - WINDOW + 1) // BLOCK


def run_pair(http: httpx.Client, figures: list[str], *, prefill: Engine, decode: Engine,
             proxy: str, lengths: tuple[int, ...], seed: int, label: str,
             computed_at_load: int) -> dict[int, tuple[int, int]]:
    """Each prompt alone (on the prefill engine, its own cache salt) and through the pair; the
    output bit-equal; per prompt length, (pages in the window, bytes the decode's room moved).
    `computed_at_load`: tokens short of the prompt the decode has computed when it loads
    (async: 0, layerwise: 1)."""
    moved: dict[int, tuple[int, int]] = {}
    bad = []
    for n in lengths:
        prompt = prompt_of(seed * 1000 + n, n)
        want = generate(http, prefill.url, body(MODEL, prompt, salt=f"alone-{seed}-{n}"))
        rooms = decode.metric(http, ROOMS_DONE, role="decode")
        nbytes = decode.metric(http, BYTES, role="decode")
        ext = external(http, decode)
        got = generate(http, proxy, body(MODEL, prompt))
        if got.tokens != want.tokens or max_diff(want, got) != 0.0:
            bad.append(f"{n} tokens: max |dlogprob| {max_diff(want, got):.3g} nats, tokens "
                       f"{'equal' if got.tokens == want.tokens else 'DIFFER'}")
        wait_until(f"{label}: a room of the {n}-token prompt done on the decode",
                   lambda r=rooms: decode.metric(http, ROOMS_DONE, role="decode") > r,
                   timeout_s=30)
        assert external(http, decode) - ext == n - computed_at_load, n
        moved[n] = (window_pages(n, n - computed_at_load),
                    int(decode.metric(http, BYTES, role="decode") - nbytes))
    figures.append(f"{label}: (pages in the window, bytes moved) per prompt length: "
                   + ", ".join(f"{n}: {p}, {b}" for n, (p, b) in moved.items()))
    assert not bad, f"{label}: the decode's output is not the engine's: " + "; ".join(bad)
    return moved


def one_page_size(moved: dict[int, tuple[int, int]]) -> None:
    """Every room moved its window's pages, of one size: no page out of the window moved."""
    sizes = {b / p for p, b in moved.values()}
    assert len(sizes) == 1, f"bytes per page differ across prompts: {moved}"


def test_sliding_window_async_bit_equal(fleet: Fleet, http: httpx.Client,
                                        figures: list[str]) -> None:
    # shorter than the window, one past it, past a dropped block, several windows (4 prompts:
    # the case stays in the default run)
    lengths = (20, 49, 80, 161)
    moved = run_pair(http, figures, prefill=fleet[P], decode=fleet[D],
                     proxy=fleet.proxy(P, D), lengths=lengths, seed=41,
                     label="SWA (window 48, block 32) async", computed_at_load=0)
    one_page_size(moved)
    # the long prompts moved fewer pages than their table holds
    assert moved[80][0] == 2 and moved[161][0] == 3
    idle(http, fleet[P], fleet[D])
