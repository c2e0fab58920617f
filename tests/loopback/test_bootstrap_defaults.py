"""`kvhandoff serve` as a user starts it: default settings, a real process, SGLang's prefill.

Four prefill ranks (dp 0-1 x tp 0-1) register the way SGLang 0.5.23 does: its own
``CommonKVManager.register_to_bootstrap`` (and ``_register_topology_row``, which PUTs with
``requests``), compiled from the installed ``sglang/srt/disaggregation/common/conn.py`` and run
on a stand-in for the manager's state, so the payload carries every field SGLang sends. Then
keep-alive ``GET /route`` lookups, as every SGLang decode asks per request. At the defaults the
server's stderr holds nothing but uvicorn's start-up and shut-down lines (no ``--- Logging
error ---``, no traceback) and the lookups write no access line; errors still do.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import queue
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.bench.servers import sglang_unavailable

KVHANDOFF = [sys.executable, "-m", "kvhandoff.cli"]
# what uvicorn itself writes to stderr at log level info when it starts and stops
LIFECYCLE = re.compile(r"INFO: +(Started server process \[\d+\]|Shutting down|"
                       r"Finished server process \[\d+\]|Waiting for connections to close\..*)$")
ROUTE_PATH = ("/route?prefill_dp_rank={dp}&prefill_cp_rank=0&target_tp_rank={tp}"
              "&target_pp_rank=0")
DP_SIZE = TP_SIZE = 2


def rank_port(dp: int, tp: int) -> int:
    return 17000 + 10 * dp + tp


@dataclass
class Served:
    url: str
    host: str
    port: int
    proc: subprocess.Popen[str]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@contextmanager
def serve(*flags: str, host: str = "127.0.0.1",
          env: dict[str, str] | None = None) -> Iterator[Served]:
    """``kvhandoff serve --host HOST --port 0 FLAGS`` with no KVHANDOFF_* variable set but those
    in ``env``; both pipes are drained by threads (a flood of log lines cannot block the
    server), and stopping the process joins them, so the lists are complete after the block."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    proc = subprocess.Popen([*KVHANDOFF, "serve", "--host", host, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**clean, **(env or {}), "PYTHONUNBUFFERED": "1"})
    first: queue.Queue[str] = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def drain(stream: Any, into: list[str], tell: queue.Queue[str] | None) -> None:
        for line in stream:
            if tell is not None and not into:
                tell.put(line)
            into.append(line.rstrip("\n"))
        if tell is not None:
            tell.put("")

    threads = [threading.Thread(target=drain, args=(proc.stdout, out, first), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err, None), daemon=True)]
    for t in threads:
        t.start()
    try:
        try:
            line = first.get(timeout=60)
        except queue.Empty:
            raise AssertionError("kvhandoff serve printed no URL within 60 s") from None
        m = re.search(r"listening on (http://(\[[0-9a-f:]+\]|[^:/\s]+):(\d+))$", line.strip())
        assert m, f"first line {line!r}, stderr {err[-20:]}"
        yield Served(url=m.group(1), host=m.group(2).strip("[]"), port=int(m.group(3)),
                     proc=proc, stdout=out, stderr=err)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        for t in threads:
            t.join(timeout=15)


# -- SGLang's prefill registration, from SGLang's source ------------------------------------------

@cache
def _sglang_register() -> tuple[Callable[..., None], Callable[..., None], dict[str, Any]]:
    """``register_to_bootstrap`` and ``_register_topology_row`` of SGLang's CommonKVManager,
    compiled from the installed conn.py with the module globals they use; ``requests`` is the
    real one behind a recorder of each PUT's payload and status."""
    import importlib.util

    import requests
    from sglang.srt.environ import envs
    from sglang.srt.utils.network import NetworkAddress

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/disaggregation/common/conn.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    manager = next(n for n in tree.body
                   if isinstance(n, ast.ClassDef) and n.name == "CommonKVManager")
    wanted = ("register_to_bootstrap", "_register_topology_row")
    methods = {n.name: n for n in manager.body
               if isinstance(n, ast.FunctionDef) and n.name in wanted}
    assert set(methods) == set(wanted), f"{path}: CommonKVManager lacks {wanted}"
    sent: list[tuple[dict[str, Any], int]] = []

    def put(url: str, *, json: dict[str, Any], timeout: float) -> Any:
        r = requests.put(url, json=json, timeout=timeout)
        sent.append((json, r.status_code))
        return r

    parallel = types.SimpleNamespace(
        enable_cp_tp_group_sharing=False, load_balance_method="follow_bootstrap_room",
        enable_dsa_cache_layer_split=False, enable_kv_cache_sharding=False, world_group=None)
    ns: dict[str, Any] = {
        "Dict": dict, "NetworkAddress": NetworkAddress, "envs": envs, "time": __import__("time"),
        "requests": types.SimpleNamespace(put=put),
        "logger": __import__("logging").getLogger("sglang.srt.disaggregation.common.conn"),
        "get_parallel": lambda: parallel,
        "get_serving": lambda: types.SimpleNamespace(port=30000),
        "get_disagg": lambda: types.SimpleNamespace(
            disaggregation_decode_allocation_policy="early"),
    }
    module = ast.Module(body=[ast.ImportFrom("__future__", [ast.alias("annotations")], 0),
                              *(methods[n] for n in wanted)], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), ns)  # noqa: S102
    return ns["register_to_bootstrap"], ns["_register_topology_row"], {"sent": sent}


def register_sglang_prefill(host: str, port: int, *, rank_ip: str = "127.0.0.1"
                            ) -> list[dict[str, Any]]:
    """The four ranks of a dp-2 x tp-2 SGLang prefill, each at ``rank_ip``, register with the
    bootstrap server at ``host:port`` by SGLang's own code; returns the payloads it sent (each
    answered 200)."""
    register, register_row, box = _sglang_register()
    sent: list[tuple[dict[str, Any], int]] = box["sent"]
    sent.clear()
    for dp in range(DP_SIZE):
        for tp in range(TP_SIZE):
            rank = types.SimpleNamespace(
                dist_init_addr=None, bootstrap_host=host, bootstrap_port=port,
                attn_tp_size=TP_SIZE, attn_tp_rank=tp, attn_cp_size=1, attn_cp_rank=0,
                attn_dp_size=DP_SIZE, attn_dp_rank=dp, pp_size=1, pp_rank=0,
                system_dp_size=1, system_dp_rank=0, local_ip=rank_ip,
                rank_port=rank_port(dp, tp),
                kv_args=types.SimpleNamespace(page_size=64, rust_http_port=None),
                kv_cache_dtype_str="bfloat16", kv_layout=None, dsv41_spec_layout=None)
            rank._register_topology_row = types.MethodType(register_row, rank)
            register(rank)
    assert [status for _, status in sent] == [200] * (DP_SIZE * TP_SIZE), sent
    return [payload for payload, _ in sent]


needs_sglang = pytest.mark.skipif(sglang_unavailable() is not None,
                                  reason=str(sglang_unavailable()))


def lookups(s: Served, n: int, *, rank_ip: str = "127.0.0.1") -> None:
    """``n`` keep-alive ``GET /route`` lookups over one connection, cycling over the four
    ranks; each answer is the rank asked for."""
    conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
    try:
        for i in range(n):
            dp, tp = divmod(i % (DP_SIZE * TP_SIZE), TP_SIZE)
            conn.request("GET", ROUTE_PATH.format(dp=dp, tp=tp))
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200, (r.status, body)
            assert json.loads(body) == {"rank_ip": rank_ip, "rank_port": rank_port(dp, tp)}
    finally:
        conn.close()


def get(s: Served, path: str) -> int:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def chunked_lookup(s: Served) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
    try:
        conn.request("GET", ROUTE_PATH.format(dp=1, tp=1), body=iter([b""]),
                     encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


#: what uvicorn writes when a stranger's bytes reach its port: a ZMQ socket of another test
#: (or process) reconnecting to an address whose port the OS gave this server since writes its
#: greeting there. Not a line this test's requests make (all are well-formed HTTP).
STRANGER = "WARNING:  Invalid HTTP request received."


def not_lifecycle(lines: list[str]) -> list[str]:
    return [line for line in lines if not LIFECYCLE.match(line) and line != STRANGER]


@needs_sglang
def test_defaults_answer_10000_lookups_with_nothing_but_start_up_lines() -> None:
    with serve() as s:
        payloads = register_sglang_prefill(s.host, s.port)
        lookups(s, 10_000)
        # a lookup with a (empty, chunked) body goes through FastAPI, not the fast path: uvicorn
        # writes its access line there, and the filter keeps it out as well
        assert chunked_lookup(s) == (200, {"rank_ip": "127.0.0.1", "rank_port": rank_port(1, 1)})
        # an error answer keeps its access line
        assert get(s, ROUTE_PATH.format(dp=0, tp=0).replace("pp_rank=0", "pp_rank=3")) == 404
        assert get(s, "/health") == 200
    # SGLang's own code sent every field it has, and a server-info lookup saw them all
    assert {"kv_layout", "prefill_http_port", "decode_allocation_policy",
            "enable_kv_cache_sharding"} <= set(payloads[0])
    errors = not_lifecycle(s.stderr)
    assert not errors, "stderr beyond uvicorn's start-up lines:\n" + "\n".join(errors[:60])
    assert any("Started server process" in line for line in s.stderr), s.stderr
    # access lines (stdout): the four PUTs, the 404 and /health; none of the 10,000 lookups
    puts = [line for line in s.stdout if '"PUT /route HTTP/1.1" 200' in line]
    assert len(puts) == DP_SIZE * TP_SIZE, s.stdout[:20]
    route = [line for line in s.stdout if '"GET /route?' in line]
    assert len(route) == 1 and "target_pp_rank=3 HTTP/1.1\" 404" in route[0], route[:5]
    assert any('"GET /health HTTP/1.1" 200' in line for line in s.stdout)


@needs_sglang
def test_route_access_log_writes_uvicorns_line_for_every_lookup() -> None:
    with serve("--route-access-log") as s:
        register_sglang_prefill(s.host, s.port)
        lookups(s, 40)
        assert get(s, "/health") == 200
    assert not not_lifecycle(s.stderr), s.stderr[:60]
    lines = [line for line in s.stdout if '"GET /route?' in line]
    assert len(lines) == 40, s.stdout[:20]
    pattern = re.compile(r'INFO: +127\.0\.0\.1:\d+ - "GET /route\?prefill_dp_rank=\d&'
                         r'prefill_cp_rank=0&target_tp_rank=\d&target_pp_rank=0 HTTP/1\.1" 200')
    assert all(pattern.match(line) for line in lines), lines[:3]


@needs_sglang
def test_slow_requests_are_logged_as_warnings_at_defaults() -> None:
    # every answer takes longer than a nanosecond: each is "slow" and says so on stderr
    with serve("--slow-request-s", "1e-9") as s:
        register_sglang_prefill(s.host, s.port)
        lookups(s, 5)
        assert get(s, "/health") == 200
    slow = not_lifecycle(s.stderr)
    route = [line for line in slow if "slow request: GET /route?prefill_dp_rank=" in line]
    assert len(route) == 5, slow[:20]
    assert all(line.startswith("WARNING:") and "answered 200 after" in line for line in route)
    assert any("slow request: PUT /route answered 200" in line for line in slow), slow
    assert any("slow request: GET /health answered 200" in line for line in slow), slow
    # the lookups still write no access line: slow is a warning, not an access line
    assert not [line for line in s.stdout if '"GET /route?' in line]
