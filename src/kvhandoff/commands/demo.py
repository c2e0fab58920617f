"""`kvhandoff demo`: one handoff on this machine, with nothing to configure.

How it works: a bootstrap server runs in this process (a uvicorn thread on a free port); a
simulated prefill engine and a simulated decode engine run as two processes
(`kvhandoff.engine_sim.spawn`). Prefill fills deterministic page contents layer by layer and hands
each layer over as it is done; decode holds a cached prefix (so only the indexer suffix moves),
verifies each layer's checksum as it lands, and at the end checks every byte against the
pattern. Progress comes from the processes' JSON events.

Rules: every child process is tracked by PID and killed in a `finally` (children run in their
own session, so a terminal's Ctrl-C does not reach them: we must). SIGTERM is turned into the
same cleanup path as Ctrl-C. Exit status 1 when anything failed to verify.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer

_DEFAULT_LAYER_MS = 2.0


class DemoError(Exception):
    """The demo could not run to the end (a process failed or timed out)."""


# set by SIGINT / SIGTERM while the demo runs (see _signals_as_interrupt)
_interrupted = threading.Event()


@contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, so one cleanup path
    serves both, also when the demo was started with SIGINT ignored (a background job of a
    non-interactive shell inherits it so, and Python then installs no handler: the demo ran on
    after SIGINT and exited 0). They are remembered too (`_interrupted`): an interrupt raised
    while the main thread happens to run a finaliser is swallowed by the interpreter
    ("Exception ignored in ..."), so the demo's wait loop and its end check the flag."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _interrupted.set()
        raise KeyboardInterrupt

    _interrupted.clear()
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
        if _interrupted.is_set():  # raised where the interpreter swallowed it
            raise KeyboardInterrupt
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _kill_all(procs: list[Any]) -> None:
    """Kills every spawned process that is still alive and reaps it (bounded)."""
    for sp in procs:
        if sp.proc.poll() is None:
            try:
                sp.proc.kill()
            except ProcessLookupError:
                pass
    for sp in procs:
        try:
            sp.proc.wait(5)
        except Exception:  # noqa: BLE001  (reaping is best effort; the kill was sent)
            pass


def _forward(sp: Any, name: str, out: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """Moves one process's events into the merged queue (daemon thread)."""
    while True:
        ev = sp.events.get()
        out.put((name, ev))
        if ev["event"] == "eof":
            return


def _rank_spec(model: str, tp_size: int, tp_rank: int, page: int | None) -> Any:
    """The layout of one rank: a head-sharded preset gives that rank's heads."""
    from kvhandoff.kv_layout import TPSplit, preset

    kw: dict[str, int] = {"page_size_tokens": page} if page else {}
    spec = preset(model, **kw)
    if any(r.tp_split is TPSplit.HEAD_SHARDED for r in spec.regions):
        spec = preset(model, tp_size=tp_size, tp_rank=tp_rank, **kw)
    # the demo's engines run no attention kernel: a page size chosen on purpose (P != D
    # pairing) drops the preset's kernel page rules, as the sim's engines do
    return spec.without_page_rules() if page else spec


def run_demo(*, model: str = "glm-5.3", context: int = 16_384, prefix: int = 4_096,
             transport: str = "shm", layer_ms: float = _DEFAULT_LAYER_MS,
             page_size: int | None = None, prefill_page: int | None = None,
             decode_page: int | None = None, prefill_tp: int = 1, decode_tp: int = 1,
             timeout_s: float = 120.0,
             on_progress: Callable[[str, int, int], None] | None = None,
             on_pids: Callable[[list[int]], None] | None = None) -> dict[str, Any]:
    """Runs one handoff end to end and returns the summary (see `kvhandoff demo --json`).

    A prefill engine of `prefill_tp` ranks and a decode engine of `decode_tp` ranks, one
    process each; each decode rank finds its prefill rank(s) through the bootstrap server.

    Args:
        page_size: page size of both sides (`prefill_page` / `decode_page` override a side).
        on_progress: called with (side, layers done, layers total) as events arrive; with
            several ranks a side's count is its slowest rank's.
        on_pids: called with the PIDs of the child processes each time one starts.

    Raises:
        DemoError: a process failed or an event did not come within `timeout_s`.
    """
    from kvhandoff.bootstrap_server.background import run_server
    from kvhandoff.bootstrap_server.client import BootstrapClient
    from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks
    from kvhandoff.engine_sim.process import spawn
    from kvhandoff.kv_layout import SendFrom, TPSplit, handoff_bytes, page_aligned
    from kvhandoff.settings import Settings

    if prefill_tp < 1 or decode_tp < 1:
        raise DemoError(f"tp: expected >= 1, got prefill={prefill_tp} decode={decode_tp}")
    p_page, d_page = prefill_page or page_size, decode_page or page_size
    p_specs = [_rank_spec(model, prefill_tp, p, p_page) for p in range(prefill_tp)]
    d_specs = [_rank_spec(model, decode_tp, d, d_page) for d in range(decode_tp)]
    spec = d_specs[0]
    replicated = all(r.tp_split is TPSplit.REPLICATED for r in spec.regions)
    sources = {d: prefill_tp_ranks(d, decode_tp, prefill_tp, replicated=replicated)
               for d in range(decode_tp)}
    readers = {p: sum(p in srcs for srcs in sources.values()) for p in range(prefill_tp)}
    prefix = min(prefix, context)
    layers = sorted({lid for r in spec.regions for lid in r.layer_ids})
    n_layers = len(layers)
    procs: list[Any] = []
    progress = on_progress or (lambda side, done, total: None)

    def started(sp: Any) -> Any:
        procs.append(sp)
        if on_pids is not None:
            on_pids([p.proc.pid for p in procs])
        return sp

    t_start = time.monotonic()
    got: dict[str, dict[str, dict[str, Any]]] = {}
    first_layer_t: dict[str, float] = {}
    try:
        with run_server(Settings(port=0, auth_token=None)) as url:
            client = BootstrapClient(url)
            room = client.allocate_rooms(1)[0]
            settings = {"transport": transport, "bootstrap_url": url}
            common = {"model": model, "settings": settings, "layer_ms": layer_ms,
                      "timeout_s": timeout_s, "plane_salt": True}
            prefills = []
            for p in range(prefill_tp):
                prefills.append(started(spawn("prefill", {
                    **common, "engine_id": "demo-prefill", "wait_for_decode": True,
                    "tp_rank": p, "tp_size": prefill_tp, "page_size": p_page,
                    "rooms": [{"room": room, "seq_len": context,
                               "num_decode_ranks": readers[p]}]})))
            ready_p = prefills[0].expect("ready", timeout_s)
            for sp in prefills:
                if not sp.expect("registered", timeout_s)["ok"]:
                    raise DemoError("prefill did not register with the bootstrap server")
            client.bind_room(room, "demo-prefill", 0)
            decodes = [started(spawn("decode", {
                **common, "bootstrap_url": url, "tp_rank": d, "tp_size": decode_tp,
                "page_size": d_page,
                "rooms": [{"room": room, "seq_len": context, "prefix": prefix}]}))
                for d in range(decode_tp)]
            names = {id(sp): f"prefill{i}" for i, sp in enumerate(prefills)}
            names.update({id(sp): f"decode{i}" for i, sp in enumerate(decodes)})
            merged: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
            for sp in prefills + decodes:
                for ev in sp.seen:  # events that arrived before "registered"
                    merged.put((names[id(sp)], ev))
                sp.seen.clear()
                threading.Thread(target=_forward, args=(sp, names[id(sp)], merged),
                                 daemon=True).start()
            got = {names[id(sp)]: {} for sp in prefills + decodes}
            counts = dict.fromkeys(got, 0)
            want = {"done", "pool", "status"}
            deadline = time.monotonic() + timeout_s
            while not all(want <= set(g) for g in got.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DemoError(f"no end of the handoff within {timeout_s:g}s (have "
                                    f"{ {s: sorted(g) for s, g in got.items()} })")
                if _interrupted.is_set():  # an interrupt the interpreter swallowed
                    raise KeyboardInterrupt
                try:
                    name, ev = merged.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                kind = ev["event"]
                side = name.rstrip("0123456789")
                if kind == "layer":
                    counts[name] += 1
                    first_layer_t.setdefault(side, ev["t"])
                    progress(side, min(c for n, c in counts.items() if n.startswith(side)),
                             n_layers)
                elif kind == "error":
                    raise DemoError(f"{name}: {ev['error']}")
                elif kind == "eof":
                    if not want <= set(got[name]):
                        sp = next(x for x in prefills + decodes if names[id(x)] == name)
                        raise DemoError(f"{name} exited (rc={sp.proc.poll()}) early; stderr: "
                                        + "".join(sp.stderr_tail[-15:]))
                else:
                    got[name][kind] = ev
            for sp in prefills + decodes:
                sp.close()
    finally:
        _kill_all(procs)

    pds = [got[f"prefill{p}"]["done"] for p in range(prefill_tp)]
    dds = [got[f"decode{d}"]["done"] for d in range(decode_tp)]
    moved = handoff_bytes(spec, seq_len=context, decode_prefix_len=prefix)
    full = handoff_bytes(spec, seq_len=context, decode_prefix_len=0)
    moved = {k: v * decode_tp for k, v in moved.items()}  # every decode rank gets its share
    full = {k: v * decode_tp for k, v in full.items()}
    suffix_regions = [r.name for r in spec.regions if r.send_from is SendFrom.DECODE_PREFIX]

    def merged_counts(key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for dd in dds:
            for k, v in (dd["stats"].get(key) or {}).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    t_first = first_layer_t.get("prefill")
    lasts = [pd["stats"].get("t_last_ready") for pd in pds if pd["stats"].get("t_last_ready")]
    dones = [dd["stats"].get("t_seen") for dd in dds]  # when the decode engine could see it
    t_last_ready = max(lasts) if lasts else None
    t_success = max(dones) if all(t is not None for t in dones) else None
    total_bytes = sum(int(dd["stats"].get("bytes", 0)) for dd in dds)
    window = (t_success - t_first) if t_success is not None and t_first else None
    tail = (t_success - t_last_ready) if t_success is not None and t_last_ready else None
    verifies = [dd.get("verify") or {} for dd in dds]
    verify = {"bad_bytes": sum(v.get("bad_bytes", 0) for v in verifies),
              "prefix_touched_bytes": sum(v.get("prefix_touched_bytes", 0) for v in verifies),
              "byte_exact": bool(verifies) and all(v.get("byte_exact") for v in verifies)}
    # endpoint lanes ("cma/memory:rma_bw#0") while a peer is connected; resources otherwise
    statuses = [g["status"]["status"]["transport"] for g in got.values()]
    lanes = next((st for st in statuses if any(":" in x for x in st["lanes"])), statuses[-1])
    released = {"prefill": all(pd.get("released") is True for pd in pds),
                "decode": all(dd.get("released") is True for dd in dds)}
    returned = {side: all(g["pool"]["free"] == g["pool"]["total"]
                          for n, g in got.items() if n.startswith(side))
                for side in ("prefill", "decode")}
    states = {"prefill": min((pd["state"] for pd in pds), key=_STATE_ORDER.index),
              "decode": min((dd["state"] for dd in dds), key=_STATE_ORDER.index)}
    ok = (states == {"prefill": "Success", "decode": "Success"} and verify["byte_exact"]
          and total_bytes == sum(moved.values()) and all(released.values()))
    return {
        "ok": ok,
        "model": model, "context_tokens": context, "prefix_tokens": prefix,
        "prefix_aligned_tokens": page_aligned(prefix, spec.page_size_tokens),
        "page_size_tokens": spec.page_size_tokens,
        "prefill_page_tokens": p_specs[0].page_size_tokens,
        "decode_page_tokens": spec.page_size_tokens,
        "prefill_tp": prefill_tp, "decode_tp": decode_tp,
        "sources": {str(d): srcs for d, srcs in sources.items()},
        "layers": n_layers, "layer_ms": layer_ms, "transport": lanes["kind"],
        "lanes": lanes["lanes"], "degraded": lanes["degraded"], "transport_reason":
            lanes.get("reason"),
        "prefill_address": ready_p["address"],
        "state": states,
        "failure": {"prefill": next((pd["failure"] for pd in pds if pd["failure"]), None),
                    "decode": next((dd["failure"] for dd in dds if dd["failure"]), None)},
        "released": released,
        "bytes": total_bytes,
        "bytes_per_region": moved,
        "bytes_saved_by_prefix": {r: full[r] - moved[r] for r in suffix_regions},
        "descriptors_before": merged_counts("descriptors_before"),
        "descriptors_after": merged_counts("descriptors"),
        "checksums_verified": sum(int(dd["stats"].get("checksums_verified", 0)) for dd in dds),
        "retransmits": sum(int(dd["stats"].get("retransmits", 0)) for dd in dds),
        "verify": verify,
        "byte_exact": verify["byte_exact"],
        "handoff_window_s": window,
        "gbps_window": total_bytes / window / 1e9 if window else None,
        "tail_s": tail,
        # per rank, the room's own timeline (what its trace spans are made of): ms from its
        # opening, the bootstrap lookup, handshake, layers and tail (docs/OPERATIONS.md)
        "timings": {"prefill": [pd.get("timings") for pd in pds],
                    "decode": [dd.get("timings") for dd in dds]},
        "wall_s": time.monotonic() - t_start,
        "pages_returned": returned,
    }


_STATE_ORDER = ["Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"]


def _fmt_bytes(n: float) -> str:
    return f"{int(n):,} B ({n / 1e6:,.1f} MB)"


def _table(r: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"kvhandoff demo: {r['model']}, {r['context_tokens']:,} tokens, "
              f"{r['prefix_tokens']:,} cached on decode, page {r['page_size_tokens']}, "
              f"{r['layers']} layers")
    t.add_column("what")
    t.add_column("value", justify="right")
    if r["prefill_tp"] > 1 or r["decode_tp"] > 1:
        t.add_row(f"ranks (prefill TP {r['prefill_tp']} -> decode TP {r['decode_tp']})",
                  "; ".join(f"decode {d} <- prefill {', '.join(map(str, srcs))}"
                            for d, srcs in r["sources"].items()))
    if r["prefill_page_tokens"] != r["decode_page_tokens"]:
        t.add_row("page sizes (tokens)", f"prefill {r['prefill_page_tokens']}, decode "
                  f"{r['decode_page_tokens']} (paired token by token)")
    for name, n in r["bytes_per_region"].items():
        suffix = " (suffix only)" if name in r["bytes_saved_by_prefix"] else ""
        t.add_row(f"bytes {name}{suffix}", _fmt_bytes(n))
    for name, n in r["bytes_saved_by_prefix"].items():
        t.add_row(f"bytes {name} saved by the prefix", _fmt_bytes(n))
    t.add_row("bytes moved (decode)", _fmt_bytes(r["bytes"]))
    before, after = r["descriptors_before"] or {}, r["descriptors_after"] or {}
    for name in after:
        t.add_row(f"descriptors {name} (all layers)", f"{before.get(name, 0):,} pages -> "
                  f"{after[name]:,} after coalescing")
    if r["handoff_window_s"]:
        t.add_row("first layer_ready -> decode Success",
                  f"{r['handoff_window_s'] * 1e3:,.1f} ms ({r['gbps_window']:.2f} GB/s, "
                  "overlapped with compute)")
    if r["tail_s"] is not None:
        t.add_row("tail: last layer_ready -> decode Success", f"{r['tail_s'] * 1e3:,.2f} ms")
    t.add_row("checksums verified (layer x region)",
              f"{r['checksums_verified']} ({r['retransmits']} retransmits)")
    v = r["verify"]
    t.add_row("byte-exact (pattern check on decode)",
              f"{'yes' if r['byte_exact'] else 'NO'} ({v.get('bad_bytes', '?')} bad bytes, "
              f"{v.get('prefix_touched_bytes', '?')} prefix bytes touched)")
    t.add_row("pages released / returned",
              ", ".join(f"{s}: {r['released'][s]}/{r['pages_returned'][s]}"
                        for s in ("prefill", "decode")))
    t.add_row("transport", r["transport"] + (" (DEGRADED)" if r["degraded"] else ""))
    t.add_row("lanes", ", ".join(r["lanes"]) or "-")
    t.add_row("result", "[green]OK[/green]" if r["ok"] else "[red]FAILED[/red]")
    return t


def _print_pids(pids: list[int]) -> None:
    sys.stderr.write(json.dumps({"children": pids}) + "\n")
    sys.stderr.flush()


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        model: str = typer.Option("glm-5.3", help="Layout preset: glm-5.3, deepseek-v3.2, "
                                  "llama-3.1-8b."),
        context: int = typer.Option(16_384, min=1, help="Sequence length in tokens."),
        prefix: int = typer.Option(4_096, min=0, help="Tokens decode already holds (suffix-only "
                                   "regions move from here, page-aligned down)."),
        transport: str = typer.Option("shm", help="Data transport: shm (same host, the "
                                      "default: the prefill writes into the decode's pages), "
                                      "ucx, tcp or inproc."),
        layer_ms: float = typer.Option(_DEFAULT_LAYER_MS, min=0.0, help="Simulated compute "
                                       "per layer on prefill, in ms (on top of filling pages)."),
        page_size: int | None = typer.Option(None, help="Page size in tokens of both sides "
                                             "(default: the preset's)."),
        prefill_page: int | None = typer.Option(None, help="Prefill page size in tokens (may "
                                                "differ from decode's)."),
        decode_page: int | None = typer.Option(None, help="Decode page size in tokens."),
        prefill_tp: int = typer.Option(1, min=1, help="Prefill TP ranks (one process each)."),
        decode_tp: int = typer.Option(1, min=1, help="Decode TP ranks (one process each); "
                                      "each finds its prefill rank(s) by route lookup."),
        timeout: float = typer.Option(120.0, help="Bound on the whole handoff, in seconds."),
        device: str = typer.Option("cpu", help="Where the KV buffers live: cpu (the agents' "
                                   "handoff between two processes), or cuda / cuda:N (both "
                                   "sides' buffers on the GPU, moved by the CUDA IPC lane "
                                   "pieces in one process, no agent yet: docs/GPU.md); "
                                   "without CUDA it exits 2."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object, no bars."),
        report_pids: bool = typer.Option(False, "--report-pids", hidden=True, help="Print "
                                         "the child PIDs as JSON lines on stderr (tests)."),
    ) -> None:
        """Hands one request's KV from a simulated prefill process to a decode process on this
        machine (bootstrap server, per-layer transfer, checksums, byte-exact check)."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        from kvhandoff.errors import KVHandoffError

        con = Console(stderr=as_json)
        if device != "cpu":
            _demo_on_device(device, con, as_json, model=model, context=context, prefix=prefix,
                            page_size=page_size, prefill_page=prefill_page,
                            decode_page=decode_page, timeout_s=timeout)
            return
        bars = Progress(TextColumn("{task.description:<34}"), BarColumn(),
                        MofNCompleteColumn(), console=con, disable=as_json, transient=False)
        tasks: dict[str, Any] = {}

        def on_progress(side: str, done: int, total: int) -> None:
            if not tasks:
                tasks["prefill"] = bars.add_task("prefill: layers computed", total=total)
                tasks["decode"] = bars.add_task("decode: layers landed + verified",
                                                total=total)
            bars.update(tasks[side], completed=done)

        try:
            with _signals_as_interrupt(), bars:
                if not as_json:
                    con.print(f"starting a bootstrap server, {prefill_tp} prefill and "
                              f"{decode_tp} decode process(es) ({transport}) ...")
                result = run_demo(model=model, context=context, prefix=prefix,
                                  transport=transport, layer_ms=layer_ms, page_size=page_size,
                                  prefill_page=prefill_page, decode_page=decode_page,
                                  prefill_tp=prefill_tp, decode_tp=decode_tp,
                                  timeout_s=timeout, on_progress=on_progress,
                                  on_pids=_print_pids if report_pids else None)
        except KeyboardInterrupt:
            typer.echo("interrupted: every child process was stopped", err=True)
            raise typer.Exit(130) from None
        except (DemoError, KVHandoffError, TimeoutError, RuntimeError) as e:
            if as_json:
                typer.echo(json.dumps({"ok": False, "error": str(e)}))
            else:
                con.print(f"[red]demo failed:[/red] {e}")
            raise typer.Exit(1) from None
        if as_json:
            typer.echo(json.dumps(result, indent=2))
        else:
            con.print(_table(result))
        if not result["ok"]:
            raise typer.Exit(1)


def _demo_on_device(device: str, con: Any, as_json: bool, **kw: Any) -> None:
    """`demo --device cuda[:N]`: exit 2 with "no CUDA device: ..." where there is none."""
    from kvhandoff.bench.device import NoCudaDevice, cuda_preflight
    from kvhandoff.commands.demo_device import print_summary, run_demo_device

    try:
        cuda_preflight(device)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--device") from None
    except NoCudaDevice as e:
        if as_json:
            typer.echo(json.dumps({"ok": False, "error": str(e)}))
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    result = run_demo_device(device=device, **kw)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_summary(result, con)
    if not result["ok"]:
        raise typer.Exit(1)
