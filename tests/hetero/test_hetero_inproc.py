"""Heterogeneous topologies in one process (issue 8): real agents over the `inproc` transport.

- MLA / indexer (glm-5.3, replicated): decode TP 1, 2, 4 x prefill TP 1, 2, 4. Each decode rank
  reads from exactly one prefill rank (the bootstrap server's mapping, ``d % P``), the decode
  ranks spread over the prefill ranks, every byte crosses once, every decode rank byte-exact.
- GQA (llama-3.1-8b, head-sharded): decode TP > prefill TP, < prefill TP, and kv_heads < TP on
  either side (heads replicated); byte-exact per head (the pattern is salted by head id).
- Page sizes: prefill 64 against decode 16, 32, 128 and the reverse, with a cached prefix not
  aligned to the larger page; key-then-scale indexer pages byte-exact, prefix pages untouched.
- Pairs that cannot work fail on both sides at the handshake, with the reason.

Agents are built once per (model, role, TP size, page size) for the module and reused by
several rooms; every room's pages go back to the pools (checked).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
from hetkit import Outcome, Rank, close_all, handoff, make_ranks, one_copy_bytes

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, TPSplit, page_aligned
from kvhandoff.kv_layout.presets import glm53, heads_of_rank, llama31_8b, main_send_from
from kvhandoff.state_machine import KVPoll

GLM_SEQ, GLM_PREFIX = 300, 100  # 5 pages of 64, the last partial; prefix 100 -> 64
LLAMA_SEQ = 100  # 7 pages of 16, the last partial
NUM_PAGES = 24  # enough for the largest room at the smallest page (300 tokens / 16)
ROOMS = itertools.count(8000)

Factory = Callable[..., list[Rank]]


@pytest.fixture(scope="module")
def engine() -> Iterator[Factory]:
    """``engine(model, role, tp, page)``: the ranks of one engine, built once per module."""
    cache: dict[tuple[str, str, int, int], list[Rank]] = {}

    def get(model: str, role: str, tp: int, page: int) -> list[Rank]:
        key = (model, role, tp, page)
        if key not in cache:
            if model == "glm-5.3":
                # P != D pages on purpose: the kernel page rules would refuse 16/32/128
                layouts = [glm53(page_size_tokens=page).without_page_rules()] * tp
            else:
                layouts = [llama31_8b(tp_size=tp, tp_rank=r, page_size_tokens=page)
                           for r in range(tp)]
            cache[key] = make_ranks(role, layouts, num_pages=NUM_PAGES, seed=len(cache))
        return cache[key]

    yield get
    for ranks in cache.values():
        close_all(ranks)


def assert_clean(out: Outcome) -> None:
    assert out.decode_states == [KVPoll.Success] * len(out.decode_states), out.failures
    assert out.prefill_states == [KVPoll.Success] * len(out.prefill_states)
    assert out.bad == [0] * len(out.bad), "decode bytes differ from the prefill's"
    assert out.touched == [0] * len(out.touched), "cached-prefix pages were overwritten"
    assert out.released and out.pools_full, "pages not released exactly once"
    for d, (after, before) in enumerate(zip(out.descriptors, out.descriptors_before,
                                            strict=True)):
        assert after and all(0 < after[k] <= before[k] for k in after), (d, after, before)


# ------------------------------------------------------------------ MLA / indexer, replicated


@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_mla_replicated_one_source_per_decode_rank(engine: Factory, prefill_tp: int,
                                                   decode_tp: int) -> None:
    pre = engine("glm-5.3", "prefill", prefill_tp, 64)
    dec = engine("glm-5.3", "decode", decode_tp, 64)
    out = handoff(pre, dec, next(ROOMS), seq_len=GLM_SEQ, prefix=GLM_PREFIX)
    assert_clean(out)
    addr = [r.agent.address for r in pre]
    # exactly one prefill rank per decode rank, spread: decode d -> prefill d % P
    assert out.peers == [[addr[d % prefill_tp]] for d in range(decode_tp)]
    used = {p[0] for p in out.peers}
    assert len(used) == min(prefill_tp, decode_tp)
    # no duplicate bytes: D copies in all, each decode rank exactly one, on both sides
    copy = one_copy_bytes(dec[0].layout, GLM_SEQ, GLM_PREFIX)
    assert out.decode_bytes == [copy] * decode_tp
    assert sum(out.prefill_bytes) == decode_tp * copy
    # every prefill rank sends one copy per decode rank it serves, idle ones send nothing
    assert out.prefill_bytes == [copy * sum(d % prefill_tp == p for d in range(decode_tp))
                                 for p in range(prefill_tp)]


# ------------------------------------------------------------------ GQA, head-sharded


@pytest.mark.parametrize(("prefill_tp", "decode_tp"),
                         [(1, 2), (2, 1), (4, 2), (2, 4), (16, 8), (8, 16)])
def test_gqa_head_slices_byte_exact(engine: Factory, prefill_tp: int, decode_tp: int) -> None:
    pre = engine("llama-3.1-8b", "prefill", prefill_tp, 16)
    dec = engine("llama-3.1-8b", "decode", decode_tp, 16)
    out = handoff(pre, dec, next(ROOMS), seq_len=LLAMA_SEQ)
    assert_clean(out)
    addr = [r.agent.address for r in pre]
    for d in range(decode_tp):
        # the legs are the prefill ranks holding this rank's heads (several when P > D)
        assert out.peers[d] == [addr[p] for p in out.sources[d]]
        mine = set(heads_of_rank(8, decode_tp, d))
        for p in out.sources[d]:
            assert mine & set(heads_of_rank(8, prefill_tp, p)), (d, p)
    # every head of every decode rank crossed exactly once (bytes are those of its planes)
    copies = [one_copy_bytes(r.layout, LLAMA_SEQ, 0) for r in dec]
    assert out.decode_bytes == copies
    assert sum(out.prefill_bytes) == sum(copies)
    if prefill_tp > 8:
        # kv_heads < prefill TP: two prefill ranks hold each head; only one of them sends it
        for d in range(decode_tp):
            sent = sorted(out.prefill_bytes[p] for p in out.sources[d])
            assert sent == [0, copies[d]], sent


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "per_layer"), [
    # identity page order, equal pages, 96 tokens = 6 whole pages of 16: descriptors per region
    # and layer on one decode rank. 1->1 and 2->2: whole pages on both sides -> one span.
    # 1->2: half of each source page (4 of 8 heads), whole destination pages -> one per page.
    # 2->1: whole source pages into half destination pages, from two legs -> 2 x 6.
    (1, 1, 1), (2, 2, 1), (1, 2, 6), (2, 1, 12),
])
def test_gqa_coalescing_identity_order(prefill_tp: int, decode_tp: int, per_layer: int) -> None:
    pre = make_ranks("prefill", [llama31_8b(tp_size=prefill_tp, tp_rank=r)
                                 for r in range(prefill_tp)], num_pages=6, shuffle=False)
    dec = make_ranks("decode", [llama31_8b(tp_size=decode_tp, tp_rank=r)
                                for r in range(decode_tp)], num_pages=6, shuffle=False)
    try:
        out = handoff(pre, dec, next(ROOMS), seq_len=96)
        assert_clean(out)
        for d in range(decode_tp):
            assert out.descriptors[d] == {"main_k": 32 * per_layer, "main_v": 32 * per_layer}
    finally:
        close_all(pre + dec)


def test_mla_coalescing_identity_order() -> None:
    """Identity page order, equal pages: main KV is one span per layer; the indexer suffix
    (from the prefix, last page partial) is keys-then-scales, so the scales of the partial
    last page are a second span."""
    pre = make_ranks("prefill", [glm53()], num_pages=5, shuffle=False)
    dec = make_ranks("decode", [glm53()], num_pages=5, shuffle=False)
    try:
        out = handoff(pre, dec, next(ROOMS), seq_len=GLM_SEQ, prefix=GLM_PREFIX)
        assert_clean(out)
        assert out.descriptors == [{"main_kv": 78, "indexer_k": 2 * 21}]
    finally:
        close_all(pre + dec)


def test_gqa_pages_and_tp_differ(engine: Factory) -> None:
    """Prefill TP4 with 32-token pages into decode TP2 with 16-token pages."""
    pre = engine("llama-3.1-8b", "prefill", 4, 32)
    dec = engine("llama-3.1-8b", "decode", 2, 16)
    out = handoff(pre, dec, next(ROOMS), seq_len=LLAMA_SEQ)
    assert_clean(out)
    assert [len(p) for p in out.peers] == [2, 2]
    assert out.decode_bytes == [one_copy_bytes(r.layout, LLAMA_SEQ, 0) for r in dec]


# ------------------------------------------------------------------ page sizes


@pytest.mark.parametrize(("prefill_page", "decode_page"),
                         [(64, 32), (64, 128), (64, 16), (32, 64), (128, 64), (16, 64)])
def test_page_sizes_differ(engine: Factory, prefill_page: int, decode_page: int) -> None:
    # a prefix not aligned to the larger page; page-aligned down to the decode page it is
    # still not a multiple of the prefill page when the prefill page is the larger one
    prefix = max(prefill_page, decode_page) * 3 // 2 + 4
    held = page_aligned(prefix, decode_page)
    if prefill_page > decode_page:
        assert held % prefill_page, "the case must cut a prefill page"
    pre = engine("glm-5.3", "prefill", 1, prefill_page)
    dec = engine("glm-5.3", "decode", 1, decode_page)
    out = handoff(pre, dec, next(ROOMS), seq_len=GLM_SEQ, prefix=prefix)
    assert_clean(out)
    assert out.decode_bytes == [one_copy_bytes(dec[0].layout, GLM_SEQ, prefix)]
    assert out.prefill_bytes == out.decode_bytes


# ------------------------------------------------------------------ refused pairs


def _refused(pre_layout: LayoutSpec, dec_layout: LayoutSpec) -> tuple[str, str]:
    """Opens a room between one prefill and one decode rank; both must fail (within the
    bound, long before any deadline: bootstrap is 120 s here). Returns both reasons."""
    pre = make_ranks("prefill", [pre_layout], num_pages=8)
    dec = make_ranks("decode", [dec_layout], num_pages=8)
    try:
        out = handoff(pre, dec, next(ROOMS), seq_len=LLAMA_SEQ)
        assert out.decode_states == [KVPoll.Failed]
        assert out.prefill_states == [KVPoll.Failed]
        assert out.released and out.pools_full
        p_reason, d_reason = out.prefill_failures[0], out.failures[0]
        assert p_reason is not None and d_reason is not None
        assert "deadline" not in p_reason + d_reason
        return p_reason, d_reason
    finally:
        close_all(pre + dec)


def _gqa_layout(heads: list[int], head_bytes: int) -> LayoutSpec:
    """A llama-3.1-8b-like layout built by hand: these heads, this many bytes per head, main KV
    from the decode's prefix as in the preset."""
    regions = tuple(
        RegionSpec(name=name, layer_ids=tuple(range(32)),
                   planes=tuple(Plane(f"h{h}", head_bytes) for h in heads),
                   send_from=main_send_from(False), tp_split=TPSplit.HEAD_SHARDED,
                   num_heads=len(heads))
        for name in ("main_k", "main_v"))
    return LayoutSpec(page_size_tokens=16, kv_dtype="bfloat16", regions=regions,
                      model="llama-3.1-8b", num_layers=32)


def test_refused_head_size_differs() -> None:
    """A decode whose heads are 64 dims (128 B) against 128-dim prefill heads (256 B)."""
    p_reason, d_reason = _refused(llama31_8b(), _gqa_layout(list(range(8)), 128))
    for reason in (p_reason, d_reason):
        assert "layout mismatch" in reason
        assert "main_k.planes[0].bytes_per_token: prefill=256 decode=128" in reason


def test_refused_heads_no_prefill_rank_holds() -> None:
    """A decode rank asking heads h8, h9 of a prefill engine that has heads h0..h7."""
    p_reason, d_reason = _refused(llama31_8b(), _gqa_layout([8, 9], 256))
    for reason in (p_reason, d_reason):
        assert "no prefill rank of this room holds planes ['h8', 'h9']" in reason


def test_refused_indexer_layers_differ() -> None:
    """MLA: a decode whose indexer sits on other layers (39 instead of 21) cannot take the
    prefill's indexer pages; the reason names the field."""
    p_reason, d_reason = _refused(glm53(page_size_tokens=16).without_page_rules(),
                                  glm53(page_size_tokens=32, indexer_layers=39)
                                  .without_page_rules())
    for reason in (p_reason, d_reason):
        assert "indexer_k.layer_ids" in reason
        assert "page_size" not in reason  # page sizes may differ; they are not the reason


def test_refused_tp_sizes_that_do_not_split() -> None:
    """TP sizes that do not divide the heads or one another are refused before any agent."""
    with pytest.raises(ConfigError, match="does not divide the 8 KV heads"):
        llama31_8b(tp_size=3, tp_rank=0)
    from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks

    with pytest.raises(ConfigError, match="must divide one another"):
        prefill_tp_ranks(0, 4, 6)
