"""The decode's pages are not released while a one-sided writer may still write into them
(issue 35), in memory (`MemoryWire`, fake clock): from the moment the decode sent a
`TransferRequest` carrying its buffers, whatever it has or has not read since."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.lifecycle import write_quarantine
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side

from .test_session_memory import (
    HB,
    SEQ,
    bad_bytes,
    kinds,
    layers,
    layout,
    open_room,
    settings,
)
from .test_session_memory import pair as mem_pair
from .test_session_one_sided import QUARANTINE, all_ready, pair


def test_an_abort_before_transfer_accepted_is_read_keeps_the_pages_until_writes_stop() -> None:
    """The prefill accepts and writes at once; the decode aborts while the TransferAccepted
    is still on the wire. Its pages stay held until the prefill's writes stopped (AbortAck),
    never at the abort."""
    w, p, d = pair()
    w.hold(lambda frm, to, m: isinstance(m, P.TransferAccepted))
    w.hold_writes = True  # the writes stay in flight until release_writes()
    open_room(w, p, d, 1)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert len(w._writes_held) == len(layers(p.session.layout))  # in flight, unread
    w.hold(lambda frm, to, m: frm == "decode:1")  # the Abort is on its way too
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].state is KVPoll.Failed
    assert w._writes_held  # still writing
    assert d.views[1].releases == 0  # writes are landing in these pages
    w.release_held()  # the TransferAccepted, then the prefill reads the Abort and cancels
    w.run()
    assert p.views[1].state is KVPoll.Failed
    assert not w._writes_held
    assert d.views[1].releases == 1 and p.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0


def test_a_lost_prefill_before_transfer_accepted_holds_the_pages_for_the_quarantine() -> None:
    w, p, d = pair()
    w.drop(lambda frm, to, m: frm == "prefill:1" and not isinstance(m, P.Hello))
    w.hold_writes = True
    open_room(w, p, d, 1)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    for _ in range(3):
        w.tick(HB)
        w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].releases == 0
    w.tick(QUARANTINE)
    w.run()
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 1


def test_a_two_sided_accept_clears_the_fence() -> None:
    """A prefill that answers two-sided never writes: an abort after its accept releases at
    once (nothing to wait for)."""
    w, p, d = pair(prefill_writes=False)
    open_room(w, p, d, 1)
    w.run()
    w.drop(lambda frm, to, m: frm == "prefill:1")
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].releases == 1


def test_a_room_id_is_reopened_only_after_its_release() -> None:
    """The decode aborts; the prefill's AbortAck is still on the wire, so the pages are held.
    Opening the same room id now fails that open (naming why) and leaves the old room alone:
    the late AbortAck then reaches the old room and releases it; afterwards the id opens."""
    w, p, d = pair()
    w.hold_writes = True
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.hold(lambda frm, to, m: isinstance(m, P.AbortAck))
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].state is KVPoll.Failed and d.views[1].releases == 0
    token = 1001
    w.feed(d, ev.OpenReceiver(1, token, (("prefill:1", 0),)))
    w.run()
    again = d.views[token]
    assert again.state is KVPoll.Failed and again.releases == 1
    assert again.failure is not None and "previous use" in again.failure.reason
    w.release_held()  # the late AbortAck of the first use
    w.run()
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0
    token2 = 1002
    w.feed(d, ev.OpenReceiver(1, token2, (("prefill:1", 0),)))
    w.run()
    assert d.views[token2].state is not KVPoll.Failed


def test_a_stale_abort_ack_does_not_unfence_an_open_room() -> None:
    """An AbortAck answers the end of a room; one that reaches a room still open (a late one
    of an earlier use of the id) must not let its pages go while the writer writes."""
    w, p, d = pair()
    w.hold_writes = True
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    leg = d.session.rooms.legs[(1, "prefill:1")]
    assert leg.state.fence.remote_writes
    pgen = p.session.ctx.me.generation
    w.feed(d, ev.MessageReceived(P.AbortAck(src="prefill:1", gen=pgen, room=1)))
    assert leg.state.fence.remote_writes
    w.hold(lambda frm, to, m: frm == "decode:1")
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].releases == 0


def test_stop_messages_unfence_a_requested_room_only_when_they_name_its_request() -> None:
    """A decode's pages are fenced from its TransferRequest on. A prefill's Failed that names
    another request (`xfer`: an earlier use of the id) is ignored altogether; one that names
    none (an older prefill) fails the room but leaves the pages fenced; the AbortAck that
    names this request lets them go, without the quarantine."""
    w, p, d = pair()
    w.hold_writes = True
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    leg = d.session.rooms.legs[(1, "prefill:1")]
    assert leg.state.fence.remote_writes and leg.xfer
    pgen = p.session.ctx.me.generation
    stale = d.session.counters["stale_messages"]
    w.feed(d, ev.MessageReceived(P.Failed(src="prefill:1", gen=pgen, room=1, reason="old",
                                          xfer=leg.xfer + 1)))
    assert d.session.counters["stale_messages"] == stale + 1
    assert not leg.state.terminal and leg.state.fence.remote_writes
    w.hold(lambda frm, to, m: True)  # nothing more reaches either side on its own
    w.feed(d, ev.MessageReceived(P.Failed(src="prefill:1", gen=pgen, room=1, reason="older")))
    assert d.views[1].state is KVPoll.Failed
    assert leg.state.fence.remote_writes and d.views[1].releases == 0
    w.feed(d, ev.MessageReceived(P.AbortAck(src="prefill:1", gen=pgen, room=1, xfer=leg.xfer)))
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0


def test_a_layer_done_before_the_accept_or_of_another_request_lands_nothing() -> None:
    """On one connection a LayerDone of this use of the room never precedes its
    TransferAccepted: one that does, or one that names another request, is an earlier use's
    (counted stale) and lands no layer."""
    w, p, d = pair()
    w.hold(lambda frm, to, m: isinstance(m, P.TransferAccepted))
    open_room(w, p, d, 1)
    w.run()
    leg = d.session.rooms.legs[(1, "prefill:1")]
    assert leg.state.requested and not leg.state.accepted
    pgen = p.session.ctx.me.generation
    empty = [P.LayerInfo(layer=lid, attempt=0, regions=[]) for lid in layers(d.session.layout)]
    stale = d.session.counters["stale_messages"]
    for xfer in (0, leg.xfer, leg.xfer + 1):
        w.feed(d, ev.MessageReceived(P.LayerDone(src="prefill:1", gen=pgen, room=1,
                                                 layers=empty, xfer=xfer)))
    assert d.session.counters["stale_messages"] == stale + 3
    assert not leg.progress.sums and not leg.progress.units_done
    w.release_held()
    w.run()
    assert leg.state.accepted
    w.feed(d, ev.MessageReceived(P.LayerDone(src="prefill:1", gen=pgen, room=1,
                                             layers=empty, xfer=leg.xfer + 1)))
    assert d.session.counters["stale_messages"] == stale + 4
    assert not leg.progress.units_done and d.views[1].state is not KVPoll.Success


# ---------------------------------------------------------------------------- checksum policy


def checksum_pair(prefill: str, decode: str) -> tuple[MemoryWire, Side, Side]:
    return mem_pair(prefill=settings(checksum=prefill), decode=settings(checksum=decode))


@pytest.mark.parametrize(("prefill", "decode"), [("off", "full"), ("sampled", "full"),
                                                 ("off", "sampled")])
def test_a_decode_refuses_a_prefill_that_sums_less_than_it_verifies(prefill: str,
                                                                     decode: str) -> None:
    """The decode verifies only the layers the prefill summed: a weaker prefill would end in
    Success with layers unchecked. Both sides refuse at the Hello, naming both modes."""
    w, p, d = checksum_pair(prefill, decode)
    open_room(w, p, d, 1)
    w.run()
    all_ready(w, p, 1)
    assert d.views[1].state is KVPoll.Failed
    f = d.views[1].failure
    assert f is not None
    assert f"decode={decode!r}" in str(f) and f"prefill={prefill!r}" in str(f), f
    assert "TransferRequest" not in kinds(w, "decode:1")
    assert d.session.counters["checksums_verified"] == 0


@pytest.mark.parametrize(("prefill", "decode"), [("full", "off"), ("full", "sampled"),
                                                 ("sampled", "sampled"), ("off", "off")])
def test_a_prefill_at_least_as_strict_serves_the_decode(prefill: str, decode: str) -> None:
    w, p, d = checksum_pair(prefill, decode)
    open_room(w, p, d, 1)
    w.run()
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    assert (d.session.counters["checksums_verified"] > 0) == (prefill != "off")


def test_a_prefill_that_does_not_say_its_mode_is_checked_per_layer() -> None:
    """An older prefill (its Hello has no `checksum`) set to off, a decode set to full: the
    first layer that comes without a sum fails the room, naming layer and mode; never
    Success."""
    w, p, d = checksum_pair("off", "full")
    send = w._send

    def older(side: Side, to: str, msg: object) -> None:
        if isinstance(msg, P.Hello):
            msg = msgspec.structs.replace(msg, checksum="")
        send(side, to, msg)

    w._send = older  # type: ignore[method-assign]
    open_room(w, p, d, 1)
    w.run()
    all_ready(w, p, 1)
    assert d.views[1].state is KVPoll.Failed
    f = d.views[1].failure
    assert f is not None and f.kind is FailureKind.CHECKSUM
    assert "decode='full' verifies layer" in f.reason and "no sum" in f.reason
    assert p.views[1].state is KVPoll.Failed


def test_a_hello_with_an_unknown_mode_is_refused_naming_it() -> None:
    w, p, d = checksum_pair("full", "full")
    send = w._send

    def bogus(side: Side, to: str, msg: object) -> None:
        if isinstance(msg, P.Hello) and side is p:
            msg = msgspec.structs.replace(msg, checksum="most")
        send(side, to, msg)

    w._send = bogus  # type: ignore[method-assign]
    open_room(w, p, d, 1)
    w.run()
    f = d.views[1].failure
    assert d.views[1].state is KVPoll.Failed and f is not None
    assert "checksum: prefill says 'most'" in str(f), f


# ---------------------------------------------------------------------------- quarantine bound


def test_the_quarantine_is_never_shorter_than_the_writers_own_bound() -> None:
    """write_quarantine_s (4 s) shorter than the writer's bound on stopping a copy
    (stall_timeout_s, 30 s): a prefill frozen for 10 s could wake and go on copying into
    pages released at 4 s. The decode holds them stall_timeout_s + 2 heartbeats."""
    w, p, d = pair(decode=settings(write_quarantine_s=QUARANTINE, stall_timeout_s=30.0))
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.drop(lambda frm, to, m: frm == "prefill:1")  # frozen
    for _ in range(3):
        w.tick(HB)
        w.run()
    assert d.views[1].state is KVPoll.Failed and d.views[1].releases == 0
    w.tick(10.0)  # past write_quarantine_s, not past the writer's bound
    w.run()
    assert d.views[1].releases == 0
    assert write_quarantine(d.session.settings) == 30.0 + 2 * HB
    w.tick(30.0 + 2 * HB - 10.0)
    w.run()
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 1
    assert any("stall_timeout_s + 2 heartbeats" in m for m in d.log)


def test_an_abort_before_the_prefill_opened_the_room_releases_at_once_and_is_never_written(
) -> None:
    """The decode's request and then its Abort reach the prefill before its engine opened
    the room: the prefill holds no leg, so it writes nothing and says so (AbortAck) at once;
    the decode's pages go back without the quarantine; when the prefill's engine opens the
    room later, the held request is not accepted (nothing is written) and the room fails
    with the abort's reason."""
    w, p, d = pair()
    lay = d.session.layout
    dst = np.arange(3, dtype=np.int64) + 5
    w.feed(d, ev.OpenReceiver(8, 8, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(8, 8, {r.name: dst for r in lay.regions}, 40, 0))
    w.run()
    assert "TransferRequest" in kinds(w, "decode:1")
    w.feed(d, ev.AbortRoom(8, 8, "request cancelled"))
    w.run()
    assert d.views[8].state is KVPoll.Failed
    assert d.views[8].releases == 1  # at once, not after the quarantine
    assert d.session.counters["write_quarantines"] == 0
    src = np.arange(3, dtype=np.int64)
    w.feed(p, ev.OpenSender(8, 8, {r.name: src for r in lay.regions}, 40, 1))
    w.run()
    for lid in layers(lay):
        w.feed(p, ev.LayerReady(8, 8, lid))
    w.run()
    assert "TransferAccepted" not in kinds(w, "prefill:1")
    assert p.session.counters["rooms_one_sided"] == 0  # never accepted, never written
    fp = p.views[8].failure
    assert fp is not None and "request cancelled" in fp.reason
    assert p.views[8].releases == 1


def test_a_fan_in_room_failed_at_one_ranks_attach_never_requests_from_the_other() -> None:
    """Found by the simulator once it ran engine calls through the driver's queue (seed 240):
    a decode opens a room read from two prefill ranks, the first of which it already knows
    refuses it (checksum off against full). The room fails at that rank's attach and, with
    only that leg made, was released at once; the second rank's leg then joined the released
    room, and the engine's `ReceiverInit` (which the engine sends before it sees the room
    fail) made it request writes into pages the engine had got back. Now every leg exists
    before any attaches: the room fails whole and nothing is requested."""
    w = MemoryWire()
    weak = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(checksum="off"))
    good = w.add("prefill:2", Role.PREFILL, layout(), settings=settings())
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    open_room(w, weak, d, 1)  # the decode learns that prefill:1 refuses it
    w.run()
    assert d.views[1].state is KVPoll.Failed
    lay = d.session.layout
    w.feed(good, ev.OpenSender(2, 2, {r.name: np.arange(3) for r in lay.regions}, SEQ, 1))
    w.feed(d, ev.OpenReceiver(2, 2, (("prefill:1", 0), ("prefill:2", 0))))
    assert d.views[2].state is KVPoll.Failed
    w.feed(d, ev.ReceiverInit(2, 2, {r.name: np.arange(5, 8) for r in lay.regions}, SEQ, 0))
    w.run()
    for lid in layers(lay):
        w.feed(good, ev.LayerReady(2, 2, lid))
    w.run()
    w.tick(HB)
    w.run()
    assert not [m for f, to, m in w.sent if f == "decode:1" and to == "prefill:2"
                and isinstance(m, P.TransferRequest)]
    assert d.views[2].releases == 1
    assert good.views[2].state is KVPoll.Failed


def test_a_woken_prefills_abort_ack_releases_the_pages_it_was_writing() -> None:
    """The prefill is stopped (SIGSTOP) with one-sided writes in flight: the decode declares it
    lost (silent) and keeps the pages fenced. Woken, the prefill declares the decode lost too;
    its Failed says its writes have not stopped yet (a copy was in flight), and once that
    copy's cancel is answered its AbortAck says they have. The decode takes that AbortAck,
    though it forgot the prefill, and releases the pages then, not after the quarantine.
    Before: an AbortAck of a forgotten peer was dropped as stale, and the pages waited for
    `write_quarantine` (30 s by default: `test_rel_peer_death`'s SIGSTOP case, on a loaded
    host where a copy was in flight at the stop)."""
    w, p, d = pair()
    w.hold_writes = True
    open_room(w, p, d, 1)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert w._writes_held  # copies in flight when the prefill stops
    # stopped: nothing reaches it, nothing it sends goes out, only the decode's clock ticks
    w.hold(lambda frm, to, m: "prefill:1" in (frm, to))
    for _ in range(3):
        w.clock.advance(HB)
        w.feed(d, ev.Tick(read_at=w.clock()))
        w.run()
    assert d.views[1].state is KVPoll.Failed and "silent" in str(d.views[1].failure)
    assert d.views[1].releases == 0  # the stopped writer may still write
    # woken: it sees its own silence first, fails the room while a copy is in flight (Failed
    # with writes_stopped=False), cancels the copy and says AbortAck once that is answered
    w._hold.clear()
    w.tick(0.0)
    w.run()
    stop_words = [m for frm, to, m in w.sent if frm == "prefill:1" and to == "decode:1"
                  and isinstance(m, P.Failed | P.AbortAck)]
    assert [type(m) for m in stop_words] == [P.Failed, P.AbortAck], stop_words
    assert not stop_words[0].writes_stopped
    w.release_held()  # what the decode said while the prefill slept, read late
    w.run()
    assert d.views[1].releases == 1  # at the AbortAck, well before the quarantine
    assert d.session.counters["write_quarantines"] == 0
    w.tick(QUARANTINE)
    w.run()
    assert d.views[1].releases == 1 and p.views[1].releases == 1


def test_a_first_write_that_never_lands_fails_at_the_stall_bound_not_the_waiting_one() -> None:
    """The prefill accepted and posted its first layer's write, which never completes (its
    bytes refused or lost on the way: junk claims that pushed out a tcp connection's, a lane
    that stopped). Before, the stall bound was armed only once a first layer had moved, so
    both sides held the room's pages for `waiting_timeout_s` (300 s by default). Now the
    prefill's first post arms it: the room fails at `stall_timeout_s` (`transfer_stall`) and
    the decode is told; its pages go back once the prefill's write was cancelled."""
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(),
              settings=settings(stall_timeout_s=3.0, waiting_timeout_s=300.0), writes=True)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=settings(write_quarantine_s=QUARANTINE, stall_timeout_s=3.0,
                                waiting_timeout_s=300.0), writes=True)
    w.hold_writes = True  # posted, never completed
    open_room(w, p, d, 1)
    w.run()
    first = layers(p.session.layout)[0]
    w.feed(p, ev.LayerReady(1, 1, first))
    w.run()
    assert w._writes_held and p.views[1].state is KVPoll.WaitingForInput
    elapsed = 0.0
    while elapsed < 3.0 + HB and p.views[1].state is not KVPoll.Failed:
        w.tick(HB)  # heartbeats flow: both peers stay alive, only the write is stuck
        w.run()
        elapsed += HB
    fp = p.views[1].failure
    assert fp is not None and fp.kind is FailureKind.DEADLINE and "transfer_stall" in fp.reason
    assert d.views[1].state is KVPoll.Failed  # told by the prefill, not at its own 300 s
    # the prefill cancelled its stuck write; the decode's pages went back once it said so
    assert not w._writes_held
    assert d.views[1].releases == 1 and p.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0
