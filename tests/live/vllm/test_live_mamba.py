"""A live pair of a model with Gated DeltaNet state in the default run: a Qwen3-Next-like model
(make_models.py ``gdn``: ``G G G F``, three GDN linear-attention layers beside one
full-attention layer, bfloat16), a prefill and a decode (async load) through our proxy, vLLM's
defaults: the hybrid allocator (a Mamba state group per GDN layer beside the attention group,
the block raised to 96 tokens so an attention page holds a state block), prefix caching on
(``mamba_cache_mode`` 'align': the state table is position-indexed).

A request's state is one block per GDN layer (conv state, then the temporal state), written
after every token. The prefill computes the prompt but its last token (the decode must compute
one token, and a state cannot take the same token twice), hands over the attention pages of
those tokens and, per GDN layer, the block holding the state after them; the decode loads both
and computes the last prompt token from that state.

Asserted per prompt (20, 40 and 65 tokens: shorter than a block; 97: one token past a block;
182, 193, 268: two and three blocks): the bytes the room moved (``vllm:kvhandoff_bytes``) are
exactly the attention layer's pages of the loaded tokens plus ONE state block per GDN layer
(the block size from vLLM's log; vLLM pads a state block to the attention page), so no other
state block moved;
every prompt token but the last one was announced as ``external_kv_transfer``; and the decode's
output against the engine alone (the prefill engine itself, without ``kv_transfer_params``,
its own ``cache_salt``):

- the prompt one token past a block: tokens equal, logprobs bit-equal. vLLM computes a prompt
  of this model in chunks ending at its last block boundary before the last token
  (``mamba_cache_mode`` 'align'): the engine alone computes the first block, then the last
  token alone, as the pair does (the prefill the block, the decode the token): the same sums
  in the same order. (For 193 tokens the engine alone computes 192 then 1, the prefill's
  192-token prompt 96 then 96: not the same sums.)
- the other prompts: the engine alone computes the last prompt token inside its last chunk
  (the chunked GDN kernel), the decode alone from the loaded state (another order of bfloat16
  sums): the first generated token's logprob within `TOL_FIRST` nats. The later tokens follow
  greedy choices, which a near-tie can flip; vLLM's own NixlConnector pair on this build
  flips the same prompts (measured with these prompts: 20 tokens at its first token, 40 at
  its 11th, 65 at its first, 193 at its 12th; first-token |dlogprob| 0 to 0.03, the same
  figures as this pair's), so tokens are not compared there. The figure printed says per prompt the
  first-token |dlogprob| and where tokens differ.

Then a prompt the decode computes alone (no room) that shares the first block of a prompt the
decode loaded: the decode's prefix cache must not serve the loaded state block as the state of
that block's end (it holds the state after the loaded tokens, not after 96): vLLM gives it no
hit (0 tokens, asserted), and the output is bit-equal to the engine alone's.

In `make test-long`: a decode without prefix caching (``mamba_cache_mode`` 'none': one state
block per request, the state groups' block the whole context, the attention block still 96)
loads from the same
prefill (mode 'align'): the state block is its one block; the same bytes move, and the output
equals this prefill's pair's (the same state, the same last step).

Before: the connector refused the model at start ("has Mamba / SSM state layers ...
KVHandoffConnector moves attention KV pages, not a request's SSM / conv state").
"""

from __future__ import annotations

import re

import httpx
import pytest
from live_fleet import Fleet, wait_until
from live_outputs import body, generate, max_diff, prompt_of
from live_pairs import EXT, ROOMS_DONE, external, idle

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MODEL = "gdn"
P, D, DN = "gdn-prefill", "gdn-decode", "gdn-decode-none"
ENGINES = (P, D)  # what this module needs of the run's fleet (DN: its long case's own)
GDN_LAYERS, FULL_LAYERS = 3, 1  # make_models.GDN_LAYER_TYPES
BYTES = "vllm:kvhandoff_bytes_total"
# vLLM's engine core: the block of each KV cache group (the hybrid allocator's unified block)
GROUPS = re.compile(r"kv cache group sizes \(([\d, ]+)\)")
ATTN_BYTES_PER_TOKEN = 2 * 128 * 2 * 2  # KV heads x head dim x (K, V) x bfloat16
TOL_FIRST = 0.05  # nats; NixlConnector's pair on these prompts: at most 0.0296 (docstring)


def first_diff(a: list[str], b: list[str]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_gdn_state_moves_async(fleet: Fleet, http: httpx.Client, figures: list[str]) -> None:
    prefill, decode, proxy = fleet[P], fleet[D], fleet.proxy(P, D)
    log = decode.log.read_text(errors="replace")
    assert "Mamba cache mode is set to 'align'" in log, decode.tail()
    sizes = GROUPS.findall(log)
    assert sizes, decode.tail()
    blocks = {int(b) for b in sizes[-1].split(",")}
    assert len(blocks) == 1 and len(sizes[-1].split(",")) == GDN_LAYERS + FULL_LAYERS, sizes
    block = blocks.pop()  # tokens of a block, the state groups' and the attention group's
    # a state block is padded to the attention page (vLLM's hybrid allocator)
    page_bytes = block * ATTN_BYTES_PER_TOKEN
    moved: dict[int, tuple[int, int]] = {}
    seen: list[str] = []
    bad: list[str] = []
    for n in (20, 40, 65, block + 1, 2 * block - 10, 2 * block + 1, 3 * block - 20):
        prompt = prompt_of(61_000 + n, n)
        want = generate(http, prefill.url, body(MODEL, prompt, salt=f"alone-{n}"))
        rooms = decode.metric(http, ROOMS_DONE, role="decode")
        nbytes = decode.metric(http, BYTES, role="decode")
        ext = external(http, decode)
        got = generate(http, proxy, body(MODEL, prompt))
        first = abs(want.logprobs[0] - got.logprobs[0])
        differ = first_diff(want.tokens, got.tokens)
        seen.append(f"{n}: first {first:.3g}, tokens "
                    f"{'equal' if differ is None else f'differ from {differ}'}")
        if n == block + 1:
            if differ is not None or max_diff(want, got) != 0.0:
                bad.append(f"{n} tokens (the engine alone's split): max |dlogprob| "
                           f"{max_diff(want, got):.3g}, tokens differ from {differ}")
        elif first > TOL_FIRST:
            bad.append(f"{n} tokens: first token |dlogprob| {first:.3g} > {TOL_FIRST}")
        wait_until(f"a room of the {n}-token prompt done on the decode",
                   lambda r=rooms: decode.metric(http, ROOMS_DONE, role="decode") > r,
                   timeout_s=30)
        loaded = n - 1  # the decode computes the last prompt token itself
        assert external(http, decode) - ext == loaded, n
        want_bytes = (FULL_LAYERS * -(-loaded // block) + GDN_LAYERS) * page_bytes
        moved[n] = (want_bytes, int(decode.metric(http, BYTES, role="decode") - nbytes))
    figures.append(f"gdn (G G G F, bfloat16, block {block}) async: (bytes of the attention "
                   "pages + one state block per GDN layer, bytes moved) per prompt length: "
                   + ", ".join(f"{n}: {w}, {b}" for n, (w, b) in moved.items())
                   + "; against the engine alone: " + "; ".join(seen))
    assert not bad, "the decode's output is not the engine's: " + "; ".join(bad)
    assert all(w == b for w, b in moved.values()), moved
    idle(http, prefill, decode)


def test_decode_prefix_cache_after_a_loaded_state(fleet: Fleet, http: httpx.Client,
                                                  figures: list[str]) -> None:
    prefill, decode, proxy = fleet[P], fleet[D], fleet.proxy(P, D)
    loaded = prompt_of(4_711, 140)
    generate(http, proxy, body(MODEL, loaded))  # the decode loads 139 tokens, then computes
    cached = decode.metric(http, EXT, source="local_cache_hit")
    local = loaded[:96] + prompt_of(4_712, 30)
    want = generate(http, prefill.url, body(MODEL, local, salt="alone-local"))
    got = generate(http, decode.url, body(MODEL, local))  # the decode alone, its own cache
    hits = decode.metric(http, EXT, source="local_cache_hit") - cached
    figures.append(f"gdn decode prefix cache after a loaded state: {hits:.0f} tokens hit, max "
                   f"|dlogprob| {max_diff(want, got):.3g}, tokens "
                   f"{'equal' if got.tokens == want.tokens else 'DIFFER'}")
    assert hits == 0  # vLLM never computed the state at token 96 on the decode
    assert got.tokens == want.tokens and max_diff(want, got) == 0.0
    idle(http, prefill, decode)


# `make test-long`: an engine of its own (the fleet of `make test` is at the memory of a
# 24 GiB host: 15 engines of about 1.5 GiB each did not start)
@pytest.mark.long
@pytest.mark.engines(DN)
def test_decode_in_mode_none_loads_from_an_align_prefill(fleet: Fleet, http: httpx.Client,
                                                        figures: list[str]) -> None:
    prefill, decode, other = fleet[P], fleet[DN], fleet[D]
    log = decode.log.read_text(errors="replace")
    assert "Mamba cache mode is set to 'align'" not in log, decode.tail()
    sizes = GROUPS.findall(log)
    assert sizes, decode.tail()
    block = min(int(b) for b in sizes[-1].split(","))  # the attention group's
    page_bytes = block * ATTN_BYTES_PER_TOKEN
    seen = []
    for n in (20, block + 1, 2 * block - 10):
        prompt = prompt_of(71_000 + n, n)
        align = generate(http, fleet.proxy(P, D), body(MODEL, prompt, salt=f"align-{n}"))
        want = generate(http, prefill.url, body(MODEL, prompt, salt=f"alone-n-{n}"))
        rooms = decode.metric(http, ROOMS_DONE, role="decode")
        nbytes = decode.metric(http, BYTES, role="decode")
        got = generate(http, fleet.proxy(P, DN), body(MODEL, prompt, salt=f"none-{n}"))
        wait_until(f"a room of the {n}-token prompt done on the mode-'none' decode",
                   lambda r=rooms: decode.metric(http, ROOMS_DONE, role="decode") > r,
                   timeout_s=30)
        moved = int(decode.metric(http, BYTES, role="decode") - nbytes)
        seen.append(f"{n}: {moved} bytes, first |dlogprob| vs alone "
                    f"{abs(want.logprobs[0] - got.logprobs[0]):.3g}")
        assert moved == (FULL_LAYERS * -(-(n - 1) // block) + GDN_LAYERS) * page_bytes, n
        assert got.tokens == align.tokens and max_diff(align, got) == 0.0, n
        assert abs(want.logprobs[0] - got.logprobs[0]) <= TOL_FIRST, n
    figures.append("gdn align prefill -> mode-'none' decode: " + "; ".join(seen))
    idle(http, prefill, decode, other)
