"""The fast path of SGLang's ``GET /route`` (prepared answers, answered in front of FastAPI and
at uvicorn's parser): the same answers as the FastAPI stack, the same metrics, answers that
follow registrations, in order on a pipelined connection, keep-alive and close honoured."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvhandoff.bootstrap_server.fastpath import http_protocol

Server = Callable[..., str]

ROUTE = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"


def put(url: str, tp: int, port: int | None = None, **over: Any) -> httpx.Response:
    return httpx.put(url + "/route", json={
        "attn_tp_size": 2, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
        "rank_port": port or 7000 + tp, "page_size": 64, "kv_cache_dtype": "auto", **over})


QUERIES = [
    ROUTE.format(-1, -1, -1, -1), ROUTE.format(0, 0, 0, 0), ROUTE.format(0, 0, 1, 0),
    ROUTE.format(0, 0, 7, 0), ROUTE.format(-1, 0, 0, 0), ROUTE.format("x", 0, 0, 0),
    ROUTE.format("", 0, 0, 0), "/route?prefill_dp_rank=0", "/route",
    ROUTE.format(0, 0, 99999, 0), ROUTE.format(0, 0, 1, 0) + "&x=1",
    ROUTE.format("1" * 40, 0, 0, 0),  # too long: the FastAPI route answers (422)
    ROUTE.format(0, 0, 0, 0) + "&prefill_dp_rank=0",  # repeated: the FastAPI route answers
]


def _answers(url: str) -> list[tuple[int, dict[str, str], bytes]]:
    out = []
    for q in QUERIES:
        r = httpx.get(url + q)
        headers = {k: v for k, v in r.headers.items() if k not in ("date",)}
        out.append((r.status_code, headers, r.content))
    return out


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def test_fast_path_answers_exactly_like_the_fastapi_stack(bootstrap_server: Server) -> None:
    fast, slow = bootstrap_server(), bootstrap_server(fast_path=False)
    for url in (fast, slow):
        put(url, 0).raise_for_status()
    assert _answers(fast) == _answers(slow)  # before readiness: 503s, 400s
    for url in (fast, slow):
        put(url, 1).raise_for_status()
    got = _answers(fast)
    assert got == _answers(slow)
    assert [s for s, _, _ in got] == [200, 200, 200, 404, 400, 400, 400, 400, 400, 400, 200,
                                      422, 200]
    assert got[2][2] == b'{"rank_ip":"127.0.0.1","rank_port":7001}'
    assert got[0][1]["content-type"] == "application/json"


def test_fast_path_follows_registrations_and_counts_metrics(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    q = ROUTE.format(0, 0, 1, 0)
    assert httpx.get(url + q).status_code == 503
    put(url, 0).raise_for_status()
    put(url, 1).raise_for_status()
    assert httpx.get(url + q).json() == {"rank_ip": "127.0.0.1", "rank_port": 7001}
    put(url, 1, port=9001).raise_for_status()  # re-registration: the prepared answer moves
    for _ in range(5):
        assert httpx.get(url + q).json() == {"rank_ip": "127.0.0.1", "rank_port": 9001}
    assert _metric(url, "kvhandoff_bootstrap_requests_total", method="GET", route="/route",
                   status="200") == 6
    assert _metric(url, "kvhandoff_bootstrap_requests_total", method="GET", route="/route",
                   status="503") == 1
    assert _metric(url, "kvhandoff_bootstrap_route_lookups_total", api="sglang",
                   outcome="ok") == 6
    assert _metric(url, "kvhandoff_bootstrap_request_seconds_count", method="GET",
                   route="/route") == 7


def _read_responses(sock: socket.socket, n: int) -> list[tuple[bytes, bytes, bytes]]:
    buf = b""
    out = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} responses: {buf!r}"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)content-length: *(\d+)", head)
        size = int(m.group(1)) if m else 0
        while len(buf) < size:
            chunk = sock.recv(65536)
            assert chunk
            buf += chunk
        body, buf = buf[:size], buf[size:]
        out.append((head.split(b"\r\n")[0], head, body))
    return out


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def test_pipelined_requests_are_answered_in_order(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    put(url, 0).raise_for_status()
    put(url, 1).raise_for_status()
    reqs = [ROUTE.format(0, 0, 0, 0), "/ready", ROUTE.format(0, 0, 1, 0),
            ROUTE.format(-1, -1, -1, -1), "/health", ROUTE.format(0, 0, 1, 0)]
    with _connect(url) as sock:
        sock.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in reqs))
        got = _read_responses(sock, len(reqs))
    bodies = [b for _, _, b in got]
    assert bodies[0] == b'{"rank_ip":"127.0.0.1","rank_port":7000}'
    assert b'"ready":true' in bodies[1]
    assert bodies[2] == bodies[5] == b'{"rank_ip":"127.0.0.1","rank_port":7001}'
    assert b'"attn_tp_size":2' in bodies[3]
    assert bodies[4] == b"OK"
    assert all(status == b"HTTP/1.1 200 OK" for status, _, _ in got)


def test_keep_alive_and_close(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    q = ROUTE.format(-1, -1, -1, -1).encode()
    with _connect(url) as sock:  # HTTP/1.0: answered, then closed
        sock.sendall(b"GET " + q + b" HTTP/1.0\r\n\r\n")
        (status, head, body), = _read_responses(sock, 1)
        assert status == b"HTTP/1.1 503 Service Unavailable"
        assert b"connection: close" in head.lower() and b"retry-after: 1" in head.lower()
        assert b"BootstrapUnavailable" in body
        assert sock.recv(10) == b""
    with _connect(url) as sock:  # Connection: close on 1.1
        sock.sendall(b"GET " + q + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        (_, head, _), = _read_responses(sock, 1)
        assert b"connection: close" in head.lower() and b"date: " in head.lower()
        assert sock.recv(10) == b""
    with _connect(url) as sock:  # keep-alive: three on one connection
        for _ in range(3):
            sock.sendall(b"GET " + q + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            (status, head, _), = _read_responses(sock, 1)
            assert status.startswith(b"HTTP/1.1 503") and b"connection: close" not in head


def test_a_get_with_a_body_goes_through_the_full_stack(bootstrap_server: Server) -> None:
    url = bootstrap_server(max_body_bytes=16)
    r = httpx.request("GET", url + ROUTE.format(-1, -1, -1, -1), content=b"x" * 64)
    assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge"


@pytest.mark.skipif(http_protocol() == "auto", reason="httptools is not installed")
def test_the_parser_level_protocol_is_what_serve_uses() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    proto = http_protocol()
    assert issubclass(proto, HttpToolsProtocol) and proto is not HttpToolsProtocol
