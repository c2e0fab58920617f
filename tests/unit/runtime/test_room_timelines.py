"""`runtime.tracing.RoomTimelines`, driven as the control loop drives it: `observe` of each
handled event with its effects, then `settle` once those effects ran. A room's end is stamped
when it is observed, but its figures (and, with the otel extra, its spans) are made at
`settle`, after the engine was told: they are not on the handoff's tail. In between, the
room's figures are still there on demand."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import RoomUpdate
from kvhandoff.runtime import tracing
from kvhandoff.runtime.tracing import RoomTimelines
from kvhandoff.state_machine import KVPoll, Role


def test_a_rooms_figures_are_made_once_its_end_was_executed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    timings = tracing.RoomTimeline.timings

    def counted(self: tracing.RoomTimeline) -> dict[str, Any]:
        made.append(self.room)
        return timings(self)

    monkeypatch.setattr(tracing.RoomTimeline, "timings", counted)
    tls = RoomTimelines(role=Role.DECODE, agent_id="d", transport="inproc")
    token = object()
    tls.observe(ev.OpenReceiver(7, token, (("prefill:1", 1),)), [])
    tls.settle()  # nothing ended: nothing to make
    assert made == []
    tls.observe(ev.Tick(read_at=0.0),
                [RoomUpdate(token, KVPoll.Success, None, frozenset({0, 1}), True)])
    assert made == []  # ended, stamped, but its figures wait for settle
    assert tls.timings(7)["state"] == "Success"  # asked meanwhile: made on demand
    made.clear()
    tls.settle()
    assert made == [7]
    got = tls.timings(7)
    assert got["state"] == "Success" and got["layers"] == 2 and got["total_ms"] is not None
    assert made == [7]  # kept: asking again makes nothing
    tls.settle()
    assert made == [7]


def test_timeline_lines_only_when_enabled_and_a_rooms_stamps_when_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    import json

    def lines() -> list[dict[str, Any]]:
        return [json.loads(r.getMessage().removeprefix("kvhandoff timeline "))
                for r in caplog.records if r.name == "kvhandoff.timeline"]

    caplog.set_level("INFO", logger="kvhandoff.timeline")
    tracing.mark("decode.alloc", rid="r1", room=7)
    assert lines() == []  # off by default: nothing written
    tracing.enable_marks()
    try:
        tracing.mark("decode.alloc", rid="r1", room=7)
        tls = RoomTimelines(role=Role.DECODE, agent_id="d", transport="inproc")
        token = object()
        tls.engine_opened(token, "r1")
        tls.observe(ev.OpenReceiver(7, token, None), [])
        tls.observe(ev.PeersResolved(7, token, (("prefill:1", 1),)), [])
        tls.observe(ev.Tick(read_at=0.0),
                    [RoomUpdate(token, KVPoll.Success, None, frozenset({0, 1}), True)])
        assert [x["what"] for x in lines()] == ["decode.alloc"]  # the room's: at settle
        tls.settle()
    finally:
        tracing.enable_marks(False)
    alloc, room = lines()
    assert alloc["rid"] == "r1" and alloc["room"] == 7 and alloc["t_ns"] > 0
    assert room["what"] == "decode.room" and room["rid"] == "r1" and room["state"] == "Success"
    assert room["opened"] <= room["lookup"][0] <= room["lookup"][1] <= room["done"]
    assert room["layers"][0] <= room["layers"][1] == room["done"]
