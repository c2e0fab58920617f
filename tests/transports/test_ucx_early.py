"""UCX messages for receives not posted yet are bounded (issue 48): two real UCX transports in
one process, over UCX's same-host lanes. A sender pushes a stream whose receive is never
posted, past the bound (tcp_early_bytes, per stream on ucx): the receiver's held bytes stay
within it, the drops are counted in `data_early_dropped` (its status, as the agent's metrics
read it), the receive posted for that stream at last fails at once naming the setting, and an
honest early transfer still lands. Before, every such message was held, unbounded, until the
transport closed. Every wait bounded."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from ondone import Done

from kvhandoff.errors import TransportError
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport

pytest.importorskip("ucxx")

WAIT_S = 20.0
CHUNK = 16 << 10
BOUND = 64 << 10  # tcp_early_bytes: three chunks (and their overhead) fit, four do not
FLOOD = 64 * CHUNK  # 64 chunks, one stream; more than the sender's window (8) of them


def dropped(t: object) -> int:
    return int(t.status().counters.get("data_early_dropped", -1))  # type: ignore[attr-defined]


def wait_for(pred: Callable[[], bool], watch: Callable[[], None]) -> bool:
    """Polls state the I/O thread owns (calling `watch` on each poll) until `pred` holds or
    WAIT_S passed."""
    end = time.monotonic() + WAIT_S
    while not pred():
        watch()
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_a_flood_for_a_never_posted_stream_stays_within_the_bound() -> None:
    st = Settings(ucx_same_host_error_handling=False, stall_timeout_s=WAIT_S,
                  chunk_bytes=CHUNK, tcp_early_bytes=BOUND)
    a, b = load_transport("ucx", st), load_transport("ucx", st)
    try:
        src = np.random.default_rng(5).integers(0, 256, FLOOD + CHUNK, dtype=np.uint8)
        dst = np.zeros(FLOOD + CHUNK, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", b.address)
        b.connect("a", a.address)
        assert dropped(b) == 0
        early = b._matcher.early  # type: ignore[attr-defined]
        most = [0]

        def watch() -> None:  # what this thread sees held, besides the store's own peak
            most[0] = max(most[0], early.total)

        flood = Done()  # a stream no receive is ever posted for (until the end)
        a.post_send("b", 1, "kv", np.array([0]), np.array([FLOOD]), flood)
        # every chunk is dropped in the end: the sender's window moves only as chunks are
        # received, and over the bound they are (into scratch), so its send completes
        assert wait_for(lambda: dropped(b) == FLOOD // CHUNK, watch), dropped(b)
        assert flood.event.wait(WAIT_S) and flood.err is None
        assert most[0] <= early.peak <= BOUND
        assert early.peak > 0  # some were held before the bound was reached
        assert early.total == 0
        assert not dst.any()  # nothing of it landed
        # its receive, posted at last, fails at once naming the setting (it does not hang)
        late = Done()
        b.post_recv("a", 1, "kv", np.array([0]), np.array([FLOOD]), late)
        assert late.event.wait(WAIT_S)
        assert isinstance(late.err, TransportError) and "tcp_early_bytes" in str(late.err)
        # an honest transfer sent before its receive is posted is held, then lands
        sent, got = Done(), Done()
        a.post_send("b", 2, "kv", np.array([FLOOD]), np.array([CHUNK]), sent)
        assert wait_for(lambda: early.total > 0, watch)
        b.post_recv("a", 2, "kv", np.array([FLOOD]), np.array([CHUNK]), got)
        assert got.event.wait(WAIT_S) and got.err is None, got.err
        assert sent.event.wait(WAIT_S) and sent.err is None
        assert np.array_equal(dst[FLOOD:], src[FLOOD:])
        assert dropped(b) == FLOOD // CHUNK
    finally:
        a.close()
        b.close()


def test_a_held_stream_is_aged_by_the_idle_io_thread() -> None:
    """A chunk whose receive is never posted is dropped after stall_timeout_s, though
    nothing else happens on the worker (the I/O thread wakes up for it), and the receive
    posted for it at last fails at once naming the setting."""
    keep_s = 0.5
    st = Settings(ucx_same_host_error_handling=False, stall_timeout_s=keep_s,
                  chunk_bytes=CHUNK, tcp_early_bytes=BOUND)
    a, b = load_transport("ucx", st), load_transport("ucx", st)
    try:
        src = np.ones(CHUNK, np.uint8)
        dst = np.zeros(CHUNK, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", b.address)
        b.connect("a", a.address)
        early = b._matcher.early  # type: ignore[attr-defined]
        a.post_send("b", 3, "kv", np.array([0]), np.array([CHUNK]), Done())
        assert wait_for(lambda: early.peak > 0, lambda: None)  # it was held
        assert wait_for(lambda: dropped(b) == 1, lambda: None)  # then aged
        assert early.total == 0
        late = Done()
        b.post_recv("a", 3, "kv", np.array([0]), np.array([CHUNK]), late)
        assert late.event.wait(WAIT_S)
        assert isinstance(late.err, TransportError) and "stall_timeout_s" in str(late.err)
        assert not dst.any()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cross", ["ucx", "tcp"])
def test_the_counter_reaches_the_status_through_transport_auto(cross: str) -> None:
    """The agent reads its transport's counters from status(); under transport=auto (ucx
    across hosts by default) they are its parts' summed. Before, auto reported none."""
    tr = load_transport("auto", Settings(auto_cross_host=cross, stall_timeout_s=WAIT_S))
    try:
        assert tr.status().counters.get("data_early_dropped") == 0
    finally:
        tr.close()
