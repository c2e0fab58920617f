"""The control plane's reply DEALERs are bounded (runtime/outbox.py, issue 48): an address that
accepts a connection and never reads (a real TCP listener on 127.0.0.1 that never accepts, so
ZMQ's handshake never completes and nothing leaves the queue) gets at most STRANGER_SNDHWM
messages queued when the session has no peer record for it, PEER_SNDHWM when it has; the rest
are dropped at once (flush never blocks), counted and logged once per window. Each failed on the
code before, where SNDHWM was 0 (no bound): every message was queued for good."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
import zmq

from kvhandoff.protocol import wire as P
from kvhandoff.runtime import outbox as ob

MSG = P.Heartbeat(src="127.0.0.1:1", gen=1, rooms=list(range(16)))


@pytest.fixture
def never_reads() -> Iterator[str]:
    """The address of a TCP port that takes connections (the kernel's backlog) and never
    reads them."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


class Box:
    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.known: set[str] = set()
        self.counters = {"messages_out": 0}
        self.out = ob.ControlOutbox(ctx=self.ctx, lane=None, frames=lambda a, m: P.encode(m),
                                    known=self.known.__contains__, counters=self.counters)

    def send(self, addr: str, n: int) -> None:
        for _ in range(n):
            self.out.send(addr, MSG)
        self.out.flush()

    def close(self) -> None:
        self.out.close()
        self.ctx.term()


@pytest.fixture
def box() -> Iterator[Box]:
    b = Box()
    yield b
    b.close()


def test_a_stranger_that_never_reads_gets_a_bounded_queue(
        box: Box, never_reads: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvhandoff.agent"):
        box.send(never_reads, 1000)
    assert box.counters["messages_out"] == ob.STRANGER_SNDHWM
    assert box.counters["control_out_dropped"] == 1000 - ob.STRANGER_SNDHWM
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and never_reads in drops[0].getMessage()
    box.send(never_reads, 10)  # still full: each one dropped, none queued
    assert box.counters["control_out_dropped"] == 1010 - ob.STRANGER_SNDHWM


def test_a_peer_that_never_reads_is_bounded_too(box: Box, never_reads: str) -> None:
    box.known.add(never_reads)
    box.send(never_reads, ob.PEER_SNDHWM + 50)
    assert box.counters["messages_out"] == ob.PEER_SNDHWM
    assert box.counters["control_out_dropped"] == 50


def test_a_stranger_that_becomes_a_peer_gets_the_peers_bound(box: Box, never_reads: str) -> None:
    box.send(never_reads, 100)
    first = box.out._dealers[never_reads]
    assert box.counters["control_out_dropped"] == 100 - ob.STRANGER_SNDHWM
    box.known.add(never_reads)  # its next Hello was taken
    box.send(never_reads, 1000)
    assert box.out._dealers[never_reads] is not first
    assert box.counters["control_out_dropped"] == 100 - ob.STRANGER_SNDHWM  # none more
    assert box.counters["messages_out"] == ob.STRANGER_SNDHWM + 1000
