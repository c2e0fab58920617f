"""`kvhandoff bench` smoke test at a tiny size: it runs every case with real processes and
writes well-formed JSON. No timing assertions (figures belong to docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvhandoff.kv_layout import handoff_bytes, preset

KVHANDOFF = str(Path(sys.executable).with_name("kvhandoff"))
CASES = ["memcpy", "raw", "handoff_full", "handoff_off", "paced"]


def test_bench_tiny_writes_well_formed_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run([KVHANDOFF, "bench", "--context", "256", "--prefix", "128", "--reps",
                        "2", "--warmup", "0", "--layer-ms", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    moved = handoff_bytes(preset("glm-5.3"), seq_len=256, decode_prefix_len=128)
    assert r["workload"]["bytes"] == sum(moved.values())
    assert r["workload"]["bytes_per_region"] == moved
    assert sorted(r["cases"]) == sorted(CASES)
    for case in CASES:
        s = r["cases"][case]
        assert s["n"] == 2 and len(s["all_s"]) == 2
        assert all(t > 0 for t in s["all_s"])
        assert s["min_s"] <= s["median_s"] <= s["max_s"]
    for case in ("memcpy", "raw", "handoff_full", "handoff_off"):
        assert r["cases"][case]["GBps_median"] > 0
    assert set(r["ratios"]) == {"handoff_full_over_raw", "handoff_off_over_raw",
                                "handoff_full_over_memcpy", "handoff_off_over_memcpy",
                                "checksum_overhead", "tail_over_one_layer"}
    assert all(isinstance(v, float) for v in r["ratios"].values())
    assert set(r["targets"]) == {"handoff_over_raw>=0.9", "handoff_over_memcpy>=0.75",
                                 "checksum_overhead<=0.10", "tail<=2x_one_layer"}
    assert r["verified"] == dict.fromkeys(CASES, True)
    assert r["checksums_verified"] == 78 + 21
    assert r["lanes"]["raw"]["kind"] == "ucx"
    assert set(r["lanes"]["handoff"]) == {"full", "off"}
    assert "ratios" in p.stdout and "handoff / raw transport" in p.stdout


def test_bench_rejects_an_unknown_case() -> None:
    p = subprocess.run([KVHANDOFF, "bench", "--cases", "memcpy,warp"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "warp" in p.stderr
