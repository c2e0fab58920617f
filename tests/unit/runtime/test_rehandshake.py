"""One side took the other for dead (a starved control loop, a frozen process) while the other
still holds the handshake: the next room must not go into the void.

The prefill drops the decode's handshake (as its liveness check does after 2 silent
heartbeats); the decode, unaware, opens a room and sends its TransferRequest. The prefill
answers "no handshake", the decode drops its side too, says Hello again and re-sends the
request: the room succeeds, byte-exact, instead of failing two heartbeats later.
"""

from __future__ import annotations

from collections.abc import Callable

from kvhandoff.state_machine import KVPoll

from .conftest import WAIT_S, Pair, layers_of

MakePair = Callable[..., Pair]


def test_room_after_the_peer_forgot_us_rehandshakes(pair: MakePair) -> None:
    pr = pair(heartbeat_interval_s=1.0)  # slow heartbeats: the decode keeps its handshake
    s1, r1, _, _ = pr.open(1, 100)
    for lid in layers_of(pr.prefill.layout):
        s1.layer_ready(lid)
    assert r1.wait(WAIT_S) is KVPoll.Success and s1.wait(WAIT_S) is KVPoll.Success

    pa, da = pr.prefill.agent, pr.decode.agent
    # what the prefill's liveness check does to a peer it took for dead
    pa._loop.query(lambda s: s.peers.lost(s.peers[da.address], "test: declared lost"))
    assert da.status()["counters"]["peers_lost"] == 0  # the decode still holds the handshake

    s2, r2, _, dst = pr.open(2, 100)
    for lid in layers_of(pr.prefill.layout):
        s2.layer_ready(lid)
    assert r2.wait(WAIT_S) is KVPoll.Success, r2.failure
    assert s2.wait(WAIT_S) is KVPoll.Success, s2.failure
    assert pr.verify(dst, 100, 0) == (0, 0)
    assert da.status()["counters"]["peers_lost"] == 1  # told, not timed out
