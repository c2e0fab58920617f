"""Authenticated sessions (``hmac_secret``), sans-IO: two sessions wired in memory through the
real wire format, every message sealed as the agent's driver seals it (`MemoryWire`)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll

from .test_session_memory import bad_bytes, layers, open_room, pair, settings

SECRET = "s3cret"


def run_room(w, p, d, room: int) -> None:  # type: ignore[no-untyped-def]
    open_room(w, p, d, room)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(room, room, lid))
    w.run()
    assert d.views[room].state is KVPoll.Success, d.views[room].failure
    assert p.views[room].state is KVPoll.Success
    assert bad_bytes(d) == 0


def secured():  # type: ignore[no-untyped-def]
    st = settings(hmac_secret=SECRET)
    return pair(prefill=st, decode=st)


def test_every_message_after_the_hello_is_sealed_and_the_room_succeeds() -> None:
    w, p, d = secured()
    run_room(w, p, d, 1)
    sealed = [m for _, _, m in w.sent if id(m) in w.seals]
    plain = [type(m).__name__ for _, _, m in w.sent if id(m) not in w.seals]
    assert set(plain) <= {"Hello", "HelloAck"}, plain
    assert len(sealed) >= 5
    assert d.session.counters["unauthenticated_messages"] == 0


def test_a_replayed_sealed_message_is_refused() -> None:
    w, p, d = secured()
    run_room(w, p, d, 1)
    req = next(m for f, _, m in w.sent if isinstance(m, P.TransferRequest))
    before = dict(p.session.counters)
    w.feed(p, ev.MessageReceived(req, w.seals[id(req)]))
    assert p.session.counters["replayed_messages"] == before["replayed_messages"] + 1
    assert p.session.counters["messages_in"] == before["messages_in"] + 1
    assert not [m for _, to, m in w.sent[-3:] if isinstance(m, P.TransferAccepted)]


@pytest.mark.parametrize("tamper", ["body", "recipient", "unsealed"])
def test_a_tampered_or_unsealed_message_is_refused(tamper: str) -> None:
    w, p, d = secured()
    open_room(w, p, d, 2)
    w.run()
    f = P.Failed(src="decode:1", gen=d.session.me.generation, room=2, reason="forged")
    seal = None
    if tamper != "unsealed":
        # sealed under the real session key, then altered
        frames = d.session.peers.frames("prefill:1" if tamper == "body" else "x:1", f)
        msg, seal = P.decode_sealed(frames, max_bytes=1 << 20)
        if tamper == "body":
            msg = msgspec.structs.replace(msg, reason="altered")
            seal = msgspec.structs.replace(seal, signed=seal.signed[:-4] + b"xxxx")
        f = msg  # type: ignore[assignment]
    before = p.session.counters["unauthenticated_messages"]
    w.feed(p, ev.MessageReceived(f, seal))
    assert p.session.counters["unauthenticated_messages"] == before + 1
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(2, 2, lid))
    w.run()
    assert d.views[2].state is KVPoll.Success, d.views[2].failure


def test_a_restarted_decode_is_taken_once_a_sealed_message_confirms_it() -> None:
    """The decode's new generation says Hello while the prefill still holds the old one: the
    prefill answers, and declares the old generation lost only when the new one's first sealed
    message comes; then a room hands off."""
    w, p, d = secured()
    run_room(w, p, d, 1)
    lost0 = p.session.counters["peers_lost"]
    # the same decode address, a new generation (a restarted process)
    del w.sides["decode:1"]
    d2 = w.add("decode:1", d.session.role, d.session.layout, settings=settings(
        hmac_secret=SECRET))
    d2.session.ctx.me = dataclasses.replace(d2.session.me, generation=99)
    open_room(w, p, d2, 3)
    w.step()  # the new Hello reaches the prefill: answered, the old generation kept
    assert isinstance(w.sent[-1][2], P.HelloAck) and p.session.counters["peers_lost"] == lost0
    w.run()
    assert p.session.counters["peers_lost"] == lost0 + 1  # confirmed: the old one is lost
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(3, 3, lid))
    w.run()
    assert d2.views[3].state is KVPoll.Success, d2.views[3].failure


def test_early_messages_per_unopened_room_are_capped() -> None:
    """A sender that floods a room the engine has not opened yet holds EARLY_PER_ROOM of its
    messages there, not all of them (each one more is counted and dropped)."""
    from kvhandoff.protocol.early import EARLY_PER_ROOM

    w, p, d = pair()
    for i in range(EARLY_PER_ROOM + 40):
        w.feed(p, ev.MessageReceived(P.Failed(src="x:1", gen=5, room=77, reason=f"{i}")))
    assert len(p.session._early.held(77)) == EARLY_PER_ROOM
    assert p.session.counters["early_dropped"] == 40


def test_early_messages_are_bounded_in_bytes_not_only_in_count() -> None:
    """Without a secret any local process can send well-typed messages naming rooms no engine
    opened: heavy ones (here 1 MiB reasons over 64 rooms) are held only up to the store's byte
    bound, each one past it counted and dropped; counted only, 4,096 rooms x 16 messages of up
    to max_message_bytes could be held. What is held is still taken when its room opens."""
    w, p, d = pair()
    early = p.session._early
    early.max_bytes = 8 << 20  # the default is 256 MiB: the same rule, a test-sized bound
    heavy = "x" * (1 << 20)
    for room in range(100, 164):
        w.feed(p, ev.MessageReceived(P.Failed(src="x:1", gen=5, room=room, reason=heavy)))
    assert early.nbytes <= early.max_bytes
    kept = len(early)
    assert 0 < kept < 64 and p.session.counters["early_dropped"] == 64 - kept
    # a message that fits still gets in, and popping a room gives its bytes back
    before = early.nbytes
    assert early.pop(100) and early.nbytes < before
    w.feed(p, ev.MessageReceived(P.Failed(src="x:1", gen=5, room=500, reason="small")))
    assert early.held(500)


def test_hkdf_matches_rfc_5869_test_case_1() -> None:
    okm = P.hkdf_sha256(bytes([0x0B] * 22), salt=bytes(range(13)),
                        info=bytes(range(0xF0, 0xFA)), length=42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_refused_hellos_are_answered_at_a_bounded_rate() -> None:
    """Each refused Hello is answered to the address it names; an outsider sending many gets
    at most REFUSALS_PER_HEARTBEAT answers per heartbeat, and no peer record."""
    from kvhandoff.protocol.peers import REFUSALS_PER_HEARTBEAT

    w, p, d = secured()
    n0 = len(w.sent)
    for i in range(REFUSALS_PER_HEARTBEAT + 50):
        w.feed(p, ev.MessageReceived(P.Hello(
            src=f"x:{i}", gen=i + 1, agent_id="x", role="decode", transport="memory",
            transport_address=b"", layout={}, layout_hash="", buffers=[], mac=b"\0" * 32)))
    # (to addresses the memory wire does not know: recorded as dropped)
    answers = [m[1] for _, _, m in w.sent[n0:] if isinstance(m[1], P.HelloReject)]
    assert len(answers) == REFUSALS_PER_HEARTBEAT
    assert p.session.counters["unauthenticated_messages"] == REFUSALS_PER_HEARTBEAT + 50
    assert list(p.session.peers) == []
