"""deploy/bin: kvhandoff-probe and kvhandoff-placeholder-engine against a real bootstrap server.

This is the compose demo in one process: a sidecar on 127.0.0.1 (port 0), a prefill and a
decode placeholder registering with it; /ready goes 503 -> 200, and with require_rdma a tcp
rank keeps it at 503.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import load_deploy_module

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.errors import BootstrapNotFound
from kvhandoff.kv_layout import preset
from kvhandoff.settings import Settings

probe = load_deploy_module("bin/probe.py")
engine = load_deploy_module("bin/placeholder_engine.py")

TOKEN = "deploy-test-token"
WAIT_S = 10.0  # bound on every wait below; the events normally fire in milliseconds


class CountingClient:
    """A BootstrapClient that signals each register/heartbeat (so tests wait on events)."""

    def __init__(self, inner: BootstrapClient) -> None:
        self.inner = inner
        self.registers = 0
        self.heartbeats = 0
        self.changed = threading.Condition()

    def _bump(self, attr: str) -> None:
        with self.changed:
            setattr(self, attr, getattr(self, attr) + 1)
            self.changed.notify_all()

    def wait_for(self, predicate: Any) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self), timeout=WAIT_S), (
                f"registers={self.registers} heartbeats={self.heartbeats}")

    def register_rank(self, **kw: Any) -> Any:
        out = self.inner.register_rank(**kw)
        self._bump("registers")
        return out

    def heartbeat(self, **kw: Any) -> Any:
        out = self.inner.heartbeat(**kw)
        self._bump("heartbeats")
        return out

    def deregister(self, **kw: Any) -> Any:
        return self.inner.deregister(**kw)


@contextmanager
def placeholder(url: str, role: str, *, transport: str = "tcp", heartbeat_s: float = 0.02,
                alive_file: Path | None = None) -> Iterator[CountingClient]:
    client = CountingClient(BootstrapClient(url, token=TOKEN, total_wait_s=WAIT_S))
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            engine.run(client, role=role, engine_id=f"{role}-0", layout=preset("glm-5.3"),
                       agent_address=f"{role}:5557", transport=transport,
                       heartbeat_s=heartbeat_s, stop=stop, alive_file=alive_file)
        except BaseException as e:  # surfaced in the test thread below
            errors.append(e)

    t = threading.Thread(target=target, name=f"placeholder-{role}")
    t.start()
    try:
        client.wait_for(lambda c: c.registers >= 1 or errors)
        assert not errors, errors
        yield client
    finally:
        stop.set()
        t.join(WAIT_S)
        client.inner.close()
    assert not t.is_alive(), "placeholder did not stop"
    assert not errors, errors


def test_probe_passes_on_health_and_fails_on_ready_without_ranks() -> None:
    with run_server(Settings(port=0, auth_token=None)) as url:
        assert probe.main(["--url", url, "/health"]) == 0
        assert probe.main(["--url", url, "/ready"]) == 1
        assert probe.main(["--url", url, "/no-such-route"]) == 1


def test_probe_fails_when_nothing_listens() -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe.main(["--url", f"http://127.0.0.1:{port}", "--timeout", "1", "/health"]) == 1


def test_probe_default_url_follows_the_port_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHANDOFF_PORT", "9123")
    assert probe.default_url() == "http://127.0.0.1:9123"
    monkeypatch.delenv("KVHANDOFF_PORT")
    assert probe.default_url() == f"http://127.0.0.1:{Settings.model_fields['port'].default}"


def test_prefill_and_decode_placeholders_make_the_sidecar_ready(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    with run_server(Settings(port=0, auth_token=TOKEN)) as url:
        assert probe.main(["--url", url, "/ready"]) == 1
        with placeholder(url, "prefill", alive_file=alive) as pre:
            assert probe.main(["--url", url, "/ready"]) == 0  # ready needs every registered rank
            with placeholder(url, "decode"):
                ready = BootstrapClient(url).ready()
                assert ready.ready, ready.reason
                assert {e.engine_id for e in ready.engines} == {"prefill-0", "decode-0"}
                assert {str(e.role) for e in ready.engines} == {"prefill", "decode"}
            pre.wait_for(lambda c: c.heartbeats >= 2)
            assert engine.main(["--check-alive", "15", "--alive-file", str(alive)]) == 0
        # stopping deregisters: the sidecar no longer knows the engine
        with BootstrapClient(url) as c, pytest.raises(BootstrapNotFound):
            c.topology("prefill-0")


def test_require_rdma_keeps_a_tcp_rank_out_of_ready() -> None:
    with run_server(Settings(port=0, auth_token=TOKEN, require_rdma=True)) as url:
        with placeholder(url, "prefill", transport="tcp"):
            ready = BootstrapClient(url).ready()
            assert not ready.ready
            assert "require_rdma" in ready.reason
            assert ready.degraded
            assert probe.main(["--url", url, "/ready"]) == 1


def test_placeholder_registers_again_when_the_sidecar_forgot_it() -> None:
    with run_server(Settings(port=0, auth_token=TOKEN)) as url:
        with placeholder(url, "prefill") as pre:
            with BootstrapClient(url, token=TOKEN) as admin:
                admin.deregister(engine_id="prefill-0")  # as a sidecar restart would
                pre.wait_for(lambda c: c.registers >= 2)
                assert [r.engine_id for r in admin.topology("prefill-0").ranks] == ["prefill-0"]


def test_placeholder_fails_loudly_with_a_wrong_token() -> None:
    from kvhandoff.errors import BootstrapUnauthorized

    with run_server(Settings(port=0, auth_token=TOKEN)) as url:
        client = BootstrapClient(url, token="wrong", total_wait_s=WAIT_S)
        with client, pytest.raises(BootstrapUnauthorized):
            engine.run(client, role="prefill", engine_id="p", layout=preset("glm-5.3"),
                       agent_address="p:5557", transport="tcp", heartbeat_s=1.0,
                       stop=threading.Event())


def test_check_alive_reads_the_age_of_the_last_heartbeat(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    args = ["--check-alive", "15", "--alive-file", str(alive)]
    assert engine.main(args) == 1  # no heartbeat yet
    alive.write_text(f"{time.time() - 60:.3f}\n")
    assert engine.alive_age_s(alive) == pytest.approx(60, abs=5)
    assert engine.main(args) == 1  # stale
    alive.write_text(f"{time.time():.3f}\n")
    assert engine.main(args) == 0
    alive.write_text("garbage\n")
    assert engine.main(args) == 1
