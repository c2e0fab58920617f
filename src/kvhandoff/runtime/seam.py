"""The seam where a test stands between the session and the control loop.

The loop drives a `Stepper`: something that takes events (`handle(event, now)` returns the
effects to execute, in order) and says when it must next be ticked (`next_wakeup`). In
production that is the `TransferSession` itself. A test that drops, holds or copies effects
(`kvhandoff.testing.faults.MessageFaults`, any `protocol.effects.EffectFilter`) gives the agent
an ``effect_filter``; the agent then puts `Filtered` in front of the session, and the loop runs
exactly as it does in production. A test that wants one on an agent already running installs it
(``agent._loop.install(lambda step: Filtered(step, my_filter))``).

Rules: nothing here is on the path of an agent built without a filter; a held effect comes out
with the first `Tick` at or after its time (the loop ticks every pass, and `next_wakeup` wakes
it in time), before the Tick's own effects.
"""

from __future__ import annotations

from typing import Protocol

from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import Effect, EffectFilter


class Stepper(Protocol):
    """What the control loop feeds events to (a `TransferSession`, or `Filtered`)."""

    def handle(self, event: ev.Event, now: float) -> list[Effect]: ...

    def next_wakeup(self) -> float: ...


class Filtered:
    """`session` with every effect passed through `effect_filter` (tests only)."""

    __slots__ = ("_filter", "_session")

    def __init__(self, session: Stepper, effect_filter: EffectFilter) -> None:
        self._session = session
        self._filter = effect_filter

    @property
    def effect_filter(self) -> EffectFilter:
        return self._filter

    def handle(self, event: ev.Event, now: float) -> list[Effect]:
        out = list(self._filter.due(now)) if isinstance(event, ev.Tick) else []
        for eff in self._session.handle(event, now):
            out.extend(self._filter(eff, now))
        return out

    def next_wakeup(self) -> float:
        when = self._session.next_wakeup()
        held = self._filter.next_due()
        return when if held is None else min(when, held)

    def __repr__(self) -> str:
        return f"Filtered({self._session!r}, {self._filter!r})"
