#!/usr/bin/env python
"""GB/s of the two-process loopback handoff per transport (a measurement, not a test).

    .venv/bin/python scripts/measure_handoff.py                      # ucx and tcp, GLM-5.3
    .venv/bin/python scripts/measure_handoff.py --transport ucx --checksum off --repeat 9

A prefill process and a decode process (this script, `--worker`) each own a TransferAgent with
GLM-5.3 buffers; pages come from a shuffled PagePool on each side (random order, as a
fragmented pool hands them out). The decode reaches the prefill directly by its agent address
(the bootstrap lookup is not what is measured). Per run:

- prefill opens the room; decode opens its receiver and sends its request; once prefill has
  accepted it (WaitingForInput), prefill marks every layer ready at once (t0) and waits for
  Success (RoomAck from decode: every layer landed and verified);
- GB/s = bytes of the handoff (main KV of every token + indexer K of the suffix) / (t_done -
  t0), both read on the prefill's monotonic clock. That includes the source checksums, the
  transport, the decode checksums and the final RoomAck: the handoff as an engine sees it.
- decode checks every landed byte of the first run against the deterministic pattern, and that
  its cached-prefix indexer pages were left alone.

It also prints a memcpy baseline of the same bytes in one process (the machine's limit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvhandoff.engine_sim.pattern import PREFIX_MARKER, check_tokens, write_tokens
from kvhandoff.kv_layout import SendFrom, page_aligned, preset
from kvhandoff.settings import Settings

SEED = 5


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _layers(spec: Any) -> list[int]:
    return sorted({lid for reg in spec.regions for lid in reg.layer_ids})


def worker_prefill(cfg: dict[str, Any]) -> None:
    from kvhandoff.buffers.bufferset import allocate
    from kvhandoff.buffers.pool import PagePool
    from kvhandoff.state_machine import KVPoll
    from kvhandoff.transfer import TransferAgent

    spec = preset("glm-5.3")
    ps = spec.page_size_tokens
    n_pages = -(-cfg["tokens"] // ps)
    pool = PagePool(n_pages + 8, seed=1)
    settings = Settings(transport=cfg["transport"], checksum=cfg["checksum"])
    with TransferAgent("prefill", spec, allocate(spec, pool.num_pages), settings,
                       engine_id="measure") as agent:
        _emit(event="ready", address=agent.address)
        layers = _layers(spec)
        for run in range(cfg["repeat"]):
            pages = pool.alloc(n_pages)
            for ri, reg in enumerate(spec.regions):
                for lid in reg.layer_ids:
                    write_tokens(agent.buffers.array(reg.name, lid), spec, ri, lid, pages, 0,
                                 cfg["tokens"], SEED)
            sender = agent.sender(run + 1, pages=pages, seq_len=cfg["tokens"])
            _emit(event="opened", run=run)
            deadline = time.monotonic() + 60
            while sender.poll() is KVPoll.Bootstrapping:  # a script may poll; tests may not
                if time.monotonic() > deadline:
                    raise TimeoutError("decode did not send its request within 60 s")
                time.sleep(0.001)
            t0 = time.monotonic()
            for lid in layers:
                sender.layer_ready(lid)
            t_ready = time.monotonic()
            state = sender.wait(120)
            stats = sender.stats()
            sender.wait_released(10)
            pool.free(pages)
            _emit(event="run", run=run, state=state.name, failure=sender.failure,
                  bytes=stats["bytes"], t0=t0, t_ready=t_ready, t_done=stats["t_done"],
                  descriptors=stats.get("descriptors"))
        _emit(event="status", status=agent.status())


def worker_decode(cfg: dict[str, Any]) -> None:
    from kvhandoff.buffers.bufferset import allocate
    from kvhandoff.buffers.pool import PagePool
    from kvhandoff.transfer import TransferAgent

    spec = preset("glm-5.3")
    ps = spec.page_size_tokens
    tokens, prefix = cfg["tokens"], page_aligned(cfg["prefix"], ps)
    n_pages = -(-tokens // ps)
    pool = PagePool(n_pages + 8, seed=2)
    settings = Settings(transport=cfg["transport"], checksum=cfg["checksum"])
    with TransferAgent("decode", spec, allocate(spec, pool.num_pages), settings) as agent:
        for line in sys.stdin:
            run = int(line)
            pages = pool.alloc(n_pages)
            for reg in spec.regions:  # the cached prefix decode already holds
                if reg.send_from is SendFrom.DECODE_PREFIX:
                    for lid in reg.layer_ids:
                        view = agent.buffers.array(reg.name, lid).reshape(
                            -1, reg.page_nbytes(ps))
                        view[pages[:prefix // ps]] = PREFIX_MARKER
            rv = agent.receiver(run + 1, peer=cfg["peer"])
            rv.init(pages, tokens, prefix)
            state = rv.wait(120)
            verify: dict[str, int] = {}
            if run == 0 and state.name == "Success":
                bad = touched = 0
                for ri, reg in enumerate(spec.regions):
                    first = prefix if reg.send_from is SendFrom.DECODE_PREFIX else 0
                    for lid in reg.layer_ids:
                        buf = agent.buffers.array(reg.name, lid)
                        bad += check_tokens(buf, spec, ri, lid, pages[first // ps:], first,
                                            tokens, SEED)
                        if first:
                            view = buf.reshape(-1, reg.page_nbytes(ps))
                            touched += int(np.count_nonzero(
                                view[pages[:first // ps]] != PREFIX_MARKER))
                verify = {"bad_bytes": bad, "prefix_touched_bytes": touched}
            rv.wait_released(10)
            pool.free(pages)
            _emit(event="run", run=run, state=state.name, failure=rv.failure, verify=verify,
                  stats={k: v for k, v in rv.stats().items() if k in ("bytes", "retransmits")})
        _emit(event="status", status=agent.status())


class Proc:
    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--worker", role, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, event: str) -> dict[str, Any]:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            msg: dict[str, Any] = json.loads(line)
            if msg.get("event") == event:
                return msg
        raise RuntimeError(f"worker exited (rc={self.p.wait()}) before {event!r}")

    def write(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        if self.p.stdin and not self.p.stdin.closed:
            self.p.stdin.close()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def measure(transport: str, checksum: str, tokens: int, prefix: int, repeat: int, warmup: int
            ) -> dict[str, Any]:
    """`warmup` + `repeat` handoffs between one pair of processes; the first `warmup` (which
    also fault in the freshly allocated buffers) are verified but not counted."""
    cfg = {"transport": transport, "checksum": checksum, "tokens": tokens, "prefix": prefix,
           "repeat": warmup + repeat}
    pre = Proc("prefill", cfg)
    dec = None
    try:
        addr = pre.read("ready")["address"]
        dec = Proc("decode", {**cfg, "peer": addr})
        runs = []
        for run in range(warmup + repeat):
            pre.read("opened")
            dec.write(str(run))
            pr = pre.read("run")
            dr = dec.read("run")
            if pr["state"] != "Success" or dr["state"] != "Success":
                raise RuntimeError(f"run {run}: prefill {pr['state']} ({pr['failure']}), "
                                   f"decode {dr['state']} ({dr['failure']})")
            if run == 0 and (dr["verify"]["bad_bytes"] or dr["verify"]["prefix_touched_bytes"]):
                raise RuntimeError(f"not byte-exact: {dr['verify']}")
            if run < warmup:
                continue
            secs = pr["t_done"] - pr["t0"]
            runs.append({"bytes": pr["bytes"], "s": secs, "gb_s": pr["bytes"] / secs / 1e9,
                         "tail_after_last_ready_s": pr["t_done"] - pr["t_ready"]})
    finally:
        if dec is not None:
            dec.close()
        pre.close()
    gbs = [r["gb_s"] for r in runs]
    return {"transport": transport, "checksum": checksum, "tokens": tokens, "prefix": prefix,
            "bytes": runs[0]["bytes"], "median_gb_s": statistics.median(gbs),
            "best_gb_s": max(gbs), "runs": runs}


def memcpy_baseline(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        cfg = json.loads(sys.argv[3])
        (worker_prefill if sys.argv[2] == "prefill" else worker_decode)(cfg)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", nargs="+", default=["ucx", "tcp"])
    ap.add_argument("--checksum", nargs="+", default=["full", "off"])
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--prefix", type=int, default=4_096)
    ap.add_argument("--repeat", type=int, default=5, help="measured runs per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs first")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = []
    for kind in args.transport:
        for mode in args.checksum:
            res = measure(kind, mode, args.tokens, args.prefix, args.repeat, args.warmup)
            results.append(res)
            print(f"{kind:4s} checksum={mode:5s} {res['bytes'] / 1e6:8.1f} MB  "
                  f"median {res['median_gb_s']:.2f} GB/s  best {res['best_gb_s']:.2f} GB/s  "
                  f"runs {[round(r['s'], 3) for r in res['runs']]} s", flush=True)
    base = memcpy_baseline(results[0]["bytes"]) if results else 0.0
    print(f"memcpy of the same bytes (one contiguous buffer, one process): {base:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "memcpy_gb_s": base}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
