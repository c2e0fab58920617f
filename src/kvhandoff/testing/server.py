"""Run real servers in the background, for tests and scripts.

`run_server` (a bootstrap server in a thread of this process) lives in
`kvhandoff.bootstrap_server.background`, `bind_socket` and `socket_url` in
`kvhandoff.bootstrap_server.sockets`; they are re-exported here beside `FakeClock` (from
`kvhandoff.testing.clock`), a settable clock for the registry. Servers as processes of their
own (`serve_process`, `sglang_process`: the bench runs them too) are
`kvhandoff.bench.servers`'.
"""

from __future__ import annotations

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url
from kvhandoff.testing.clock import FakeClock

__all__ = ["FakeClock", "bind_socket", "run_server", "socket_url"]
