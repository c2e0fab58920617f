"""The tcp receiver's replies (credits, finals) MAC'd under the connection's key with a sequence
number of their own (docs/SECURITY.md, "The tcp data plane"): an on-path relay from
`kvhandoff.testing.hostile` between two real tcp transports on 127.0.0.1 injects forged,
bare and replayed replies into the sender's connection. Each test failed on the code before,
where any well-formed reply was taken: a made-up final failed a send, a replayed final ok
completed a send whose bytes never landed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from test_tcp_session import CHUNK, N, Pair, counter, wait_for

from kvhandoff.testing import hostile
from kvhandoff.transports.chunkauth import REPLY_TRAILER
from kvhandoff.transports.tcp import _CREDIT, _FINAL


class OnPathPair(Pair):
    """`a` sends to `b` through `hostile.OnPath` (a relay that can inject into a's connection)."""

    def __init__(self, secret: str | None) -> None:
        self.path: hostile.OnPath | None = None
        super().__init__(secret)

    def session(self, key: bytes) -> None:
        if self.path is None:
            self.path = hostile.OnPath(self.b.address)
        self.key = key
        self.a.bind_session("b", key)
        self.a.connect("b", self.path.address)
        self.b.bind_session("a", key)
        self.b.connect("a", self.a.address)

    def close(self) -> None:
        super().close()
        assert self.path is not None
        self.path.close()


@pytest.fixture
def keyed() -> Iterator[OnPathPair]:
    p = OnPathPair("s3cret")
    yield p
    p.close()


def test_made_up_replies_neither_complete_nor_fail_a_send(keyed: OnPathPair) -> None:
    """A send whose receive is not posted yet (its chunks wait in the receiver's early store):
    the relay injects credits and finals (ok and failed) with made-up MACs, the same finals
    without a trailer, and a "not taken" that carries none. None of them is taken (each is
    counted), the send is still pending, and once the receive is posted both end byte-exact."""
    p = keyed
    assert p.path is not None
    send = p.send(7)
    assert wait_for(lambda: p.path is not None and p.path.forwarded >= 1 + N // CHUNK)
    forged = hostile.forged_replies(1, [7], chunks=N // CHUNK)
    p.path.inject(forged)
    assert wait_for(lambda: counter(p.a, "data_forged_replies")
                    + counter(p.a, "data_unverified_replies") >= len(forged))
    assert counter(p.a, "data_unverified_replies") == 1  # the "not taken" without a MAC
    assert not send.event.is_set()
    got = p.recv(7)
    assert [got.wait(), send.wait()] == [None, None]
    assert p.exact()
    assert counter(p.b, "data_forged_chunks") == 0


def test_a_replayed_reply_is_refused(keyed: OnPathPair) -> None:
    """The relay records a whole transfer's replies (tag 1), then, while a second send of the
    same tag waits for its receive, replays them: its final ok (which used to complete the
    send with nothing landed) and its credits, in their order and reversed. Each is refused as
    not above the last sequence number taken; the real transfer then completes byte-exact."""
    p = keyed
    assert p.path is not None
    assert p.both(1)
    recorded = p.path.recorded()
    assert len(recorded) == N // CHUNK + 1  # a credit per chunk, one final
    assert all(len(r[0]) == _CREDIT.size + REPLY_TRAILER.size for r in recorded[:-1])
    final = recorded[-1]
    assert len(final[0]) == _FINAL.size + REPLY_TRAILER.size and final[0][9:10] == b"\x01"
    forwarded = p.path.forwarded
    send = p.send(1, at=N)
    assert wait_for(lambda: p.path is not None and p.path.forwarded >= forwarded + N // CHUNK)
    replays = [final, *recorded[:-1], *reversed(recorded[:-1]), final]
    p.path.inject(replays)
    assert wait_for(lambda: counter(p.a, "data_forged_replies") >= len(replays))
    assert not send.event.is_set() and not p.dst[N:2 * N].any()
    got = p.recv(1, at=N)
    assert [got.wait(), send.wait()] == [None, None]
    assert p.exact(N)


def test_without_a_secret_the_replies_are_as_before() -> None:
    """No secret: the replies carry no trailer (the wire and its cost unchanged), and are
    taken as they come (docs/SECURITY.md says what that leaves open on loopback)."""
    p = OnPathPair(None)
    try:
        assert p.path is not None
        assert p.both(1)
        recorded = p.path.recorded()
        assert [len(r[0]) for r in recorded] == [_CREDIT.size] * (N // CHUNK) + [_FINAL.size]
        assert counter(p.a, "data_forged_replies") == 0
    finally:
        p.close()


def test_a_rekeyed_receiver_still_fails_a_stale_send_fast(keyed: OnPathPair) -> None:
    """The receiver takes a new session key while the sender still sends under the old one:
    its "not taken" goes MAC'd under the connection the sender proved before (kept for that),
    so the sender fails that send at once, as before replies were MAC'd, and proves itself
    again; after the sender rekeys too the next transfer lands."""
    p = keyed
    assert p.both(1)
    key = os.urandom(32)
    p.b.bind_session("a", key)
    p.b.connect("a", p.a.address)
    err = p.send(2, at=N).wait()
    assert err is not None and "not taken" in str(err)
    assert counter(p.a, "data_forged_replies") == 0
    p.a.bind_session("b", key)
    p.a.connect("b", p.path.address if p.path else b"")
    assert p.both(3, at=2 * N)
