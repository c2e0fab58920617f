"""`kvhandoff plan --prefill-tp/--decode-tp/--prefill-page/--decode-page` (issue 8): the rank
map of the pair, descriptors per request before/after coalescing over random page tables, and
bytes per rank, in the table and in --json."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from kvhandoff.cli import app
from kvhandoff.kv_layout import handoff_bytes, page_aligned
from kvhandoff.kv_layout.presets import glm53, llama31_8b

runner = CliRunner()


def plan_json(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, ["plan", *args, "--json"])
    assert res.exit_code == 0, res.output
    d: dict[str, Any] = json.loads(res.output)
    return d


def test_glm_pair_rank_map_bytes_and_descriptors() -> None:
    ctx, prefix = 8192, 1000  # decode page 32: prefix held 992
    d = plan_json("--model", "glm-5.3", "--context", str(ctx), "--prefix", str(prefix),
                  "--prefill-tp", "2", "--decode-tp", "4", "--decode-page", "32")
    pair = d["pair"]
    assert (pair["split"], pair["prefill_page"], pair["decode_page"]) == ("replicated", 64, 32)
    # replicated: each decode rank reads from exactly one prefill rank, spread d % P
    assert [r["sources"] for r in pair["decode_ranks"]] == [[0], [1], [0], [1]]
    assert [p["decode_ranks"] for p in pair["prefill_ranks"]] == [[0, 2], [1, 3]]
    copy = sum(handoff_bytes(glm53(page_size_tokens=32), seq_len=ctx,
                             decode_prefix_len=prefix).values())
    assert [r["bytes"] for r in pair["decode_ranks"]] == [copy] * 4
    assert [p["bytes"] for p in pair["prefill_ranks"]] == [2 * copy] * 2
    assert pair["total_bytes"] == 4 * copy
    # before coalescing: one piece per 32-token segment (page boundaries of both sides) and
    # plane, both from the prefix: main KV one plane on 78 layers, indexer key + scale on 21
    held = page_aligned(prefix, 32)
    want_before = (ctx - held) // 32 * (78 + 2 * 21)
    for r in pair["decode_ranks"]:
        assert r["descriptors_before"] == want_before
        assert 0 < r["descriptors"] <= r["descriptors_before"]
    assert pair["descriptors_before"] == 4 * want_before


def test_llama_kv_heads_below_tp_one_leg_per_head() -> None:
    ctx = 4096
    pair = plan_json("--model", "llama-3.1-8b", "--context", str(ctx), "--prefill-tp", "16",
                     "--decode-tp", "8")["pair"]
    assert pair["split"] == "head_sharded"
    for r in pair["decode_ranks"]:
        d = r["rank"]
        assert r["sources"] == [2 * d, 2 * d + 1]  # both hold head d
        brought = [leg["planes"]["main_k"] for leg in r["legs"]]
        assert brought == [[f"h{d}"], []]  # the first source brings it, once
        copy = sum(handoff_bytes(llama31_8b(tp_size=8, tp_rank=d), seq_len=ctx,
                                 decode_prefix_len=0).values())
        assert r["bytes"] == copy
    assert [p["bytes"] > 0 for p in pair["prefill_ranks"]] == [True, False] * 8


def test_llama_gather_coalesces_when_pages_match() -> None:
    """Decode TP2 gathering from prefill TP4: each leg brings two adjacent heads, a run of
    two planes in each page on both sides, so 'before' already counts them as one piece."""
    ctx = 1024
    pair = plan_json("--model", "llama-3.1-8b", "--context", str(ctx), "--prefill-tp", "4",
                     "--decode-tp", "2", "--prefill-page", "16", "--decode-page", "16")["pair"]
    for r in pair["decode_ranks"]:
        assert len(r["legs"]) == 2
        for leg in r["legs"]:
            assert leg["descriptors_before"] == ctx // 16 * 2 * 32  # pages x (k, v) x layers
            assert leg["descriptors"] <= leg["descriptors_before"]


def test_pair_table_text() -> None:
    res = runner.invoke(app, ["plan", "--model", "glm-5.3", "--context", "4096",
                              "--prefill-tp", "2", "--decode-tp", "4"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "prefill TP2 page 64 -> decode TP4 page 64 (replicated)" in res.output
    assert "prefill rank 0 -> decode ranks 0, 2" in res.output
    assert "prefill rank 1 -> decode ranks 1, 3" in res.output


def test_without_pair_flags_no_pair() -> None:
    assert "pair" not in plan_json("--context", "4096")


def test_pair_that_cannot_split_is_refused() -> None:
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--context", "1024",
                              "--prefill-tp", "2", "--decode-tp", "3"])
    assert res.exit_code != 0
    assert "does not divide the 8 KV heads" in res.output


def test_issue17_layout_variants_plan_the_bytes_of_their_rows() -> None:
    """Packed blocks move the bytes of the per-layer layout; index_kpool=2 moves indexer rows
    (one per 2 tokens); MTP adds the draft layer's main KV and indexer."""
    ctx, prefix = 4096, 1000
    base = plan_json("--model", "glm-5.3", "--context", str(ctx), "--prefix", str(prefix),
                     "--prefill-tp", "1", "--decode-tp", "2")["pair"]
    packed = plan_json("--model", "glm-5.3-vllm", "--context", str(ctx), "--prefix",
                       str(prefix), "--prefill-tp", "1", "--decode-tp", "2")["pair"]
    assert packed["total_bytes"] == base["total_bytes"]
    assert packed["descriptors_before"] == base["descriptors_before"]
    k2 = plan_json("--model", "glm-5.3-kpool2", "--context", str(ctx), "--prefix", str(prefix),
                   "--prefill-tp", "1", "--decode-tp", "1")["pair"]
    held = page_aligned(prefix, 128)
    assert k2["decode_page"] == 128
    assert k2["total_bytes"] == (ctx - held) * 656 * 78 + (ctx - held) // 2 * 132 * 21
    mtp = plan_json("--model", "glm-5.3-mtp", "--context", str(ctx), "--prefix", str(prefix),
                    "--prefill-tp", "1", "--decode-tp", "1")["pair"]
    held = page_aligned(prefix, 64)
    assert mtp["total_bytes"] == base["total_bytes"] // 2 + (ctx - held) * (656 + 132)
