"""`kvhandoff plan` prints the pinned byte accounts (table and --json)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvhandoff.cli import app

runner = CliRunner()


def test_plan_json_glm53_1m():
    res = runner.invoke(app, ["plan", "--model", "glm-5.3", "--context", "1048576",
                              "--link-gbps", "3200", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["bytes_per_token"] == 53_940
    assert d["bytes_per_page"] == 3_452_160
    assert d["pages"] == 16_384
    regions = {r["name"]: r for r in d["regions"]}
    assert regions["main_kv"]["bytes_per_layer"] == 687_865_856
    assert regions["indexer_k"]["bytes_per_layer"] == 138_412_032
    assert regions["indexer_k"]["bytes_per_context"] == 2_906_652_672
    assert round(d["transfer_s"], 4) == 0.1414
    assert d["decode_step"]["sparse_kv_read_bytes"] == 104_792_064


def test_plan_indexer_layers_39():
    res = runner.invoke(app, ["plan", "--indexer-layers", "39", "--context", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bytes_per_token"] == 56_316


def test_plan_table_shows_both_units():
    res = runner.invoke(app, ["plan"], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.output
    assert "53,653,536,768 B" in res.output
    assert "GB" in res.output and "GiB" in res.output


def test_plan_bad_model_is_a_clear_error():
    res = runner.invoke(app, ["plan", "--model", "gpt-9"])
    assert res.exit_code != 0
    assert "unknown preset" in res.output


def test_plan_moves_main_kv_and_indexer_from_the_decode_prefix():
    """Seed 000: one prefix hit covers both caches; 948,608 suffix tokens x 53,940 B."""
    res = runner.invoke(app, ["plan", "--model", "glm-5.3", "--context", "1048576",
                              "--prefix", "100000", "--json"])
    assert res.exit_code == 0, res.output
    moved = json.loads(res.output)["handoff_bytes"]
    assert sum(moved.values()) == 948_608 * 53_940 == 51_167_915_520
    res = runner.invoke(app, ["plan", "--context", "1048576", "--prefix", "100000"],
                        env={"COLUMNS": "220"})
    assert "total 51,167,915,520 B" in res.output


def test_plan_admission_prints_each_line_and_the_refusal():
    res = runner.invoke(app, ["plan", "--memory-gb", "56"], env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    out = res.output
    assert "1,048,576 prompt + 256 new tokens (0 cached): 16,388 pages" in out
    for line in ("main_kv: 53,", "indexer_k: 2,", "indexer workspace: 71,304,192 B"):
        assert line in out, line
    assert "refused" in out and "56,000,000,000 B free" in out
    d = json.loads(runner.invoke(app, ["plan", "--memory-gb", "56.64", "--json"]).output)
    assert d["admission"]["admitted"] is False
    assert "fits only without its output" in d["admission"]["reason"]
    d = json.loads(runner.invoke(app, ["plan", "--memory-gb", "56.64", "--new-tokens", "0",
                                       "--json"]).output)
    assert d["admission"]["admitted"] is True
    bad = runner.invoke(app, ["plan", "--memory-gb", "60", "--dcp-size", "2"])
    assert bad.exit_code != 0 and "dcp_size" in bad.output
