"""Abort races: an abort at every phase of a room, from either side, and twice at once.

Both sides must end terminal (Failed, or Success where the ack had already won) within a
bounded wait, carry the abort's reason (or the deadline's that ended them), and hand their
pages back exactly once (the release callbacks count calls; the pools must be full again).
Real agents over tcp in the test process.
"""

from __future__ import annotations

import threading

import pytest
from relkit import WAIT_S, Engine, engine_pair, fast_settings, layers_of, wait_until

from kvhandoff.errors import FailureKind, RoomFailed
from kvhandoff.state_machine import KVPoll

SEQ = 48  # three 16-token pages
Pair = tuple[Engine, Engine]


def settle(p: Engine, d: Engine, room: int, handles: list, reason: str | None) -> None:
    """Both sides terminal; the failed ones name `reason`; pages released exactly once."""
    for h in handles:
        st = h.wait(WAIT_S)
        assert st.is_terminal, f"{h} not terminal after {WAIT_S}s"
        if st is KVPoll.Failed and reason is not None:
            assert reason in (h.failure or ""), h.failure
    assert p.wait_all_released([room], WAIT_S) and d.wait_all_released([room], WAIT_S)
    for eng in (p, d):
        assert eng.releases[room] == 1
        assert not eng.release_errors


def assert_pools_full(p: Engine, d: Engine) -> None:
    p.assert_no_leak()
    d.assert_no_leak()


def in_state(h, state: KVPoll) -> bool:  # type: ignore[no-untyped-def]
    return bool(wait_until(lambda: h.poll() is state, WAIT_S))


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_abort_before_handshake(shared_pair: Pair, room_id: int, by: str) -> None:
    p, d = shared_pair
    reason = f"{by} gave up before the handshake"
    if by == "prefill":
        s = p.send(room_id, SEQ)
        s.abort(reason)
        rv = d.recv(room_id, SEQ, p.address)
    else:
        rv = d.recv(room_id, SEQ, p.address, init=False)
        rv.abort(reason)
        s = p.send(room_id, SEQ)  # the prefill engine opens the room after the abort came
    settle(p, d, room_id, [s, rv], reason)
    assert s.poll() is KVPoll.Failed and rv.poll() is KVPoll.Failed
    assert_pools_full(p, d)


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_abort_during_waiting_for_input(shared_pair: Pair, room_id: int, by: str) -> None:
    p, d = shared_pair
    s = p.send(room_id, SEQ, ready=False)
    rv = d.recv(room_id, SEQ, p.address)
    assert in_state(s, KVPoll.WaitingForInput) and in_state(rv, KVPoll.WaitingForInput)
    reason = f"{by} aborted while waiting for input"
    (s if by == "prefill" else rv).abort(reason)
    settle(p, d, room_id, [s, rv], reason)
    assert s.poll() is KVPoll.Failed and rv.poll() is KVPoll.Failed
    for lid in layers_of(p.layout):  # a late engine marks layers ready: nothing moves
        s.layer_ready(lid)
    assert s.poll() is KVPoll.Failed and rv.poll() is KVPoll.Failed
    assert_pools_full(p, d)


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_abort_mid_transfer(shared_pair: Pair, room_id: int, by: str) -> None:
    p, d = shared_pair
    layers = layers_of(p.layout)
    half = len(layers) // 2
    s = p.send(room_id, SEQ, ready=half)
    rv = d.recv(room_id, SEQ, p.address)
    assert rv.wait_for_layer(layers[half - 1], WAIT_S)
    assert rv.poll() is KVPoll.Transferring
    reason = f"{by} aborted mid-transfer"
    (s if by == "prefill" else rv).abort(reason)
    for lid in layers[half:]:
        s.layer_ready(lid)
    settle(p, d, room_id, [s, rv], reason)
    assert s.poll() is KVPoll.Failed and rv.poll() is KVPoll.Failed
    with pytest.raises(RoomFailed, match=reason):
        rv.wait_for_layer(layers[-1], 0.1)
    assert_pools_full(p, d)


def test_abort_twice_from_both_sides_at_once(shared_pair: Pair, room_id: int) -> None:
    p, d = shared_pair
    layers = layers_of(p.layout)
    s = p.send(room_id, SEQ, ready=2)
    rv = d.recv(room_id, SEQ, p.address)
    assert rv.wait_for_layer(layers[1], WAIT_S)
    go = threading.Barrier(4)

    def hammer(h, who: str) -> None:  # type: ignore[no-untyped-def]
        go.wait(WAIT_S)
        h.abort(f"{who} abort")
        h.abort(f"{who} abort again")

    threads = [threading.Thread(target=hammer, args=(h, w))
               for h, w in ((s, "prefill"), (s, "prefill"), (rv, "decode"), (rv, "decode"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    settle(p, d, room_id, [s, rv], "abort")
    assert s.poll() is KVPoll.Failed and rv.poll() is KVPoll.Failed
    # the first abort's reason is kept, never "again" (a second abort changes nothing)
    assert "again" not in (s.failure or "") and "again" not in (rv.failure or "")
    s.abort("after the end")
    rv.abort("after the end")
    assert "after the end" not in (s.failure or "") + (rv.failure or "")
    assert_pools_full(p, d)


def test_abort_after_success_changes_nothing(shared_pair: Pair, room_id: int) -> None:
    p, d = shared_pair
    s = p.send(room_id, SEQ)
    rv = d.recv(room_id, SEQ, p.address)
    assert rv.wait(WAIT_S) is KVPoll.Success and s.wait(WAIT_S) is KVPoll.Success
    rv.abort("too late")
    s.abort("too late")
    settle(p, d, room_id, [s, rv], None)
    assert s.poll() is KVPoll.Success and rv.poll() is KVPoll.Success
    assert d.bad_bytes(room_id, SEQ) == 0
    assert_pools_full(p, d)


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_abort_after_last_layer_before_room_ack(room_id: int, by: str) -> None:
    """Decode drops its RoomAck (fault injection): decode has Success, prefill still waits for
    the ack. An abort now fails the prefill (decode keeps its Success: the bytes landed and were
    verified); the prefill's pages are freed once, the decode's once."""
    with engine_pair(decode_faults={"drop": ["RoomAck"]}) as (p, d):
        s = p.send(room_id, SEQ)
        rv = d.recv(room_id, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Success
        assert d.bad_bytes(room_id, SEQ) == 0
        assert in_state(s, KVPoll.Transferring)  # every layer sent, no ack: still waiting
        reason = f"{by} aborted after the last layer"
        (s if by == "prefill" else rv).abort(reason)
        if by == "prefill":
            settle(p, d, room_id, [s, rv], reason)
            assert s.poll() is KVPoll.Failed
        else:
            # decode's abort of a room it already finished is a no-op: the prefill room ends by
            # its lease (decode's heartbeats no longer renew it), see the next test
            assert rv.poll() is KVPoll.Success
            s.abort("prefill engine gives up waiting for the ack")
            settle(p, d, room_id, [s, rv], "gives up")
            assert s.poll() is KVPoll.Failed
        assert rv.poll() is KVPoll.Success
        assert_pools_full(p, d)


def test_lost_room_ack_ends_by_lease_never_stuck(room_id: int) -> None:
    """Nobody aborts and the RoomAck is lost: the prefill room still ends, by its lease (the
    failure is the lease deadline's: no other cause ended it) and frees its pages. How long
    after the decode's Success is printed (the lease plus up to a heartbeat on an idle host),
    not asserted."""
    lease_s = 1.0
    st = fast_settings(lease_s=lease_s)
    with engine_pair(prefill_settings=st, decode_settings=fast_settings(lease_s=lease_s),
                     decode_faults={"drop": ["RoomAck"]}) as (p, d):
        s = p.send(room_id, SEQ)
        rv = d.recv(room_id, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Success
        assert s.wait(WAIT_S) is KVPoll.Failed
        assert "lease" in (s.failure or ""), s.failure
        assert s.failure_kind is FailureKind.DEADLINE
        assert s.error is not None and s.error.deadline == "lease", s.error
        took = s.stats()["t_done"] - rv.stats()["t_done"]
        print(f"lost RoomAck: prefill room Failed by lease {took:.3f}s after decode Success")
        settle(p, d, room_id, [s, rv], "lease")
        assert_pools_full(p, d)
