"""The `kvhandoff` command: serve, route, drain, demo, bench, plan, inspect, doctor, verify.

Each subcommand lives in `kvhandoff.commands.<name>` and exposes `register(app)`; modules are
imported here so `kvhandoff --help` lists all of them, but heavy imports (torch, ucxx) happen
inside the command functions only.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvhandoff",
    help="Hand the KV cache of a request from a prefill engine to a decode engine.",
    no_args_is_help=True,
    add_completion=False,
)



@app.callback()
def _root() -> None:
    """kvhandoff: per-layer, checksummed KV-cache handoff from prefill to decode."""


_COMMANDS = ("plan", "inspect", "serve", "route", "demo", "bench", "doctor", "verify")

for _name in _COMMANDS:
    try:
        _mod = importlib.import_module(f"kvhandoff.commands.{_name}")
    except ModuleNotFoundError as e:  # a command not built yet must not break the others
        if e.name != f"kvhandoff.commands.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
