"""The tcp data plane bound to the control session (docs/SECURITY.md, "The tcp data plane"):
two real tcp transports on 127.0.0.1 and a stranger from `kvhandoff.testing.hostile` on real
sockets. Each failed on the code before, which took chunks from any connection that named a
tag, let a reused ZMQ identity take a connection over (ROUTER_HANDOVER) and held early chunks
without a bound."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq
from test_conformance import Done  # the shared harness (tests/transports is on sys.path)

from kvhandoff.errors import TransportError
from kvhandoff.settings import Settings
from kvhandoff.testing import hostile
from kvhandoff.transports import chunkauth
from kvhandoff.transports.chunkauth import PROOF, Signer
from kvhandoff.transports.tcp import TcpTransport

CHUNK = 16 << 10
N = 4 * CHUNK  # one receive: four chunks
WAIT_S = 20.0




class Pair:
    """`a` sends to `b`; both bound to one session key (as the agent's Connect does)."""

    def __init__(self, secret: str | None, **kw: object) -> None:
        s = Settings(transport="tcp", chunk_bytes=CHUNK, hmac_secret=secret, **kw)  # type: ignore[arg-type]
        self.a, self.b = TcpTransport(s), TcpTransport(s)
        self.src = np.random.default_rng(3).integers(0, 256, 64 * N, dtype=np.uint8)
        self.dst = np.zeros(64 * N, np.uint8)
        self.a.register("kv", self.src)
        self.b.register("kv", self.dst)
        self.key = os.urandom(32) if secret else b""
        self.session(self.key)

    def session(self, key: bytes) -> None:
        self.key = key
        for t, name, other in ((self.a, "b", self.b), (self.b, "a", self.a)):
            t.bind_session(name, key)
            t.connect(name, other.address)

    def send(self, tag: int, at: int = 0, n: int = N) -> Done:
        d = Done()
        self.a.post_send("b", tag, "kv", np.array([at]), np.array([n]), d)
        return d

    def recv(self, tag: int, at: int = 0, n: int = N) -> Done:
        d = Done()
        self.b.post_recv("a", tag, "kv", np.array([at]), np.array([n]), d)
        return d

    def both(self, tag: int, at: int = 0) -> bool:
        """A transfer of N bytes at `at` (receive posted first); whether it ended byte-exact."""
        got = self.recv(tag, at)
        return [self.send(tag, at).wait(), got.wait()] == [None, None] and self.exact(at)

    def exact(self, at: int = 0, n: int = N) -> bool:
        return bool(np.array_equal(self.dst[at:at + n], self.src[at:at + n]))

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=[None, "s3cret"], ids=["open", "secret"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


@pytest.fixture
def keyed() -> Iterator[Pair]:
    p = Pair("s3cret")
    yield p
    p.close()


def ident(t: TcpTransport) -> bytes:
    return t.address[-32:]


def counter(t: TcpTransport, name: str) -> int:
    return int(getattr(t.status(), "counters", {}).get(name, 0))


def wait_for(pred: Callable[[], bool]) -> bool:
    """Polls state another thread owns until `pred` holds or WAIT_S passed."""
    end = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def whole_receive(tag: int, payload: bytes) -> list[list[bytes]]:
    """Chunks that would complete a posted receive of N bytes under `tag`."""
    return [hostile.tcp_chunk(tag, k, N // CHUNK, N, payload[k * CHUNK:(k + 1) * CHUNK])
            for k in range(N // CHUNK)]


def test_a_strangers_chunks_never_land_in_a_posted_receive(keyed: Pair) -> None:
    """A forged proof in the sender's name, then chunks that would fill the posted receive;
    the same from a connection that took the sender's ZMQ identity: nothing lands, every chunk
    is counted, and the sender's own bytes then land byte-exact."""
    p = keyed
    got = p.recv(5)
    garbage = os.urandom(N)
    sent = hostile.send_tcp_frames(p.b.address, [
        hostile.TcpCase("forged_proof", None, [[PROOF.pack(b"P", ident(p.a), os.urandom(16),
                                                        os.urandom(32))],
                                                *whole_receive(5, garbage)]),
        hostile.TcpCase("identity_reuse", ident(p.a), whole_receive(5, garbage))])
    assert sent == 2 * (N // CHUNK) + 1
    assert wait_for(lambda: counter(p.b, "data_unproven_chunks") >= 2 * (N // CHUNK))
    assert counter(p.b, "data_refused_proofs") >= 1
    assert not got.event.is_set() and not p.dst[:N].any()
    done = p.send(5)
    assert [got.wait(), done.wait()] == [None, None]
    assert p.exact()


def test_a_reused_identity_cannot_take_the_connection_over(pair: Pair) -> None:
    """A stranger connects with the sender's ZMQ identity and stays connected: with
    ROUTER_HANDOVER it took the routing id over (the receiver's credits went to it, the
    sender's transfer stalled); now the receiver names connections itself."""
    p = pair
    assert p.both(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident(p.a))
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(p.b.address.decode().rsplit("/", 1)[0])
        for frames in whole_receive(2, os.urandom(N)):
            sock.send_multipart(frames)
        assert wait_for(lambda: counter(p.b, "data_unproven_chunks") >= N // CHUNK)
        assert p.both(2, at=N)
    finally:
        sock.close()
        ctx.term()


def test_a_replayed_proof_is_refused(keyed: Pair) -> None:
    """The sender's proof and chunks as captured on the wire, replayed on a connection of the
    attacker's own: the proof is refused (its nonce was taken), so are the chunks; after a new
    session (re-handshake: a new key), the old session's proof does not verify; the sender's
    own transfers go on under each session."""
    p = keyed
    assert p.both(1)
    # what the sender's connection put on the wire
    captured = Signer(p.key, nonce=p.a._signers["b"].nonce)
    proof = captured.proof(ident(p.a), ident(p.b))
    payload = os.urandom(N)
    chunks = [hostile.tcp_chunk(7, k, N // CHUNK, N, payload[k * CHUNK:(k + 1) * CHUNK],
                                trailer=captured.trailer(
                                    b"D" + (7).to_bytes(8, "little") + k.to_bytes(4, "little")
                                    + (N // CHUNK).to_bytes(4, "little")
                                    + N.to_bytes(8, "little"),
                                    payload[k * CHUNK:(k + 1) * CHUNK]))
              for k in range(N // CHUNK)]
    got = p.recv(7, at=N)
    hostile.send_tcp_frames(p.b.address, [hostile.TcpCase("replayed_proof", None,
                                                          [[proof], *chunks])])
    assert wait_for(lambda: counter(p.b, "data_unproven_chunks") >= N // CHUNK)
    assert counter(p.b, "data_replayed_proofs") == 1
    assert not got.event.is_set() and not p.dst[N:2 * N].any()
    assert p.send(7, at=N).wait() is None and got.wait() is None and p.exact(N)

    p.session(os.urandom(32))  # a new control session: both sides bound to its key
    hostile.send_tcp_frames(p.b.address, [hostile.TcpCase("replayed_proof", None,
                                                          [[proof], *chunks])])
    assert wait_for(lambda: counter(p.b, "data_refused_proofs") >= 1)
    assert p.both(8, at=2 * N)


def test_an_early_chunk_flood_stays_within_the_bound() -> None:
    """Without a secret a stranger's claim in a peer's name is taken: its flood of chunks
    for tags no one posted is held up to tcp_early_bytes per peer, the rest dropped and
    counted."""
    p = Pair(None, tcp_early_bytes=64 << 10)
    try:
        cases = [c for c in hostile.tcp_session_cases(1, 5 * 200, flood_bytes=4096,
                                                      claims=[p.a.address[-32:]])
                 if c.kind == "early_flood"]
        flood = len(cases[0].frame_sets) - 1
        assert flood == 200
        held = p.b._early
        # the flood's connection stays open while it is counted: a ROUTER drops what a closed
        # connection sent and it had not read yet (on a busy host, part of the flood)
        with hostile.tcp_connections(p.b.address, cases):
            assert wait_for(lambda: counter(p.b, "data_early_dropped") + len(held) == flood)
        assert 0 < held.total <= 64 << 10 and len(held) <= 16
        assert counter(p.b, "data_early_dropped") >= flood - 16
        # the receiver still takes its peer's transfers
        assert p.both(3)
    finally:
        p.close()


def test_a_peer_over_the_early_bound_fails_its_rooms_cleanly() -> None:
    """A peer holding the key sends ten transfers before any receive is posted, past the
    bound: each send ends (those over the bound fail at once), each receive posted afterwards
    ends (the held ones byte-exact, the dropped ones failed at once): nothing hangs."""
    p = Pair("s3cret", tcp_early_bytes=4 * N)
    try:
        chunks = 10 * (N // CHUNK)
        sends = [p.send(100 + i, at=i * N) for i in range(10)]
        held = p.b._early  # every chunk came: held, or dropped and counted
        assert wait_for(lambda: counter(p.b, "data_early_dropped") + len(held) == chunks)
        assert 0 < held.total <= 4 * N
        failed = [i for i in range(10) if held.overflowed((ident(p.a), 100 + i))]
        assert len(failed) >= 6
        assert all(isinstance(sends[i].wait(), TransportError) for i in failed)
        recvs = [p.recv(100 + i, at=i * N) for i in range(10)]
        for i in range(10):
            err = recvs[i].wait()
            if i in failed:
                assert isinstance(err, TransportError) and "tcp_early_bytes" in str(err)
            else:
                assert err is None and sends[i].wait() is None and p.exact(i * N)
    finally:
        p.close()


def test_a_sender_a_handshake_ahead_is_taken_once_the_receiver_has_the_key(keyed: Pair) -> None:
    """A new handshake reaches the sender first (the prefill rekeys on the Hello, the decode
    on the HelloAck): its new proof goes with its next chunk, which it sends only once the
    receiver asked under the new session (bound the new key), so the proof is checked at
    once and taken, and the next transfer lands (issue 48: proofs are no longer held for a
    key to come, in a table junk could push them out of)."""
    p = keyed
    assert p.both(1)
    key = os.urandom(32)
    p.a.bind_session("b", key)
    p.a.connect("b", p.b.address)
    p.b.bind_session("a", key)
    p.b.connect("a", p.a.address)
    assert p.both(2, at=N)
    assert counter(p.b, "data_unproven_chunks") == 0
    assert counter(p.b, "data_refused_proofs") == 0


def test_chunks_are_macd_with_gmac_and_without_cryptography_with_hmac(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyed pair MACs its chunks with AES-256-GMAC (the status says so); the same pair in a
    process where `cryptography` does not import falls back to HMAC-SHA256, says so in its
    status, and still lands its transfers byte-exact, a forged chunk still refused."""
    p = Pair("s3cret")
    try:
        assert p.both(1)
        assert p.a._signers["b"].kind == chunkauth.GMAC
        assert "AES-256-GMAC" in p.a.status().reason
    finally:
        p.close()
    monkeypatch.setattr(chunkauth, "_AESGCM", None)
    p = Pair("s3cret")
    try:
        assert p.both(1)
        assert p.a._signers["b"].kind == chunkauth.HMAC_SHA256
        reason = p.b.status().reason
        assert "HMAC-SHA256" in reason and "fallback" in reason
        got = p.recv(2, at=N)
        hostile.send_tcp_frames(p.b.address, [hostile.TcpCase(
            "identity_reuse", ident(p.a), whole_receive(2, os.urandom(N)))])
        assert wait_for(lambda: counter(p.b, "data_unproven_chunks") >= N // CHUNK)
        assert not p.dst[N:2 * N].any()
        assert p.send(2, at=N).wait() is None and got.wait() is None and p.exact(N)
    finally:
        p.close()
