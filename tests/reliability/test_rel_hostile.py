"""Hostile input on the network-facing surfaces (`kvhandoff.testing.hostile`): nothing an
outsider sends ends an agent's control thread; it counts what it refused and still hands off.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest
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
    wait_until,
)

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.runtime.locallane import available
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing import hostile

OWN_LANES = True  # the control surfaces do not depend on the data transport


def counters(e: Engine) -> dict[str, int]:
    return e.agent.status()["counters"]


def alive(e: Engine) -> bool:
    t = e.agent._loop._thread
    return t is not None and t.is_alive()


@pytest.mark.parametrize("surface", ["control", "lane"])
def test_deeply_nested_frame_leaves_the_agent_serving(surface: str) -> None:
    """A Hello whose layout nests 10,000 maps (about 30 KB, no secret needed) used to raise
    RecursionError in decode and end the control thread; it is refused and counted."""
    if surface == "lane" and not available():
        pytest.skip("no same-host lane on this platform")
    with engine_pair(settings=fast_settings(), num_pages=8) as (p, d):
        before = counters(p)["rejected_messages"]
        frame = hostile.nested_maps(10_000)
        if surface == "control":
            hostile.send_control(p.address, [frame] * 3)
        else:
            hostile.send_lane(p.address, [frame] * 3)
        assert wait_until(lambda: counters(p)["rejected_messages"] - before >= 3, WAIT_S)
        with Prober(p.address) as pr:
            pr.barrier("prefill")
        assert alive(p)
        assert counters(p)["rejected_messages"] - before == 3
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


def test_a_garbage_flood_does_not_suspend_dead_peer_detection() -> None:
    """While an outsider floods the decode's control socket with frames that do not decode,
    the prefill falls silent mid-room (its control thread frozen until the room ends): the
    decode's room still fails as silent. Before: the socket was never read empty, and silence
    was measured only up to the last time it was, so the dead peer stayed alive."""
    with engine_pair(settings=fast_settings(), num_pages=8) as (p, d):
        r = secrets.randbits(63)
        s = p.send(r, 40, ready=2)
        rv = d.recv(r, 40, p.address)
        assert rv.wait_for_layer(layers_of(p.layout)[1], WAIT_S)
        stop = threading.Event()
        junk = [[hostile.P.HEADER, b"\xc1" * 8]] * 200

        def flood() -> None:
            while not stop.is_set():
                hostile.send_control(d.address, junk)

        floods = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        for t in floods:
            t.start()
        try:
            assert wait_until(lambda: counters(d)["rejected_messages"] > 1000, WAIT_S)
            with frozen_control(p):
                assert rv.wait(WAIT_S) is KVPoll.Failed
            assert "silent" in (rv.failure or ""), rv.failure
        finally:
            stop.set()
            for t in floods:
                t.join(WAIT_S)
        s.abort("test over")


def test_a_flood_of_heavy_heartbeats_does_not_hide_a_frozen_peer() -> None:
    """A stranger floods the decode with well-typed Heartbeats naming a million rooms each
    (tens of ms to decode: every read pass ends on its time limit, never on an empty socket)
    while the prefill's control thread is frozen mid-room: the decode still
    fails the room as silent, since silence is measured by time from the prefill's last
    message. Before: silence was measured only up to the last "drained" read, which the flood
    never let come, so the frozen prefill stayed alive. (Heartbeats of 0.5 s: a message takes
    up to ~0.1 s to decode on a loaded host, and the decode must stay responsive itself.)"""
    hb = 0.5
    with engine_pair(settings=fast_settings(heartbeat_interval_s=hb), num_pages=8) as (p, d):
        r = secrets.randbits(63)
        s = p.send(r, 40, ready=2)
        rv = d.recv(r, 40, p.address)
        assert rv.wait_for_layer(layers_of(p.layout)[1], WAIT_S)
        stop = threading.Event()
        # a stranger's Heartbeat naming a million rooms: a 4.9 MB frame
        heavy = hostile.P.encode(hostile.P.Heartbeat(src="127.0.0.1:1", gen=1,
                                                     rooms=list(range(1_000_000))))
        sent = 0

        def flood() -> None:  # kept a few messages ahead of what the decode has read
            nonlocal sent
            while not stop.is_set():
                if sent - counters(d)["stale_messages"] < 8:
                    sent += hostile.send_control(d.address, [heavy] * 4)
                else:
                    stop.wait(0.005)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            assert wait_until(lambda: counters(d)["stale_messages"] > 20, WAIT_S)
            with frozen_control(p):
                assert rv.wait(WAIT_S) is KVPoll.Failed
            assert "silent" in (rv.failure or ""), rv.failure
        finally:
            stop.set()
            flooder.join(WAIT_S)
        s.abort("test over")


def test_strangers_cost_a_bounded_number_of_sockets() -> None:
    """Each refused Hello (no valid MAC) from another made-up address is answered over a ZMQ
    DEALER of its own: those sockets are capped (the least recently used closed) and closed
    once idle, and no peer record is kept for any of them."""
    from kvhandoff.runtime import outbox as outbox_mod

    with engine_pair(settings=fast_settings(hmac_secret="s3cret"), num_pages=8) as (p, d):
        n = outbox_mod.MAX_STRANGER_DEALERS + 100
        hellos = []
        for i in range(n):
            h = hostile.P.Hello(src=f"127.0.0.1:{20000 + i}", gen=i + 1, agent_id="x",
                                role="decode", transport="tcp", transport_address=b"",
                                layout={}, layout_hash="", buffers=[], mac=b"\0" * 32)
            hellos.append(hostile.P.encode(h))
        hostile.send_control(p.address, hellos)
        assert wait_until(lambda: counters(p)["unauthenticated_messages"] >= n, WAIT_S)
        loop = p.agent._loop
        assert wait_until(lambda: loop.query(lambda _: len(loop.outbox._dealers))
                          <= outbox_mod.MAX_STRANGER_DEALERS + 1, WAIT_S)
        assert p.agent._loop.query(lambda s: sum(1 for _ in s.peers)) <= 1
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


SECRET = "s3cret"


class _HoldAnswer:
    """A seam in front of an agent's session: the HelloAck from `peer` is handed to the
    session only once `release` is set (`held` is set when it arrived): the agent has said its
    Hello and not read the answer, whatever the host's speed."""

    def __init__(self, step: Any, peer: str, release: threading.Event) -> None:
        from kvhandoff.protocol import wire as P

        self._step, self._peer, self._release = step, peer, release
        self._ack = P.HelloAck
        self.held = threading.Event()

    def handle(self, event: Any, now: float) -> Any:
        msg = getattr(event, "msg", None)
        if isinstance(msg, self._ack) and msg.src == self._peer and not self.held.is_set():
            self.held.set()
            self._release.wait(WAIT_S)
        return self._step.handle(event, now)

    def next_wakeup(self) -> float:
        return float(self._step.next_wakeup())


def test_a_replayed_hello_does_not_replace_a_restarted_decodes_handshake() -> None:
    """A decode restarts on its address (a new generation) while the prefill still holds the
    old one's session; its Hello waits at the prefill for a sealed message to confirm it. An
    outsider replays that Hello (captured on the wire: its MAC verifies). Before: the replay
    replaced the pending handshake with a new key, the decode's sealed request under the first
    key no longer verified and it refused the second HelloAck as a replay: the room failed
    `silent` and the prefill's stayed in Bootstrapping. Now the copy is dropped as a replay and
    the room hands off."""
    from kvhandoff.protocol import wire as P

    # heartbeats of 5 s: the prefill keeps the old decode's session (in use) across the
    # restart, and the decode held below is not taken for having slept
    port = free_port()
    st = fast_settings(hmac_secret=SECRET, heartbeat_interval_s=5.0)
    with engine_pair(settings=st, num_pages=8,
                     decode_settings=fast_settings(hmac_secret=SECRET, agent_port=port,
                                                   heartbeat_interval_s=5.0)) as (p, d0):
        handoff(p, d0, secrets.randbits(63), 40)
        d0.close()
        d = Engine("decode", p.layout, 8, fast_settings(hmac_secret=SECRET, agent_port=port,
                                                        heartbeat_interval_s=5.0))
        release = threading.Event()
        try:
            assert gen_of(d) != gen_of(p) and d.address == d0.address
            seams: list[_HoldAnswer] = []  # it takes the prefill's answer only once released
            d.agent._loop.install(lambda step: seams.append(_HoldAnswer(step, p.address,
                                                                         release)) or seams[0])
            r = secrets.randbits(63)
            s = p.send(r, 40)
            rv = d.recv(r, 40, p.address)
            assert seams[0].held.wait(WAIT_S)
            # the Hello the decode said, byte for byte (what a wire tap captured)
            nonce = d.agent._loop.session.peers._keys[p.address].nonce  # held: read here
            hello = d.agent._loop.session.me.hello(P.Hello, p.address, nonce=nonce)
            # sealed for the prefill as the decode seals it (a fresh GCM nonce: what the
            # prefill opens is the same Hello)
            hello_frames = P.seal_hello(hello, key=P.hello_key(SECRET.encode()),
                                        recipient=p.address, iv=secrets.token_bytes(12))
            # the prefill answered it and waits for a sealed message to confirm it
            assert wait_until(lambda: bool(p.agent._loop.query(
                lambda ses: getattr(ses.peers._keys.get(d.address), "pending", None))), WAIT_S)
            replayed0 = counters(p)["replayed_messages"]
            with Prober(p.address) as pr:
                pr.send(hello_frames)
                pr.barrier("prefill")  # the replay was read
            assert counters(p)["replayed_messages"] - replayed0 == 1
            release.set()
            assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
            assert s.wait(WAIT_S) is KVPoll.Success, s.failure
            assert d.bad_bytes(r, 40) == 0
        finally:
            release.set()
            d.close()


def test_a_hello_said_to_one_agent_does_not_verify_at_another() -> None:
    """The Hello's MAC covers its recipient: one the decode said to a prefill (captured on
    the wire), replayed to another prefill of the same secret, is refused there as not
    authenticated and leaves no peer record. Before: the second prefill took it and started a
    handshake the decode never asked for."""
    from kvhandoff.protocol import wire as P

    with engine_pair(settings=fast_settings(hmac_secret=SECRET), num_pages=8) as (p, d):
        handoff(p, d, secrets.randbits(63), 40)
        other = Engine("prefill", p.layout, 8, fast_settings(hmac_secret=SECRET))
        try:
            hello = d.agent._loop.session.me.hello(P.Hello, p.address,
                                                   nonce=secrets.token_bytes(P.NONCE_BYTES))
            assert d.agent._loop.session.me.verifies(hello) is False  # not said to d
            before = counters(other)["unauthenticated_messages"]
            with Prober(other.address) as pr:
                # as captured on the wire: sealed for p (its seal names p as recipient too)
                pr.send(P.seal_hello(hello, key=P.hello_key(SECRET.encode()),
                                     recipient=p.address, iv=secrets.token_bytes(12)))
                pr.send(P.encode(hello))  # and its body alone, unsealed
                pr.barrier("prefill")  # itself unsealed: one more refused
            assert counters(other)["unauthenticated_messages"] - before == 3
            assert d.address not in [x["addr"] for x in other.agent.status()["peers"]]
            r = secrets.randbits(63)  # the session it was meant for is untouched
            handoff(p, d, r, 40)
            assert d.bad_bytes(r, 40) == 0
        finally:
            other.close()


def _hostile_run(surface: str, secret: str | None, count: int, rooms: int) -> None:
    """A seeded corpus of `count` thrown at `surface` of the prefill by a process of its own
    while `rooms` real handoffs run; every handoff ends byte-exact, both control threads stay
    up, the prefill counted what it refused, and a handoff after the attack still works."""
    # heartbeats of 1 s: on a loaded 2-core host, an agent starved by the attacking process is
    # not taken for a dead peer (that is test_a_garbage_flood_..., with short heartbeats)
    with engine_pair(settings=fast_settings(hmac_secret=secret, heartbeat_interval_s=1.0),
                     num_pages=16) as (p, d):
        seed = secrets.randbits(32)
        print(f"hostile seed: {seed}")
        done: list[int] = []
        room_ids = [secrets.randbits(63) for _ in range(rooms)]
        # With a secret, the corpus impersonates both agents (their addresses and generations
        # are public) and names the rooms under way. Without one nothing is authenticated
        # (docs/SECURITY.md: whoever knows a peer's generation or a room's id can end a room),
        # so the corpus is a stranger's: made-up addresses, made-up rooms.
        if secret:
            peers = [(p.address, gen_of(p)), (d.address, gen_of(d))]
            known_rooms = room_ids
        else:
            peers = [("127.0.0.1:1", 7), ("127.0.0.1:2", 9)]
            known_rooms = [secrets.randbits(63)]
        refused0 = refused(p)

        def work() -> None:
            for r in room_ids:
                handoff(p, d, r, 40)
                assert d.bad_bytes(r, 40) == 0
                done.append(r)

        if surface == "http":
            with run_server() as url:
                out = hostile.beside_process(hostile.attack_argv(
                    "http", url, seed=seed, count=count // 10), work)
                statuses = out["sent"]["statuses"]
                # every request answered, none with a server error
                assert statuses and all(0 < s < 500 for s in statuses), sorted(set(statuses))
                sent = len(statuses)
                status, _ = _get(url + "/health")
                assert status == 200
        elif surface == "tcp_data":
            # the decode's data port, where the rooms' receives are posted, in the name of the
            # prefill's transport (its id is in the address its Hello carries)
            target = d.agent.transport.address.decode()
            sent = hostile.beside_process(hostile.attack_argv(
                surface, target, seed=seed, count=count,
                claims=[p.agent.transport.address[-32:]]), work)["sent"]
        else:
            sent = hostile.beside_process(hostile.attack_argv(
                surface, p.address, seed=seed, count=count, known_peers=peers,
                known_rooms=known_rooms), work)["sent"]
        assert sent > 0 and done == room_ids
        assert alive(p) and alive(d)
        assert p.agent._loop.query(lambda _: True)  # its control thread answers
        # (no Prober.barrier: with a secret, refused Hellos are answered at a bounded rate,
        # and the corpus's forged Hellos may have used this heartbeat's answers up)
        if surface == "control":  # most of the corpus is refused, and counted
            assert wait_until(lambda: refused(p) - refused0 >= sent // 2, WAIT_S), (
                refused(p) - refused0, sent)
        elif surface == "lane":  # a frame over the limits ends a connection, and what followed
            assert refused(p) > refused0
        elif surface == "tcp_data":  # the stranger's chunks were dropped and counted
            c = counters(d)
            assert wait_until(lambda: counters(d)["data_unproven_chunks"] > 0, WAIT_S), c
            if secret:  # its proofs (forged, in the prefill's name) were refused
                assert c["data_refused_proofs"] > 0, c
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0


def refused(e: Engine) -> int:
    c = counters(e)
    return c["rejected_messages"] + c["stale_messages"]


def gen_of(e: Engine) -> int:
    return int(e.agent.generation)


def _get(url: str) -> tuple[int, bytes]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=WAIT_S) as resp:
        return int(resp.status), resp.read()


SURFACES = ["control", "lane", "tcp_data", "http"]


@pytest.mark.parametrize("secret", [None, "s3cret"])
@pytest.mark.parametrize("surface", SURFACES)
def test_hostile_corpus_beside_real_handoffs(surface: str, secret: str | None) -> None:
    if surface == "lane" and not available():
        pytest.skip("no same-host lane on this platform")
    if surface == "http" and secret is not None:
        pytest.skip("the bootstrap server does not use the agents' secret")
    _hostile_run(surface, secret, count=1500, rooms=3)


@pytest.mark.long
@pytest.mark.parametrize("surface", SURFACES)
def test_hostile_corpus_long(surface: str) -> None:
    if surface == "lane" and not available():
        pytest.skip("no same-host lane on this platform")
    for secret in (None, "s3cret"):
        _hostile_run(surface, secret, count=50_000, rooms=20)
