"""`Sender.layer_ready(layer, event)` (and `layers_ready(layers, event)`) with a device event,
on CPU: a fake event whose `query()`
says False until the test completes it (the `torch.cuda.Event` API). The engine thread never
waits (the fake refuses `synchronize()`); the layer is not sent before its event completed,
then it is; a room's layers keep their order; a `query()` that raises fails the room naming
the layer; closing an agent with events pending does not hang. Two real agents over the
in-process transport (conftest), and the waiter alone with a recording post."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvhandoff.errors import Aborted, ConfigError, FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.runtime.eventwait import EventWaiter
from kvhandoff.state_machine import KVPoll

from .conftest import WAIT_S, Pair, layers_of

SEQ = 100


class FakeEvent:
    """query() is False until complete(); raises `error` when set; counts its queries and
    lets a test wait (bounded) until it was queried n times. synchronize() is refused: the
    engine thread must never block on a device event."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self.error = error
        self.queries = 0
        self._cond = threading.Condition()

    def query(self) -> bool:
        with self._cond:
            self.queries += 1
            self._cond.notify_all()
        if self.error is not None:
            raise self.error
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        raise AssertionError("synchronize() called: the engine thread must not block")

    def wait_queried(self, n: int, timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.queries >= n, timeout)


def _landed(pair: Pair, receiver: Any) -> frozenset[int]:
    return receiver._v.landed


def test_layer_ready_returns_at_once_and_the_layer_waits_for_its_event(pair: Any) -> None:
    p = pair()
    sender, receiver, _, dst = p.open(1, SEQ)
    layers = layers_of(p.prefill.layout)
    first = FakeEvent()
    sender.layer_ready(layers[0], first)  # returns although the event is not complete
    for lid in layers[1:]:  # marked without events: they queue behind the first
        sender.layer_ready(lid)
    waiter = p.prefill.agent._events
    assert first.wait_queried(3), "the waiter never polled the event"
    assert waiter.pending() == len(layers) and waiter.posted == 0
    assert _landed(p, receiver) == frozenset()
    assert receiver.poll() is not KVPoll.Success
    first.complete()
    for lid in layers:
        assert receiver.wait_for_layer(lid, WAIT_S)
    assert receiver.wait(WAIT_S) is KVPoll.Success
    assert sender.wait(WAIT_S) is KVPoll.Success
    assert p.verify(dst, SEQ, 0) == (0, 0)
    assert waiter.pending() == 0 and waiter.posted == len(layers)


def test_each_layer_waits_for_its_own_event_in_order(pair: Any) -> None:
    p = pair()
    sender, receiver, _, dst = p.open(2, SEQ)
    layers = layers_of(p.prefill.layout)
    events = [FakeEvent() for _ in layers]
    for lid, e in zip(layers, events, strict=True):
        sender.layer_ready(lid, e)
    events[-1].complete()  # the last completes first: nothing may go before layer 0
    assert events[0].wait_queried(3)
    assert p.prefill.agent._events.posted == 0
    for lid, e in zip(layers, events, strict=True):
        e.complete()
        assert receiver.wait_for_layer(lid, WAIT_S)
    assert receiver.wait(WAIT_S) is KVPoll.Success
    assert p.verify(dst, SEQ, 0) == (0, 0)


def test_an_event_whose_query_raises_fails_the_room_naming_the_layer(pair: Any) -> None:
    p = pair()
    sender, receiver, _, _ = p.open(3, SEQ)
    layers = layers_of(p.prefill.layout)
    sender.layer_ready(layers[0])
    bad = FakeEvent(error=RuntimeError("CUDA error: an illegal memory access"))
    sender.layer_ready(layers[1], bad)
    for lid in layers[2:]:
        sender.layer_ready(lid, FakeEvent())  # never complete: dropped with the room
    assert sender.wait(WAIT_S) is KVPoll.Failed
    assert sender.failure_kind is FailureKind.ABORTED
    assert f"layer {layers[1]}" in (sender.failure or "")
    assert "illegal memory access" in (sender.failure or "")
    with pytest.raises(Aborted, match=f"layer {layers[1]}"):
        sender.raise_for_failure()
    assert receiver.wait(WAIT_S) is KVPoll.Failed  # the decode learns it too
    assert p.prefill.agent._events.failed == 1


def test_layers_ready_with_one_event_waits_for_it_then_sends_every_layer(pair: Any) -> None:
    """`layers_ready(layers, event)`: one entry for the waiter; nothing goes before the event
    completed, then every layer lands, byte-exact."""
    p = pair()
    sender, receiver, _, dst = p.open(7, SEQ)
    layers = layers_of(p.prefill.layout)
    e = FakeEvent()
    sender.layers_ready(layers, e)
    waiter = p.prefill.agent._events
    assert e.wait_queried(3)
    assert waiter.pending() == 1 and _landed(p, receiver) == frozenset()
    e.complete()
    assert receiver.wait(WAIT_S) is KVPoll.Success and sender.wait(WAIT_S) is KVPoll.Success
    assert p.verify(dst, SEQ, 0) == (0, 0)
    assert waiter.posted == 1


def test_layers_ready_whose_event_raises_fails_the_room_naming_its_layers(pair: Any) -> None:
    p = pair()
    sender, receiver, _, _ = p.open(8, SEQ)
    layers = layers_of(p.prefill.layout)
    sender.layers_ready(layers[1:], FakeEvent(error=RuntimeError("CUDA error: launch failed")))
    assert sender.wait(WAIT_S) is KVPoll.Failed
    assert sender.failure_kind is FailureKind.ABORTED
    assert f"layers {', '.join(map(str, layers[1:3]))}" in (sender.failure or "")
    assert "launch failed" in (sender.failure or "")
    assert receiver.wait(WAIT_S) is KVPoll.Failed


def test_a_room_aborted_while_its_event_is_pending_is_dropped(pair: Any) -> None:
    p = pair()
    sender, receiver, _, _ = p.open(4, SEQ)
    waiter = p.prefill.agent._events
    e = FakeEvent()
    sender.layer_ready(layers_of(p.prefill.layout)[0], e)
    assert e.wait_queried(2)
    sender.abort("engine gave up")
    assert sender.poll() is KVPoll.Failed
    t = waiter.thread
    n = e.queries
    if t is not None:
        t.join(WAIT_S)  # the entry is dropped; idle, the thread ends
        assert not t.is_alive()
    assert waiter.pending() == 0 and waiter.posted == 0
    assert e.queries <= n + 1  # not polled on after the room ended
    assert receiver.wait(WAIT_S) is KVPoll.Failed


def test_closing_the_agent_with_pending_events_does_not_hang(pair: Any) -> None:
    p = pair()
    sender, _, _, _ = p.open(5, SEQ)
    waiter = p.prefill.agent._events
    events = [FakeEvent() for _ in layers_of(p.prefill.layout)]
    for lid, e in zip(layers_of(p.prefill.layout), events, strict=True):
        sender.layer_ready(lid, e)
    assert events[0].wait_queried(2)
    t = waiter.thread
    assert t is not None and t.is_alive()
    p.prefill.agent.close()  # returns without waiting for any device event
    t.join(WAIT_S)
    assert not t.is_alive()
    assert waiter.pending() == 0 and waiter.posted == 0
    assert sender.wait(WAIT_S) is KVPoll.Failed


def test_an_event_without_query_is_refused_on_the_engine_thread(pair: Any) -> None:
    p = pair()
    sender, _, _, _ = p.open(6, SEQ)
    with pytest.raises(ConfigError, match="event must have a query"):
        sender.layer_ready(0, object())
    with pytest.raises(ConfigError, match="not a layer of the layout"):
        sender.layer_ready(99, FakeEvent())
    with pytest.raises(ConfigError, match=r"layers_ready: \[99\] not layers of the layout"):
        sender.layers_ready([0, 99])  # nothing of it is marked
    with pytest.raises(ConfigError, match="event must have a query"):
        sender.layers_ready([0], object())
    assert p.prefill.agent._events.pending() == 0 and p.prefill.agent._events.posted == 0
    sender.abort()


# ---- the waiter alone --------------------------------------------------------------------

class _View:
    def __init__(self, room: int) -> None:
        self.room = room
        self.done = False


class _Posts:
    def __init__(self) -> None:
        self.items: list[ev.Event] = []
        self._cond = threading.Condition()

    def __call__(self, e: ev.Event) -> None:
        with self._cond:
            self.items.append(e)
            self._cond.notify_all()

    def wait_count(self, n: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.items) >= n, WAIT_S)


def test_waiter_keeps_each_rooms_order_and_lets_other_rooms_pass() -> None:
    posts = _Posts()
    w = EventWaiter(posts, closed=lambda: False, idle_exit_s=0.05)
    a, b = _View(1), _View(2)
    ea = [FakeEvent() for _ in range(3)]
    for i, e in enumerate(ea):
        w.submit(a, e, ev.LayerReady(1, a, i), layer=i)
    w.submit(a, None, ev.AbortRoom(1, a, "marker"))  # no event, but behind room 1's layers
    eb = FakeEvent()
    w.submit(b, eb, ev.LayerReady(2, b, 0), layer=0)
    w.submit(b, None, ev.LayerReady(2, b, 1))
    ea[2].complete()
    ea[1].complete()
    eb.complete()  # room 2 is not held up by room 1
    assert posts.wait_count(2)
    assert [(e.room, e.layer) for e in posts.items] == [(2, 0), (2, 1)]  # type: ignore[attr-defined]
    assert ea[0].wait_queried(2) and len(posts.items) == 2
    ea[0].complete()
    assert posts.wait_count(6)
    room1 = [e for e in posts.items if e.room == 1]
    assert [getattr(e, "layer", "abort") for e in room1] == [0, 1, 2, "abort"]
    # with nothing queued a submit without an event is posted on the caller's thread
    w.submit(a, None, ev.LayerReady(1, a, 5))
    assert posts.items[-1].layer == 5  # type: ignore[attr-defined]
    t = w.thread
    if t is not None:
        t.join(WAIT_S)
        assert not t.is_alive()  # idle: it ended; the next event starts another


def test_waiter_ends_when_closed_and_drops_what_waits() -> None:
    posts = _Posts()
    closed = threading.Event()
    w = EventWaiter(posts, closed=closed.is_set)
    e = FakeEvent()
    w.submit(_View(1), e, ev.LayerReady(1, None, 0), layer=0)
    assert e.wait_queried(2)
    closed.set()
    t = w.thread
    assert t is not None
    t.join(WAIT_S)
    assert not t.is_alive() and w.pending() == 0 and posts.items == []


def test_a_chunk_added_while_its_layers_wait_goes_after_them(pair: Any) -> None:
    """Chunked prefill: add_chunk right after marking the first chunk's layers with pending
    events; the chunk waits behind them (it would otherwise reach the session first); then
    all lands byte-exact."""
    from kvhandoff.engine_sim.pattern import write_tokens

    from .conftest import SEED

    p = pair()
    lay = p.prefill.layout
    ps = lay.page_size_tokens
    src = p.prefill.pool.alloc(-(-SEQ // ps))
    dst = p.decode.pool.alloc(-(-SEQ // ps))
    receiver = p.decode.agent.receiver(7, peer=p.prefill.agent.address)
    receiver.init(dst, SEQ, 0)
    first_end = 2 * ps
    sender = p.prefill.agent.sender(7, pages=src[:2], seq_len=SEQ, chunk_end=first_end)
    waiter = p.prefill.agent._events
    events = []
    for start, end in ((0, first_end), (first_end, SEQ)):
        if start:
            sender.add_chunk(src[2:], SEQ)  # behind the first chunk's pending layers
            assert events[0].wait_queried(2)
            assert waiter.pending() == len(layers_of(lay)) + 1 and waiter.posted == 0
        for ri, reg in enumerate(lay.regions):
            for lid in reg.layer_ids:
                write_tokens(p.prefill.agent.buffers.array(reg.name, lid), lay, ri, lid,
                             src[start // ps:], start, end, SEED)
        for lid in layers_of(lay):
            e = FakeEvent()
            events.append(e)
            sender.layer_ready(lid, e)
    assert receiver.poll() is not KVPoll.Success
    for e in events:
        e.complete()
    assert receiver.wait(WAIT_S) is KVPoll.Success, receiver.failure
    assert sender.wait(WAIT_S) is KVPoll.Success, sender.failure
    assert p.verify(dst, SEQ, 0) == (0, 0)
