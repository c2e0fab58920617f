"""Forged and replayed control messages, with and without a shared secret.

Each test sends, from a raw ZMQ socket (`Prober`), what an outsider can build from public
information (an agent's control address and generation are shown by the bootstrap server; a
room id by the engines' routers) or could have captured on the wire, while a real handoff is
under way, and checks that the handoff still ends byte-exact and that the agent counted what
it refused. Each failed on the code before sessions were authenticated.
"""

from __future__ import annotations

import secrets
import threading

import msgspec
from relkit import (
    WAIT_S,
    Engine,
    Prober,
    engine_pair,
    fast_settings,
    free_port,
    frozen_control,
    handoff,
    layers_of,
)

from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll

OWN_LANES = True
SEQ = 40
SECRET = "shared-s3cret"


def room() -> int:
    return secrets.randbits(63)


def counter(e: Engine, name: str) -> int:
    return int(e.agent.status()["counters"].get(name, 0))


def gen(e: Engine) -> int:
    return int(e.agent.generation)


def finish(p: Engine, d: Engine, r: int, s: object, rv: object, done: int) -> None:
    for lid in layers_of(p.layout)[done:]:
        s.layer_ready(lid)  # type: ignore[attr-defined]
    assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure  # type: ignore[attr-defined]
    assert s.wait(WAIT_S) is KVPoll.Success, s.failure  # type: ignore[attr-defined]
    assert d.bad_bytes(r, SEQ) == 0


def in_flight(p: Engine, d: Engine) -> tuple[int, object, object]:
    """A room whose first two layers landed, the rest not yet ready."""
    r = room()
    layers = layers_of(p.layout)
    s = p.send(r, SEQ, ready=2)
    rv = d.recv(r, SEQ, p.address)
    assert rv.wait_for_layer(layers[1], WAIT_S)
    return r, s, rv


def signed_hello(e: Engine, to: Engine, *, generation: int) -> P.Hello:
    """A Hello of `e` to `to` with a valid MAC, as captured on the wire (of this generation
    of `e`, or of an earlier one)."""
    me = e.agent._loop.session.me  # type: ignore[union-attr]
    msg = msgspec.structs.replace(me.hello(P.Hello, to.address), gen=generation, mac=b"")
    return P.sign_hello(msg, SECRET.encode(), recipient=to.address)


def sealed(msg: P.Hello, to: Engine) -> list[bytes]:
    """`msg` sealed for `to` under the secret's handshake key, as an agent sends it."""
    return P.seal_hello(msg, key=P.hello_key(SECRET.encode()), recipient=to.address,
                        iv=secrets.token_bytes(12))


def test_unsigned_hello_in_the_name_of_the_decode_fails_no_room() -> None:
    """Before: the prefill took the generation change as the decode's restart before it
    checked the MAC, and failed every room with it."""
    with engine_pair(settings=fast_settings(hmac_secret=SECRET), num_pages=8) as (p, d):
        r, s, rv = in_flight(p, d)
        with Prober(p.address) as pr:
            forged = msgspec.structs.replace(signed_hello(d, p, generation=gen(d) + 2),
                                             mac=b"\0" * 32)
            pr.send(P.encode(forged))
            pr.send(sealed(forged, p))  # sealed by a holder of the secret, MAC made up
            pr.barrier("prefill")
        assert counter(p, "peers_lost") == 0
        finish(p, d, r, s, rv, 2)


def test_replayed_hello_of_an_earlier_generation_fails_no_room() -> None:
    """A captured Hello (valid MAC) of the decode's previous generation, replayed to the
    prefill: answered, but not acted on, since nobody confirms it under the new session key."""
    with engine_pair(settings=fast_settings(hmac_secret=SECRET), num_pages=8) as (p, d):
        r, s, rv = in_flight(p, d)
        with Prober(p.address) as pr:
            for g in (gen(d) + 2, gen(d)):  # an earlier generation, then this one
                pr.send(sealed(signed_hello(d, p, generation=g), p))
            pr.barrier("prefill")
        assert counter(p, "peers_lost") == 0
        finish(p, d, r, s, rv, 2)
        handoff(p, d, room(), SEQ)  # the session with the real decode goes on


def test_forged_hello_reject_does_not_cut_a_decode_off_its_prefill() -> None:
    """Before: a HelloReject needed no MAC, and one in the prefill's name (its address and
    generation are public) failed every later room of the decode toward it, for good."""
    for secret in (SECRET, None):
        with engine_pair(settings=fast_settings(hmac_secret=secret), num_pages=8) as (p, d):
            handoff(p, d, room(), SEQ)
            with Prober(d.address) as pr:
                pr.send(P.encode(P.HelloReject(src=p.address, gen=gen(p), reason="forged",
                                               diff=["forged"])))
                pr.barrier("decode")
            for _ in range(2):
                r = room()
                handoff(p, d, r, SEQ)
                assert d.bad_bytes(r, SEQ) == 0


def test_forged_failed_abort_ack_and_heartbeat_are_refused() -> None:
    """With the secret set, messages in the decode's name (its address and generation) are
    refused: they are not sealed under its session. Before: Failed failed the room."""
    with engine_pair(settings=fast_settings(hmac_secret=SECRET), num_pages=8) as (p, d):
        r, s, rv = in_flight(p, d)
        before = counter(p, "unauthenticated_messages")
        with Prober(p.address) as pr:
            forged = [P.Failed(src=d.address, gen=gen(d), room=r, reason="forged"),
                      P.AbortAck(src=d.address, gen=gen(d), room=r),
                      P.Heartbeat(src=d.address, gen=gen(d), rooms=[r]),
                      P.Abort(src=d.address, gen=gen(d), room=r, reason="forged")]
            for m in forged:
                pr.send(P.encode(m))
                # with a made-up seal as well
                pr.send([b"KVA\x01", P.encode(m)[1] + secrets.token_bytes(40)])
            pr.barrier("prefill")
        finish(p, d, r, s, rv, 2)
        assert counter(p, "unauthenticated_messages") - before >= 2 * len(forged)


def test_forged_heartbeats_do_not_keep_a_dead_prefill_alive() -> None:
    """The prefill falls silent mid-room (its control thread frozen until the room ends); an
    outsider keeps sending heartbeats in its name (address and generation, both public). The
    decode's room still fails as silent (the heartbeats are not sealed under the prefill's
    session). Before: they renewed the silent peer until it woke."""
    with engine_pair(settings=fast_settings(hmac_secret=SECRET), num_pages=8) as (p, d):
        r, s, rv = in_flight(p, d)
        addr, g = p.address, gen(p)
        stop = threading.Event()

        def flood() -> None:
            with Prober(d.address) as pr:
                while not stop.is_set():
                    pr.send(P.encode(P.Heartbeat(src=addr, gen=g, rooms=[r])))
                    stop.wait(0.02)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        try:
            with frozen_control(p):
                assert rv.wait(WAIT_S) is KVPoll.Failed
            assert "silent" in (rv.failure or ""), rv.failure
        finally:
            stop.set()
            t.join(5)


def test_a_restarted_decode_on_the_same_address_hands_off_with_the_secret() -> None:
    """The decode process is replaced by a new one on the same control address (a new
    generation) right after a handoff: the prefill, which may still hold the old generation,
    takes the new one once its sealed messages prove it, and rooms hand off byte-exact."""
    port = free_port()
    st = fast_settings(hmac_secret=SECRET)
    with engine_pair(settings=st, num_pages=8) as (p, d0):
        d0.close()
        d1 = Engine("decode", p.layout, 8, fast_settings(hmac_secret=SECRET, agent_port=port))
        try:
            handoff(p, d1, room(), SEQ)
        finally:
            d1.close()
        d2 = Engine("decode", p.layout, 8, fast_settings(hmac_secret=SECRET, agent_port=port))
        try:
            assert gen(d2) != gen(d1)
            for _ in range(2):
                r = room()
                handoff(p, d2, r, SEQ)
                assert d2.bad_bytes(r, SEQ) == 0
        finally:
            d2.close()
