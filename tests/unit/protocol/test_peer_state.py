"""`PeerState`: a peer's handshake moves only along `PEER_PHASES`, through the method named for
its event, and the flags the handshake carries move with it."""

from __future__ import annotations

import pytest

from kvhandoff.errors import Failure, FailureKind, InvalidTransition
from kvhandoff.protocol.peerstate import PEER_PHASES, Peer, PeerPhase, PeerState


def why(reason: str = "layouts differ") -> Failure:
    return Failure(kind=FailureKind.LAYOUT_MISMATCH, reason=reason)


def test_the_table_names_every_phase() -> None:
    assert set(PEER_PHASES) == set(PeerPhase)
    assert all(to in PeerPhase for tos in PEER_PHASES.values() for to in tos)


def test_a_decode_says_hello_and_is_matched() -> None:
    st = PeerState(addr="p:1")
    assert not st.talking
    st.hello_sent()
    assert st.phase is PeerPhase.HELLO_SENT and st.initiated and st.talking
    st.hello_taken(answer=False)  # its HelloAck
    assert st.connecting and not st.ack_owed
    st.connected(register=False)
    assert st.matched and not st.answer_hello()


def test_a_prefill_writing_one_sided_answers_once_registered() -> None:
    st = PeerState(addr="d:1")
    st.hello_taken(answer=True)  # the decode's Hello, answered once matched
    st.connected(register=True)
    assert st.phase is PeerPhase.REGISTERING and st.connecting and not st.matched
    st.registered(writes=True)
    assert st.matched and st.writes
    assert st.answer_hello() and not st.answer_hello()  # owed once
    # a new handshake of the same generation: what the last one decided no longer holds
    st.hello_taken(answer=True)
    assert st.connecting and not st.writes


def test_a_refusal_is_kept_until_its_next_hello_is_taken() -> None:
    st = PeerState(addr="p:1")
    st.hello_sent()
    st.refused(why())
    assert st.phase is PeerPhase.REJECTED and st.rejected == why() and st.talking
    st.refused(why("again"))  # the newer reason wins
    assert st.rejected == why("again")
    st.hello_taken(answer=True)
    assert st.rejected is None and st.connecting


def test_a_failed_attempt_starts_over_but_never_unmatches() -> None:
    st = PeerState(addr="p:1")
    st.hello_sent()
    st.attempt_failed()
    assert st.phase is PeerPhase.NEW and st.initiated  # heartbeats go on
    st.hello_sent()
    st.hello_taken(answer=False)
    st.connected(register=False)
    st.attempt_failed()
    assert st.matched


@pytest.mark.parametrize("move", [
    lambda st: st.connected(register=False),  # NEW: nothing to connect
    lambda st: st.registered(writes=True),
    lambda st: (st.hello_sent(), st.hello_sent()),
    lambda st: (st.hello_taken(answer=True), st.connected(register=False),
                st.connected(register=False)),
    lambda st: (st.hello_taken(answer=True), st.connected(register=False), st.hello_sent()),
    lambda st: (st.hello_taken(answer=True), st.connected(register=False),
                st.registered(writes=True)),
])
def test_moves_off_the_table_raise(move) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidTransition, match="peer p:1"):
        move(PeerState(addr="p:1"))


def test_a_peer_record_reads_its_state() -> None:
    p = Peer(addr="d:1")
    assert p.state.addr == "d:1" and p.state.phase is PeerPhase.NEW
    p.state.hello_taken(answer=True)
    p.state.connected(register=True)
    p.state.registered(writes=True)
    assert p.matched and p.writes
