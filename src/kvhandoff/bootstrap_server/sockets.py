"""Listening sockets for the bootstrap server: bound before uvicorn starts, so ``port 0`` works
and the URL is known at once (`kvhandoff serve` and `bootstrap_server.background`)."""

from __future__ import annotations

import socket

from kvhandoff.netaddr import bare_host, url_for


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. An IPv6 host may come
    with or without brackets (``::1``, ``[::1]``)."""
    host = bare_host(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only
    # when it is, and without it every response waits ~40 ms on Nagle + delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return url_for(host, port)
