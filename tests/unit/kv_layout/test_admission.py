"""Admission at the handshake and prompt-prefix agreement (issue 17, seed 003): pure functions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import (
    AllocationPolicy,
    admission_refusal,
    check_capacity,
    check_reservation,
    decode_need,
    first_differing_page,
    handoff_bytes,
    policy_mismatch,
    prefix_digest,
    preset,
    prompt_digest,
    prompt_mismatch,
)
from kvhandoff.kv_layout.admission import IndexerWorkspace, request_budget


def test_a_1m_request_on_glm_needs_16384_blocks_of_3_29_mib():
    need = decode_need(preset("glm-5.3"), seq_len=1_048_576, decode_prefix_len=0)
    assert need.pages == 16_384 and need.held_pages == 0
    assert need.bytes_per_page == 3_452_160
    assert need.bytes == 16_384 * 3_452_160 == 56_560_189_440
    assert {r.name: r.bytes_reserved for r in need.regions} == {
        "main_kv": 16_384 * 78 * 41_984, "indexer_k": 16_384 * 21 * 8_448}
    assert need.bytes_moved == need.bytes  # nothing cached: everything moves


def test_cached_prefix_pages_are_not_reserved_again_and_both_caches_move_only_their_suffix():
    spec = preset("glm-5.3")
    need = decode_need(spec, seq_len=300, decode_prefix_len=100)  # held: 64 tokens, 1 page
    assert need.held_pages == 1 and need.pages == 4
    moved = {r.name: r.bytes_moved for r in need.regions}
    assert moved == handoff_bytes(spec, seq_len=300, decode_prefix_len=100)
    assert moved == {"main_kv": (300 - 64) * 656 * 78, "indexer_k": (300 - 64) * 132 * 21}
    # the named whole-sequence option: main KV from token 0, the indexer still suffix-only
    whole = preset("glm-5.3", whole_sequence=True)
    assert handoff_bytes(whole, seq_len=300, decode_prefix_len=100) == {
        "main_kv": 300 * 656 * 78, "indexer_k": (300 - 64) * 132 * 21}


def test_kpool2_and_0_row_layers_count_rows_and_live_layers():
    need = decode_need(preset("glm-5.3-kpool2"), seq_len=129, decode_prefix_len=0)
    assert need.pages == 2 and need.bytes_per_page == 128 * 656 * 78 + 64 * 132 * 21
    idx = next(r for r in need.regions if r.name == "indexer_k")
    assert idx.bytes_moved == 65 * 132 * 21  # 129 tokens: 65 rows of 2 tokens
    assert idx.bytes_reserved == 2 * 64 * 132 * 21


def test_capacity_refusal_names_the_need_and_what_is_free():
    need = decode_need(preset("glm-5.3"), seq_len=1_048_576, decode_prefix_len=0)
    assert check_capacity(need, free_pages=16_384) is None
    assert check_capacity(need, free_pages=16_383) == (
        "admission: 1,048,576 tokens with 0 cached need 16,384 pages of 64 tokens "
        "(56,560,189,440 B); the decode has 16,383 free")
    assert check_reservation(need, reserved_pages=16_384) is None
    assert check_reservation(need, reserved_pages=100) == (
        "admission: 1,048,576 tokens with 0 cached need 16,384 pages of 64 tokens "
        "(56,560,189,440 B); the decode reserved 100")
    with pytest.raises(ConfigError, match="free_pages"):
        check_capacity(need, free_pages=-1)
    with pytest.raises(ConfigError, match="decode_prefix_len"):
        decode_need(preset("glm-5.3"), seq_len=10, decode_prefix_len=11)


def test_allocation_policy_parses_and_both_sides_must_agree():
    assert AllocationPolicy.parse("early") is AllocationPolicy.EARLY
    assert AllocationPolicy.parse("prefill_complete") is AllocationPolicy.PREFILL_COMPLETE
    with pytest.raises(ConfigError, match=r"^allocation_policy: expected one of early, "
                       r"prefill_complete, got 'late'"):
        AllocationPolicy.parse("late")
    assert policy_mismatch(AllocationPolicy.EARLY, AllocationPolicy.EARLY) is None
    assert policy_mismatch(AllocationPolicy.EARLY, AllocationPolicy.PREFILL_COMPLETE) == (
        "allocation_policy: prefill=early decode=prefill_complete (both sides must run the "
        "same --disaggregation-decode-allocation-policy)")


def test_prompt_digest_names_the_first_differing_page():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, 1000)
    mine = prompt_digest(prompt, 64)
    assert len(mine.pages) == 16 and mine.num_tokens == 1000
    assert prompt_mismatch(mine, prompt_digest(prompt.tolist(), 64)) is None
    other = prompt.copy()
    other[200] += 1  # page 3 (tokens 192..255)
    assert prompt_mismatch(mine, prompt_digest(other, 64)) == (
        "prompt mismatch: the prompt token ids differ; first differing page 3 "
        "(tokens 192..255)")
    assert prompt_mismatch(mine, prompt_digest(prompt[:999], 64)) == (
        "prompt mismatch: seq_len prefill=1000 decode=999")


def test_the_cached_prefix_must_be_the_prompts_tokens():
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 150_000, 1000)
    mine = prompt_digest(prompt, 64)
    cached = prefix_digest(prompt, 300, 64)  # page-aligned: 256 tokens, 4 pages
    assert cached.num_tokens == 256 and len(cached.pages) == 4
    assert prompt_mismatch(mine, mine, cached) is None
    stale = prompt.copy()
    stale[130] = 7  # the decode's cache was computed from other tokens on page 2
    assert prompt_mismatch(mine, mine, prefix_digest(stale, 300, 64)) == (
        "prefix mismatch: the decode's cached 256-token prefix is not the prompt's; first "
        "differing page 2 (tokens 128..191)")
    with pytest.raises(ConfigError, match="page_size_tokens=32"):
        prompt_mismatch(mine, prompt_digest(prompt, 32))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=300), st.integers(1, 70),
       st.data())
def test_first_differing_page_is_the_page_of_the_first_differing_token(tokens, ps, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[i] = tokens[i] + 1
    a, b = prompt_digest(tokens, ps), prompt_digest(other, ps)
    assert first_differing_page(a.pages, b.pages) == i // ps
    assert prompt_mismatch(a, b) is not None and f"page {i // ps} " in str(prompt_mismatch(a, b))
    assert first_differing_page(a.pages, a.pages) is None


def test_admission_refusal_is_one_reason_in_order_policy_prompt_capacity():
    spec = preset("glm-5.3")
    prompt = np.arange(300) % 97
    mine = prompt_digest(prompt, 64)
    early, late = AllocationPolicy.EARLY, AllocationPolicy.PREFILL_COMPLETE
    kw = {"seq_len": 300, "decode_prefix_len": 100}
    assert admission_refusal(spec, **kw, prefill_policy=early, decode_policy=early,
                             reserved_pages=4, prefill_prompt=mine, decode_prompt=mine,
                             decode_prefix=prefix_digest(prompt, 100, 64)) is None
    # the policy first, whatever else is wrong
    assert admission_refusal(spec, **kw, prefill_policy=early, decode_policy=late,
                             free_pages=0).startswith("allocation_policy: prefill=early")
    other = prompt.copy()
    other[5] += 1
    assert admission_refusal(spec, **kw, prefill_policy=late, decode_policy=late, free_pages=0,
                             prefill_prompt=mine, decode_prompt=prompt_digest(other, 64)
                             ).startswith("prompt mismatch: the prompt token ids differ; first "
                                          "differing page 0")
    assert admission_refusal(spec, **kw, prefill_policy=late, decode_policy=late,
                             free_pages=0, prefill_prompt=mine) == (
        "prompt digest: only one side sent one (prefill=yes decode=no)")
    # held: 1 page (64 of the 100 cached tokens); 300 tokens: 5 pages, 4 new
    assert admission_refusal(spec, **kw, prefill_policy=late, decode_policy=late,
                             free_pages=3) == (
        "admission: 300 tokens with 64 cached need 4 pages of 64 tokens (13,808,640 B); the "
        "decode has 3 free")
    assert admission_refusal(spec, **kw, prefill_policy=early, decode_policy=early,
                             reserved_pages=3).endswith("the decode reserved 3")
    with pytest.raises(ConfigError, match="^reserved_pages: required"):
        admission_refusal(spec, **kw, prefill_policy=early, decode_policy=early)
    with pytest.raises(ConfigError, match="^free_pages: required"):
        admission_refusal(spec, **kw, prefill_policy=late, decode_policy=late)


def test_the_budget_counts_prompt_output_and_indexer_workspace_line_by_line():
    spec = preset("glm-5.3")
    # seed 000's 1M request with 256 new tokens: refused at 56 GB free
    b = request_budget(spec, seq_len=1_048_576, new_tokens=256, available_bytes=56 * 10**9)
    assert b.need.pages == 16_388 and b.need.prompt_pages == 16_384  # rounded to pages
    assert [x.name for x in b.lines] == ["main_kv", "indexer_k", "indexer workspace"]
    assert b.lines[0].nbytes == 16_388 * 78 * 41_984
    assert b.lines[1].nbytes == 16_388 * 21 * 8_448  # the indexer's pages for the output too
    ws = 8192 * 2048 * 4 + 1 * 1_048_832 * 4  # top-k index buffer + one row of logits
    assert b.lines[2].nbytes == ws
    assert b.total_bytes == 16_388 * 3_452_160 + ws
    assert not b.admitted and b.reason is not None
    assert "1,048,576 tokens + 256 new" in b.reason and "56,000,000,000 B free" in b.reason
    assert "only without its output" not in b.reason  # not even the prompt fits
    # room for the prompt (and the workspace) but not for its output: refused, saying so
    mid = request_budget(spec, seq_len=1_048_576, new_tokens=256,
                         available_bytes=16_384 * 3_452_160 + ws + 1)
    assert not mid.admitted and mid.reason is not None
    assert "fits only without its output" in mid.reason
    assert request_budget(spec, seq_len=1_048_576, new_tokens=256,
                          available_bytes=60 * 10**9).admitted
    # a held prefix: its pages are not reserved again
    held = request_budget(spec, seq_len=1_048_576, new_tokens=256, decode_prefix_len=100_000,
                          available_bytes=60 * 10**9)
    assert held.need.pages == 16_388 - 100_000 // 64


def test_dcp_is_refused_by_name_and_bad_counts_name_their_field():
    spec = preset("glm-5.3")
    with pytest.raises(ConfigError, match=r"^dcp_size: 2 is not modelled"):
        request_budget(spec, seq_len=10, new_tokens=1, available_bytes=1, dcp_size=2)
    with pytest.raises(ConfigError, match=r"^new_tokens: expected >= 0"):
        request_budget(spec, seq_len=10, new_tokens=-1, available_bytes=1)
    with pytest.raises(ConfigError, match=r"^index_topk: expected > 0"):
        IndexerWorkspace(index_topk=0)
    # a model without an indexer has no workspace line
    lines = request_budget(preset("llama-3.1-8b"), seq_len=10, new_tokens=1,
                           available_bytes=10**9).lines
    assert [x.name for x in lines] == ["main_k", "main_v"]
