"""One-sided writes in the transfer protocol, in memory (`MemoryWire`, fake clock, no threads):
the decode offers its buffers in its Hello, the prefill installs them and writes each layer
straight into the decode's pages with the checksum computed while copying; the decode posts
nothing per span, verifies the landed bytes when the layer's LayerDone comes, and gives its
pages back only once the prefill can no longer write into them."""

from __future__ import annotations

import pytest

from kvhandoff.errors import FailureKind
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.effects import PostRecv, PostSend, PostWrite

from .test_session_memory import HB, bad_bytes, kinds, layers, layout, open_room, settings

QUARANTINE = 4.0


def pair(*, prefill_writes: bool = True, decode_writes: bool = True,
         decode: Settings | None = None) -> tuple[MemoryWire, Side, Side]:
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(),
              writes=prefill_writes)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=decode or settings(write_quarantine_s=QUARANTINE), writes=decode_writes)
    return w, p, d


def record_effects(w: MemoryWire) -> list[tuple[str, object]]:
    """Every effect the sides execute from now on, as (side, effect)."""
    seen: list[tuple[str, object]] = []
    run = w._execute

    def execute(side: Side, eff: object) -> None:
        seen.append((side.name, eff))
        run(side, eff)  # type: ignore[arg-type]

    w._execute = execute  # type: ignore[method-assign]
    return seen


def all_ready(w: MemoryWire, p: Side, room: int) -> None:
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(room, room, lid))
    w.run()


def test_layers_are_written_into_the_decode_and_verified_there() -> None:
    w, p, d = pair()
    seen = record_effects(w)
    open_room(w, p, d, 1)
    w.run()
    accepted = [m for f, _, m in w.sent if isinstance(m, P.TransferAccepted)]
    assert accepted and accepted[0].one_sided is True
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    writes = [e for s, e in seen if s == "prefill:1" and isinstance(e, PostWrite)]
    assert writes and all(e.checksum for e in writes)
    # nothing two-sided on either side, and no receive on the decode
    assert not [e for _, e in seen if isinstance(e, PostSend | PostRecv)]
    c = d.session.counters
    assert c["checksums_verified"] == 4 + 2 and c["rooms_one_sided"] == 1
    assert p.session.counters["rooms_one_sided"] == 1
    assert d.views[1].releases == 1 and p.views[1].releases == 1
    assert [x["one_sided_writes"] for x in p.session.status()["peers"]] == [True]


def test_a_corrupted_write_is_caught_and_written_again() -> None:
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    w.corrupt_next(layers(p.session.layout)[1], "main_kv")
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert "LayerNack" in kinds(w, "decode:1")
    assert d.session.counters["retransmits"] == 1 and bad_bytes(d) == 0


@pytest.mark.parametrize(("prefill_writes", "decode_writes"), [(False, True), (True, False)])
def test_either_side_without_writes_means_two_sided(prefill_writes: bool,
                                                    decode_writes: bool) -> None:
    w, p, d = pair(prefill_writes=prefill_writes, decode_writes=decode_writes)
    seen = record_effects(w)
    open_room(w, p, d, 1)
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert not [e for _, e in seen if isinstance(e, PostWrite)]
    assert [e for s, e in seen if s == "decode:1" and isinstance(e, PostRecv)]
    assert d.session.counters["rooms_one_sided"] == 0


def test_refused_descriptors_fall_back_to_two_sided_with_a_warning() -> None:
    w, p, d = pair()
    w.refuse_writes = "descriptor of another host"
    seen = record_effects(w)
    open_room(w, p, d, 1)
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert not [e for _, e in seen if isinstance(e, PostWrite)]
    assert any("one-sided writes refused (descriptor of another host)" in m for m in p.log)
    assert [x["one_sided_writes"] for x in p.session.status()["peers"]] == [False]


def test_a_decode_failure_holds_its_pages_until_the_prefill_confirms() -> None:
    """The decode fails the room (engine abort); its pages go back only when the prefill's
    AbortAck says its writes stopped, never before."""
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.hold(lambda frm, to, m: isinstance(m, P.AbortAck))
    w.feed(d, ev.AbortRoom(1, 1, "engine gave up"))
    w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].releases == 0  # the prefill has not confirmed yet
    w.release_held()
    w.run()
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0


def test_a_failed_from_the_decode_is_answered_so_its_pages_go_back() -> None:
    w, p, d = pair(decode=settings(write_quarantine_s=QUARANTINE, stall_timeout_s=1.0))
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    for _ in range(4):  # the stall deadline fails the decode's room: Failed to the prefill
        w.tick(0.4)
        w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].failure is not None and d.views[1].failure.kind is FailureKind.DEADLINE
    assert "AbortAck" in kinds(w, "prefill:1")
    assert d.views[1].releases == 1 and p.views[1].releases == 1


def test_a_lost_prefill_holds_the_pages_for_the_quarantine() -> None:
    """A prefill that goes silent may only be stopped: the decode fails the room within two
    heartbeats but keeps its pages write_quarantine_s, then releases them (counted, logged)."""
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.drop(lambda frm, to, m: frm == "prefill:1")
    for _ in range(3):
        w.tick(HB)
        w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].failure is not None and d.views[1].failure.kind is FailureKind.PEER_LOST
    assert d.views[1].releases == 0
    w.tick(QUARANTINE)
    w.run()
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 1
    assert any("never confirmed" in m for m in d.log)


def test_a_prefill_whose_process_exited_releases_at_once() -> None:
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.drop(lambda frm, to, m: frm == "prefill:1")
    w.exited.add("prefill:1")  # the transport knows its pidfd fired
    for _ in range(3):
        w.tick(HB)
        w.run()
    assert d.views[1].state is KVPoll.Failed
    assert d.views[1].releases == 1
    assert d.session.counters["write_quarantines"] == 0


def test_the_prefill_fails_and_frees_when_writes_to_a_dead_decode_fail() -> None:
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    w.exited.add("decode:1")  # writes into it now fail
    w.feed(p, ev.LayerReady(1, 1, layers(p.session.layout)[0]))
    w.run()
    w.drop(lambda frm, to, m: frm == "decode:1")
    for _ in range(3):
        w.tick(HB)
        w.run()
    assert p.views[1].state is KVPoll.Failed
    assert p.views[1].failure is not None
    assert p.views[1].releases == 1
