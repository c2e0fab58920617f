"""`kvhandoff.testing.faults` does what it says: its faults fire and the agent reacts as the
product must (the rest of the matrix is in tests/reliability)."""

from __future__ import annotations

from collections.abc import Callable

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Log, Send
from kvhandoff.runtime.seam import Filtered
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.faults import FaultyTransport, MessageFaults

from .conftest import WAIT_S, Pair, layers_of

MakePair = Callable[..., Pair]
SEQ = 100


def test_delayed_messages_still_hand_off(pair: MakePair) -> None:
    pr = pair(decode_faults={"delay_ms": 30})
    s, rv, _, dst = pr.open(1, SEQ)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    assert rv.wait(WAIT_S) is KVPoll.Success and s.wait(WAIT_S) is KVPoll.Success
    assert pr.verify(dst, SEQ, 0) == (0, 0)
    step = pr.decode.agent._loop.stepper
    assert isinstance(step, Filtered)
    filt = step.effect_filter
    assert isinstance(filt, MessageFaults) and filt.delay_s == 0.03 and not filt.dropped


def test_the_delay_filter_holds_messages_until_due_and_passes_the_rest() -> None:
    """Delaying is the filter's own business (no effect exists for it in the product): it
    holds a message and hands it back to the driver, in order, once its time came."""
    filt = MessageFaults(delay_s=0.5)
    first, second = (Send("d:1", P.RoomAck(src="p:1", gen=1, room=room)) for room in (1, 2))
    assert list(filt(first, 10.0)) == [] and list(filt(second, 10.2)) == []
    other = Log(20, "not a message")
    assert list(filt(other, 10.2)) == [other]  # only control messages are delayed
    assert filt.next_due() == 10.5
    assert filt.due(10.4) == []
    assert filt.due(10.5) == [first] and filt.next_due() == 10.7
    assert filt.due(11.0) == [second] and filt.next_due() is None


def test_a_stalled_layer_fails_the_room_by_its_stall_deadline(pair: MakePair) -> None:
    pr = pair(prefill_faults={"stall_layers": [2]}, stall_timeout_s=0.5)
    s, rv, _, _ = pr.open(2, SEQ)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
    assert rv.failure_kind is FailureKind.DEADLINE or s.failure_kind is FailureKind.DEADLINE
    assert "transfer_stall deadline expired" in (rv.failure or "") + (s.failure or "")
    tr = pr.prefill.agent.transport
    assert isinstance(tr, FaultyTransport) and tr.log.stalled >= 1
    # the stalled sends were cancelled when the room failed: the pages come back
    assert s.wait_released(WAIT_S) and rv.wait_released(WAIT_S)


def test_dropped_room_ack_is_counted_and_the_decode_still_succeeds(pair: MakePair) -> None:
    pr = pair(decode_faults={"drop": ["RoomAck"]})
    s, rv, _, _ = pr.open(3, SEQ)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    assert rv.wait(WAIT_S) is KVPoll.Success
    step = pr.decode.agent._loop.stepper
    assert isinstance(step, Filtered)
    filt = step.effect_filter
    assert isinstance(filt, MessageFaults) and filt.dropped == ["RoomAck"]
    # no ack: the prefill still waits (its view may lag one update behind the last send)
    assert s.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
    s.abort("test over")
