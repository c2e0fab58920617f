"""`kvhandoff inspect ...`: look inside kvhandoff's own definitions.

`inspect states` prints the room state diagram, derived from `TRANSITIONS` (never drawn by
hand), as Mermaid (default) or Graphviz DOT.
"""

from __future__ import annotations

import enum

import typer

inspect_app = typer.Typer(
    name="inspect",
    help="Look inside kvhandoff's definitions (state machine, ...).",
    no_args_is_help=True,
)


class DiagramFormat(str, enum.Enum):
    MERMAID = "mermaid"
    DOT = "dot"


@inspect_app.callback()
def _inspect() -> None:
    """Look inside kvhandoff's definitions."""


@inspect_app.command("states")
def states(
    fmt: DiagramFormat = typer.Option(
        DiagramFormat.MERMAID, "--format", "-f", help="Diagram language.", case_sensitive=False
    ),
) -> None:
    """Print the room state diagram (KVPoll), derived from the transition table."""
    from kvhandoff.state_machine import render_dot, render_mermaid

    text = render_mermaid() if fmt is DiagramFormat.MERMAID else render_dot()
    typer.echo(text, nl=False)


def register(app: typer.Typer) -> None:
    """Add the `inspect` command group to `app`."""
    app.add_typer(inspect_app, name="inspect")
