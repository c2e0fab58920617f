"""RoomView wakes an engine thread only when what it waits for holds: an update that lands
another layer leaves it asleep; the one it waits for, a failure or the release wake it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvhandoff.errors import Failure, FailureKind
from kvhandoff.runtime.handles import RoomView
from kvhandoff.state_machine import KVPoll


def _waiting(v: RoomView, pred_holds: Callable[[], bool]
             ) -> tuple[threading.Thread, list[bool], list[int]]:
    """A thread in `v.wait_until`, counting its own evaluations of the predicate; returns once
    it sleeps in the view's condition (it holds the view's lock until then)."""
    entered = threading.Event()
    evaluated: list[int] = []
    result: list[bool] = []

    def pred() -> bool:
        if threading.current_thread() is t:
            evaluated.append(1)
            entered.set()
        return bool(pred_holds())

    t = threading.Thread(target=lambda: result.append(v.wait_until(pred, 30)), daemon=True)
    t.start()
    assert entered.wait(30)
    with v._cond:  # acquired only once the waiter sleeps in wait()
        pass
    return t, result, evaluated


def test_a_layer_it_does_not_wait_for_leaves_the_waiter_asleep() -> None:
    v = RoomView(7, (0, 1, 2, 3), None)
    t, result, evaluated = _waiting(v, lambda: 3 in v.landed)
    before = len(evaluated)  # before it slept: once before registering, once in the loop
    for n in range(1, 3):
        v.update(KVPoll.Transferring, None, frozenset(range(n)), False)
    with v._cond:
        assert len(evaluated) == before  # the control thread's checks are not the waiter's
        assert len(v._cond._waiters) == 1  # type: ignore[attr-defined]  # never notified
    v.update(KVPoll.Transferring, None, frozenset({0, 1, 3}), False)
    t.join(30)
    assert result == [True] and len(evaluated) == before + 1


def test_failure_and_release_wake_their_waiters() -> None:
    v = RoomView(8, (0, 1), None)
    t, result, _ = _waiting(v, lambda: 1 in v.landed or v.failure is not None)
    v.update(KVPoll.Failed, Failure(FailureKind.TRANSPORT, "peer gone"), frozenset(), True)
    t.join(30)
    assert result == [True]
    t2, result2, _ = _waiting(v, lambda: v.released)
    v.release()
    t2.join(30)
    assert result2 == [True]
