"""Runs the bench: baselines and handoffs alternating in one run, then medians and ratios.

Cases (each repetition runs all of them, in an order rotated per repetition so that no case
always follows another):
- memcpy: this process copies the page set's spans (the agents' own plans) between two
  preallocated buffer sets, one numpy slice copy per span: the machine's limit for this
  gather/scatter.
- raw: this process sends the same total bytes as one contiguous buffer over the bare transport
  to a receiver process (the same transport class, settings and UCX tuning the agents use).
- handoff_full / handoff_off: a prefill process hands the page set to a decode process through
  `TransferAgent`s (checksums on / off), every layer ready at once: end to end from the first
  `layer_ready` to decode Success.
- paced: the same with one layer ready every `layer_ms` (checksums on), for the tail: last
  `layer_ready` -> decode Success, compared with the time one layer takes on the raw transport.
Timed cases never include process start, buffer allocation or the handshake.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvhandoff.bench.pageset import PageSet, digest

CASES = ("memcpy", "raw", "handoff_full", "handoff_off", "paced")


@dataclass
class BenchConfig:
    model: str = "glm-5.3"
    context: int = 16_384
    prefix: int = 4_096
    page_size: int | None = None
    transport: str = "ucx"
    reps: int = 5
    warmup: int = 1
    layer_ms: float = 5.0
    chunk_bytes: int = 4 << 20
    slack: float = 1.25
    seed: int = 0
    timeout_s: float = 120.0
    cases: tuple[str, ...] = CASES


class _Child:
    """A bench worker process and its JSON-line replies."""

    def __init__(self, role: str, procs: list[subprocess.Popen[str]]) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvhandoff.bench.worker", role], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
        procs.append(self.proc)
        self.q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.q.put(json.loads(line))
        self.q.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            del self.err[:-50]

    def tell(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def get(self, timeout: float) -> dict[str, Any]:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"bench {self.role}: no answer within {timeout}s; stderr: "
                               + "".join(self.err[-10:])) from None
        if msg is None:
            raise RuntimeError(f"bench {self.role} exited (rc={self.proc.poll()}); stderr: "
                               + "".join(self.err[-20:]))
        if "error" in msg and "t_done" not in msg:
            raise RuntimeError(f"bench {self.role}: {msg['error']}")
        return msg

    def ask(self, timeout: float, **msg: Any) -> dict[str, Any]:
        self.tell(**msg)
        return self.get(timeout)

    def close(self) -> None:
        try:
            self.tell(cmd="exit")
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def summarise(values: list[float]) -> dict[str, Any]:
    """Median and spread of repeated timings (seconds)."""
    if not values:
        return {"n": 0}
    med = statistics.median(values)
    return {"n": len(values), "median_s": med, "min_s": min(values), "max_s": max(values),
            "stdev_s": statistics.stdev(values) if len(values) > 1 else 0.0,
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0,
            "all_s": values}


class Bench:
    """One bench run (see the module comment). `run()` returns the result object."""

    def __init__(self, cfg: BenchConfig, *, progress: Callable[[str], None] | None = None
                 ) -> None:
        from kvhandoff.kv_layout import preset

        self.cfg = cfg
        kw = {"page_size_tokens": cfg.page_size} if cfg.page_size else {}
        self.spec = preset(cfg.model, **kw)
        self.pageset = PageSet.random(self.spec, seq_len=cfg.context, prefix=cfg.prefix,
                                      slack=cfg.slack, seed=cfg.seed)
        self.plans = self.pageset.plans()
        self.total_bytes = self.pageset.total_bytes()
        self.progress = progress or (lambda s: None)
        self.procs: list[subprocess.Popen[str]] = []  # every child, for cleanup by the caller
        self.times: dict[str, list[float]] = {c: [] for c in cfg.cases}
        self.tails: list[float] = []
        self.verified: dict[str, bool] = {}
        self._room = int.from_bytes(os.urandom(4), "little") << 16

    # ---------------------------------------------------------------- memcpy

    def _setup_memcpy(self) -> None:
        n = self.pageset.num_pages
        ps = self.spec.page_size_tokens
        rng = np.random.default_rng(self.cfg.seed)
        self.mc_src: dict[tuple[str, int], np.ndarray] = {}
        self.mc_dst: dict[tuple[str, int], np.ndarray] = {}
        for reg in self.spec.regions:
            size = reg.page_nbytes(ps) * n
            for lid in reg.layer_ids:
                self.mc_src[(reg.name, lid)] = rng.integers(0, 256, size, dtype=np.uint8)
                self.mc_dst[(reg.name, lid)] = np.zeros(size, np.uint8)
        self.mc_spans = [
            (self.mc_src[(name, lid)], self.mc_dst[(name, lid)],
             list(zip(p.src_offsets.tolist(), p.dst_offsets.tolist(), p.nbytes.tolist(),
                      strict=True)))
            for lid in self.pageset.layers()
            for name, p in ((r.name, self.plans[r.name]) for r in self.spec.regions_of_layer(lid))
        ]

    def _memcpy(self, verify: bool) -> float:
        t0 = time.perf_counter()
        for src, dst, spans in self.mc_spans:
            for so, do, nb in spans:
                dst[do:do + nb] = src[so:so + nb]
        dt = time.perf_counter() - t0
        if verify:
            self.verified["memcpy"] = (
                digest(lambda r, lid: self.mc_src[(r, lid)], self.spec, self.plans, side="src")
                == digest(lambda r, lid: self.mc_dst[(r, lid)], self.spec, self.plans,
                          side="dst"))
        return dt

    # ---------------------------------------------------------------- raw transport

    def _setup_raw(self) -> None:
        from kvhandoff.settings import Settings
        from kvhandoff.transfer.transports.base import load_transport

        n = self.total_bytes
        self.raw_src = np.random.default_rng(self.cfg.seed + 1).integers(0, 256, n,
                                                                         dtype=np.uint8)
        self.raw_tr = load_transport(self.cfg.transport, Settings(
            transport=self.cfg.transport, chunk_bytes=self.cfg.chunk_bytes))
        self.raw_tr.register("raw", self.raw_src)
        self.raw_child = _Child("raw", self.procs)
        to = self.cfg.timeout_s
        addr = self.raw_child.ask(to, cmd="setup", kind=self.cfg.transport, nbytes=n,
                                  chunk_bytes=self.cfg.chunk_bytes)["address"]
        self.raw_tr.connect("child", bytes.fromhex(addr))
        self.raw_child.ask(to, cmd="connect", address=self.raw_tr.address.hex())
        self._raw_tag = 0

    def _raw(self, verify: bool) -> float:
        n = self.total_bytes
        to = self.cfg.timeout_s
        self._raw_tag += 1
        self.raw_child.ask(to, cmd="recv", tag=self._raw_tag, nbytes=n, verify=verify,
                           timeout_s=to)
        done = threading.Event()
        errors: list[BaseException | None] = []

        def on_done(exc: BaseException | None) -> None:
            errors.append(exc)
            done.set()

        t0 = time.monotonic()
        self.raw_tr.post_send("child", self._raw_tag, "raw", np.array([0], np.int64),
                              np.array([n], np.int64), on_done)
        res = self.raw_child.get(to)
        if not done.wait(to) or errors[0] is not None or res["error"] is not None:
            raise RuntimeError(f"raw transport: send {errors[:1]} / receive {res['error']}")
        if verify:
            self.verified["raw"] = res["digest"] == xxhash.xxh3_64_hexdigest(
                self.raw_src.data)
        return float(res["t_done"]) - t0

    # ---------------------------------------------------------------- handoffs

    def _setup_handoff(self) -> None:
        modes = sorted({"off" if c == "handoff_off" else "full" for c in self.cfg.cases
                        if c.startswith("handoff") or c == "paced"})
        msg = {"cmd": "setup", "model": self.cfg.model, "page_size": self.spec.page_size_tokens,
               "pageset": self.pageset.to_msg(), "modes": modes, "transport": self.cfg.transport,
               "chunk_bytes": self.cfg.chunk_bytes, "seed": self.cfg.seed + 2,
               "timeout_s": self.cfg.timeout_s}
        self.prefill = _Child("prefill", self.procs)
        self.decode = _Child("decode", self.procs)
        self.prefill.tell(**msg)
        self.decode.tell(**msg)
        self.prefill_addr = self.prefill.get(self.cfg.timeout_s)["addresses"]
        self.decode.get(self.cfg.timeout_s)

    def _handoff(self, mode: str, layer_ms: float, verify: bool, key: str) -> tuple[float, float]:
        to = self.cfg.timeout_s
        self._room += 1
        room = self._room
        self.prefill.ask(to, cmd="open", room=room, mode=mode)
        acc = self.decode.ask(to, cmd="open", room=room, mode=mode,
                              peer=self.prefill_addr[mode], verify=verify)
        if acc["state"] != "WaitingForInput":
            raise RuntimeError(f"handoff {key}: decode room is {acc['state']} before the start")
        p = self.prefill.ask(to, cmd="go", room=room, layer_ms=layer_ms, verify=verify)
        d = self.decode.get(to)
        if p["state"] != "Success" or d["state"] != "Success":
            raise RuntimeError(f"handoff {key}: prefill {p['state']} ({p['failure']}), "
                               f"decode {d['state']} ({d['failure']})")
        if d["stats"]["bytes"] != self.total_bytes:
            raise RuntimeError(f"handoff {key}: decode got {d['stats']['bytes']} bytes, "
                               f"expected {self.total_bytes}")
        if verify:
            self.verified[key] = p["digest"] is not None and p["digest"] == d["digest"]
            self.descriptors = {"before": d["stats"]["descriptors_before"],
                                "after": d["stats"]["descriptors"]}
            self.checksums_verified = d["stats"]["checksums_verified"]
        t_done = float(d["stats"]["t_done"])
        return t_done - float(p["t0"]), t_done - float(p["stats"]["t_last_ready"])

    # ---------------------------------------------------------------- run

    def _one(self, case: str, verify: bool) -> float:
        if case == "memcpy":
            return self._memcpy(verify)
        if case == "raw":
            return self._raw(verify)
        if case == "paced":
            _, tail = self._handoff("full", self.cfg.layer_ms, verify, case)
            self._last_tail = tail
            return tail
        mode = "off" if case == "handoff_off" else "full"
        return self._handoff(mode, 0.0, verify, case)[0]

    def run(self) -> dict[str, Any]:
        cases = self.cfg.cases
        self.progress("setting up (buffers, processes)")
        if "memcpy" in cases:
            self._setup_memcpy()
        if "raw" in cases:
            self._setup_raw()
        if any(c.startswith("handoff") or c == "paced" for c in cases):
            self._setup_handoff()
        total = self.cfg.warmup + self.cfg.reps
        for rep in range(total):
            k = rep % len(cases)
            order = cases[k:] + cases[:k]
            timed = rep >= self.cfg.warmup
            for case in order:
                self.progress(f"rep {rep + 1}/{total}{'' if timed else ' (warm-up)'}: {case}")
                dt = self._one(case, verify=rep == total - 1)
                if timed:
                    self.times[case].append(dt)
        return self.result()

    def lanes(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if hasattr(self, "raw_tr"):
            st = self.raw_tr.status()
            out["raw"] = {"kind": st.kind, "lanes": list(st.lanes), "degraded": st.degraded}
        if hasattr(self, "prefill"):
            out["handoff"] = self.prefill.ask(self.cfg.timeout_s, cmd="status")["status"]
        return out

    def result(self) -> dict[str, Any]:
        n = self.total_bytes
        cases: dict[str, Any] = {}
        for case, ts in self.times.items():
            s = summarise(ts)
            if ts:
                s["bytes"] = n
                s["GBps_median"] = n / s["median_s"] / 1e9
                s["GBps_best"] = n / s["min_s"] / 1e9
            cases[case] = s
        if "paced" in cases and self.times.get("paced"):
            cases["paced"]["layer_ms"] = self.cfg.layer_ms
            cases["paced"].pop("GBps_median", None)
            cases["paced"].pop("GBps_best", None)

        def med(c: str) -> float | None:
            ts = self.times.get(c)
            return statistics.median(ts) if ts else None

        ratios: dict[str, float | None] = {}
        h, r, m, off = med("handoff_full"), med("raw"), med("memcpy"), med("handoff_off")
        ratios["handoff_full_over_raw"] = r / h if h and r else None
        ratios["handoff_off_over_raw"] = r / off if off and r else None
        ratios["handoff_full_over_memcpy"] = m / h if h and m else None
        ratios["handoff_off_over_memcpy"] = m / off if off and m else None
        ratios["checksum_overhead"] = h / off - 1.0 if h and off else None
        layer_bytes = max(
            sum(self.plans[reg.name].total_bytes for reg in self.spec.regions_of_layer(lid))
            for lid in self.pageset.layers())
        one_layer_s = layer_bytes / n * r if r else None
        tail = med("paced")
        ratios["tail_over_one_layer"] = tail / one_layer_s if tail and one_layer_s else None
        targets = {
            "handoff_over_raw>=0.9": _ok(ratios["handoff_full_over_raw"], 0.9),
            "handoff_over_memcpy>=0.75": _ok(ratios["handoff_full_over_memcpy"], 0.75),
            "checksum_overhead<=0.10": (None if ratios["checksum_overhead"] is None
                                        else ratios["checksum_overhead"] <= 0.10),
            "tail<=2x_one_layer": (None if ratios["tail_over_one_layer"] is None
                                   else ratios["tail_over_one_layer"] <= 2.0),
        }
        ps = self.pageset
        return {
            "config": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in self.cfg.__dict__.items()},
            "workload": {
                "model": self.cfg.model, "context_tokens": ps.seq_len, "prefix_tokens": ps.prefix,
                "page_size_tokens": self.spec.page_size_tokens, "pool_pages": ps.num_pages,
                "bytes": n, "bytes_per_region": {
                    reg.name: self.plans[reg.name].total_bytes * reg.num_layers
                    for reg in self.spec.regions},
                "pieces": sum(self.plans[reg.name].count * reg.num_layers
                              for reg in self.spec.regions),
                "pieces_before_coalescing": sum(
                    self.plans[reg.name].descriptors_before * reg.num_layers
                    for reg in self.spec.regions),
                "largest_layer_bytes": layer_bytes,
                "one_layer_on_raw_s": one_layer_s,
            },
            "cases": cases, "ratios": ratios, "targets": targets,
            "verified": self.verified,
            "checksums_verified": getattr(self, "checksums_verified", None),
            "lanes": self.lanes(),
            "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        }

    def close(self) -> None:
        for name in ("raw_child", "prefill", "decode"):
            c = getattr(self, name, None)
            if c is not None:
                c.close()
        tr = getattr(self, "raw_tr", None)
        if tr is not None:
            tr.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def _ok(v: float | None, at_least: float) -> bool | None:
    return None if v is None else v >= at_least
