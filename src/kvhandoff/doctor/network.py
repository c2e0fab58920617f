"""Address check: which address family the agents' control and data sockets and the bootstrap
server use, and whether the agents' address can be bound and reached on this node.

Rules: the family comes from the host as written (`netaddr.address_family`): an IPv4 or IPv6
literal, or a name, which is resolved here to say which families it gives (ZMQ and the
bootstrap client take the first). A wildcard agent_host (``0.0.0.0``, ``::``) FAILs: an agent
announces its host to its peers, and a wildcard reaches none of them. With probes, the agent's
host is bound once (port 0, its family) to prove it is an address of this node.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

from kvhandoff.netaddr import AddressFamily, address_family, bare_host

from .model import CheckResult, Status

_FIX_HOST = ("set KVHANDOFF_AGENT_HOST to an address of this node that the peer nodes reach "
             "(an IPv6 one bare or in brackets: ::1, [fd00::5])")


def _resolved(host: str) -> list[str]:
    """The families a name resolves to, in the resolver's order ("ipv4" / "ipv6")."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    out: list[str] = []
    for fam, *_ in infos:
        name = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6"}.get(fam)
        if name and name not in out:
            out.append(name)
    return out


def _bind_error(host: str, fam: AddressFamily) -> str | None:
    """None if a TCP socket binds `host` on port 0, else why not."""
    af = socket.AF_INET6 if fam is AddressFamily.IPV6 else socket.AF_INET
    h = bare_host(host)
    try:
        if fam is AddressFamily.NAME:
            info = socket.getaddrinfo(h, 0, type=socket.SOCK_STREAM)[0]
            af, addr = info[0], info[4]
        else:
            addr = (h, 0)
        with socket.socket(af, socket.SOCK_STREAM) as s:
            s.bind(addr)
    except OSError as e:
        return str(e)
    return None


def _describe(host: str) -> tuple[AddressFamily, str, dict[str, Any]]:
    fam = address_family(host)
    if fam is AddressFamily.NAME:
        got = _resolved(host)
        text = f"{host} (a name: {', '.join(got) or 'does not resolve'})"
        return fam, text, {"host": host, "family": fam.value, "resolves_to": got}
    label = "IPv6" if fam is AddressFamily.IPV6 else "IPv4"
    return fam, f"{bare_host(host)} ({label})", {"host": bare_host(host), "family": fam.value}


def check_addresses(agent_host: str, *, bootstrap_url: str | None = None,
                    probe: bool = True) -> CheckResult:
    """The address family of the agents' sockets (agent_host) and of the bootstrap server."""
    fam, agent_text, agent = _describe(agent_host)
    details: dict[str, Any] = {"agent": agent}
    parts = [f"agents on {agent_text}"]
    if bootstrap_url:
        host = urlsplit(bootstrap_url if "//" in bootstrap_url else f"http://{bootstrap_url}"
                        ).hostname or ""
        _, boot_text, details["bootstrap"] = _describe(host)
        parts.append(f"bootstrap server on {boot_text}")
    summary = "; ".join(parts)
    h = bare_host(agent_host)
    if fam is not AddressFamily.NAME and ipaddress.ip_address(h.split("%", 1)[0]).is_unspecified:
        return CheckResult("addresses", Status.FAIL, f"{summary}: a wildcard agent_host is "
                           "announced to peers as is and reaches none of them", details,
                           fix=_FIX_HOST)
    if fam is AddressFamily.NAME and not agent["resolves_to"]:
        return CheckResult("addresses", Status.FAIL, f"{summary}: agent_host does not resolve",
                           details, fix=_FIX_HOST)
    if probe:
        why = _bind_error(agent_host, fam)
        details["bind"] = why or "ok"
        if why:
            return CheckResult("addresses", Status.FAIL, f"{summary}: agent_host cannot be "
                               f"bound here ({why})", details, fix=_FIX_HOST)
    return CheckResult("addresses", Status.OK, summary, details)
