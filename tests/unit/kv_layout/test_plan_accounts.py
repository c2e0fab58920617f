"""`kvhandoff plan` reproduces the seeds' remaining accounts (issue 17): link efficiency, the
TTFT tail, admission capacity in SGLang's and vLLM's terms, tail-page waste, page rules."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from kvhandoff.cli import app
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import capacity, cell_size, plan, preset, tail_waste

runner = CliRunner()


def plan_json(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, ["plan", *args, "--json"])
    assert res.exit_code == 0, res.output
    d: dict[str, Any] = json.loads(res.output)
    return d


def test_realistic_link_efficiency_for_1m_tokens_at_400_gbs():
    d = plan_json("--context", "1048576", "--link-gbps", "3200")
    link = {x["efficiency"]: x for x in d["link"]}
    assert set(link) == {0.6, 0.8}
    assert round(link[0.8]["transfer_s"], 2) == 0.18  # 320 GB/s
    assert round(link[0.6]["transfer_s"], 3) == 0.236  # 240 GB/s
    # the seed's upper figure 0.23 s is its 250 GB/s (62.5 % of line rate)
    d = plan_json("--link-efficiency", "0.625")
    assert [round(x["transfer_s"], 2) for x in d["link"]] == [0.23]
    # against the measured 0.5-1 s: 3.5-7x the ideal 0.1414 s
    assert [round(x, 1) for x in d["measured_over_ideal"]] == [3.5, 7.1]
    # the measurement is of that request only
    assert plan_json("--context", "4096")["measured_over_ideal"] is None


def test_ttft_tail_is_the_last_layers_transfer():
    d = plan_json("--prefill-s", "30", "--first-step-s", "0.05")
    t = d["ttft_tail"]
    assert t["last_layer"] == 77 and t["regions"] == ["main_kv", "indexer_k"]
    assert t["last_layer_bytes"] == 1_048_576 * (656 + 132) == 826_277_888
    assert round(t["last_layer_s"] * 1e3, 2) == 2.07  # 1.72 ms main KV + 0.35 ms indexer
    assert round(t["floor_s"], 4) == 30.0521
    # a 100K decode prefix: main KV and indexer of the last layer move only their suffix
    t = plan_json("--prefix", "100000")["ttft_tail"]
    assert t["last_layer_bytes"] == (1_048_576 - 99_968) * (656 + 132)


def test_admission_capacity_in_sglang_and_vllm_terms():
    d = plan_json("--memory-gb", "59.334")
    c = d["capacity"]
    assert c["cell_size"] == 53_940
    assert c["max_total_num_tokens"] == 1_099_968  # 1,100,000 aligned down to 64
    assert c["bytes_per_block"] == 3_452_160 and round(c["bytes_per_block_mib"], 2) == 3.29
    assert c["num_blocks"] == 17_187
    assert c["pages_per_request"] == 16_384 and c["requests_at_context"] == 1
    # 1,000,000 tokens of room cannot admit one 1M request
    small = plan_json("--memory-gb", str(1_000_000 * 53_940 / 1e9))["capacity"]
    assert small["max_total_num_tokens"] == 1_000_000 and small["requests_at_context"] == 0
    # 39 indexer layers: 56,316 B per token, ~4.2 % fewer tokens in the same memory
    more = plan_json("--memory-gb", "59.334", "--indexer-layers", "39")["capacity"]
    assert more["cell_size"] == 56_316
    assert round(1 - more["max_total_num_tokens"] / c["max_total_num_tokens"], 3) == 0.042


def test_tail_page_waste():
    w = plan_json("--requests", "1000")["tail_waste"]
    assert w["avg_tokens"] == 32 and w["per_request_bytes"] == 32 * 53_940 == 1_726_080
    assert round(w["per_request_bytes"] / 1e6, 2) == 1.73
    assert round(w["total_bytes"] / 1e9, 2) == 1.73


def test_the_table_prints_the_figures():
    res = runner.invoke(app, ["plan", "--memory-gb", "59.334", "--prefill-s", "30",
                              "--first-step-s", "0.05"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    for text in ("60 % (240 GB/s) 0.236 s", "80 % (320 GB/s) 0.177 s",
                 "measured 0.5-1 s = 3.5-7.1x the ideal",
                 "TTFT >= T_prefill + 2.07 ms + T_first_decode_step",
                 "max_total_num_tokens = available // cell_size (53,940 B) = 1,099,968 tokens",
                 "(3,452,160 B = 3.29 MiB) = 17,187 blocks",
                 "1.73 MB per request; 1,000 requests 1.73 GB",
                 "page rules hold: main_kv: FlashMLA: page == 64 rows"):
        assert text in out, text


def test_broken_page_rules_are_shown_and_bad_flags_name_the_field():
    res = runner.invoke(app, ["plan", "--page-size", "32"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "page rules broken (an agent refuses to start): region 'main_kv': rule FlashMLA" in out
    assert plan_json("--page-size", "32")["page_rules"]["problems"][0].startswith(
        "region 'main_kv'")
    for args, field in ((["--link-efficiency", "1.5"], "link_efficiency"),
                        (["--memory-gb", "0"], "memory_gb"),
                        (["--requests", "-1"], "requests")):
        res = runner.invoke(app, ["plan", *args])
        assert res.exit_code != 0 and field in res.output, res.output


def test_layout_variants_plan_the_same_bytes_per_token():
    for name in ("glm-5.3-mtp", "glm-5.3-vllm", "glm-5.3-vllm-mla"):
        d = plan_json("--model", name, "--memory-gb", "59.334")
        base = 53_940 + (656 + 132 if name == "glm-5.3-mtp" else 0)
        assert d["bytes_per_token"] == base, name
        assert d["capacity"]["cell_size"] == base, name
    k2 = preset("glm-5.3-kpool2")
    assert cell_size(k2) == (128 * 656 * 78 + 64 * 132 * 21) // 128 == 52_554
    assert plan(k2, context_tokens=1_048_576).bytes_per_context == (
        1_048_576 * 656 * 78 + 524_288 * 132 * 21)


def test_pure_functions_refuse_bad_input():
    with pytest.raises(ConfigError, match="memory"):
        capacity(preset("glm-5.3"), available_bytes=0, context_tokens=1)
    with pytest.raises(ConfigError, match="requests"):
        tail_waste(preset("glm-5.3"), requests=-1)
