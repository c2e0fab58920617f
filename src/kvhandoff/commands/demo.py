"""`kvhandoff demo`: one handoff on this machine, with nothing to configure.

How it works: a bootstrap server runs in this process (a uvicorn thread on a free port); a
simulated prefill engine and a simulated decode engine run as two processes
(`kvhandoff.sim.spawn`). Prefill fills deterministic page contents layer by layer and hands each
layer over as it is done; decode holds a cached prefix (so only the indexer suffix moves),
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


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, so one cleanup path serves both."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


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


def _forward(sp: Any, out: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """Moves one process's events into the merged queue (daemon thread)."""
    while True:
        ev = sp.events.get()
        out.put((sp.role, ev))
        if ev["event"] == "eof":
            return


def run_demo(*, model: str = "glm-5.3", context: int = 16_384, prefix: int = 4_096,
             transport: str = "ucx", layer_ms: float = _DEFAULT_LAYER_MS,
             page_size: int | None = None, timeout_s: float = 120.0,
             on_progress: Callable[[str, int, int], None] | None = None,
             on_pids: Callable[[list[int]], None] | None = None) -> dict[str, Any]:
    """Runs one handoff end to end and returns the summary (see `kvhandoff demo --json`).

    Args:
        on_progress: called with (side, layers done, layers total) as events arrive.
        on_pids: called with the PIDs of the child processes each time one starts.

    Raises:
        DemoError: a process failed or an event did not come within `timeout_s`.
    """
    from kvhandoff.bootstrap_server.client import BootstrapClient
    from kvhandoff.bootstrap_server.testing import run_server
    from kvhandoff.kv_layout import SendFrom, handoff_bytes, page_aligned, preset
    from kvhandoff.settings import Settings
    from kvhandoff.sim import spawn

    kw = {"page_size_tokens": page_size} if page_size else {}
    spec = preset(model, **kw)
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
    try:
        with run_server(Settings(port=0, auth_token=None)) as url:
            client = BootstrapClient(url)
            room = client.allocate_rooms(1)[0]
            settings = {"transport": transport, "bootstrap_url": url}
            common = {"model": model, "settings": settings, "layer_ms": layer_ms,
                      "timeout_s": timeout_s}
            if page_size:
                common["page_size"] = page_size
            prefill = started(spawn("prefill", {
                **common, "engine_id": "demo-prefill", "wait_for_decode": True,
                "rooms": [{"room": room, "seq_len": context}]}))
            ready_p = prefill.expect("ready", timeout_s)
            if not prefill.expect("registered", timeout_s)["ok"]:
                raise DemoError("prefill did not register with the bootstrap server")
            client.bind_room(room, "demo-prefill", 0)
            decode = started(spawn("decode", {
                **common, "bootstrap_url": url,
                "rooms": [{"room": room, "seq_len": context, "prefix": prefix}]}))
            merged: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
            for sp in (prefill, decode):
                for ev in sp.seen:  # events that arrived before "registered"
                    merged.put((sp.role, ev))
                sp.seen.clear()
                threading.Thread(target=_forward, args=(sp, merged), daemon=True).start()
            got: dict[str, dict[str, dict[str, Any]]] = {"prefill": {}, "decode": {}}
            counts = {"prefill": 0, "decode": 0}
            first_layer_t: dict[str, float] = {}
            want = {"done", "pool", "status"}
            deadline = time.monotonic() + timeout_s
            while not all(want <= set(got[s]) for s in got):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DemoError(f"no end of the handoff within {timeout_s:g}s (have "
                                    f"{ {s: sorted(g) for s, g in got.items()} })")
                try:
                    side, ev = merged.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                kind = ev["event"]
                if kind == "layer":
                    counts[side] += 1
                    first_layer_t.setdefault(side, ev["t"])
                    progress(side, counts[side], n_layers)
                elif kind == "error":
                    raise DemoError(f"{side}: {ev['error']}")
                elif kind == "eof":
                    if not want <= set(got[side]):
                        sp = prefill if side == "prefill" else decode
                        raise DemoError(f"{side} exited (rc={sp.proc.poll()}) early; stderr: "
                                        + "".join(sp.stderr_tail[-15:]))
                else:
                    got[side][kind] = ev
            prefill.close()
            decode.close()
    finally:
        _kill_all(procs)

    pd, dd = got["prefill"]["done"], got["decode"]["done"]
    ps_, ds_ = pd["stats"], dd["stats"]
    ps = spec.page_size_tokens
    moved = handoff_bytes(spec, seq_len=context, decode_prefix_len=prefix)
    full = handoff_bytes(spec, seq_len=context, decode_prefix_len=0)
    suffix_regions = [r.name for r in spec.regions if r.send_from is SendFrom.DECODE_PREFIX]
    t_first = first_layer_t.get("prefill")
    t_last_ready = ps_.get("t_last_ready")
    t_success = ds_.get("t_done")
    total_bytes = int(ds_.get("bytes", 0))
    window = (t_success - t_first) if t_success is not None and t_first else None
    tail = (t_success - t_last_ready) if t_success is not None and t_last_ready else None
    verify = dd.get("verify") or {}
    # endpoint lanes ("cma/memory:rma_bw#0") while a peer is connected; resources otherwise
    statuses = [got[s]["status"]["status"]["transport"] for s in ("prefill", "decode")]
    lanes = next((st for st in statuses if any(":" in x for x in st["lanes"])), statuses[1])
    ok = (pd["state"] == "Success" and dd["state"] == "Success"
          and bool(verify.get("byte_exact")) and total_bytes == sum(moved.values())
          and pd.get("released") is True and dd.get("released") is True)
    return {
        "ok": ok,
        "model": model, "context_tokens": context, "prefix_tokens": prefix,
        "prefix_aligned_tokens": page_aligned(prefix, ps), "page_size_tokens": ps,
        "layers": n_layers, "layer_ms": layer_ms, "transport": lanes["kind"],
        "lanes": lanes["lanes"], "degraded": lanes["degraded"], "transport_reason":
            lanes.get("reason"),
        "prefill_address": ready_p["address"],
        "state": {"prefill": pd["state"], "decode": dd["state"]},
        "failure": {"prefill": pd["failure"], "decode": dd["failure"]},
        "released": {"prefill": pd.get("released"), "decode": dd.get("released")},
        "bytes": total_bytes,
        "bytes_per_region": moved,
        "bytes_saved_by_prefix": {r: full[r] - moved[r] for r in suffix_regions},
        "descriptors_before": ds_.get("descriptors_before"),
        "descriptors_after": ds_.get("descriptors"),
        "checksums_verified": ds_.get("checksums_verified"),
        "retransmits": ds_.get("retransmits"),
        "verify": verify,
        "byte_exact": bool(verify.get("byte_exact")),
        "handoff_window_s": window,
        "gbps_window": total_bytes / window / 1e9 if window else None,
        "tail_s": tail,
        "wall_s": time.monotonic() - t_start,
        "pages_returned": {s: got[s]["pool"]["free"] == got[s]["pool"]["total"] for s in got},
    }



def _fmt_bytes(n: float) -> str:
    return f"{int(n):,} B ({n / 1e6:,.1f} MB)"


def _table(r: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"kvhandoff demo: {r['model']}, {r['context_tokens']:,} tokens, "
              f"{r['prefix_tokens']:,} cached on decode, page {r['page_size_tokens']}, "
              f"{r['layers']} layers")
    t.add_column("what")
    t.add_column("value", justify="right")
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
        transport: str = typer.Option("ucx", help="Data transport: ucx, tcp or inproc."),
        layer_ms: float = typer.Option(_DEFAULT_LAYER_MS, min=0.0, help="Simulated compute "
                                       "per layer on prefill, in ms (on top of filling pages)."),
        page_size: int | None = typer.Option(None, help="Page size in tokens (default: the "
                                             "preset's)."),
        timeout: float = typer.Option(120.0, help="Bound on the whole handoff, in seconds."),
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
            with _sigterm_as_interrupt(), bars:
                if not as_json:
                    con.print(f"starting a bootstrap server, a prefill and a decode process "
                              f"({transport}) ...")
                result = run_demo(model=model, context=context, prefix=prefix,
                                  transport=transport, layer_ms=layer_ms, page_size=page_size,
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
