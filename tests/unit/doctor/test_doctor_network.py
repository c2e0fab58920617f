"""The doctor's address check: the family the agents and the bootstrap server use, wildcard and
foreign agent hosts refused with the fix (binds one socket on port 0; sends nothing)."""

from __future__ import annotations

import socket

import pytest

from kvhandoff.doctor import Status, check_addresses


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_ipv4_agents_and_an_ipv6_bootstrap_server() -> None:
    r = check_addresses("127.0.0.1", bootstrap_url="http://[::1]:8998")
    assert r.status is Status.OK, r.summary
    assert r.summary == "agents on 127.0.0.1 (IPv4); bootstrap server on ::1 (IPv6)"
    assert r.details["agent"] == {"host": "127.0.0.1", "family": "ipv4"}
    assert r.details["bootstrap"]["family"] == "ipv6"
    assert r.details["bind"] == "ok"


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_agents(host: str) -> None:
    r = check_addresses(host, bootstrap_url="[::1]:8998")
    assert r.status is Status.OK, r.summary
    assert r.summary.startswith("agents on ::1 (IPv6)")
    assert r.details["agent"]["family"] == "ipv6"


def test_a_name_says_what_it_resolves_to() -> None:
    r = check_addresses("localhost")
    assert r.status is Status.OK, r.summary
    assert r.details["agent"]["family"] == "name"
    assert "ipv4" in r.details["agent"]["resolves_to"]
    assert r.summary.startswith("agents on localhost (a name: ipv4")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_wildcard_agent_host_is_blocking(host: str) -> None:
    r = check_addresses(host, probe=False)
    assert r.status is Status.FAIL and "wildcard" in r.summary
    assert r.fix and "KVHANDOFF_AGENT_HOST" in r.fix


@pytest.mark.parametrize("host", ["192.0.2.7", "fd00:6b76:6864::1"])
def test_an_address_of_another_node_is_blocking(host: str) -> None:
    r = check_addresses(host)
    assert r.status is Status.FAIL and "cannot be bound here" in r.summary, r.summary
    assert r.details["bind"] != "ok"
    assert check_addresses(host, probe=False).status is Status.OK  # without probes: unknown


def test_a_name_that_does_not_resolve_is_blocking() -> None:
    r = check_addresses("no-such-host.invalid", probe=False)
    assert r.status is Status.FAIL and "does not resolve" in r.summary
