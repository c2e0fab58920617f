"""`kvhandoff bench`: the handoff against memcpy and the raw transport, measured in one run.

See `kvhandoff.bench.runner` for what each case measures and docs/PERFORMANCE.md for figures.
Every child process is killed in a `finally` (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import typer

from kvhandoff.bench.rooms import ROOMS_CONTEXTS, ROOMS_MODELS


def _print_summary(r: dict[str, Any], con: Any) -> None:
    from rich.table import Table

    w = r["workload"]
    ho = r["handoff"]
    pages = (f", pages {w['prefill_page_tokens']} -> {w['decode_page_tokens']} tokens"
             if w["prefill_page_tokens"] != w["decode_page_tokens"] else "")
    t = Table(title=f"kvhandoff bench: {w['model']}, {w['context_tokens']:,} tokens "
              f"({w['prefix_tokens']:,} cached), {w['bytes'] / 1e6:,.1f} MB in "
              f"{w['pieces']:,} pieces{pages}, {r['config']['reps']} reps")
    single = ho["prefill_tp"] == 1 and ho["decode_tp"] == 1
    ranks = "" if single else f" (TP {ho['prefill_tp']} -> {ho['decode_tp']})"
    for col in ("case", "median", "GB/s (median)", "GB/s (best)", "spread (max-min)/med"):
        t.add_column(col, justify="left" if col == "case" else "right")
    pair = "" if single else ", single pair"
    labels = {"memcpy": f"memcpy of the page set (1 process{pair})",
              "raw": f"raw {r['config']['transport']}, 1 contiguous buffer{pair}",
              "handoff_full": f"handoff{ranks}, checksums full",
              "handoff_off": f"handoff{ranks}, checksums off",
              "paced": f"tail{ranks}, 1 layer per {r['config']['layer_ms']:g} ms",
              "nixl": "NIXL WRITE of the page set (2 agents, 1 process)"}
    for case, s in r["cases"].items():
        if not s.get("n"):
            continue
        gb = f"{s['GBps_median']:.2f}" if "GBps_median" in s else "-"
        best = f"{s['GBps_best']:.2f}" if "GBps_best" in s else "-"
        t.add_row(labels.get(case, case), f"{s['median_s'] * 1e3:,.2f} ms", gb, best,
                  f"{s['spread_pct']:.1f} %")
    con.print(t)
    if not single:
        con.print("ranks: " + "; ".join(f"decode {d} <- prefill {', '.join(map(str, s))}"
                                        for d, s in ho["sources"].items())
                  + f"; handoff bytes = {ho['decode_tp']} decode ranks x "
                  f"{ho['bytes_per_decode_rank'][0]:,} B = {ho['bytes']:,} B; baselines "
                  f"(memcpy, raw) are a single pair moving {w['bytes']:,} B")
    rt = Table(title="ratios (throughput; medians)")
    rt.add_column("ratio")
    rt.add_column("value", justify="right")
    rt.add_column("target", justify="right")
    tg = r["targets"]
    rows = [("handoff / raw transport", "handoff_full_over_raw", "handoff_over_raw>=0.9",
             ">= 0.90"),
            ("handoff / memcpy", "handoff_full_over_memcpy", "handoff_over_memcpy>=0.75",
             ">= 0.75"),
            ("handoff (no checksum) / raw", "handoff_off_over_raw", None, ""),
            ("handoff (no checksum) / memcpy", "handoff_off_over_memcpy", None, ""),
            ("checksum overhead", "checksum_overhead", "checksum_overhead<=0.10", "<= 0.10"),
            ("checksum overhead in CPU s (both sides)", "checksum_cpu_overhead", None, ""),
            ("tail / one layer on raw", "tail_over_one_layer", "tail<=2x_one_layer", "<= 2"),
            ("handoff / NIXL WRITE", "handoff_full_over_nixl", None, ">= 2")]
    for label, key, tkey, target in rows:
        v = r["ratios"].get(key)
        if v is None:
            continue
        mark = "" if tkey is None or tg.get(tkey) is None else (
            " [green]met[/green]" if tg[tkey] else " [red]missed[/red]")
        rt.add_row(label, f"{v:.3f}", target + mark)
    con.print(rt)
    if r.get("cpu_s"):
        con.print("CPU s per handoff (prefill + decode processes, every thread; medians): "
                  + ", ".join(f"{c} {v:.3f}" for c, v in r["cpu_s"].items()))
    if r.get("targets_note"):
        con.print(r["targets_note"])
    lanes = r.get("lanes", {})
    for name, st in lanes.items():
        if name == "raw":
            how = " (one post_writes job, as the agents write)" if st.get("one_sided") else ""
            con.print(f"raw lanes: {', '.join(st['lanes'])}{how}")
        elif name == "ucx_build":
            con.print(f"UCX build: {st}")
        elif name == "nixl":
            con.print(f"NIXL {st['version']}: backend {st['backend']}, {st['descriptors']:,} "
                      f"descriptors ({st['setup']})")
        else:
            for mode, s in st.items():
                how = ""
                if "rooms_one_sided" in s and s.get("rooms"):
                    how = (f"; {s['rooms_one_sided']} of {s['rooms']} rooms by one-sided "
                           "writes" if s["rooms_one_sided"] else "; two-sided sends")
                con.print(f"handoff ({mode}) lanes: {', '.join(s['lanes'])}{how}")
    con.print("verified byte-exact: " + ", ".join(f"{k}={v}" for k, v in r["verified"].items()))


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_cmd(
        model: str = typer.Option("glm-5.3", help="Layout preset."),
        context: int = typer.Option(16_384, min=1, help="Sequence length in tokens."),
        prefix: int = typer.Option(4_096, min=0, help="Tokens decode already holds."),
        page_size: int | None = typer.Option(None, help="Page size in tokens (default: the "
                                             "preset's)."),
        prefill_page: int | None = typer.Option(None, min=1, help="Prefill page size in "
                                                "tokens (default: --page-size)."),
        decode_page: int | None = typer.Option(None, min=1, help="Decode page size in tokens "
                                               "(default: --page-size); paired with prefill's "
                                               "token by token."),
        prefill_tp: int = typer.Option(1, min=1, help="Prefill TP ranks of the handoff cases "
                                       "(one worker process each)."),
        decode_tp: int = typer.Option(1, min=1, help="Decode TP ranks of the handoff cases "
                                      "(one worker process each, routed to its prefill "
                                      "rank(s)); memcpy and raw stay single-pair."),
        transport: str = typer.Option("auto", help="Data transport: auto (the product's "
                                      "default: shm with a peer on this host, the cross-host "
                                      "transport with the others), shm (same host), ucx, tcp, "
                                      "nixl (the nixl extra) or inproc (one process only: the "
                                      "memcpy and raw cases)."),
        shm_pool: bool = typer.Option(True, help="shm and auto: the decode's pool in a "
                                      "kvhandoff shared segment (the map lane); --no-shm-pool: "
                                      "plain memory (process_vm_writev lane)."),
        reps: int = typer.Option(5, min=1, help="Timed repetitions of every case."),
        warmup: int = typer.Option(1, min=0, help="Untimed repetitions first."),
        layer_ms: float = typer.Option(5.0, min=0.0, help="Pacing of the tail case: one layer "
                                       "ready every this many ms."),
        chunk_mib: float = typer.Option(4.0, min=0.0625, help="Largest data message, MiB."),
        slack: float = typer.Option(1.25, min=1.0, help="Pool pages per needed page (random "
                                    "page slots are drawn from the pool)."),
        seed: int = typer.Option(0, help="Seed of page slots and contents."),
        cases: str = typer.Option(",".join(("memcpy", "raw", "handoff_full", "handoff_off",
                                            "paced")), help="Cases to run, comma-separated; "
                                  "add 'nixl' for a NIXL WRITE baseline (the nixl extra)."),
        timeout: float = typer.Option(120.0, help="Bound on each step, in seconds."),
        device: str = typer.Option("cpu", help="Where the KV buffers live: cpu (memcpy, raw "
                                   "transport and agent handoff cases), or cuda / cuda:N "
                                   "(device cases only: contiguous copy, gather/scatter limit "
                                   "baseline, the CUDA IPC lane's copy engine, device "
                                   "checksum; docs/GPU.md); without CUDA it exits 2."),
        rooms: int = typer.Option(0, min=0, help="Rooms mode: this many short handoffs per "
                                  "model, context and concurrency (0: the one-page-set cases "
                                  "above). Every token moves (no cached prefix); the baselines "
                                  "(memcpy, raw, NIXL) take --reps repetitions of the same "
                                  "pieces."),
        models: str = typer.Option(",".join(ROOMS_MODELS), help="Rooms mode: layout presets, "
                                   "comma-separated."),
        contexts: str = typer.Option(",".join(map(str, ROOMS_CONTEXTS)), help="Rooms mode: "
                                     "context sizes in tokens, comma-separated."),
        inflight: str = typer.Option("1,4", help="Rooms mode: rooms open at once (engine "
                                     "threads per side), comma-separated."),
        rounds: int = typer.Option(3, min=1, help="Rooms mode: the rooms are split in this "
                                   "many rounds, the cases' order rotated per round."),
        modes: str = typer.Option("full,off", help="Rooms mode: the handoff cases, each a "
                                  "checksum mode (full, sampled, off), with '+hmac' for agents "
                                  "that share a secret (every control message sealed), "
                                  "comma-separated; e.g. full,full+hmac."),
        out: str | None = typer.Option(None, "--out", help="Write the JSON result here."),
        as_json: bool = typer.Option(False, "--json", help="Print the JSON result on stdout."),
    ) -> None:
        """Measures memcpy of the page set, the raw transport and the kvhandoff handoff
        (checksums on and off) in one run, alternating; prints medians, spread and ratios."""
        from rich.console import Console

        from kvhandoff.bench.runner import CASES, OPTIONAL_CASES, Bench, BenchConfig

        chosen = tuple(c.strip() for c in cases.split(",") if c.strip())
        known = CASES + OPTIONAL_CASES
        unknown = [c for c in chosen if c not in known]
        if unknown or not chosen:
            raise typer.BadParameter(f"cases: unknown {unknown}; choose from {', '.join(known)}")
        con = Console(stderr=True)
        if rooms:
            _bench_rooms(con, out, as_json, rooms=rooms, models=_names(models, "models"),
                         contexts=tuple(int(c) for c in _names(contexts, "contexts")),
                         inflight=tuple(int(c) for c in _names(inflight, "inflight")),
                         transport=transport, rounds=rounds, baseline_reps=reps,
                         modes=_modes(modes),
                         chunk_bytes=int(chunk_mib * (1 << 20)), slack=slack, seed=seed,
                         timeout_s=timeout, shared_pool=shm_pool)
            return
        if device != "cpu":
            _bench_on_device(device, con, out, as_json, model=model, context=context,
                             prefix=prefix, page_size=page_size, prefill_page=prefill_page,
                             decode_page=decode_page, reps=reps, warmup=warmup, slack=slack,
                             seed=seed)
            return
        cfg = BenchConfig(model=model, context=context, prefix=prefix, page_size=page_size,
                          prefill_page=prefill_page, decode_page=decode_page,
                          prefill_tp=prefill_tp, decode_tp=decode_tp,
                          transport=transport, reps=reps, warmup=warmup, layer_ms=layer_ms,
                          chunk_bytes=int(chunk_mib * (1 << 20)), slack=slack, seed=seed,
                          timeout_s=timeout, cases=chosen, shared_pool=shm_pool)
        result = _run_bench(con, "bench", lambda progress: Bench(cfg, progress=progress))
        _report(result, con, out, as_json, _print_summary)


def _names(text: str, what: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise typer.BadParameter(f"{what}: expected a comma-separated list, got {text!r}")
    if what != "models" and not all(x.isdigit() and int(x) > 0 for x in items):
        raise typer.BadParameter(f"{what}: expected positive integers, got {text!r}")
    return items


def _modes(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    ok = {c + a for c in ("full", "sampled", "off") for a in ("", "+hmac")}
    if not items or not set(items) <= ok:
        raise typer.BadParameter(f"modes: expected some of {', '.join(sorted(ok))}, "
                                 f"got {text!r}")
    return items


def _bench_rooms(con: Any, out: str | None, as_json: bool, **kw: Any) -> None:
    """`bench --rooms N`: the rooms mode (`kvhandoff.bench.rooms`)."""
    from kvhandoff.bench.rooms import RoomsBench, RoomsConfig
    from kvhandoff.errors import KVHandoffError
    from kvhandoff.kv_layout import preset

    for m in kw["models"]:
        try:
            preset(m)
        except KVHandoffError as e:
            raise typer.BadParameter(str(e), param_hint="--models") from None
    result = _run_bench(con, "bench rooms",
                        lambda progress: RoomsBench(RoomsConfig(**kw), progress=progress))
    _report(result, con, out, as_json, _print_rooms)


def _run_bench(con: Any, label: str, make: Callable[[Callable[[str], None]], Any]
               ) -> dict[str, Any]:
    """Runs `make(progress).run()` under a status line; every child process is stopped in a
    `finally` (also on Ctrl-C / SIGTERM: exit 130); a failure exits 1 with its reason."""
    from kvhandoff.errors import KVHandoffError

    def term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, term)
    bench = None
    try:
        with con.status(label) as status:
            bench = make(lambda s: status.update(f"{label}: {s}"))
            result: dict[str, Any] = bench.run()
    except KeyboardInterrupt:
        typer.echo("interrupted: every child process was stopped", err=True)
        raise typer.Exit(130) from None
    except (KVHandoffError, TimeoutError, RuntimeError) as e:
        con.print(f"[red]bench failed:[/red] {e}")
        raise typer.Exit(1) from None
    finally:
        if bench is not None:
            bench.close()
        signal.signal(signal.SIGTERM, old)
    return result


def _print_rooms(r: dict[str, Any], con: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    if not con.is_terminal:  # a file or a pipe: one line per row, not wrapped at 80
        con = Console(width=220)

    cfg = r["config"]
    t = Table(title=f"kvhandoff bench, rooms mode: {cfg['rooms']} rooms per row, transport "
              f"{cfg['transport']}, every token moved; latency = layers_ready -> the decode "
              "engine sees Success (ms)")
    modes = cfg["modes"]
    cols = ["model", "tokens", "MB", "in flight"]
    cols += [f"{m} p50 / p99" for m in modes] + ["NIXL p50 / p99", "memcpy", "raw", "NIXL 1x"]
    cols += [f"{modes[0]} / NIXL 1x", "rooms/s " + modes[0], "rooms/s NIXL",
             f"CPU ms/room {modes[0]} (P + D)"]
    for c in cols:
        t.add_column(c, justify="left" if c == "model" else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f}"

    for row in r["rows"]:
        cs, bl = row["cases"], row["baselines"]
        nx = cs.get("nixl")
        first = cs[f"handoff_{modes[0]}"]
        cells = [row["model"], f"{row['context_tokens']:,}", f"{row['bytes'] / 1e6:.1f}",
                 str(row["inflight"])]
        cells += [f"{ms(cs[f'handoff_{m}']['p50_s'])} / {ms(cs[f'handoff_{m}']['p99_s'])}"
                  for m in modes]
        cells.append(f"{ms(nx['p50_s'])} / {ms(nx['p99_s'])}" if nx else "-")
        cells += [ms(bl.get("memcpy")), ms(bl.get("raw")), ms(bl.get("nixl"))]
        ratio = row["ratios"].get(f"{modes[0]}_p50_over_nixl_write")
        cells.append("-" if ratio is None else f"{ratio:.2f}")
        cells.append(f"{first['rooms_per_s']:,.0f}")
        cells.append(f"{nx['rooms_per_s']:,.0f}" if nx else "-")
        cpu = first["cpu_s_per_room"]
        cells.append(f"{cpu['prefill'] * 1e3:.1f} + {cpu['decode'] * 1e3:.1f}")
        t.add_row(*cells)
    con.print(t)
    for model, fits in r["fixed_cost"].items():
        parts = [f"{c} {f['fixed_s'] * 1e3:.2f} ms + {f['per_MB_s'] * 1e3:.3f} ms/MB"
                 for c, f in fits.items() if f]
        if parts:
            con.print(f"fixed cost per handoff ({model}, least squares over the contexts, "
                      f"{min(cfg['inflight'])} in flight): " + "; ".join(parts))
    seen: set[str] = set()
    for row in r["rows"]:  # the agents of one model and context sent these per room
        if row["model"] in seen or "messages_per_room" not in row:
            continue
        seen.add(row["model"])
        con.print(f"control messages sent per room ({row['model']}, {row['context_tokens']:,} "
                  "tokens; prefill, decode; heartbeats included): " + "; ".join(
                      f"{m} {v['prefill']:.1f}, {v['decode']:.1f}"
                      for m, v in row["messages_per_room"].items()))
    for row in r["rows"]:  # the control threads alone: where a short room's time goes
        ctl_parts: list[str] = []
        for m in modes:
            ctl = row["cases"][f"handoff_{m}"].get("control_cpu_s_per_room") or {}
            if ctl.get("prefill") is not None and ctl.get("decode") is not None:
                ctl_parts.append(f"{m} {ctl['prefill'] * 1e3:.2f} + {ctl['decode'] * 1e3:.2f}")
        if ctl_parts:
            con.print(f"control-thread CPU ms per room, prefill + decode ({row['model']}, "
                      f"{row['context_tokens']:,} tokens, {row['pieces']:,} pieces, "
                      f"{row['inflight']} in flight): " + "; ".join(ctl_parts))
    for name, tg in r["targets"].items():
        con.print(target_line(name, tg))
    if r.get("nixl_missing"):
        con.print(f"NIXL baselines not run: {r['nixl_missing']}")
    ld = r["load"]
    con.print(f"load average before {ld['before'][0]:.2f}, after {ld['after'][0]:.2f} "
              f"({r['host']['cpus']} CPUs); NIXL's CPU is both of its agents in one process, "
              "busy-polling")
    con.print("verified byte-exact (baselines): "
              + ("all" if all(r["verified"].values()) else
                 ", ".join(k for k, v in r["verified"].items() if not v) + " FAILED"))


def target_line(name: str, tg: dict[str, Any]) -> str:
    """One target as the bench prints it: its value, and met, or missed by how much (the
    value over its bound, or the bound over the value for a floor), or not measured."""
    v = tg["value"]
    if tg["met"] is None:
        mark = "not measured" + (f": {tg['why']}" if tg.get("why") else "")
    elif tg["met"]:
        mark = "met"
    else:
        bound, op = tg.get("bound"), tg.get("op")
        by = (v / bound if op == "<=" else bound / v) if bound and v else None
        mark = "missed" + (f" by {by:.2f}x" if by else "")
    info = ", ".join(f"{k} {tg[k]:.3f}" if isinstance(tg[k], float) else f"{k} {tg[k]}"
                     for k in ("mode", "model", "context_tokens", "how", "cpu_ratio")
                     if tg.get(k) is not None)
    return (f"target {name}: {'-' if v is None else f'{v:.3f}'} ({mark}"
            + (f"; {info}" if info else "") + ")")


def _bench_on_device(device: str, con: Any, out: str | None, as_json: bool, **kw: Any) -> None:
    """`bench --device cuda[:N]`: exit 2 with "no CUDA device: ..." where there is none."""

    from kvhandoff.bench.device import (
        NoCudaDevice,
        cuda_preflight,
        print_device_summary,
        run_device_bench,
    )

    try:
        cuda_preflight(device)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--device") from None
    except NoCudaDevice as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    with con.status("bench") as status:
        result = run_device_bench(device=device, progress=lambda s: status.update(
            f"bench: {s}"), **kw)
    _report(result, con, out, as_json, print_device_summary)


def _report(result: dict[str, Any], con: Any, out: str | None, as_json: bool,
            summary: Any) -> None:
    """Writes the result (`--out`), prints it (JSON, or `summary` as tables) and exits 1
    when a case did not move the bytes exactly."""
    from rich.console import Console

    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        typer.echo(text)
    else:
        summary(result, Console())
    if not all(result["verified"].values()):
        con.print("[red]a case did not move the bytes exactly[/red]")
        raise typer.Exit(1)
