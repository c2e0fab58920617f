"""``KVHandoffKVBootstrapServer``: the bootstrap server SGLang starts on a prefill node.

SGLang constructs it with ``(host, port)`` = ``--host`` and ``--disaggregation-bootstrap-port``.

- Default: runs kvhandoff's bootstrap server (`kvhandoff.bootstrap_server.create_app`) in this
  process, on a uvicorn thread, bound to that host and port before it returns. It serves
  SGLang's routes (``PUT/GET /route``, ``/register_dp_rank``, ``/query_dp_ranks``,
  ``/health``) and kvhandoff's ``/v1`` API (agent registration and route lookup), ``/ready``
  and ``/metrics``. Settings come from the ``KVHANDOFF_*`` environment (auth token, TTL, ...),
  host and port from SGLang.
- ``KVHANDOFF_BOOTSTRAP_URL`` set: the node runs a ``kvhandoff serve`` sidecar; nothing is
  started, the sidecar must answer ``/health`` (bounded wait) and listen on the same port SGLang
  was given (decode ranks reach the prefill's bootstrap server at that port).

It subclasses SGLang's ``BaseKVBootstrapServer`` only, not ``CommonKVBootstrapServer``: SGLang's
Rust server stands in for ``Common*`` bootstrap servers, and this one must not be replaced.

``KVHANDOFF_AUTH_TOKEN`` protects both servers' write routes. SGLang's own writes to its
bootstrap server (the prefill rank's ``PUT /route``, a request's ``POST /register_dp_rank``)
carry no token, so this backend makes them itself (`write`), with the token of the process's
``KVHANDOFF_*`` environment; reads (``GET /route``, ``/query_dp_ranks``) need none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlparse

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, KVPoll

from kvhandoff.errors import ConfigError

log = logging.getLogger("kvhandoff.sglang")

STARTUP_TIMEOUT_S = 30.0
WRITE_ATTEMPTS = 5  # as SGLang's prefill registration: up to 5 tries, backing off 0.5 s .. 4 s
WRITE_TIMEOUT_S = 5.0


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer <KVHANDOFF_AUTH_TOKEN>`` when the token is set, else nothing."""
    from kvhandoff.settings import Settings

    token = Settings().auth_token
    return {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}


def write(method: str, url: str, payload: dict[str, Any], *, attempts: int = WRITE_ATTEMPTS,
          what: str) -> None:
    """One of SGLang's writes to its bootstrap server, with this process's token. Retried
    (bounded) while the server is unreachable or answers 5xx; a 4xx is not retried: 401/403
    is a `ConfigError` naming KVHANDOFF_AUTH_TOKEN, another 4xx names the route and the
    server's answer. `what` says what the write is for, in errors."""
    import httpx

    last = ""
    for attempt in range(attempts):
        try:
            r = httpx.request(method, url, json=payload, headers=auth_headers(),
                              timeout=WRITE_TIMEOUT_S)
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if r.status_code == 200:
                return
            if r.status_code in (401, 403):
                have = "is set" if auth_headers() else "is not set"
                raise ConfigError(
                    f"KVHANDOFF_AUTH_TOKEN: the kvhandoff bootstrap server at {url} refused "
                    f"{what} ({r.status_code}); KVHANDOFF_AUTH_TOKEN {have} in this SGLang "
                    f"process: give it the server's token")
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code < 500:
                raise ConfigError(f"{method} {url} ({what}) refused: {last}")
        if attempt + 1 < attempts:
            time.sleep(min(0.5 * 2 ** attempt, 4.0))
    raise ConfigError(f"{method} {url} ({what}) failed {attempts} times, last: {last}")


class KVHandoffKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, int(port)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        sidecar = os.environ.get("KVHANDOFF_BOOTSTRAP_URL")
        if sidecar:
            self.url = sidecar.rstrip("/")
            self.sidecar = True
            self._check_sidecar()
        else:
            self.sidecar = False
            self.url = self._start()

    def _check_sidecar(self) -> None:
        u = urlparse(self.url)
        if u.scheme not in ("http", "https") or u.port is None:
            raise ConfigError(f"KVHANDOFF_BOOTSTRAP_URL: expected http://host:port, got "
                              f"{self.url!r}")
        if u.port != self.port:
            raise ConfigError(
                f"KVHANDOFF_BOOTSTRAP_URL: the sidecar listens on port {u.port} but "
                f"--disaggregation-bootstrap-port is {self.port}; decode ranks reach the "
                f"prefill's bootstrap server at that port, so give both the same port")
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("kvhandoff bootstrap: using the sidecar at %s", self.url)
                    return
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.2)
        raise ConfigError(f"KVHANDOFF_BOOTSTRAP_URL: no kvhandoff server answers {self.url}"
                          f"/health within {STARTUP_TIMEOUT_S:.0f}s ({last})")

    def _start(self) -> str:
        import uvicorn

        from kvhandoff.bootstrap_server.app import create_app
        from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url
        from kvhandoff.settings import Settings

        settings = Settings().model_copy(update={"host": self.host, "port": self.port})
        sock = bind_socket(self.host, self.port)
        url = socket_url(sock)
        config = uvicorn.Config(create_app(settings), log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        daemon=True, name="kvh-sglang-bootstrap")
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"kvhandoff bootstrap server on {url} did not start")
            time.sleep(0.01)
        self.port = sock.getsockname()[1]
        log.info("kvhandoff bootstrap server (in-process) on %s", url)
        return url

    def run(self) -> None:
        """Already serving since construction (SGLang's API)."""

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def poll(self) -> KVPoll:  # SGLang's Common server has it; nothing to report here
        return KVPoll.Success
