"""The decode's pages are not released while a one-sided writer may still write into them
(issue 35), in memory (`MemoryWire`, fake clock): from the moment the decode sent a
`TransferRequest` carrying its buffers, whatever it has or has not read since."""

from __future__ import annotations

from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll

from .test_session_memory import HB, layers, open_room
from .test_session_one_sided import QUARANTINE, pair


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
    assert leg.remote_writes
    pgen = p.session.ctx.me.generation
    w.feed(d, ev.MessageReceived(P.AbortAck(src="prefill:1", gen=pgen, room=1)))
    assert leg.remote_writes
    w.hold(lambda frm, to, m: frm == "decode:1")
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].releases == 0
