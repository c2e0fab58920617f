"""host:port strings for IPv4, names and IPv6 (kvhandoff.netaddr): one writer, one strict reader,
and the places that build or read them (bootstrap server schemas, vLLM params, SGLang URL)."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.netaddr import (
    AddressFamily,
    address_family,
    bare_host,
    join_host_port,
    split_host_port,
    split_zmq_endpoint,
    url_for,
    zmq_endpoint,
    zmq_ipv6,
)


@pytest.mark.parametrize(("host", "port", "text"), [
    ("127.0.0.1", 8998, "127.0.0.1:8998"),
    ("node-7.example", 1, "node-7.example:1"),
    ("::1", 8998, "[::1]:8998"),
    ("[::1]", 8998, "[::1]:8998"),  # given with brackets: never doubled
    ("fe80::1%eth0", 65535, "[fe80::1%eth0]:65535"),
])
def test_join_and_split_round_trip(host: str, port: int, text: str) -> None:
    assert join_host_port(host, port) == text
    assert split_host_port(text) == (bare_host(host), port)


def test_url_for_brackets_ipv6_once() -> None:
    assert url_for("::1", 80) == "http://[::1]:80"
    assert url_for("[::1]", 80) == "http://[::1]:80"
    assert url_for("10.0.0.1", 80, scheme="tcp") == "tcp://10.0.0.1:80"


@pytest.mark.parametrize(("text", "says"), [
    ("::1:8998", "brackets"),  # a bare IPv6 with a port: ambiguous, refused
    ("::1", "brackets"),
    ("127.0.0.1", "host:port"),
    (":8998", "with a host"),
    ("[::1]8998", "[ipv6]:port"),
    ("[::1", "[ipv6]:port"),
    ("h:0", "1..65535"),
    ("h:65536", "1..65535"),
    ("h:x", "1..65535"),
    ("a b:1", "with a host"),
])
def test_split_refuses_with_what_came(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r".*") as e:
        split_host_port(text)
    assert says in str(e.value) and repr(text) in str(e.value)


def test_vllm_params_ipv6_forms() -> None:
    from kvhandoff.integrations.vllm.params import RemotePrefill, split_addr

    base = {"remote_room": 5, "remote_num_tokens": 3}
    for host in ("::1", "[::1]"):
        rp = RemotePrefill.parse({**base, "remote_host": host, "remote_port": 8998})
        assert rp.bootstrap_addr == "[::1]:8998"
    assert split_addr("http://[::1]:8998/") == ("::1", 8998)
    for bad in ("::1", "::1:8998", "http://::1:8998"):
        with pytest.raises(ConfigError, match="bootstrap_url"):
            split_addr(bad)


def test_socket_url_of_an_ipv6_socket_has_brackets() -> None:
    import socket

    from kvhandoff.bootstrap_server.sockets import socket_url

    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 support")
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        try:
            s.bind(("::1", 0))
        except OSError as e:
            pytest.skip(f"no IPv6 loopback on this machine: {e}")
        assert socket_url(s).startswith("http://[::1]:")
    finally:
        s.close()



@pytest.mark.parametrize(("host", "family"), [
    ("127.0.0.1", AddressFamily.IPV4), ("::1", AddressFamily.IPV6),
    ("[::1]", AddressFamily.IPV6), ("fe80::1%eth0", AddressFamily.IPV6),
    ("::ffff:127.0.0.1", AddressFamily.IPV6), ("node-7.example", AddressFamily.NAME),
    ("localhost", AddressFamily.NAME),
])
def test_address_family_and_zmq_ipv6_option(host: str, family: AddressFamily) -> None:
    assert address_family(host) is family
    # on wherever the host may be IPv6: off only for IPv4 literals (their form stays as it was)
    assert zmq_ipv6(host) is (family is not AddressFamily.IPV4)


def test_zmq_endpoints_write_and_read_brackets() -> None:
    assert zmq_endpoint("::1", 5555) == "tcp://[::1]:5555"
    assert zmq_endpoint("[::1]", 5555) == "tcp://[::1]:5555"
    assert zmq_endpoint("::1") == "tcp://[::1]"  # pyzmq's bind_to_random_port appends :port
    assert zmq_endpoint("10.0.0.2", 1) == "tcp://10.0.0.2:1"
    assert zmq_endpoint("10.0.0.2") == "tcp://10.0.0.2"
    assert split_zmq_endpoint("tcp://[::ffff:127.0.0.1]:43269") == ("::ffff:127.0.0.1", 43269)
    assert split_zmq_endpoint("tcp://10.0.0.2:1") == ("10.0.0.2", 1)
    for bad in ("ipc:///tmp/x", "tcp://::1:5555", "tcp://[::1]", "[::1]:5555"):
        with pytest.raises(ValueError):
            split_zmq_endpoint(bad)
