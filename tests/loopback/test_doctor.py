"""`kvhandoff doctor` against a real bootstrap server (uvicorn on 127.0.0.1, port 0)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import httpx

from kvhandoff.doctor import Status, check_bootstrap
from kvhandoff.kv_layout import layout_hash, preset

Server = Callable[..., str]
GLM = preset("glm-5.3")


def _rank(tp: int, transport: str) -> dict[str, object]:
    return {"engine_id": "p", "role": "prefill", "dp_rank": 0, "dp_size": 1, "tp_rank": tp,
            "tp_size": 2, "agent_address": f"127.0.0.1:{6000 + tp}", "generation": "g1",
            "layout": GLM.to_dict(), "layout_hash": layout_hash(GLM), "transport": transport}


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def test_bootstrap_check_follows_readiness(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    r = check_bootstrap(url)
    assert r.status is Status.WARN and "/ready 503" in r.summary
    assert "no rank has registered yet" in r.summary and r.fix
    assert r.details["health"] == {"status": 200, "body": "OK"}
    httpx.post(url + "/v1/ranks", json=_rank(0, "inproc")).raise_for_status()
    r = check_bootstrap(url)
    assert r.status is Status.WARN and "1/2 ranks live" in r.summary
    httpx.post(url + "/v1/ranks", json=_rank(1, "tcp")).raise_for_status()
    r = check_bootstrap(url + "/")
    assert r.details["ready"]["status"] == 200
    assert "/ready 200: 2/2 ranks live, 1 engine(s), degraded (tcp)" in r.summary
    assert r.status is Status.WARN  # ready, but one rank fell back to tcp


def test_bootstrap_check_ready_is_ok(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for tp in (0, 1):
        httpx.post(url + "/v1/ranks", json=_rank(tp, "inproc")).raise_for_status()
    r = check_bootstrap(url)
    assert r.status is Status.OK and "2/2 ranks live" in r.summary and r.fix is None


def test_bootstrap_check_unreachable_and_not_configured() -> None:
    r = check_bootstrap(_closed_port_url(), timeout_s=2)
    assert r.status is Status.FAIL and "does not answer" in r.summary
    assert "kvhandoff serve" in (r.fix or "")
    assert check_bootstrap(None).status is Status.SKIP


def test_doctor_cli_against_a_real_server(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    env["KVHANDOFF_BOOTSTRAP_URL"] = url  # the env var, as an engine node has it

    def run(*args: str) -> tuple[int, dict[str, object]]:
        out = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "doctor", "--json",
                              "--no-probes", *args], capture_output=True, text=True, env=env,
                             timeout=120)
        report = json.loads(out.stdout)
        return out.returncode, {c["name"]: c for c in report["checks"]}

    rc, checks = run()
    boot = checks["bootstrap"]
    assert boot["status"] == "warn" and boot["details"]["url"] == url  # type: ignore[index]
    assert boot["details"]["ready"]["body"]["expected_ranks"] == 0  # type: ignore[index]
    rc, checks = run("--bootstrap-url", _closed_port_url())  # the flag wins over the env
    assert rc == 1 and checks["bootstrap"]["status"] == "fail"  # type: ignore[index]
