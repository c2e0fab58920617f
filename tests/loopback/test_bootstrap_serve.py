"""`kvhandoff serve` as a real process: port 0, env settings, --help, bad flags."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from test_bootstrap_defaults import serve

from kvhandoff.settings import Settings

SERVER_FIELDS = ("host", "port", "auth_token", "rank_ttl_s", "max_body_bytes",
                 "room_retention_s", "log_level", "require_rdma", "route_access_log",
                 "slow_request_s")
KVHANDOFF = [sys.executable, "-m", "kvhandoff.cli"]


@pytest.fixture
def served() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with serve("--log-level", "warning", "--rank-ttl-s", "7",
               env={"KVHANDOFF_AUTH_TOKEN": "from-env"}) as s:
        yield s.url, s.proc


def test_serve_listens_on_a_free_port_with_env_settings(
        served: tuple[str, subprocess.Popen[str]]) -> None:
    url, proc = served
    # the socket listens before the line is printed: the first answer comes once uvicorn runs
    r = httpx.get(url + "/health", timeout=30)
    assert proc.poll() is None
    assert r.status_code == 200 and r.text == "OK"
    # the token came from KVHANDOFF_AUTH_TOKEN
    assert httpx.post(url + "/v1/rooms", json={"count": 1}).status_code == 401
    r = httpx.post(url + "/v1/rooms", json={"count": 1},
                   headers={"Authorization": "Bearer from-env"})
    assert r.status_code == 200
    hb = httpx.post(url + "/v1/ranks/heartbeat", json={"engine_id": "x"},
                    headers={"Authorization": "Bearer from-env"})
    assert hb.status_code == 404


def test_help_documents_every_server_setting() -> None:
    out = subprocess.run([*KVHANDOFF, "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    flat = " ".join(out.split())
    for name in SERVER_FIELDS:
        assert f"--{name.replace('_', '-')}" in flat, name
        assert f"KVHANDOFF_{name.upper()}" in flat, name
        first_words = " ".join(str(Settings.model_fields[name].description).split()[:4])
        assert first_words in flat, name


def test_bad_flag_value_names_the_setting() -> None:
    r = subprocess.run([*KVHANDOFF, "serve", "--rank-ttl-s", "-1", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "rank_ttl_s" in r.stderr


def test_bound_socket_gives_accepted_connections_tcp_nodelay() -> None:
    """Without TCP_NODELAY every answer waits ~40 ms (Nagle + delayed ACK): asyncio sets it on
    accepted sockets only when the listening socket's proto is IPPROTO_TCP."""
    import asyncio
    import socket

    from kvhandoff.bootstrap_server.sockets import bind_socket

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            s = w.get_extra_info("socket")
            got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            w.close()

        server = await asyncio.start_server(on_conn, sock=sock)
        _, w = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(got, 10)
        w.close()
        server.close()
        return value

    assert asyncio.run(main()) != 0
