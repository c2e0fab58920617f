"""What a stranger's bytes cost an agent (issue 48): a frame is authenticated over its raw
bytes before it is decoded, a connection's queue is bounded in bytes, and nothing a stranger
sends pushes an honest connection's proof or claim out of the tcp data plane's tables. Each
attack runs as a process of its own, as another user when this one is root (the case of an
unprivileged local process); each test runs with and without a secret where both apply.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time

import pytest
from relkit import (
    WAIT_S,
    Engine,
    engine_pair,
    fast_settings,
    frozen_control,
    handoff,
    layers_of,
    wait_until,
)

from kvhandoff.state_machine import KVPoll
from kvhandoff.testing import hostile

OWN_LANES = True  # the control surfaces do not depend on the data transport
OTHER_UID = 65534 if os.geteuid() == 0 else None  # nobody: an unprivileged local process


def counters(e: Engine) -> dict[str, int]:
    return e.agent.status()["counters"]


def attack(argv: list[str]) -> None:
    """Runs one attack process to its end (its sends queued, its sockets closed)."""
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def test_a_sealed_frame_is_authenticated_before_it_is_decoded() -> None:
    """Frames sealed in the decode's name (its address and generation are public) whose
    bodies are no msgpack after their first fields, under made-up seals, from another user:
    the prefill refuses each as unauthenticated, having checked the seal over the raw bytes,
    and never decodes one (none counted as malformed). Before, every one was decoded first
    and counted as malformed (`rejected_messages`), the seal never looked at."""
    with engine_pair(settings=fast_settings(hmac_secret="s3cret"), num_pages=8) as (p, d):
        handoff(p, d, secrets.randbits(63), 40)  # a session between the two
        c0 = counters(p)
        n = 200
        attack(hostile.attack_argv("sealed_garbage", p.address, seed=1, count=n,
                                   known_peers=[(d.address, int(d.agent.generation))],
                                   uid=OTHER_UID))
        assert wait_until(lambda: counters(p)["unauthenticated_messages"]
                          - c0["unauthenticated_messages"] >= n, WAIT_S), counters(p)
        assert counters(p)["rejected_messages"] == c0["rejected_messages"]
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_an_oversized_hello_is_refused_before_it_is_decoded(secret: str | None) -> None:
    """A Hello carries its MAC inside (over its decoded form), so it is decoded before it is
    authenticated; one larger than any honest Hello (`wire.HELLO_MAX_BYTES`, 1 MiB; an honest
    one is a few KB) is refused from its size alone: counted as rejected, never answered.
    Before: a 4 MiB Hello with a made-up MAC was decoded and answered with a HelloReject
    (`unauthenticated_messages` with a secret): a stranger made each agent decode up to
    `max_message_bytes` (16 MiB) per frame."""
    from relkit import Prober

    from kvhandoff.protocol import wire as P

    with engine_pair(settings=fast_settings(hmac_secret=secret), num_pages=8) as (p, d):
        c0 = counters(p)
        with Prober(p.address) as pr:
            big = P.Hello(src=pr.address, gen=pr.gen, agent_id="big", role="decode",
                          transport="tcp", transport_address=b"x" * (P.HELLO_MAX_BYTES * 4),
                          layout={}, layout_hash="", buffers=[], mac=b"m" * 32)
            pr.send(P.encode(big))
            got = pr.barrier("decode")  # read after the big one (one connection, in order)
        assert [type(m).__name__ for m in got] == ["HelloReject"]  # the barrier's alone
        c = counters(p)
        assert c["rejected_messages"] - c0["rejected_messages"] == 1, c
        # with a secret the barrier's own Hello (unsigned) is the one refused as such
        assert (c["unauthenticated_messages"] - c0["unauthenticated_messages"]
                == (1 if secret else 0)), c
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_one_connection_of_heavy_frames_costs_a_bounded_queue(secret: str | None) -> None:
    """One connection of another user sends 160 well-typed Heartbeats of a million rooms each
    (4.9 MB, 779 MB in all; with a secret, sealed in the decode's name under made-up seals)
    to the prefill, in this process. Its resident memory grows by less than 300 MB at its peak
    (the queue of one connection is bounded in bytes: loop.CONTROL_CONN_BYTES); before, ZMQ
    queued 10,000 messages per connection and this process grew by about 690 MB. Every frame
    is refused and counted, and a handoff afterwards is byte-exact."""
    with engine_pair(settings=fast_settings(hmac_secret=secret), num_pages=8) as (p, d):
        handoff(p, d, secrets.randbits(63), 40)
        n = 160
        argv = hostile.attack_argv(
            "heavy_control", p.address, seed=2, count=n, rooms=1_000_000,
            known_peers=[(d.address, int(d.agent.generation))] if secret else [],
            uid=OTHER_UID)
        c0 = counters(p)
        key = "unauthenticated_messages" if secret else "stale_messages"
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from now
        rss0 = _rss_kb("VmRSS")
        attack(argv)
        assert wait_until(lambda: counters(p)[key] - c0[key] >= n, 120), counters(p)
        grew_mb = (_rss_kb("VmHWM") - rss0) / 1024
        print(f"peak resident growth: {grew_mb:.0f} MB")
        assert grew_mb < 300, grew_mb
        assert counters(p)["rejected_messages"] == c0["rejected_messages"]
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


def tcp_pair_settings(secret: str | None) -> dict[str, object]:
    return {"transport": "tcp", "hmac_secret": secret}


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_junk_claims_do_not_push_out_the_real_connection(secret: str | None) -> None:
    """1,100 connections of another user each send a proof-shaped frame naming a made-up
    transport id (a claim without a secret, a forged proof with one), then a chunk, to the
    decode's tcp data port after a handoff proved the prefill's connection. Rooms after it
    still end Success byte-exact. Before, the claims table kept the latest 1,024 connections
    and the proofs table the latest 256: the junk pushed the real connection out, and its
    chunks were dropped as unproven for good (rooms WaitingForInput)."""
    with engine_pair(settings=fast_settings(**tcp_pair_settings(secret)), num_pages=8) as (p, d):
        handoff(p, d, secrets.randbits(63), 40)
        attack(hostile.attack_argv("junk_claims", d.agent.transport.address.decode(), seed=3,
                                   count=1100, uid=OTHER_UID))
        assert wait_until(lambda: counters(d)["data_unproven_chunks"] >= 1100, WAIT_S), \
            counters(d)
        for _ in range(2):
            r = secrets.randbits(63)
            handoff(p, d, r, 40)
            assert d.bad_bytes(r, 40) == 0


def test_junk_proofs_before_the_key_do_not_strand_a_connection() -> None:
    """With a secret: a process of another user floods the decode's tcp data port with junk
    proofs (thousands a second, each on a connection of its own) while the decode's control
    thread is stalled between its Hello and the prefill's HelloAck (as a slow flood of its
    control socket would stall it). The room still ends Success byte-exact, and so does one
    after the flood. Before, the prefill's proof came before the decode had the session key,
    waited in a 256-slot table the junk pushed it out of, and the connection was never proven
    (the room stayed WaitingForInput for good)."""
    # heartbeats of 2 s: the stall (1 s) is not long enough for either side to give up
    with engine_pair(settings=fast_settings(**tcp_pair_settings("s3cret"),
                                            heartbeat_interval_s=2.0), num_pages=8) as (p, d):
        target = d.agent.transport.address.decode()
        flood = subprocess.Popen(hostile.attack_argv("junk_claims", target, seed=5,
                                                     count=50_000, uid=OTHER_UID),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_until(lambda: counters(d)["data_refused_proofs"] >= 300, WAIT_S)
            out0 = counters(d)["messages_out"]
            r = secrets.randbits(63)
            s = p.send(r, 40)
            rv = d.recv(r, 40, p.address)
            # the decode's Hello is out: stall its control thread before the HelloAck is read
            assert wait_until(lambda: counters(d)["messages_out"] > out0, WAIT_S)
            d.agent._loop.query(lambda _: time.sleep(1.0), timeout=WAIT_S)
            assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
            assert s.wait(WAIT_S) is KVPoll.Success, s.failure
            assert d.bad_bytes(r, 40) == 0
        finally:
            flood.kill()
            flood.wait(WAIT_S)
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


def test_a_flood_refused_before_decoding_does_not_hide_a_dead_peer() -> None:
    """With a secret: while frames sealed in the prefill's name under made-up seals flood the
    decode (refused over their raw bytes, never decoded), the prefill falls silent mid-room
    (its control thread frozen until the room ends): the decode's room still fails as silent.
    A batch of such frames counts as read (none taken), as a batch of garbage does."""
    with engine_pair(settings=fast_settings(hmac_secret="s3cret"), num_pages=8) as (p, d):
        r = secrets.randbits(63)
        s = p.send(r, 40, ready=2)
        rv = d.recv(r, 40, p.address)
        assert rv.wait_for_layer(layers_of(p.layout)[1], WAIT_S)
        stop = threading.Event()
        junk = [hostile.sealed_garbage(p.address, int(p.agent.generation))] * 200

        def flood() -> None:
            while not stop.is_set():
                hostile.send_control(d.address, junk)

        floods = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        for t in floods:
            t.start()
        try:
            assert wait_until(lambda: counters(d)["unauthenticated_messages"] > 1000, WAIT_S)
            with frozen_control(p):
                assert rv.wait(WAIT_S) is KVPoll.Failed
            assert "silent" in (rv.failure or ""), rv.failure
        finally:
            stop.set()
            for t in floods:
                t.join(WAIT_S)
        s.abort("test over")


def _spy_decoder(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every body the agents of this process hand the msgpack decoder from now on
    (`wire.decode_body`, which the control loop calls through the module)."""
    from kvhandoff.protocol import wire as P

    seen: list[bytes] = []
    real = P.decode_body

    def spy(body: memoryview | bytes) -> P.Message:
        seen.append(bytes(body))
        return real(body)

    monkeypatch.setattr(P, "decode_body", spy)
    return seen


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_a_hello_whose_seal_does_not_open_is_refused_undecoded(
        secret: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sealed Hellos a stranger can build (sealed under another secret, or by a holder of the
    secret for another agent, or garbage in place of the ciphertext) are refused before their
    bodies reach the msgpack decoder: not counted as malformed, counted as not authenticated,
    and answered (unsealed, naming the reason) from the clear envelope alone, echoing its
    nonce. Without a secret the agent can open none: refused alike. Before: a Hello's MAC
    covered its decoded form, so every Hello was decoded before it was authenticated (and a
    sealed one was no kvhandoff frame at all)."""
    from relkit import Prober

    from kvhandoff.protocol import wire as P
    from kvhandoff.protocol.peers import BAD_HMAC

    with engine_pair(settings=fast_settings(hmac_secret=secret), num_pages=8) as (p, d):
        handoff(p, d, secrets.randbits(63), 40)
        c0 = counters(p)
        seen = _spy_decoder(monkeypatch)
        with Prober(p.address) as pr:
            hello = P.Hello(src=pr.address, gen=pr.gen, agent_id="stranger", role="decode",
                            transport="tcp", transport_address=b"x", layout={},
                            layout_hash="", buffers=[], nonce=secrets.token_bytes(16))
            frames = [
                # a key the prefill does not hold
                P.seal_hello(hello, key=P.hello_key(b"not-the-secret"), recipient=p.address,
                             iv=os.urandom(12)),
                # the right key, said to another agent (a capture replayed here)
                P.seal_hello(hello, key=P.hello_key((secret or "x").encode()),
                             recipient=d.address, iv=os.urandom(12)),
            ]
            good = P.seal_hello(hello, key=P.hello_key(b"k"), recipient=p.address,
                                iv=os.urandom(12))
            env_len = len(good[1]) - len(P.encode(hello)[1]) - 16
            # a ciphertext that is an (unencrypted) msgpack bomb, 512 KiB of nested arrays
            frames.append([good[0], good[1][:env_len] + b"\x91" * (512 << 10) + b"\xc0"])
            for f in frames:
                pr.send(f)
            answers = [pr.recv(WAIT_S) for _ in frames]
        assert all(isinstance(a, P.HelloReject) and a.reason == BAD_HMAC
                   and a.echo == hello.nonce for a in answers), answers
        c = counters(p)
        assert c["unauthenticated_messages"] - c0["unauthenticated_messages"] == len(frames), c
        assert c["rejected_messages"] == c0["rejected_messages"], c  # none decoded
        bodies = {bytes(f[1][env_len:]) for f in frames}
        assert not bodies & set(seen), "a body whose seal did not open was decoded"
        r = secrets.randbits(63)
        handoff(p, d, r, 40)  # the session between the two goes on (its Hellos opened)
        assert d.bad_bytes(r, 40) == 0


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_a_sealed_hello_shows_no_remote_key_or_worker_address(secret: str | None) -> None:
    """A decode offering one-sided writes (shm: its buffers' descriptors, what a NIC's remote
    key is to RDMA) says Hello to a peer on the wire (a prober): with a secret, neither a
    descriptor nor its transport address nor its layout is in the frame's bytes, and the frame
    opens, under the secret's handshake key for that recipient only, to a Hello that carries
    them. Without a secret (loopback only) they are in the clear, as before. Before: the
    Hello went in the clear whatever the secret."""
    from relkit import Prober, mini_glm

    from kvhandoff.protocol import wire as P

    st = fast_settings(hmac_secret=secret, transport="shm", one_sided_writes=True)
    d = Engine("decode", mini_glm(), 8, st)
    try:
        with Prober(d.address) as pr:
            d.recv(secrets.randbits(63), 40, pr.address)
            assert pr.router.poll(int(WAIT_S * 1000))
            frames = pr.router.recv_multipart()[1:]
        me = d.agent._loop.session.me
        descriptors = [b.descriptor for b in me.buffers if b.descriptor]
        assert descriptors and me.transport_address  # what must not show
        secret_parts = [*descriptors, me.transport_address, me.layout_hash.encode()]
        raw = b"".join(frames)
        if secret is None:
            assert frames[0] == P.HEADER
            assert all(x in raw for x in secret_parts)
            return
        assert frames[0] == P.HELLO_SEALED_HEADER
        assert not [x for x in secret_parts if x in raw], "sent in the clear"
        opened = P.open_frames(frames, max_bytes=1 << 24)
        key = P.hello_key(secret.encode())
        assert P.open_hello(opened, key=key, recipient=d.address) is None  # not said to d
        body = P.open_hello(opened, key=key, recipient=pr.address)
        assert body is not None
        hello = P.decode_body(body)
        assert isinstance(hello, P.Hello)
        assert [b.descriptor for b in hello.buffers if b.descriptor] == descriptors
        assert hello.transport_address == me.transport_address
    finally:
        d.close()
