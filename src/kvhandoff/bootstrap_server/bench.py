"""Throughput of route lookups (a measurement script, not a test).

    python -m kvhandoff.bootstrap_server.bench [--seconds 5] [--concurrency 32]

Starts `kvhandoff serve --port 0` as its own process (so the load generator does not share a
GIL with the server), registers a prefill engine of TP 8 (native) and 8 SGLang ranks, then
drives keep-alive GETs (raw asyncio streams) from ``--clients`` processes, each an asyncio loop with
``--concurrency`` requests in flight, for ``--seconds`` per route. Prints requests/s and
latency percentiles of each route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import re
import subprocess
import sys
import time
from typing import Any

import httpx

ROUTES = {
    "GET /v1/route (native, by dp_rank)": "/v1/route?engine_id=p&dp_rank=0&tp_rank=3&tp_size=8",
    "GET /route (SGLang, one rank)": "/route?prefill_dp_rank=0&prefill_cp_rank=0"
                                     "&target_tp_rank=3&target_pp_rank=0",
    "GET /health": "/health",
}


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
    return asyncio.run(_load(*args))


def _seed(url: str) -> None:
    from kvhandoff.bootstrap_server import BootstrapClient
    from kvhandoff.kv_layout import preset

    c = BootstrapClient(url)
    for tp in range(8):
        c.register_rank(engine_id="p", role="prefill", agent_address=f"127.0.0.1:{9000 + tp}",
                        generation="bench", layout=preset("glm-5.3"), tp_rank=tp, tp_size=8)
        httpx.put(url + "/route", json={
            "attn_tp_size": 8, "attn_tp_rank": tp, "attn_dp_size": 1, "attn_dp_rank": 0,
            "pp_size": 1, "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 9100 + tp,
            "page_size": 64, "kv_cache_dtype": "auto"}).raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--clients", type=int, default=1, help="load-generating processes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "kvhandoff.cli", "serve", "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    results: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        m = re.search(r"(http://\S+)", proc.stdout.readline())
        if not m:
            raise SystemExit("kvhandoff serve printed no URL")
        url = m.group(1)
        _seed(url)
        for name, path in ROUTES.items():
            with mp.get_context("spawn").Pool(a.clients) as pool:
                parts = pool.map(_client, [(url, path, a.seconds, a.concurrency)] * a.clients)
            lat = sorted(x for p in parts for x in p)
            n = len(lat)
            results[name] = {
                "requests": n, "requests_per_s": round(n / a.seconds),
                "p50_ms": round(lat[n // 2] * 1e3, 2), "p99_ms": round(lat[int(n * 0.99)] * 1e3, 2),
            }
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    if a.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{a.clients} client process(es) x {a.concurrency} in flight, {a.seconds:g} s each")
    for name, r in results.items():
        print(f"{name:40s} {r['requests_per_s']:>7,} req/s  p50 {r['p50_ms']:.2f} ms  "
              f"p99 {r['p99_ms']:.2f} ms  ({r['requests']:,} requests)")


if __name__ == "__main__":
    main()
