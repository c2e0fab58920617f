"""`kvhandoff bench`: the handoff against memcpy and the raw transport, measured in one run.

See `kvhandoff.bench.runner` for what each case measures and docs/PERFORMANCE.md for figures.
Every child process is killed in a `finally` (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import json
import signal
from typing import Any

import typer


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
            how = " (one post_write, as the agents write)" if st.get("one_sided") else ""
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
        transport: str = typer.Option("ucx", help="Data transport: ucx, tcp, shm (same host) "
                                      "or inproc."),
        shm_pool: bool = typer.Option(True, help="shm: the decode's pool in a kvhandoff shared "
                                      "segment (the map lane); --no-shm-pool: plain memory "
                                      "(process_vm_writev lane)."),
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
        out: str | None = typer.Option(None, "--out", help="Write the JSON result here."),
        as_json: bool = typer.Option(False, "--json", help="Print the JSON result on stdout."),
    ) -> None:
        """Measures memcpy of the page set, the raw transport and the kvhandoff handoff
        (checksums on and off) in one run, alternating; prints medians, spread and ratios."""
        from rich.console import Console

        from kvhandoff.bench.runner import CASES, OPTIONAL_CASES, Bench, BenchConfig
        from kvhandoff.errors import KVHandoffError

        chosen = tuple(c.strip() for c in cases.split(",") if c.strip())
        known = CASES + OPTIONAL_CASES
        unknown = [c for c in chosen if c not in known]
        if unknown or not chosen:
            raise typer.BadParameter(f"cases: unknown {unknown}; choose from {', '.join(known)}")
        con = Console(stderr=True)
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

        def term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGTERM, term)
        bench = None
        try:
            with con.status("bench") as status:
                bench = Bench(cfg, progress=lambda s: status.update(f"bench: {s}"))
                result = bench.run()
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
        _report(result, con, out, as_json, _print_summary)


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
