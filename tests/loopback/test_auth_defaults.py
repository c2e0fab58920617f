"""Safe defaults: an agent or a bootstrap server that would listen on a non-loopback address
without its secret refuses to start, naming the setting; on loopback it starts; with
``allow_unauthenticated`` it starts, warns, and says ``auth: off`` in its status, /ready,
metrics and doctor.

The non-loopback address is this host's own (the one a UDP socket "connected" outward takes),
or the wildcard where the host has none.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import httpx
import pytest
from typer.testing import CliRunner

from kvhandoff.bootstrap_server.app import create_app
from kvhandoff.buffers.bufferset import allocate
from kvhandoff.cli import app as cli_app
from kvhandoff.doctor import Status, check_auth
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import preset
from kvhandoff.runtime.metrics import metrics_text
from kvhandoff.settings import Settings, is_loopback_host
from kvhandoff.transfer import TransferAgent

SPEC = preset("glm-5.3")


def _outward_host() -> str:
    """An address of this host that is not loopback."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.200", 9))  # no packet is sent: this only picks the source address
        host = str(s.getsockname()[0])
    except OSError:
        host = "0.0.0.0"
    finally:
        s.close()
    return "0.0.0.0" if is_loopback_host(host) else host


HOST = _outward_host()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.3.4.5"])
def test_loopback_hosts_are_loopback(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "[fd00::5]", HOST,
                                  "no-such-host.invalid"])
def test_other_hosts_are_not(host: str) -> None:
    assert not is_loopback_host(host)


@pytest.mark.parametrize("host", [HOST, "0.0.0.0"])
def test_agent_without_a_secret_on_a_non_loopback_host_refuses_naming_the_setting(
        host: str) -> None:
    with pytest.raises(ConfigError, match=r"agent_host=.*hmac_secret.*KVHANDOFF_HMAC_SECRET"
                                          r".*allow_unauthenticated"):
        TransferAgent("prefill", SPEC, allocate(SPEC, 2),
                      Settings(transport="inproc", agent_host=host))


def test_agent_on_loopback_without_a_secret_starts() -> None:
    with TransferAgent("prefill", SPEC, allocate(SPEC, 2), Settings(transport="inproc")) as a:
        assert a.status()["auth"] == "loopback"
        assert "kvhandoff_agent_unauthenticated 0.0" in metrics_text(a)


def test_agent_with_a_secret_on_a_non_loopback_host_starts() -> None:
    with TransferAgent("decode", SPEC, allocate(SPEC, 2),
                       Settings(transport="tcp", agent_host=HOST, hmac_secret="k" * 32)) as a:
        assert a.status()["auth"] == "secret"


def test_allow_unauthenticated_starts_with_a_warning_and_says_auth_off(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvhandoff")
    with TransferAgent("prefill", SPEC, allocate(SPEC, 2),
                       Settings(transport="tcp", agent_host=HOST,
                                allow_unauthenticated=True)) as a:
        assert a.status()["auth"] == "off"
        assert "kvhandoff_agent_unauthenticated 1.0" in metrics_text(a)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("WITHOUT authentication" in m and "hmac_secret" in m for m in warned), warned


def test_bootstrap_server_without_a_token_on_a_non_loopback_host_refuses() -> None:
    with pytest.raises(ConfigError, match=r"host=.*auth_token.*KVHANDOFF_AUTH_TOKEN"):
        create_app(Settings(host=HOST, port=0))


def test_serve_refuses_before_binding_naming_the_setting() -> None:
    r = CliRunner().invoke(cli_app, ["serve", "--host", HOST, "--port", "0"])
    assert r.exit_code == 2, r.output
    assert "auth_token" in r.output and "KVHANDOFF_AUTH_TOKEN" in r.output


def test_bootstrap_server_allowed_unauthenticated_says_auth_off(
        bootstrap_server: Callable[..., str]) -> None:
    url = bootstrap_server(host=HOST, allow_unauthenticated=True)
    assert httpx.get(url + "/ready").json()["auth"] == "off"
    assert "kvhandoff_bootstrap_unauthenticated 1.0" in httpx.get(url + "/metrics").text


def test_bootstrap_server_on_loopback_says_so(bootstrap_server: Callable[..., str]) -> None:
    url = bootstrap_server()
    assert httpx.get(url + "/ready").json()["auth"] == "loopback"
    url = bootstrap_server(auth_token="t" * 16)
    assert httpx.get(url + "/ready").json()["auth"] == "secret"
    assert "kvhandoff_bootstrap_unauthenticated 0.0" in httpx.get(url + "/metrics").text


def test_doctor_flags_refusal_and_auth_off() -> None:
    assert check_auth(Settings()).status is Status.OK
    refused = check_auth(Settings(agent_host=HOST))
    assert refused.status is Status.FAIL and "hmac_secret" in refused.summary
    off = check_auth(Settings(agent_host=HOST, host=HOST, allow_unauthenticated=True))
    assert off.status is Status.WARN and "auth off" in off.summary
    assert off.details == {"agents": "off", "bootstrap server": "off"}
    ok = check_auth(Settings(agent_host=HOST, hmac_secret="s" * 16, host=HOST,
                             auth_token="t" * 16))
    assert ok.status is Status.OK and ok.details == {"agents": "secret",
                                                      "bootstrap server": "secret"}
