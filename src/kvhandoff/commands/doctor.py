"""`kvhandoff doctor`: check a node before it goes live.

Prints a table (or ``--json``) of checks: the UCX library loaded (version, build: verbs,
rdmacm, cuda), its transports and the lanes a loopback endpoint picks; NIXL; RDMA devices,
locked memory, /dev/shm, cross-process memory access, hugepages; CUDA devices and CUDA IPC;
the bootstrap server's /health and /ready; the address family (IPv4, IPv6, a name) the agents
(KVHANDOFF_AGENT_HOST) and the bootstrap server use. Each problem comes with a one-line fix.
Exit code 1 when a check FAILs (blocking), else 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvhandoff.settings import Settings

_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of a "
                                     "table."),
        bootstrap_url: str | None = typer.Option(
            None, help="Bootstrap server to check (env KVHANDOFF_BOOTSTRAP_URL)."),
        require_rdma: bool | None = typer.Option(
            None, "--require-rdma/--allow-tcp", help="Treat a missing RDMA path as blocking "
            "(env KVHANDOFF_REQUIRE_RDMA; default false)."),
        probes: bool = typer.Option(True, "--probes/--no-probes", help="Run the checks that "
                                    "start processes or endpoints (loopback UCX lanes, "
                                    "cross-process read, CUDA IPC)."),
        root: Path = typer.Option(Path("/"), help="Read system files (/sys, /proc, /dev) under "
                                  "this directory (for tests)."),
    ) -> None:
        """Check this node: UCX build and lanes, RDMA, memlock, /dev/shm, ptrace scope,
        hugepages, CUDA/CUDA IPC, the bootstrap server, the agents' and the server's address
        family (KVHANDOFF_AGENT_HOST). Exit 1 on a blocking problem."""
        from pydantic import ValidationError

        from kvhandoff.doctor import report_json, run_checks

        try:
            settings = Settings()
        except ValidationError as e:  # a bad KVHANDOFF_* variable is itself a blocking problem
            bad = "; ".join(f"KVHANDOFF_{'.'.join(map(str, x['loc'])).upper()}: {x['msg']}"
                            for x in e.errors())
            typer.echo(f"kvhandoff doctor: bad setting in the environment: {bad}", err=True)
            raise typer.Exit(1) from None
        results = run_checks(
            root, bootstrap_url=bootstrap_url or settings.bootstrap_url,
            require_rdma=settings.require_rdma if require_rdma is None else require_rdma,
            transport=str(settings.transport), auto_cross_host=str(settings.auto_cross_host),
            probes=probes, layout_probe=settings.layout_probe, agent_host=settings.agent_host,
            settings=settings)
        report = report_json(results)
        if as_json:
            typer.echo(json.dumps(report, indent=2, default=str))
        else:
            from rich.console import Console
            from rich.table import Table
            from rich.text import Text

            table = Table(title="kvhandoff doctor", show_lines=True)
            for col in ("check", "status", "finding", "fix"):
                table.add_column(col, overflow="fold")
            for r in results:
                table.add_row(r.name, Text(r.status.value, style=_STYLE[r.status.value]),
                              Text(r.summary), Text(r.fix or ""))
            console = Console(width=max(Console().width, 140))
            console.print(table)
            if report["blocking"]:
                console.print(Text(f"{len(report['blocking'])} blocking problem(s): "
                                   f"{', '.join(report['blocking'])}", style="bold red"))
            else:
                console.print(Text("no blocking problem", style="green"))
        raise typer.Exit(1 if report["blocking"] else 0)
