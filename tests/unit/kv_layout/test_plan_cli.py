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
