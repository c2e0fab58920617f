"""The same-host control lane (`runtime.locallane`): real Unix sockets between lanes of this
process, driven by a zmq poller as the control loop drives them; and real agents whose control
messages take it (or ZMQ, with the lane off). Every wait is a bounded poll loop."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from kvhandoff.protocol import wire as P
from kvhandoff.runtime.locallane import LocalLane, available, lane_name
from kvhandoff.runtime.metrics import metrics_text
from kvhandoff.state_machine import KVPoll

from .conftest import Pair, layers_of
from .test_agent_inproc import PREFIX, SEQ, finish

pytestmark = pytest.mark.skipif(not available(), reason="abstract Unix socket names: Linux only")

MAX_BODY = 16 << 20
_names = itertools.count()


class Side:
    """A lane with its own poller, as one agent's control loop holds it."""

    def __init__(self, address: str, max_body: int = MAX_BODY) -> None:
        self.address = address
        self.counters = {"messages_out_local": 0, "rejected_messages": 0}
        self.lane = LocalLane(address, max_message_bytes=max_body, counters=self.counters)
        self.poller = zmq.Poller()
        self.lane.attach(self.poller)

    def pump(self) -> None:
        self.lane.service(dict(self.poller.poll(50)))


@pytest.fixture
def sides() -> Iterator[Callable[[], Side]]:
    made: list[Side] = []

    def make() -> Side:
        s = Side(f"127.0.0.1:{next(_names)}-lane-test-{id(made)}")
        made.append(s)
        return s

    yield make
    for s in made:
        s.lane.close()


def pump_until(done: Callable[[], bool], *sides: Side, rounds: int = 400) -> bool:
    for _ in range(rounds):
        if done():
            return True
        for s in sides:
            s.pump()
    return done()


def heartbeat(n: int) -> list[bytes]:
    return P.encode(P.Heartbeat(src=f"a:{n}", gen=n, rooms=[n]))


def test_messages_arrive_whole_and_in_order_both_ways(sides: Callable[[], Side]) -> None:
    """Small messages and one larger than any socket buffer (it waits for POLLOUT in parts)
    arrive in the order sent, each whole; a reply the other way too."""
    a, b = sides(), sides()
    assert a.lane.listening and b.lane.listening
    big = P.encode(P.Heartbeat(src="a:big", gen=7, rooms=list(range(1_000_000))))
    assert len(big[1]) > 4 << 20
    sent = [heartbeat(1), heartbeat(2), big, heartbeat(3)]
    for frames in sent:
        assert a.lane.send(b.address, frames)
    assert pump_until(lambda: len(b.lane.inbox) == 4, a, b)
    assert [list(m) for m in b.lane.inbox] == sent
    assert P.decode(b.lane.inbox[2], max_bytes=MAX_BODY).rooms[-1] == 999_999  # type: ignore
    assert b.lane.send(a.address, heartbeat(9))
    assert pump_until(lambda: len(a.lane.inbox) == 1, a, b)
    assert a.lane.inbox[0] == heartbeat(9)
    assert a.counters["messages_out_local"] == 4 and b.counters["messages_out_local"] == 1


def test_nobody_listening_there_means_zmq_for_that_address(sides: Callable[[], Side]) -> None:
    """An address no lane listens under (a peer on another host): the caller sends over ZMQ,
    and keeps doing so for that address (never two lanes to one peer)."""
    a = sides()
    elsewhere = f"10.0.0.9:{next(_names)}-not-here"
    assert lane_name(elsewhere) is not None
    assert not a.lane.send(elsewhere, heartbeat(1))
    b = Side(elsewhere)  # someone listens there later: that address stays on ZMQ
    try:
        assert not a.lane.send(elsewhere, heartbeat(2))
        b.pump()
        assert not b.lane.inbox
    finally:
        b.lane.close()
    assert a.counters["messages_out_local"] == 0


def test_a_peer_that_exited_is_chosen_again(sides: Callable[[], Side]) -> None:
    """The peer closed its lane (it exited): the next message finds nobody and goes over ZMQ;
    once the session dropped that peer, one listening again at its address (restarted) gets a
    new connection."""
    a, b = sides(), sides()
    assert a.lane.send(b.address, heartbeat(1))
    assert pump_until(lambda: len(b.lane.inbox) == 1, a, b)
    address = b.address
    b.lane.close()
    sent = [a.lane.send(address, heartbeat(n)) for n in range(2, 200)]
    assert sent[-1] is False  # the closed connection was noticed, nobody listens any more
    c = Side(address)
    try:
        a.lane.drop(address)
        assert a.lane.send(address, heartbeat(300))
        assert pump_until(lambda: len(c.lane.inbox) == 1, a, c)
        assert c.lane.inbox[0] == heartbeat(300)
    finally:
        c.lane.close()


def test_a_frame_over_the_limits_closes_that_connection(sides: Callable[[], Side]) -> None:
    """A length over max_message_bytes: the messages before it were taken, the connection
    closes (a stream cannot be resynchronised) and the rejection is counted."""
    a = sides()
    small = Side(a.address + "-small", max_body=1000)
    try:
        assert a.lane.send(small.address, heartbeat(1))
        assert a.lane.send(small.address, [P.HEADER, b"x" * 5000])
        assert a.lane.send(small.address, heartbeat(2))
        assert pump_until(lambda: small.counters["rejected_messages"] == 1, a, small)
        assert list(small.lane.inbox) == [heartbeat(1)]
        assert not small.lane._in  # noqa: SLF001 - the connection is gone
    finally:
        small.lane.close()


@pytest.mark.parametrize("on", [True, False], ids=["lane", "zmq"])
def test_agents_of_one_host_talk_over_the_lane(pair: Callable[..., Pair], on: bool) -> None:
    """Two agents of this process (one host, one network namespace): with the lane on every
    control message either sent went over it, off none did; the room ends Success both ways,
    byte-exact."""
    st: dict[str, Any] = {"local_control_lane": on}
    pr = pair(transport="shm", prefill_settings=st, decode_settings=st)
    lids = layers_of(pr.prefill.layout)
    sender, receiver, _, dst = pr.open(3, SEQ, PREFIX, ready=tuple(lids))
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    for side in (pr.prefill, pr.decode):
        c = side.agent.status()["counters"]
        assert c["messages_out"] > 0
        assert c["messages_out_local"] == (c["messages_out"] if on else 0), c


_SQUATTER = r"""
import json, os, select, socket, sys
os.setgid(65534)  # another user from here on (the interpreter and modules are loaded)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(bytes.fromhex(sys.argv[1]))
s.listen(16)
print(json.dumps({"pid": os.getpid(), "uid": os.geteuid()}), flush=True)
conns, accepted, got = [], 0, 0
while True:
    ready, _, _ = select.select([s, sys.stdin, *conns], [], [])
    if s in ready:
        conns.append(s.accept()[0])
        accepted += 1
    for c in [c for c in conns if c in ready]:
        data = c.recv(65536)
        got += len(data)
        if not data:
            conns.remove(c)
            c.close()
    if sys.stdin in ready:
        line = sys.stdin.readline()
        print(json.dumps({"accepted": accepted, "bytes": got}), flush=True)
        if not line:
            break
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="a squatter of another user needs root to start")
def test_a_squatted_lane_name_is_refused_counted_and_the_handoff_goes_over_zmq(
        pair: Callable[..., Pair]) -> None:
    """A process of another user takes the decode's lane name before the decode starts: the
    decode counts its name as squatted, the prefill refuses the squatter (SO_PEERCRED) and
    counts it, the squatter reads 0 bytes, and the room completes over ZMQ byte-exact."""
    port = _free_port()
    name = lane_name(f"127.0.0.1:{port}")
    assert name is not None
    squatter = subprocess.Popen([sys.executable, "-c", _SQUATTER, name.hex()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert squatter.stdin is not None and squatter.stdout is not None
    try:
        assert json.loads(squatter.stdout.readline())["uid"] == 65534
        pr = pair(transport="shm", decode_settings={"agent_port": port})
        assert pr.decode.agent.address == f"127.0.0.1:{port}"
        lids = layers_of(pr.prefill.layout)
        sender, receiver, _, dst = pr.open(3, SEQ, PREFIX, ready=tuple(lids))
        assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
        assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
        p, d = (side.agent.status()["counters"] for side in (pr.prefill, pr.decode))
        assert d["lane_squatted"] == 1
        assert p["lane_refused"] >= 1
        assert p["messages_out_local"] == 0 < p["messages_out"]  # all of it over ZMQ
        squatter.stdin.write("report\n")
        squatter.stdin.flush()
        report = json.loads(squatter.stdout.readline())
        assert report["bytes"] == 0, report  # the squatter read nothing
        assert report["accepted"] >= 1  # it was reached, and refused
        assert "kvhandoff_agent_lane_refused_total" in metrics_text(pr.prefill.agent)
    finally:
        squatter.stdin.close()
        squatter.wait(10)
