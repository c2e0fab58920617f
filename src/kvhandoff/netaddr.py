"""``host:port`` strings, IPv4, names and IPv6 alike: one way to write them, one way to read them.

Rules: an IPv6 host with a port is always written in brackets (``[::1]:8998``, RFC 3986); a host
given with its brackets already (``[::1]``) is not bracketed twice. Reading is strict: a bare
IPv6 address with a port (``::1:8998``) is refused, since its last group and a port cannot be
told apart; a missing port, a port outside 1..65535 or an empty host is refused with what came.
ZMQ: a socket binds or connects an IPv6 address only with its ``IPV6`` option on, and with it
on an IPv4 address reads back in its mapped form (``tcp://[::ffff:127.0.0.1]:port``). So the
option is on exactly where the host is not an IPv4 literal (an IPv6 literal or a name, which may
resolve to IPv6 only): an IPv4 fleet's addresses stay as they were, and both ends of a pair
decide the same way from the same host.
Pure: no sockets, no name lookups.
"""

from __future__ import annotations

import enum
import ipaddress

__all__ = ["AddressFamily", "address_family", "bare_host", "join_host_port", "split_host_port",
           "split_zmq_endpoint", "url_for", "zmq_endpoint", "zmq_ipv6"]


class AddressFamily(enum.Enum):
    """What a host is: an IPv4 or an IPv6 literal, or a name resolved when used."""

    IPV4 = "ipv4"
    IPV6 = "ipv6"
    NAME = "name"


def address_family(host: str) -> AddressFamily:
    """``127.0.0.1`` -> IPV4, ``::1`` / ``[::1]`` / ``fe80::1%eth0`` -> IPV6, else NAME."""
    h = bare_host(host)
    try:
        ip = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        return AddressFamily.NAME
    return AddressFamily.IPV6 if ip.version == 6 else AddressFamily.IPV4


def bare_host(host: str) -> str:
    """``[::1]`` -> ``::1``; anything else unchanged."""
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> ``host:port``, brackets around an IPv6 host (never doubled)."""
    h = bare_host(host)
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def url_for(host: str, port: int, scheme: str = "http") -> str:
    """(host, port) -> ``http://host:port`` with the same bracket rule."""
    return f"{scheme}://{join_host_port(host, port)}"


def split_host_port(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port), the host without brackets. Raises
    ValueError saying what was expected and what came."""
    a = addr
    if a.startswith("["):
        end = a.find("]")
        if end < 0 or not a[end + 1:].startswith(":"):
            raise ValueError(f"expected [ipv6]:port, got {addr!r}")
        host, port_s = a[1:end], a[end + 2:]
    else:
        host, sep, port_s = a.rpartition(":")
        if not sep:
            raise ValueError(f"expected host:port, got {addr!r}")
        if ":" in host:
            raise ValueError(f"an IPv6 address with a port goes in brackets ([{host}]:{port_s}), "
                             f"got {addr!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"expected host:port with a host, got {addr!r}")
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"port must be 1..65535, got {port_s!r} in {addr!r}")
    return host, int(port_s)


def zmq_ipv6(host: str) -> bool:
    """Whether a ZMQ socket binding or connecting `host` needs its ``IPV6`` option (see the
    module doc): every host but an IPv4 literal."""
    return address_family(host) is not AddressFamily.IPV4


def zmq_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host:port`` (brackets around an IPv6 host); without `port`, ``tcp://host`` (what
    pyzmq's ``bind_to_random_port`` takes)."""
    if port is None:
        h = bare_host(host)
        return f"tcp://[{h}]" if ":" in h else f"tcp://{h}"
    return f"tcp://{join_host_port(host, port)}"


def split_zmq_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` / ``tcp://[v6]:port`` -> (host, port); ValueError otherwise."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"expected a tcp://host:port endpoint, got {endpoint!r}")
    return split_host_port(endpoint[len("tcp://"):])
