"""The diagram is derived from TRANSITIONS, and docs/STATE_MACHINE.md cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from kvhandoff.cli import app
from kvhandoff.state_machine import (
    FAILURE_EVENTS,
    TRANSITIONS,
    diagram_edges,
    render_dot,
    render_mermaid,
)
from kvhandoff.state_machine.diagram import ANY_FAILURE

DOC = Path(__file__).resolve().parents[3] / "docs" / "STATE_MACHINE.md"
BLOCK = re.compile(
    r"<!-- BEGIN GENERATED: kvhandoff inspect states -->\n```mermaid\n(.*?)```\n"
    r"<!-- END GENERATED -->",
    re.S,
)


def test_edges_cover_the_table_exactly() -> None:
    seen = set()
    for src, dst, labels in diagram_edges():
        for label in labels:
            if label == ANY_FAILURE:
                names = [k.__name__ for k in FAILURE_EVENTS]
            else:
                names = [label.split(" ")[0]]
            for name in names:
                (kind,) = [k for (s, k) in TRANSITIONS if s == src and k.__name__ == name]
                assert TRANSITIONS[(src, kind)] is dst
                seen.add((src, kind))
    assert seen == set(TRANSITIONS)


def test_mermaid_and_dot_draw_every_edge() -> None:
    mermaid, dot = render_mermaid(), render_dot()
    assert mermaid.startswith("stateDiagram-v2\n") and "[*] --> Bootstrapping" in mermaid
    assert dot.startswith("digraph KVPoll {") and dot.rstrip().endswith("}")
    for src, dst, labels in diagram_edges():
        assert f"{src.name} --> {dst.name}: {', '.join(labels)}\n" in mermaid
        assert f'{src.name} -> {dst.name} [label="{", ".join(labels)}"];' in dot


def test_doc_diagram_equals_the_generated_one() -> None:
    match = BLOCK.search(DOC.read_text(encoding="utf-8"))
    assert match, f"{DOC} lost its generated diagram block"
    assert match.group(1) == render_mermaid(), (
        "docs/STATE_MACHINE.md is stale: paste the output of `kvhandoff inspect states`"
    )


def test_cli_prints_both_formats_and_refuses_an_unknown_one() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", "states"])
    assert result.exit_code == 0, result.output
    assert result.output == render_mermaid()
    result = runner.invoke(app, ["inspect", "states", "--format", "dot"])
    assert result.exit_code == 0, result.output
    assert result.output == render_dot()
    result = runner.invoke(app, ["inspect", "states", "--format", "svg"])
    assert result.exit_code != 0
    assert "--format" in result.output
