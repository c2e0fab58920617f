"""Draw the room state diagram from `TRANSITIONS` (Mermaid or Graphviz DOT).

Rule: the diagram is derived, never drawn by hand. `kvhandoff inspect states` prints it and
docs/STATE_MACHINE.md embeds it; a test keeps the document equal to what this module renders.

Edges between the same two states are merged into one labelled edge; an event only one side
receives is suffixed with that side, e.g. ``LayerSent (prefill)``; when an edge carries every
failure event they are written ``any failure event`` and listed once in a comment.
"""

from __future__ import annotations

from kvhandoff.state_machine.transitions import (
    FAILURE_EVENTS,
    INITIAL,
    ROLE_EVENTS,
    TERMINAL,
    TRANSITIONS,
)
from kvhandoff.state_machine.vocabulary import KVPoll, LegEvent

ANY_FAILURE = "any failure event"
_LIFE_ORDER = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)


def _event_label(kind: type[LegEvent]) -> str:
    sides = [role for role, kinds in ROLE_EVENTS.items() if kind in kinds]
    return kind.__name__ if len(sides) != 1 else f"{kind.__name__} ({sides[0]})"


def diagram_edges() -> list[tuple[KVPoll, KVPoll, tuple[str, ...]]]:
    """The edges of the diagram: (source, target, labels), in life-cycle order."""
    grouped: dict[tuple[KVPoll, KVPoll], list[type[LegEvent]]] = {}
    for (src, kind), dst in TRANSITIONS.items():
        grouped.setdefault((src, dst), []).append(kind)
    edges = []
    for (src, dst), kinds in grouped.items():
        merged = set(FAILURE_EVENTS) <= set(kinds)
        labels = ([ANY_FAILURE] if merged else []) + [
            _event_label(k) for k in kinds if not (merged and k in FAILURE_EVENTS)
        ]
        edges.append((src, dst, tuple(labels)))
    edges.sort(key=lambda e: (_LIFE_ORDER.index(e[0]), _LIFE_ORDER.index(e[1])))
    return edges


def _failure_legend() -> str:
    return f"{ANY_FAILURE} = " + " | ".join(k.__name__ for k in FAILURE_EVENTS)


def render_mermaid() -> str:
    """The diagram as a Mermaid ``stateDiagram-v2`` (ends with a newline)."""
    lines = ["stateDiagram-v2", f"    %% {_failure_legend()}", f"    [*] --> {INITIAL.name}"]
    lines += [
        f"    {src.name} --> {dst.name}: {', '.join(labels)}"
        for src, dst, labels in diagram_edges()
    ]
    lines += [f"    {s.name} --> [*]" for s in _LIFE_ORDER if s in TERMINAL]
    return "\n".join(lines) + "\n"


def render_dot() -> str:
    """The diagram as a Graphviz DOT digraph (ends with a newline)."""
    lines = [
        "digraph KVPoll {",
        f"    // {_failure_legend()}",
        "    rankdir=LR;",
        "    node [shape=box, style=rounded];",
        '    start [shape=point, label=""];',
        f"    start -> {INITIAL.name};",
    ]
    lines += [f"    {s.name} [peripheries=2];" for s in _LIFE_ORDER if s in TERMINAL]
    lines += [
        f'    {src.name} -> {dst.name} [label="{", ".join(labels)}"];'
        for src, dst, labels in diagram_edges()
    ]
    lines.append("}")
    return "\n".join(lines) + "\n"
