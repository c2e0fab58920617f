"""`runtime.hashing.Hasher`: the driver's checksums are the room's algorithm, wherever they run
(the transport while copying, the pool after the write, the pool for a `HashSpans`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvhandoff.buffers.devsum import room_checksum
from kvhandoff.kv_layout import plan_of
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import HashSpans, PostWrite, WritePart
from kvhandoff.runtime.hashing import Hasher
from kvhandoff.settings import Settings
from kvhandoff.transports.base import WriteResult
from kvhandoff.transports.inproc import InprocTransport

WAIT_S = 60.0  # a bound, not a timing: the first devsum imports torch


class Posted:
    """What the hasher hands back to the control thread."""

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.arrived = threading.Event()

    def __call__(self, e: ev.Event) -> None:
        self.events.append(e)
        self.arrived.set()


@contextmanager
def hasher() -> Iterator[tuple[Hasher, Posted, np.ndarray]]:
    """A hasher over one buffer, and the transport it asks; both closed at the end (the hasher
    does not own the transport)."""
    buf = np.arange(4096, dtype=np.uint32).view(np.uint8).copy()
    posted = Posted()
    tr = InprocTransport(Settings(transport="inproc"))
    h = Hasher(buffers={"main_kv/0": buf}, transport=tr, post=posted)
    try:
        yield h, posted, buf
    finally:
        h.close()
        tr.close()


SPANS = (np.array([0, 1024], dtype=np.int64), np.array([512, 256], dtype=np.int64))


def write(alg: str, checksum: bool = True) -> PostWrite:
    offsets, nbytes = SPANS
    return PostWrite(7, "peer:1", (WritePart(3, "main_kv/0", plan_of(offsets, offsets, nbytes)),),
                     checksum, alg)


def test_an_xxh3_write_of_host_memory_is_hashed_by_the_transport_while_copying() -> None:
    with hasher() as (h, posted, _):
        fused, done = h.write_plan(write("xxh3"))
        assert fused  # what every transport's fused hash gives for host buffers
        done(WriteResult(None, (1234,)))
        assert posted.events == [ev.Written(7, None, (1234,))]


def test_a_devsum_write_is_hashed_after_it_landed_with_the_rooms_algorithm() -> None:
    with hasher() as (h, posted, buf):
        fused, done = h.write_plan(write("devsum"))
        assert not fused  # the transport's digest would be xxh3: not the room's
        done(WriteResult(None, (None,)))
        assert posted.arrived.wait(WAIT_S)
        want = room_checksum(buf, *SPANS, "devsum")
        assert posted.events == [ev.Written(7, None, (want,))]


def test_a_failed_write_is_not_hashed_and_says_why() -> None:
    with hasher() as (h, posted, _):
        _, done = h.write_plan(write("devsum"))
        done(WriteResult(RuntimeError("peer gone")))
        assert posted.events == [ev.Written(7, "peer gone")]


def test_hash_spans_sums_each_list_and_reports_errors_as_events() -> None:
    with hasher() as (h, posted, buf):
        job = HashSpans(5, (("main_kv/0", *SPANS), ("main_kv/0", SPANS[0][:1], SPANS[1][:1])))
        h.submit(job)
        assert posted.arrived.wait(WAIT_S)
        assert posted.events == [ev.Hashed(5, (room_checksum(buf, *SPANS, "xxh3"),
                                               room_checksum(buf, SPANS[0][:1], SPANS[1][:1],
                                                             "xxh3")))]
        bad = h.hashed(HashSpans(6, (("no/such", *SPANS),)))
        assert bad.job == 6 and bad.sums == () and "no/such" in (bad.error or "")
