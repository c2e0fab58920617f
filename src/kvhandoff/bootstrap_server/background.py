"""The bootstrap server in a background thread of this process: `kvhandoff demo`, benches,
scripts and tests serve it this way.

    with run_server(Settings(rank_ttl_s=1.0)) as url:   # e.g. "http://127.0.0.1:40123"
        BootstrapClient(url).ready()

Rules: the listening socket is bound (port 0 = any free port) and listening before uvicorn
starts, so the URL is known at once; `run_server` still waits, with a bound, for uvicorn's
startup to finish and fails loudly if the server thread dies. Leaving the block stops the
server and joins the thread (bounded). This is its one import path (tests and scripts too).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from kvhandoff.bootstrap_server.app import create_app
from kvhandoff.bootstrap_server.fastpath import http_protocol
from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url
from kvhandoff.errors import BootstrapError
from kvhandoff.settings import Settings

__all__ = ["run_server"]


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the end of its startup through an Event."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = threading.Event()
        self.error: BaseException | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.started_event.set()


@contextmanager
def run_server(
    settings: Settings | None = None,
    *,
    clock: Callable[[], float] | None = None,
    startup_timeout_s: float = 15.0,
    fast_path: bool = True,
    **overrides: Any,
) -> Iterator[str]:
    """Serve `create_app(settings)` on ``settings.host`` and a free port (``port`` is ignored
    unless given in ``overrides``); yield the base URL.

    Args:
        settings: server settings; ``overrides`` are applied on top (e.g. ``rank_ttl_s=0.2``).
        clock: fake clock for the registry (default: `time.monotonic`).
        startup_timeout_s: bound on waiting for uvicorn's startup.
        fast_path: see `create_app` (False: every request through the FastAPI stack).
    """
    base = settings or Settings(port=0)
    # validated (a str token becomes a SecretStr), without reading the environment again
    settings = Settings.model_validate({**base.model_dump(), "port": 0, **overrides})
    app = create_app(settings, fast_path=fast_path) if clock is None else create_app(
        settings, clock=clock, fast_path=fast_path)
    sock = bind_socket(settings.host, settings.port)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, http=http_protocol())
    server = _Server(config)

    def target() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as e:  # reported to the waiting thread below
            server.error = e
            server.started_event.set()

    thread = threading.Thread(target=target, name="kvhandoff-bootstrap", daemon=True)
    thread.start()
    try:
        if not server.started_event.wait(startup_timeout_s):
            raise BootstrapError(f"bootstrap server did not start within {startup_timeout_s} s")
        if server.error is not None:
            raise BootstrapError(f"bootstrap server failed to start: {server.error}") from (
                server.error)
        if not server.started:
            raise BootstrapError("bootstrap server failed to start (see its log)")
        yield socket_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
