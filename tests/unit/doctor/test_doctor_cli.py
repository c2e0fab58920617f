"""`kvhandoff doctor` as a real process: JSON report, table, exit code on blocking problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .fakeroot import fake_ucx, limits, put, rdma_node

CHECKS = ["ucx", "ucx_lanes", "nixl", "rdma", "memlock", "shm", "native_copy",
          "cross_process_memory", "hugepages", "cuda", "cuda_ipc", "bootstrap", "addresses",
          "layout_probe", "auth"]


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    return subprocess.run([sys.executable, "-m", "kvhandoff.cli", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def test_doctor_json_on_this_machine_is_truthful() -> None:
    out = doctor("--json")
    report = json.loads(out.stdout)
    checks = by_name(report)
    assert list(checks) == CHECKS
    assert out.returncode == (1 if report["blocking"] else 0)
    assert report["blocking"] == [n for n, c in checks.items() if c["status"] == "fail"]
    for c in checks.values():
        assert c["summary"]
        if c["status"] in ("warn", "fail"):
            assert c["fix"] and "\n" not in c["fix"]
    if not Path("/sys/class/infiniband").exists():  # this machine: no RDMA, wheel UCX
        assert checks["rdma"]["status"] == "warn"
        assert "no RDMA device" in checks["rdma"]["summary"]
        assert checks["ucx"]["details"]["verbs"] is False
        # and with --require-rdma that is blocking
        strict = doctor("--json", "--require-rdma", "--no-probes")
        assert strict.returncode == 1
        assert {"rdma", "ucx"} <= set(json.loads(strict.stdout)["blocking"])


def test_doctor_table_lists_every_check() -> None:
    out = doctor("--no-probes")
    assert out.returncode in (0, 1)
    assert "kvhandoff doctor" in out.stdout
    for name in CHECKS:
        assert name in out.stdout
    assert ("no blocking problem" in out.stdout) == (out.returncode == 0)


def test_doctor_fake_rdma_node_exit_code_follows_memlock(tmp_path: Path) -> None:
    rdma_node(tmp_path)
    fake_ucx(tmp_path, modules=("ib", "rdmacm", "cma"), flags="--with-verbs --with-rdmacm")
    (tmp_path / "dev/shm").mkdir(parents=True)
    put(tmp_path, "/proc/self/limits", limits("8388608"))
    out = doctor("--json", "--no-probes", "--require-rdma", "--root", str(tmp_path))
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["blocking"] == ["memlock"], report["blocking"]
    checks = by_name(report)
    assert checks["rdma"]["status"] == "ok" and checks["ucx"]["status"] == "ok"
    assert checks["ucx"]["details"]["version"] == "1.18.0"
    put(tmp_path, "/proc/self/limits", limits("unlimited"))
    out = doctor("--json", "--no-probes", "--require-rdma", "--root", str(tmp_path))
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout)["ok"] is True


def test_doctor_bad_environment_setting_names_the_variable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    env["KVHANDOFF_RANK_TTL_S"] = "soon"
    out = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "doctor", "--no-probes"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "KVHANDOFF_RANK_TTL_S" in out.stderr and "Traceback" not in out.stderr
