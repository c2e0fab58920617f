"""Rooms mode of `kvhandoff bench` (`--rooms N`): many short handoffs, the cost a fleet pays
per request, beside NIXL moving the same pieces in the same run.

For each model and context size (prefix 0: the decode holds no cached tokens, every token
moves), one pair of bench workers (`bench.worker prefill|decode`, one `TransferAgent` per
checksum mode, pools of `inflight` page slots) runs N rooms with C of them in flight: C engine
threads per side, thread k serving rooms k, k + C, ... on its own page slot. A prefill thread
opens its sender, waits until the decode's pages are known (as an engine's bootstrap queue
does), then marks every layer ready at once (`Sender.layers_ready`); a decode thread opens its
receiver, offers its pages and waits for Success. Each room's latency runs from that mark
(prefill's `time.monotonic()`) to when the decode engine could see Success (`t_seen` of its
room's stats; the same host: one clock).

Baselines from the same run and the same page set (the `Bench` of that context): memcpy of
the room's spans in one process, one `post_writes` job of the room's bytes on the raw transport,
one NIXL WRITE of every piece (when NIXL is installed), each `baseline_reps` times; and NIXL
in rooms mode: N WRITE requests of the room's pieces with C in flight, polled as NIXL's users
poll. The rooms run in `rounds` rounds, the order of the cases (handoff per checksum mode,
NIXL) rotated per round, so that a change of the machine's load hits every case alike; the
latencies of all rounds are pooled. Rooms per second = rooms / the summed wall time (first
mark to last Success of each round); CPU seconds per room of each side = that
process's CPU time (every thread) over its rooms / the rooms.

The fixed cost per handoff is the intercept of a least-squares line through the p50 latencies
of one model's context sizes against their bytes (at the lowest concurrency measured), the
same for NIXL.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvhandoff.bench.runner import Bench, _Child

ROOMS_MODELS = ("llama-3.1-8b", "glm-5.3")
ROOMS_CONTEXTS = (256, 512, 1024, 2048, 4096)
SETUP_S = 300.0  # added to --timeout for a worker's start
DESC_MIN_TOKENS = 512  # Llama-8B: a layer of 2 MiB and more leaves as a job of its own


@dataclass
class RoomsConfig:
    rooms: int = 100
    models: tuple[str, ...] = ROOMS_MODELS
    contexts: tuple[int, ...] = ROOMS_CONTEXTS
    inflight: tuple[int, ...] = (1, 4)
    modes: tuple[str, ...] = ("full", "off")
    transport: str = "auto"
    rounds: int = 3
    baseline_reps: int = 5
    nixl: bool = True  # NIXL baselines where NIXL is installed (else noted, not run)
    chunk_bytes: int = 4 << 20
    slack: float = 1.25
    seed: int = 0
    timeout_s: float = 120.0
    shared_pool: bool = True
    # the agents' heartbeat: longer than the product's 0.5 s, so that a loaded machine's
    # scheduling stalls (seconds, with other work on 2 cores) do not fail rooms as a lost
    # peer; heartbeats are not on the data path
    heartbeat_s: float = 2.0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _lat_summary(lat: list[float], wall_s: float, n: int) -> dict[str, Any]:
    return {"rooms": n, "p50_s": _pct(lat, 50), "p99_s": _pct(lat, 99), "min_s": min(lat),
            "max_s": max(lat), "mean_s": statistics.fmean(lat), "wall_s": wall_s,
            "rooms_per_s": n / wall_s if wall_s > 0 else None}


TIMING_KEYS = ("total_ms", "bootstrap_lookup_ms", "handshake_ms", "layers_ms", "tail_ms")


def timing_medians(timings: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each of `TIMING_KEYS` over rooms' `room_timings` (None where no room had
    that step: a prefill does no bootstrap lookup)."""
    out: dict[str, float | None] = {}
    for k in TIMING_KEYS:
        vals = [float(t[k]) for t in timings if t.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def fixed_cost(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least-squares line t = a + b * bytes through (bytes, seconds): the fixed cost `a`
    (seconds per handoff) and the cost per MB (seconds); None with fewer than 2 sizes."""
    if len({b for b, _ in points}) < 2:
        return None
    x = np.asarray([b for b, _ in points], np.float64) / 1e6
    y = np.asarray([t for _, t in points], np.float64)
    slope, icept = np.polyfit(x, y, 1)
    return {"fixed_s": float(icept), "per_MB_s": float(slope)}


class RoomsBench:
    """One rooms-mode run (see the module comment). `run()` returns the result object."""

    def __init__(self, cfg: RoomsConfig, *,
                 progress: Callable[[str], None] | None = None) -> None:
        from kvhandoff.errors import ConfigError

        if cfg.rooms < 1 or cfg.rounds < 1 or not cfg.inflight or min(cfg.inflight) < 1:
            raise ConfigError(f"rooms mode: expected rooms >= 1, rounds >= 1 and inflight >= 1, "
                              f"got rooms={cfg.rooms} rounds={cfg.rounds} "
                              f"inflight={list(cfg.inflight)}")
        if not cfg.contexts or min(cfg.contexts) < 1:
            raise ConfigError(f"contexts: expected token counts >= 1, got {list(cfg.contexts)}")
        self.cfg = cfg
        self.progress = progress or (lambda s: None)
        self.nixl_missing: str | None = None
        if cfg.nixl:
            from kvhandoff.bench.nixl_baseline import check_installed

            try:
                check_installed()
            except ConfigError as e:
                self.nixl_missing = str(e)
        else:
            self.nixl_missing = "not asked for (--no-nixl)"
        self._room = int.from_bytes(os.urandom(4), "little") << 20
        self._bench: Bench | None = None
        self._children: list[_Child] = []
        self._timings: dict[str, dict[str, list[dict[str, Any]]]] = {}

    # ---------------------------------------------------------------- one page set

    def _one(self, model: str, context: int) -> list[dict[str, Any]]:
        from kvhandoff.bench.runner import Bench, BenchConfig, _Child

        cfg = self.cfg
        base_cases: tuple[str, ...] = ("memcpy", "raw")
        if self.nixl_missing is None:
            base_cases += ("nixl",)
        bench = self._bench = Bench(BenchConfig(
            model=model, context=context, prefix=0, transport=cfg.transport,
            reps=cfg.baseline_reps, warmup=1, chunk_bytes=cfg.chunk_bytes, slack=cfg.slack,
            seed=cfg.seed, timeout_s=cfg.timeout_s, cases=base_cases,
            shared_pool=cfg.shared_pool), progress=lambda s: self.progress(
                f"{model} {context} tokens: baselines: {s}"))
        try:
            base = bench.run()
            slots = max(cfg.inflight)
            prefill = _Child("prefill", bench.procs)
            decode = _Child("decode", bench.procs)
            self._children = [prefill, decode]
            msg = {"cmd": "setup", "model": model, "pageset": bench.pageset.to_msg(),
                   "modes": list(cfg.modes), "transport": cfg.transport,
                   "chunk_bytes": cfg.chunk_bytes, "shared_pool": bench._shared(),
                   "timeout_s": cfg.timeout_s, "slots": slots, "tp_size": 1, "tp_rank": 0,
                   "heartbeat_s": cfg.heartbeat_s}
            prefill.tell(**msg, page_size=bench.src_spec.page_size_tokens, seed=cfg.seed + 2)
            decode.tell(**msg, page_size=bench.spec.page_size_tokens, seed=cfg.seed + 2)
            # a worker's start (imports, pools filled) is not timed; on a loaded machine it
            # took more than two minutes, so it gets a bound of its own
            addr = prefill.get(cfg.timeout_s + SETUP_S)["addresses"]
            decode.get(cfg.timeout_s + SETUP_S)
            rows = [self._rooms_at(bench, base, prefill, decode, addr, c)
                    for c in cfg.inflight]
            # the handoff agents' lanes (every room one-sided or not) and the control
            # messages each side sent per room (warm-up rooms and heartbeats included)
            status = self._status(prefill)
            d_status = self._status(decode)
            sent = {mode: {"prefill": status[mode]["messages_out"] / max(status[mode]["rooms"], 1),
                           "decode": d_status[mode]["messages_out"]
                           / max(d_status[mode]["rooms"], 1)} for mode in status}
            for r in rows:
                r["lanes"] = status
                r["messages_per_room"] = sent
            return rows
        finally:
            for c in self._children:
                c.close()
            self._children = []
            bench.close()
            self._bench = None

    def _status(self, child: _Child) -> dict[str, Any]:
        st: dict[str, Any] = child.ask(self.cfg.timeout_s, cmd="status")["status"]
        return st

    def _rooms_at(self, bench: Bench, base: dict[str, Any], prefill: _Child, decode: _Child,
                  addr: dict[str, str], inflight: int) -> dict[str, Any]:
        cfg = self.cfg
        ps_msg = bench.pageset.to_msg()
        cases = [f"handoff_{m}" for m in cfg.modes]
        if self.nixl_missing is None:
            cases.append("nixl")
        lat: dict[str, list[float]] = {c: [] for c in cases}
        # each side's per-room timings (the agents' room_timings: what their spans carry)
        self._timings = {c: {"prefill": [], "decode": []} for c in cases if c != "nixl"}
        wall: dict[str, float] = dict.fromkeys(cases, 0.0)
        cpu: dict[str, dict[str, float]] = {c: {"prefill": 0.0, "decode": 0.0} for c in cases}
        # the agents' control threads alone (None once a side could not read its clock)
        ctl: dict[str, dict[str, float | None]] = {c: {"prefill": 0.0, "decode": 0.0}
                                                   for c in cases if c != "nixl"}
        per_round = [cfg.rooms // cfg.rounds + (i < cfg.rooms % cfg.rounds)
                     for i in range(cfg.rounds)]
        label = f"{bench.cfg.model} {bench.cfg.context} tokens, {inflight} in flight"
        for case in cases:  # warm-up: one room per engine thread, untimed
            self._case(case, min(inflight, cfg.rooms), inflight, prefill, decode, addr, ps_msg)
        for rnd, n in enumerate(per_round):
            if not n:
                continue
            k = rnd % len(cases)
            for case in cases[k:] + cases[:k]:
                self.progress(f"{label}: round {rnd + 1}/{cfg.rounds}: {case} ({n} rooms)")
                got_lat, got_wall, got_cpu, got_ctl = self._case(case, n, inflight, prefill,
                                                                 decode, addr, ps_msg)
                lat[case] += got_lat
                wall[case] += got_wall
                for side, v in got_cpu.items():
                    cpu[case][side] += v
                for side, c in got_ctl.items():
                    was = ctl[case][side]
                    ctl[case][side] = None if was is None or c is None else was + c
        out: dict[str, Any] = {
            "model": bench.cfg.model, "context_tokens": bench.cfg.context, "inflight": inflight,
            "bytes": bench.total_bytes,
            "pieces": base["workload"]["pieces"],
            "baselines": {c: base["cases"][c]["median_s"] for c in base["cases"]
                          if base["cases"][c].get("n")},
            "verified": base["verified"], "cases": {},
        }
        for case in cases:
            s = _lat_summary(lat[case], wall[case], len(lat[case]))
            s["cpu_s_per_room"] = {side: v / len(lat[case]) for side, v in cpu[case].items()}
            if case in ctl:
                s["control_cpu_s_per_room"] = {
                    side: None if v is None else v / len(lat[case])
                    for side, v in ctl[case].items()}
            if case in self._timings:
                s["timings_ms_p50"] = {side: timing_medians(t)
                                       for side, t in self._timings.pop(case).items()}
            out["cases"][case] = s
        out["ratios"] = self._ratios(out)
        return out

    def _ratios(self, row: dict[str, Any]) -> dict[str, float | None]:
        """Time ratios of p50 latencies (> 1: the handoff takes longer) and throughput ratios
        of rooms per second (> 1: the handoff serves more)."""
        cs, bl = row["cases"], row["baselines"]
        out: dict[str, float | None] = {}
        for mode in self.cfg.modes:
            h = cs.get(f"handoff_{mode}")
            if h is None:
                continue
            p50 = h["p50_s"]
            out[f"{mode}_p50_over_memcpy"] = p50 / bl["memcpy"] if bl.get("memcpy") else None
            out[f"{mode}_p50_over_raw"] = p50 / bl["raw"] if bl.get("raw") else None
            out[f"{mode}_p50_over_nixl_write"] = p50 / bl["nixl"] if bl.get("nixl") else None
            nx = cs.get("nixl")
            out[f"{mode}_p50_over_nixl_rooms_p50"] = p50 / nx["p50_s"] if nx else None
            out[f"{mode}_rooms_per_s_over_nixl"] = (
                h["rooms_per_s"] / nx["rooms_per_s"] if nx and nx["rooms_per_s"] else None)
        return out

    def _case(self, case: str, n: int, inflight: int, prefill: _Child, decode: _Child,
              addr: dict[str, str], ps_msg: dict[str, Any]
              ) -> tuple[list[float], float, dict[str, float], dict[str, float | None]]:
        """n rooms of one case: latencies, wall seconds, CPU seconds per side (the process,
        and its agent's control thread alone)."""
        to = self.cfg.timeout_s + n  # a bound on the whole batch, not a figure
        if case == "nixl":
            assert self._bench is not None
            r = self._bench.nixl.ask(to, cmd="rooms", n=n, inflight=inflight)
            if "error" in r:
                raise RuntimeError(f"rooms mode, nixl: {r['error']}")
            return list(r["lat"]), float(r["wall_s"]), {"prefill": float(r["cpu_s"]),
                                                         "decode": 0.0}, {}
        mode = case.removeprefix("handoff_")
        first = self._room
        self._room += n
        common = {"cmd": "rooms", "mode": mode, "n": n, "inflight": inflight, "first": first,
                  "pageset": ps_msg}
        prefill.tell(**common)
        decode.tell(**common, peer=addr[mode])
        p, d = prefill.get(to), decode.get(to)
        errors = [f"prefill: {e}" for e in p["errors"]] + [f"decode: {e}" for e in d["errors"]]
        for side, res in (("prefill", p), ("decode", d)):
            for rec in res["rooms"]:
                if rec is None:
                    errors.append(f"{side}: a room did not finish")
                elif rec[2] != "Success":
                    errors.append(f"{side}: room {rec[0]} {rec[2]} ({rec[3]})")
        if errors:
            raise RuntimeError(f"rooms mode, {case}: " + "; ".join(errors[:5]))
        t0 = [float(r[1]) for r in p["rooms"]]
        t1 = [float(r[1]) for r in d["rooms"]]
        lat = [b - a for a, b in zip(t0, t1, strict=True)]
        for side, res in (("prefill", p), ("decode", d)):
            self._timings[case][side] += [r[4] for r in res["rooms"] if r[4]]
        return lat, max(t1) - min(t0), {"prefill": float(p["cpu_s"]),
                                        "decode": float(d["cpu_s"])}, {
            "prefill": p.get("control_cpu_s"), "decode": d.get("control_cpu_s")}

    # ---------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        load_before = os.getloadavg()
        rows: list[dict[str, Any]] = []
        for model in cfg.models:
            for context in cfg.contexts:
                rows += self._one(model, context)
        fits: dict[str, Any] = {}
        low = min(cfg.inflight)
        for model in cfg.models:
            mine = [r for r in rows if r["model"] == model and r["inflight"] == low]
            cases = {c for r in mine for c in r["cases"]}
            fits[model] = {c: fixed_cost([(r["bytes"], r["cases"][c]["p50_s"]) for r in mine
                                          if c in r["cases"]]) for c in sorted(cases)}
            if any("nixl" in r["baselines"] for r in mine):
                fits[model]["nixl_write"] = fixed_cost([(r["bytes"], r["baselines"]["nixl"])
                                                        for r in mine])
        verified = {f"{r['model']}/{r['context_tokens']}/{case}": ok for r in rows
                    for case, ok in r["verified"].items()}
        return {"config": {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in cfg.__dict__.items()},
                "mode": "rooms", "rows": rows, "fixed_cost": fits,
                "targets": self._targets(rows, fits), "nixl_missing": self.nixl_missing,
                "verified": verified,
                "load": {"before": load_before, "after": os.getloadavg()},
                "host": {"cpus": os.cpu_count()}}

    def _targets(self, rows: list[dict[str, Any]], fits: dict[str, Any]
                 ) -> dict[str, dict[str, Any]]:
        """The issues' per-request targets, judged where this run measured them: each
        {value, met (None: not measured), bound, op ("<=" or ">="), ...}."""
        low = min(self.cfg.inflight)
        modes = self.cfg.modes
        first = "full" if "full" in modes else modes[0]
        out: dict[str, dict[str, Any]] = {}

        def row(model: str, ctx: int, inflight: int) -> dict[str, Any] | None:
            return next((r for r in rows if r["model"] == model and r["context_tokens"] == ctx
                         and r["inflight"] == inflight), None)

        def judged(v: float | None, op: str, bound: float, **more: Any) -> dict[str, Any]:
            met = None if v is None else (v <= bound if op == "<=" else v >= bound)
            return {"value": v, "met": met, "bound": bound, "op": op, **more}

        r = row("llama-3.1-8b", 512, low)
        out["llama512_full_over_nixl_write<=1.0"] = judged(
            r["ratios"].get("full_p50_over_nixl_write") if r else None, "<=", 1.0)
        fit = fits.get("llama-3.1-8b", {}).get("handoff_full")
        out["fixed_cost_ms<=5"] = judged(fit["fixed_s"] * 1e3 if fit else None, "<=", 5.0)
        best = max((r for r in rows if r["model"] == "llama-3.1-8b"
                    and r["context_tokens"] == 1024 and "handoff_full" in r["cases"]),
                   key=lambda r: r["cases"]["handoff_full"]["rooms_per_s"] or 0, default=None)
        full = best["cases"]["handoff_full"] if best else None
        out["llama1024_rooms_per_s>=1000"] = judged(
            full["rooms_per_s"] if full else None, ">=", 1000,
            inflight=best["inflight"] if best else None,
            cpu_s_per_room=full["cpu_s_per_room"] if full else None)
        # issue 46: a short room against NIXL WRITE's rooms of the same pieces
        r = row("llama-3.1-8b", 16, low)
        rt = r["ratios"] if r else {}
        out["room16_p50_over_nixl_rooms_p50<=2"] = judged(
            rt.get(f"{first}_p50_over_nixl_rooms_p50"), "<=", 2.0, mode=first)
        out["room16_rooms_per_s_over_nixl>=0.5"] = judged(
            rt.get(f"{first}_rooms_per_s_over_nixl"), ">=", 0.5, mode=first)
        out["tcp_secret_over_tcp<=1.10"] = self._secret_target(rows, low, judged)
        out["cpu_us_per_descriptor<=0.5"] = self._descriptor_target(rows, low, first, judged)
        return out

    def _secret_target(self, rows: list[dict[str, Any]], low: int,
                       judged: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """p50 with a secret over p50 without, on tcp (every chunk MAC'd): the largest context
        of the lowest concurrency that ran a mode both ways (the MAC's cost is per byte)."""
        pair = next((m for m in self.cfg.modes if f"{m}+hmac" in self.cfg.modes), None)
        if self.cfg.transport != "tcp" or pair is None:
            return judged(None, "<=", 1.10, why="needs --transport tcp and a mode with and "
                          "without +hmac")
        mine = [r for r in rows if r["inflight"] == low and f"handoff_{pair}" in r["cases"]]
        r = max(mine, key=lambda r: r["bytes"], default=None)
        if r is None:
            return judged(None, "<=", 1.10)
        a, b = r["cases"][f"handoff_{pair}"], r["cases"][f"handoff_{pair}+hmac"]
        cpu_a, cpu_b = (sum(x["cpu_s_per_room"].values()) for x in (a, b))
        return judged(b["p50_s"] / a["p50_s"], "<=", 1.10, mode=pair, model=r["model"],
                      context_tokens=r["context_tokens"],
                      cpu_ratio=cpu_b / cpu_a if cpu_a else None)

    def _descriptor_target(self, rows: list[dict[str, Any]], low: int, mode: str,
                           judged: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """CPU of the prefill's control thread (planning, posting, completions, LayerDone)
        per descriptor (piece) of a room: the slope of its CPU per room against the room's
        pieces over the contexts of one model, those of at least DESC_MIN_TOKENS tokens where
        two were measured (each of their layers leaves as a write job of its own, so the slope
        counts descriptors, not jobs: shorter rooms share jobs between layers,
        batching.WRITE_BATCH_BYTES); with one context, per room / pieces (an upper bound: the
        room's fixed cost included)."""
        case = f"handoff_{mode}"
        best: dict[str, Any] | None = None
        for model in dict.fromkeys(r["model"] for r in rows):
            pts = [(r["pieces"], r["cases"][case].get("control_cpu_s_per_room", {})
                    .get("prefill")) for r in rows
                   if r["model"] == model and r["inflight"] == low and case in r["cases"]]
            ctxs = [r["context_tokens"] for r in rows
                    if r["model"] == model and r["inflight"] == low and case in r["cases"]]
            pts = [(n, c) for n, c in pts if c is not None and n]
            if not pts:
                continue
            long = [(n, c) for (n, c), t in zip(pts, ctxs, strict=True)
                    if t >= DESC_MIN_TOKENS]
            if len({n for n, _ in long}) >= 2:
                pts, where = long, f" of >= {DESC_MIN_TOKENS} tokens (a job per layer)"
            else:
                where = ""
            if len({n for n, _ in pts}) >= 2:
                x = np.asarray([n for n, _ in pts], np.float64)
                y = np.asarray([c for _, c in pts], np.float64)
                slope = float(np.polyfit(x, y, 1)[0])
                got = {"value": slope * 1e6, "how": f"slope over {len(pts)} contexts{where}",
                       "model": model}
            else:
                n, c = pts[0]
                got = {"value": c / n * 1e6, "how": "one context: per room / pieces, an "
                       "upper bound", "model": model}
            if best is None or ("slope" in got["how"] and "slope" not in best["how"]):
                best = got
        if best is None:
            return judged(None, "<=", 0.5)
        return judged(best.pop("value"), "<=", 0.5, mode=mode, **best)

    def close(self) -> None:
        for c in self._children:
            c.close()
        if self._bench is not None:
            self._bench.close()
