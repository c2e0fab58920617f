"""The device options of `kvhandoff demo` / `kvhandoff bench` and scripts/gpu_check.sh, on CPU:
without CUDA `--device cuda` exits 2 with "no CUDA device: ..." (real CLI processes); the
device demo and device bench run their very code on CPU tensors (same page sets, plans,
event waiter, copy_spans, device checksums) and their checks can fail; the GPU check script
is `bash -n` clean and runs the commands it says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvhandoff.bench.device import DEVICE_CASES, _byte_index, run_device_bench
from kvhandoff.bench.pageset import PageSet, layers_of, rank_spec
from kvhandoff.buffers.bufferset import BufferSet, allocate
from kvhandoff.commands.demo_device import _check, run_demo_device
from kvhandoff.kv_layout import handoff_bytes
from kvhandoff.transports.shm.cuda_ipc import copy_spans

ROOT = Path(__file__).resolve().parents[3]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvhandoff.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@no_cuda
@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_device_cuda_without_cuda_exits_2_saying_so(cmd: str) -> None:
    r = _cli(cmd, "--device", "cuda")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert re.search(r"^no CUDA device: torch \S+ (is a CPU-only build|\(CUDA)", r.stderr, re.M)
    r = _cli(cmd, "--device", "cuda:1", "--json")
    assert r.returncode == 2 and "no CUDA device: " in r.stderr
    if cmd == "demo":  # --json still prints one JSON object
        assert json.loads(r.stdout)["error"].startswith("no CUDA device: ")


@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_unknown_device_is_a_usage_error(cmd: str) -> None:
    r = _cli(cmd, "--device", "tpu")
    assert r.returncode == 2 and "expected cpu, cuda or cuda:N, got 'tpu'" in r.stderr


def test_device_demo_code_on_cpu_moves_the_page_set_byte_exact() -> None:
    r = run_demo_device(device="cpu", context=300, prefix=100, prefill_page=64,
                        decode_page=16)
    spec = rank_spec("glm-5.3", 16)
    want = handoff_bytes(spec, seq_len=300, decode_prefix_len=100)
    assert r["ok"] and r["byte_exact"] and r["verify"]["prefix_touched_bytes"] == 0
    assert r["bytes_per_region"] == want and r["bytes"] == sum(want.values())
    pairs = sum(len(spec.regions_of_layer(lid)) for lid in layers_of(spec))
    assert r["checksums_verified"] == pairs
    assert r["degraded"] is True and "no agent" in r["transport_reason"]
    assert r["state"] == {"prefill": "Success", "decode": "Success"} and r["failure"] is None


def test_device_demo_check_sees_a_flipped_byte_and_a_stray_write() -> None:
    src_spec, spec = rank_spec("glm-5.3", 64), rank_spec("glm-5.3", 16)
    ps = PageSet.random(seq_len=200, prefix=0, src_page_size=64, dst_page_size=16, seed=3)
    plans = ps.plans(src_spec, spec)
    src = BufferSet(src_spec, allocate(src_spec, ps.src_num_pages, fill=None))
    dst = BufferSet(spec, allocate(spec, ps.dst_num_pages))
    layers = layers_of(spec)[:2]
    for lid in layers:
        for reg in spec.regions_of_layer(lid):
            p = plans[reg.name]
            s = torch.from_numpy(src.array(reg.name, lid))
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8))
            copy_spans(s, torch.from_numpy(dst.array(reg.name, lid)), p)
    dev = torch.device("cpu")
    assert _check(src, dst, spec, plans, layers, dev, _byte_index) == (True, 0)
    p = plans["main_kv"]
    d = dst.array("main_kv", layers[0])
    d[int(p.dst_offsets[3]) + 1] ^= 0x40
    assert _check(src, dst, spec, plans, layers, dev, _byte_index)[0] is False
    d[int(p.dst_offsets[3]) + 1] ^= 0x40
    inside = np.zeros(d.size, bool)
    for o, n in zip(p.dst_offsets, p.nbytes, strict=True):
        inside[o:o + n] = True
    d[int(np.flatnonzero(~inside)[0])] = 7
    assert _check(src, dst, spec, plans, layers, dev, _byte_index) == (True, 1)


def test_device_bench_code_on_cpu_verifies_every_case() -> None:
    r = run_device_bench(device="cpu", context=256, prefix=64, page_size=64, reps=1, warmup=0)
    assert set(r["cases"]) == set(DEVICE_CASES)
    assert r["verified"] == {"limit": True, "lane": True, "contiguous": True}
    spec = rank_spec("glm-5.3", 64)
    assert r["workload"]["bytes"] == sum(
        handoff_bytes(spec, seq_len=256, decode_prefix_len=64).values())
    assert all(r["ratios"][k] is not None for k in r["ratios"])
    assert "no agent transport moves device memory yet" in r["not_run"]


def test_gpu_check_script_is_bash_clean_and_runs_the_gpu_commands() -> None:
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    for needed in ('-m pytest -q -m gpu tests', '-m kvhandoff.bench.devsum --device "$DEV"',
                   '-m kvhandoff.cli bench --device "$DEV"',
                   '-m kvhandoff.cli demo --device "$DEV"', "-m kvhandoff.cli doctor --json",
                   'R=${OUT:-./gpu_check_out}',
                   '-m pytest -q -m gpu tests/unit/gpu/test_staging_cuda.py'):
        assert needed in body, needed
    caps = [int(x) for x in re.findall(r"^\s*timeout (\d+) ", body, re.M)]
    devsum_runs = 2  # the devsum step's timeout runs once per page set
    devsum = re.search(r"^\s*timeout (\d+) \"\$PY\" -m kvhandoff\.bench\.devsum", body, re.M)
    assert devsum is not None
    total = sum(caps) + int(devsum.group(1)) * (devsum_runs - 1)
    assert len(caps) == 6 and total < 8 * 60, caps
