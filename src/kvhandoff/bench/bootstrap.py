"""Throughput of route lookups, beside SGLang's own bootstrap server (a measurement script, not
a test).

    python -m kvhandoff.bench.bootstrap [--seconds 5] [--concurrency 1,32] [--routes all]
                                        [--serve-args=--route-access-log]

Starts the server as a user does, ``kvhandoff serve --host 127.0.0.1 --port 0`` with default
settings (no other flag, no ``KVHANDOFF_*`` variable; ``--serve-args`` adds flags, and the
output says which), as its own process (so the load generator does not share a GIL with the
server), and, when SGLang is installed, SGLang 0.5.23's ``CommonKVBootstrapServer`` as another
(`kvhandoff.bench.servers.sglang_process`). What our server wrote is counted and printed:
its stderr lines beyond uvicorn's start-up and shut-down lines (the first few shown) and its
access lines. Registers a native prefill engine of TP 8
on ours and the same 8 SGLang-style ranks (``PUT /route``) on both, then drives keep-alive GETs
(raw asyncio streams, on uvloop when installed) from ``--clients`` processes, each an event
loop with N requests in flight, for ``--seconds`` per route and concurrency. The SGLang route
is measured on both servers in ``--rounds`` alternating slices (ours, SGLang, SGLang, ours, ...)
so that a change of the machine's load hits both alike, and the kvhandoff/SGLang ratio is
printed for each concurrency with the load average, and with the median and range of the
ratios of the rounds (one slice per server each), which show how much the load moved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx

SGLANG_ROUTE = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0"
ROUTES = {
    "GET /v1/route (native, by dp_rank)": "/v1/route?engine_id=p&dp_rank=0&tp_rank=3&tp_size=8",
    "GET /route (SGLang, one rank)": SGLANG_ROUTE,
    "GET /health": "/health",
}
SGLANG_NAME = "GET /route (SGLang, one rank)"


async def _load(url: str, path: str, seconds: float, concurrency: int) -> list[float]:
    """Keep-alive GETs over raw asyncio streams (httpx would be the bottleneck, not the
    server); each response's status line and body length are checked."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"{path}: {head[:200]!r}")
                m = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(m.group(1)) if m else 0)
                lat.append(time.perf_counter() - t)
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


def _client(args: tuple[str, str, float, int]) -> list[float]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_load(*args))
    return uvloop.run(_load(*args))


def _sglang_rank(tp: int) -> dict[str, Any]:
    return {"attn_tp_size": 8, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": 9100 + tp, "page_size": 64, "kv_cache_dtype": "auto"}


def _seed(url: str, *, native: bool) -> None:
    from kvhandoff.bootstrap_server.client import BootstrapClient
    from kvhandoff.kv_layout import preset

    c = BootstrapClient(url)
    for tp in range(8):
        if native:
            c.register_rank(engine_id="p", role="prefill", agent_address=f"127.0.0.1:{9000 + tp}",
                            generation="bench", layout=preset("glm-5.3"), tp_rank=tp, tp_size=8)
        httpx.put(url + "/route", json=_sglang_rank(tp)).raise_for_status()
    # both answer the same, or the comparison is meaningless
    r = httpx.get(url + SGLANG_ROUTE)
    if r.status_code != 200 or r.json() != {"rank_ip": "127.0.0.1", "rank_port": 9103}:
        raise SystemExit(f"{url}{SGLANG_ROUTE}: {r.status_code} {r.text[:200]}")


def _slice(pool: Any, url: str, path: str, seconds: float, concurrency: int,
           clients: int) -> list[float]:
    parts = pool.map(_client, [(url, path, seconds, concurrency)] * clients)
    return [x for p in parts for x in p]


def _summary(lat: list[float], seconds: float) -> dict[str, Any]:
    lat = sorted(lat)
    n = len(lat)
    return {"requests": n, "requests_per_s": round(n / seconds),
            "p50_ms": round(lat[n // 2] * 1e3, 3), "p99_ms": round(lat[int(n * 0.99)] * 1e3, 3)}


_LIFECYCLE = re.compile(r"INFO: +(Started server process|Shutting down|Finished server process|"
                        r"Waiting for connections to close)")


class _Served:
    """What `kvhandoff serve` wrote while it was measured."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.stdout_lines = 0
        self.stderr_lines: list[str] = []

    def report(self) -> dict[str, Any]:
        extra = [line for line in self.stderr_lines if not _LIFECYCLE.match(line)]
        return {"command": shlex.join(self.argv), "stdout_lines": self.stdout_lines,
                "stderr_lines": len(self.stderr_lines),
                "stderr_lines_beyond_start_up": len(extra), "stderr_first": extra[:5]}


@contextmanager
def _kvhandoff_serve(flags: list[str]) -> Iterator[tuple[str, _Served]]:
    """``kvhandoff serve --host 127.0.0.1 --port 0 FLAGS`` without ``KVHANDOFF_*`` variables;
    stdout (URL, access lines) is counted by a thread, stderr goes to a file read at the end."""
    shown = ["kvhandoff", "serve", "--host", "127.0.0.1", "--port", "0", *flags]
    served = _Served(shown)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvhandoff.cli", *shown[1:]],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
        first: queue.Queue[str] = queue.Queue()

        def drain() -> None:
            assert proc.stdout is not None
            first.put(proc.stdout.readline())
            for _ in proc.stdout:
                served.stdout_lines += 1

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            try:
                line = first.get(timeout=60)
            except queue.Empty:
                raise SystemExit("kvhandoff serve printed no URL within 60 s") from None
            m = re.search(r"(http://\S+)", line)
            if m is None:
                err.seek(0)
                raise SystemExit(f"kvhandoff serve did not start: {line!r} {err.read()[-2000:]}")
            yield m.group(1), served
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=10)
            err.seek(0)
            served.stderr_lines = err.read().splitlines()


def main() -> None:
    from kvhandoff.bench.servers import sglang_process, sglang_unavailable

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", default="1,32",
                    help="requests in flight per client process, comma-separated")
    ap.add_argument("--clients", type=int, default=1, help="load-generating processes")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating slices per server for the SGLang comparison")
    ap.add_argument("--routes", choices=("all", "sglang"), default="all",
                    help="sglang: only the SGLang route, on both servers")
    ap.add_argument("--no-sglang", action="store_true", help="do not start SGLang's server")
    ap.add_argument("--serve-args", default="",
                    help="flags added to `kvhandoff serve` (default: none, the defaults), "
                    "e.g. --serve-args=--route-access-log")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    why_not = "--no-sglang" if a.no_sglang else sglang_unavailable()
    routes = ROUTES if a.routes == "all" else {SGLANG_NAME: SGLANG_ROUTE}
    results: dict[str, Any] = {"seconds": a.seconds, "clients": a.clients,
                               "loadavg_before": os.getloadavg(), "kvhandoff": {}, "sglang": {},
                               "ratio_kvhandoff_over_sglang": {}, "round_ratios": {},
                               "sglang_missing": why_not}
    with ExitStack() as stack:
        ours, served = stack.enter_context(_kvhandoff_serve(shlex.split(a.serve_args)))
        _seed(ours, native=True)
        theirs = None
        if why_not is None:
            theirs = stack.enter_context(sglang_process())
            _seed(theirs, native=False)
        pool = stack.enter_context(mp.get_context("spawn").Pool(a.clients))
        for c in levels:
            for name, path in routes.items():
                key = f"{name} @{c}"
                if name != SGLANG_NAME or theirs is None:
                    lat = _slice(pool, ours, path, a.seconds, c, a.clients)
                    results["kvhandoff"][key] = _summary(lat, a.seconds)
                    continue
                mine: list[float] = []
                other: list[float] = []
                part = a.seconds / a.rounds
                per_round: list[float] = []
                for i in range(a.rounds):
                    order = ((ours, mine), (theirs, other))
                    before = len(mine), len(other)
                    for url, into in order if i % 2 == 0 else order[::-1]:
                        into += _slice(pool, url, path, part, c, a.clients)
                    per_round.append((len(mine) - before[0]) / max(len(other) - before[1], 1))
                per_round.sort()
                results["round_ratios"][str(c)] = {
                    "median": round(per_round[len(per_round) // 2], 2),
                    "min": round(per_round[0], 2), "max": round(per_round[-1], 2)}
                results["kvhandoff"][key] = _summary(mine, a.seconds)
                results["sglang"][key] = _summary(other, a.seconds)
                results["ratio_kvhandoff_over_sglang"][str(c)] = round(
                    len(mine) / max(len(other), 1), 2)
    results["loadavg_after"] = os.getloadavg()
    results["kvhandoff_serve"] = report = served.report()
    if a.json:
        print(json.dumps(results, indent=2))
        return
    how = "default settings" if not a.serve_args else f"default settings but {a.serve_args}"
    print(f"kvhandoff: `{report['command']}` as a user starts it ({how}; no KVHANDOFF_* "
          f"variable). SGLang: its CommonKVBootstrapServer as SGLang runs it.")
    print(f"{a.clients} client process(es), {a.seconds:g} s each; load average before "
          f"{results['loadavg_before'][0]:.2f}, after {results['loadavg_after'][0]:.2f}")
    for server in ("kvhandoff", "sglang"):
        for name, r in results[server].items():
            print(f"{server:9s} {name:44s} {r['requests_per_s']:>7,} req/s  "
                  f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                  f"({r['requests']:,} requests)")
    if why_not is not None:
        print(f"SGLang's server not measured: {why_not}")
    for c, ratio in results["ratio_kvhandoff_over_sglang"].items():
        spread = results["round_ratios"][c]
        print(f"kvhandoff/SGLang GET /route (one rank), {c} in flight: {ratio:.2f}x "
              f"(per round of one slice each: median {spread['median']:.2f}x, "
              f"{spread['min']:.2f}-{spread['max']:.2f}x)")
    print(f"kvhandoff serve wrote {report['stdout_lines']:,} access lines (stdout) and "
          f"{report['stderr_lines_beyond_start_up']:,} stderr lines beyond uvicorn's start-up "
          f"and shut-down lines" + "".join(f"\n  {line}" for line in report["stderr_first"]))


if __name__ == "__main__":
    main()
