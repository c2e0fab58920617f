"""Kept for older imports (`kvhandoff demo` uses it): the helpers live in
`kvhandoff.testing.server` and `kvhandoff.bootstrap_server.sockets`."""

from kvhandoff.testing.server import FakeClock, bind_socket, run_server, socket_url

__all__ = ["FakeClock", "bind_socket", "run_server", "socket_url"]
