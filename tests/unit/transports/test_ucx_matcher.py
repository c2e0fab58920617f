"""The UCX receive matcher's store of messages that came before their receive was posted
(issue 48: early messages bounded and aged). Before, it held every such message's handle,
unbounded and for ever, until the transport closed. A held "handle" here is any object (the
matcher only hands it back); the clock is a fake one, moved by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvhandoff.errors import TransportError
from kvhandoff.transports.ucx.matcher import HELD_OVERHEAD, ReceiveMatcher

BITS = 24
BOUND = 10_000  # tcp_early_bytes in these tests: per stream; 4 times that in all


@dataclass
class Plan:
    nchunks: int


class Op:
    def __init__(self, stream: int, nchunks: int, tag: int = 7) -> None:
        self.base = stream << BITS  # a chunk-0 tag (chunk bits clear)
        self.tag = tag
        self.plan = Plan(nchunks)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def matcher(clock: Clock | None = None, keep_s: float = 5.0) -> tuple[ReceiveMatcher[Op],
                                                                         dict[str, int]]:
    counters: dict[str, int] = {}
    m: ReceiveMatcher[Op] = ReceiveMatcher(1 << 16, chunk_bits=BITS, early_bytes=BOUND,
                                           keep_s=keep_s, counters=counters,
                                           now=clock or Clock())
    return m, counters


def test_an_early_message_is_matched_when_its_receive_is_posted_later() -> None:
    m, counters = matcher()
    op = Op(1, nchunks=3)
    assert m.arrived(op.base ^ 2, "h2", 100) == []  # held
    assert m.early.total == 100 + HELD_OVERHEAD
    ready, drop = m.post(op)
    assert ready == [(2, "h2")] and drop == []
    assert m.early.total == 0
    assert m.arrived(op.base ^ 0, "h0", 100) == (op, 0)  # the rest is expected
    assert m.arrived(op.base ^ 1, "h1", 100) == (op, 1)
    assert counters["data_early_dropped"] == 0


def test_a_stream_over_its_bound_is_dropped_and_its_receive_fails_naming_the_setting() -> None:
    m, counters = matcher()
    flood, honest = Op(1, nchunks=64), Op(2, nchunks=1)
    assert m.arrived(honest.base, "honest", 1000) == []
    n = 3000  # + HELD_OVERHEAD: two fit in BOUND, the third does not
    assert m.arrived(flood.base ^ 0, "f0", n) == []
    assert m.arrived(flood.base ^ 1, "f1", n) == []
    # the third goes over: dropped at once with what its stream held
    assert m.arrived(flood.base ^ 2, "f2", n) == ["f0", "f1", "f2"]
    assert counters["data_early_dropped"] == 3
    assert m.early.held_bytes((flood.base, 0)) == 0
    # what still comes of that stream is dropped at once, never held
    assert m.arrived(flood.base ^ 3, "f3", 10) == ["f3"]
    assert counters["data_early_dropped"] == 4
    assert m.early.total == 1000 + HELD_OVERHEAD  # the other stream's message is still held
    with pytest.raises(TransportError, match="tcp_early_bytes"):
        m.post(flood)
    # the failed receive's stream: its late messages are dropped, not held
    assert m.arrived(flood.base ^ 5, "f5", 10) == ["f5"]
    assert m.post(honest) == ([(0, "honest")], [])


def test_held_bytes_are_bounded_in_total_over_streams() -> None:
    m, counters = matcher()
    n = 8000  # one per stream fits its own bound; four of them fill the total (4 * BOUND)
    held = []
    for s in range(1, 9):
        got = m.arrived(Op(s, 1).base, f"s{s}", n)
        if got == []:
            held.append(s)
        else:
            assert got == [f"s{s}"]
        assert m.early.total <= 4 * BOUND
    assert held == [1, 2, 3, 4]
    assert counters["data_early_dropped"] == 4
    with pytest.raises(TransportError, match="tcp_early_bytes"):
        m.post(Op(5, 1))
    assert m.post(Op(1, 1)) == ([(0, "s1")], [])


def test_held_messages_are_aged_and_their_receive_fails_naming_stall_timeout_s() -> None:
    clock = Clock()
    m, counters = matcher(clock, keep_s=5.0)
    old, young = Op(1, 2), Op(2, 1)
    assert m.next_expiry() is None
    assert m.arrived(old.base ^ 0, "o0", 10) == []
    clock.t += 3
    assert m.arrived(old.base ^ 1, "o1", 10) == []
    assert m.arrived(young.base, "y", 10) == []
    assert m.next_expiry() == pytest.approx(2.0)  # the oldest stream's first arrival + 5 s
    assert m.expire() == []
    clock.t += 2.5  # the old stream's first message was held 5.5 s, the young one 2.5 s
    assert m.expire() == ["o0", "o1"]
    assert counters["data_early_dropped"] == 2
    assert m.early.total == 10 + HELD_OVERHEAD
    assert m.next_expiry() == pytest.approx(2.5)
    with pytest.raises(TransportError, match="stall_timeout_s"):
        m.post(old)
    assert m.post(young) == ([(0, "y")], [])
    assert m.next_expiry() is None


def test_a_cancelled_receive_drops_what_its_stream_held_and_what_comes_later() -> None:
    m, counters = matcher()
    op = Op(3, 4)
    ready, _ = m.post(op)
    assert ready == []
    assert m.arrived(op.base ^ 9, "stray", 10) == []  # not a chunk of its plan: held
    assert m.forget(op) == ["stray"]
    assert m.arrived(op.base ^ 1, "late", 10) == ["late"]
    assert m.early.total == 0
    assert counters["data_early_dropped"] == 0  # a cancel's drops are not early drops
