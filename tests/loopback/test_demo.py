"""`kvhandoff demo` as a user runs it: a real subprocess, real bootstrap server, real prefill
and decode processes over UCX on loopback. Small contexts keep it lean."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvhandoff.kv_layout import handoff_bytes, preset

KVHANDOFF = str(Path(sys.executable).with_name("kvhandoff"))


def _run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVHANDOFF, "demo", *args], capture_output=True, text=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_demo_end_to_end_json_byte_exact() -> None:
    p = _run("--context", "1024", "--prefix", "256", "--layer-ms", "0", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    spec = preset("glm-5.3")
    moved = handoff_bytes(spec, seq_len=1024, decode_prefix_len=256)
    full = handoff_bytes(spec, seq_len=1024, decode_prefix_len=0)
    assert r["ok"] is True
    assert r["byte_exact"] is True and r["verify"]["bad_bytes"] == 0
    assert r["verify"]["prefix_touched_bytes"] == 0
    assert r["state"] == {"prefill": "Success", "decode": "Success"}
    assert r["bytes_per_region"] == moved
    assert r["bytes"] == sum(moved.values())
    # main KV and indexer both move from the decode's cached prefix on (seed 000)
    assert r["bytes_saved_by_prefix"] == {k: full[k] - moved[k] for k in full}
    assert all(v > 0 for v in r["bytes_saved_by_prefix"].values())
    # one checksum per (layer, region): 78 main-KV layers + 21 indexer layers
    assert r["checksums_verified"] == 78 + 21
    assert r["descriptors_before"]["main_kv"] == 78 * ((1024 - 256) // 64)  # the suffix
    assert 0 < r["descriptors_after"]["main_kv"] <= r["descriptors_before"]["main_kv"]
    assert r["transport"] == "shm" and r["lanes"] and not r["degraded"]
    assert r["tail_s"] is not None and r["tail_s"] >= 0
    assert r["released"] == {"prefill": True, "decode": True}
    assert r["pages_returned"] == {"prefill": True, "decode": True}
    # each side's room timeline: every layer, the bytes the decode counted, a bootstrap lookup
    (pt,), (dt,) = r["timings"]["prefill"], r["timings"]["decode"]
    assert (pt["role"], dt["role"], pt["state"], dt["state"]) == (
        "prefill", "decode", "Success", "Success")
    assert pt["layers"] == dt["layers"] == 78 and dt["bytes"] == r["bytes"] == pt["bytes"]
    assert dt["bootstrap_lookup_ms"] is not None and pt["bootstrap_lookup_ms"] is None
    assert dt["total_ms"] >= dt["handshake_ms"] >= 0 and pt["tail_ms"] >= 0


def test_demo_fails_loudly_when_the_handoff_cannot_run() -> None:
    p = _run("--context", "256", "--transport", "no-such-transport", "--json", timeout=60)
    assert p.returncode == 1
    r = json.loads(p.stdout)
    assert r["ok"] is False and "no-such-transport" in r["error"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell's `cmd &`


@pytest.mark.parametrize("sig,ignored", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                         (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-inherited-ignored"])
def test_demo_interrupted_leaves_no_child(sig: int, ignored: bool) -> None:
    # 78 layers x 50 ms of simulated compute: the handoff is still running when we signal
    proc = subprocess.Popen(
        [KVHANDOFF, "demo", "--context", "2048", "--prefix", "0", "--layer-ms", "50",
         "--report-pids"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "100"},
        preexec_fn=_ignore_sigint if ignored else None)  # noqa: PLW1509 - only sets a signal
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    children: list[int] = []
    tail: list[str] = []
    try:
        while len(children) < 2:  # prefill and decode both started
            line = lines.get(timeout=60)
            assert line is not None, f"demo exited (rc={proc.poll()}): {''.join(tail)}"
            tail.append(line)
            if line.startswith('{"children"'):
                children = json.loads(line)["children"]
        assert all(_alive(pid) for pid in children)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 130
    rest = []
    while (line := lines.get(timeout=10)) is not None:
        rest.append(line)
    assert any("interrupted" in x for x in rest)
    assert [pid for pid in children if _alive(pid)] == []


def test_demo_heterogeneous_ranks_and_pages_json() -> None:
    """Issue 8 flags: GQA prefill TP 2 -> decode TP 1 with different page sizes, as processes;
    the decode rank gathers heads from both prefill ranks, byte-exact."""
    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", "demo", "--json", "--model", "llama-3.1-8b",
         "--context", "300", "--prefix", "0", "--prefill-tp", "2", "--decode-tp", "1",
         "--prefill-page", "16", "--decode-page", "32", "--transport", "tcp",
         "--layer-ms", "0", "--timeout", "90"],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["ok"] and d["byte_exact"]
    assert d["sources"] == {"0": [0, 1]}
    assert (d["prefill_page_tokens"], d["decode_page_tokens"]) == (16, 32)
    assert d["bytes"] == 300 * 2 * 8 * 256 * 32  # K and V, 8 heads x 256 B, 32 layers, once
