"""GPU tests (marker `gpu`; skipped with "no CUDA device" without one; run by
scripts/gpu_check.sh): the layout probe against vLLM's GPU attention backends (the CUDA build,
vLLM 0.33), each forced on vLLM's own layers (`cpu_engine_proc.py` with ``"device": "cuda"``):
FLASH_ATTN, FLASHINFER and TRITON_ATTN with head-major (LBHNC) and token-major (LBNHC) pages,
FLASHMLA (pages of 64, bfloat16), vLLM 0.33's dense MLA picks (FLASH_ATTN_MLA, FLASHINFER_MLA,
CUTLASS_MLA, TRITON_MLA) and per-tensor fp8 caches of each backend that takes one. For each,
`register_kv_caches` must log "layout verified against <backend>": the cache write
(``reshape_and_cache_flash``, Triton's, ``concat_and_cache_mla``) put every probed token where
the connector's layout says. A backend
whose kernel library this machine lacks (e.g. no flashinfer wheel) is skipped naming what
failed to load.

Nothing here has run on a GPU yet: its first run on a lent machine is the first check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

ROOT = Path(__file__).resolve().parents[3]
PROC = Path(__file__).with_name("cpu_engine_proc.py")
GQA = [(b, lay) for b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN") for lay in ("LBHNC", "LBNHC")]
CASES = [{"case": "gqa", "device": "cuda", "backend": b, "layout": lay, "dtype": "bfloat16",
          "head_dim": 64, "block_size": 16} for b, lay in GQA]
CASES.append({"case": "mla", "device": "cuda", "backend": "FLASHMLA", "layout": "LBHNC",
              "dtype": "bfloat16", "block_size": 64})
# vLLM 0.33's dense MLA backends (Hopper's first pick FLASH_ATTN_MLA, Blackwell's FLASHINFER_MLA,
# CUTLASS_MLA, TRITON_MLA), each at a page size its kernel runs, bfloat16 and (where vLLM takes
# it) a per-tensor fp8 cache: the probe compares the kernel's quantised write with the same
# quantisation of its input
MLA = {"FLASH_ATTN_MLA": 64, "FLASHINFER_MLA": 64, "CUTLASS_MLA": 128, "TRITON_MLA": 64,
       "FLASHMLA": 64}
for b, bs in MLA.items():
    for cd in ("auto", "fp8"):
        if (b, cd) in (("FLASHMLA", "auto"), ("FLASH_ATTN_MLA", "fp8")):
            continue  # FLASHMLA auto: above; FLASH_ATTN_MLA takes no fp8 cache
        CASES.append({"case": "mla", "device": "cuda", "backend": b, "layout": "LBHNC",
                      "dtype": "bfloat16", "block_size": bs, "cache_dtype": cd})
# per-tensor fp8 GQA caches (head-major pages)
CASES += [{"case": "gqa", "device": "cuda", "backend": b, "layout": "LBHNC", "dtype": "bfloat16",
           "head_dim": 64, "block_size": 16, "cache_dtype": cd}
          for b, cd in (("FLASH_ATTN", "fp8"), ("FLASHINFER", "fp8"), ("TRITON_ATTN", "fp8"),
                        ("TRITON_ATTN", "fp8_e5m2"))]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("vllm", reason="the CUDA build of vLLM is not installed")
    p = subprocess.run([sys.executable, str(PROC), json.dumps(
        {"dir": str(tmp_path_factory.mktemp("gpu-probe")), "cases": CASES})],
        capture_output=True, text=True, timeout=540, cwd=ROOT)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and len(lines) == len(CASES), p.stderr[-4000:]
    return lines


@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{c['backend']}-{c['layout']}-{c.get('cache_dtype', 'auto')}"
                              for c in CASES])
def test_probe_verifies_gpu_backend(results: list[dict[str, Any]], i: int) -> None:
    r, case = results[i], CASES[i]
    if "unavailable" in r:
        pytest.skip(f"{case['backend']} cannot run here: {r['unavailable']}")
    assert "error" not in r, r
    assert r["backend"] == case["backend"] and r["whole_pages"]
    assert r["probe"].startswith(f"layout verified against {case['backend']}"), r
    order = "MLA" if case["case"] == "mla" else ("HND" if case["layout"] == "LBHNC" else "NHD")
    assert f"({order} pages;" in r["probe"]
