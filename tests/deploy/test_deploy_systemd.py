"""deploy/systemd: the unit's settings, and systemd's own verifier and security rating.

`systemd-analyze` comes with Debian's `systemd` package (`make setup` installs it when run as
root). Where it is missing, the two tests that run it are skipped and say so; the structural
checks still run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_helpers import ENV_EXAMPLE, UNIT, setting_env_names

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (Debian package `systemd`; `make setup` installs "
    "it as root). Structural checks of the unit still ran.")
# systemd-analyze security: 0 = fully locked down, 10 = unprotected; "OK" ends at 4.9
MAX_EXPOSURE = 3.0


def unit_entries(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd keys may repeat, so values are lists)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        m = re.fullmatch(r"\[(\w+)\]", line)
        if m:
            section = m.group(1)
            out.setdefault(section, {})
            continue
        assert section is not None, f"entry outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not Key=Value: {line!r}"
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def service() -> dict[str, list[str]]:
    return unit_entries(UNIT.read_text())["Service"]


def test_unit_runs_kvhandoff_serve_as_an_unprivileged_user_from_the_env_file() -> None:
    s = service()
    (exec_start,) = s["ExecStart"]
    assert exec_start.split()[0].startswith("/"), "ExecStart needs an absolute path"
    assert exec_start.split()[0].endswith("/kvhandoff") and exec_start.split()[1:] == ["serve"]
    assert s["User"][-1] not in ("root", "0")
    assert s["EnvironmentFile"] == ["/etc/kvhandoff/kvhandoff.env"]


def test_unit_restarts_and_is_hardened() -> None:
    s = service()
    unit = unit_entries(UNIT.read_text())
    assert s["Restart"] == ["on-failure"]
    assert "StartLimitBurst" in unit["Unit"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    expected = {
        "LimitMEMLOCK": "infinity", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "ProtectHome": "yes", "PrivateTmp": "yes", "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes", "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes",
        # RDMA and GPU device nodes must stay reachable
        "PrivateDevices": "no",
    }
    got = {k: s.get(k, ["<missing>"])[-1] for k in expected}
    assert got == expected
    assert s["CapabilityBoundingSet"] == [""], "no capabilities at all"
    assert "AF_NETLINK" in s["RestrictAddressFamilies"][-1].split()


def test_env_example_sets_only_real_settings() -> None:
    known = setting_env_names()
    keys = [ln.split("=", 1)[0] for ln in ENV_EXAMPLE.read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]
    assert keys
    assert [k for k in keys if k not in known] == []
    assert "KVHANDOFF_AUTH_TOKEN" in keys and "KVHANDOFF_REQUIRE_RDMA" in keys


def _verifiable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart pointing at an executable that exists here.

    verify checks that the ExecStart binary exists; the real path only exists once installed.
    """
    exe = tmp_path / "kvhandoff"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    (exec_start,) = unit_entries(text)["Service"]["ExecStart"]
    binary = exec_start.split()[0]
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(f"ExecStart={binary}", f"ExecStart={exe}"))
    return unit


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False)


@needs_systemd_analyze
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    res = _verify(_verifiable_copy(tmp_path, UNIT.read_text()))
    # verify exits 0 even for unknown keys (it only warns), so the output must be empty too
    assert res.returncode == 0 and (res.stdout + res.stderr).strip() == "", res.stdout + res.stderr


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_a_misspelt_option(tmp_path: Path) -> None:
    # the check above can fail: the same unit with one key misspelt is reported
    bad = UNIT.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilegez=yes")
    res = _verify(_verifiable_copy(tmp_path, bad))
    assert "NoNewPrivilegez" in res.stdout + res.stderr


@needs_systemd_analyze
def test_systemd_security_exposure_is_low(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    unit = _verifiable_copy(tmp_path, UNIT.read_text())
    res = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager",
                          str(unit)], capture_output=True, text=True, timeout=60, check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout + res.stderr)
    assert m, res.stdout[-2000:] + res.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, res.stdout
