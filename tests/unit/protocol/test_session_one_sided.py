"""One-sided writes in the transfer protocol, in memory (`MemoryWire`, fake clock, no threads):
the decode offers its buffers in its Hello, the prefill installs them and writes each layer
straight into the decode's pages with the checksum computed while copying; the decode posts
nothing per span, verifies the landed bytes when the layer's LayerDone comes, and gives its
pages back only once the prefill can no longer write into them."""

from __future__ import annotations

import msgspec
import pytest

from kvhandoff.buffers.checksum import span_checksum
from kvhandoff.errors import FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import HashSpans, PostRecv, PostSend, PostWrite
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side

from .test_session_memory import HB, bad_bytes, kinds, layers, layout, open_room, settings

QUARANTINE = 4.0
STALL = 2.0  # the writer's bound on stopping a copy: the quarantine may not be shorter


def pair(*, prefill_writes: bool = True, decode_writes: bool = True,
         decode: Settings | None = None) -> tuple[MemoryWire, Side, Side]:
    w = MemoryWire()
    # the prefill's stall bound as the decode's: its Hello says it, and the decode's quarantine
    # outlasts the longer of the two
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(stall_timeout_s=STALL),
              writes=prefill_writes)
    d = w.add("decode:1", Role.DECODE, layout(),
              settings=decode or settings(write_quarantine_s=QUARANTINE, stall_timeout_s=STALL),
              writes=decode_writes)
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
    # one write job per layer, its parts every region of that layer, each under its own tag
    lay = p.session.layout
    want = sorted(tuple(r.name for r in lay.regions if lid in r.layer_ids) for lid in layers(lay))
    assert sorted(tuple(x.buffer.rsplit("/", 1)[0] for x in e.parts) for e in writes) == want
    assert any(len(e.parts) > 1 for e in writes)
    assert all(len({x.tag for x in e.parts}) == len(e.parts) for e in writes)
    # nothing two-sided on either side, and no receive on the decode
    assert not [e for _, e in seen if isinstance(e, PostSend | PostRecv)]
    c = d.session.counters
    assert c["checksums_verified"] == 4 + 2 and c["rooms_one_sided"] == 1
    assert p.session.counters["rooms_one_sided"] == 1
    assert d.views[1].releases == 1 and p.views[1].releases == 1
    assert [x["one_sided_writes"] for x in p.session.status()["peers"]] == [True]


@pytest.mark.parametrize("writer_reads_back", [False, True])
def test_a_corrupted_write_is_caught_and_written_again(writer_reads_back: bool) -> None:
    """Caught by the decode's pass, or (`writer_reads_back`) by the writer's read-back, whose
    sum then differs from the source's."""
    w, p, d = pair()
    if writer_reads_back:
        read_back_writes(w)
    open_room(w, p, d, 1)
    w.run()
    w.corrupt_next(layers(p.session.layout)[1], "main_kv")
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert "LayerNack" in kinds(w, "decode:1")
    assert d.session.counters["retransmits"] == 1 and bad_bytes(d) == 0
    assert d.session.counters["checksum_failures"] == 1


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


def read_back_writes(w: MemoryWire, *, plan_skew: bool = False) -> None:
    """The writer's verification as shm's mapped lane gives it: each write's `Written` carries
    `landed`, the sum of the decode's pages read back at the plan's destination pieces right
    after the write (so a corrupt_next flip is in it). `plan_skew`: the LayerDones then name a
    plan digest one off, as a writer that wrote by another plan would."""
    write = w._write

    def with_read_back(side: Side, eff: PostWrite) -> None:
        write(side, eff)
        side_, done = w.completions.pop()
        assert isinstance(done, ev.Written) and done.op == eff.op
        landed = tuple(span_checksum(w.sides[eff.peer].buffers[x.buffer], x.plan.dst_offsets,
                                     x.plan.nbytes) for x in eff.parts)
        w.completions.append((side_, ev.Written(done.op, done.error, done.digests, landed)))

    w._write = with_read_back  # type: ignore[method-assign]
    if not plan_skew:
        return
    send = w._send

    def skewed(side: Side, to: str, msg: object) -> None:
        if isinstance(msg, P.LayerDone):
            msg = msgspec.structs.replace(msg, layers=[msgspec.structs.replace(info, regions=[
                msgspec.structs.replace(x, plan=None if x.plan is None else x.plan ^ 1)
                for x in info.regions]) for info in msg.layers])
        send(side, to, msg)

    w._send = skewed  # type: ignore[method-assign]


def test_the_writers_read_back_spares_the_decode_its_pass() -> None:
    """With `landed` in every Written, every LayerDone region carries the landed sum and the
    plan digest; the decode checks both against the source sum and its own plan and hashes
    nothing itself."""
    w, p, d = pair()
    read_back_writes(w)
    seen = record_effects(w)
    open_room(w, p, d, 1)
    w.run()
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    done = [x for _, _, m in w.sent if isinstance(m, P.LayerDone) for i in m.layers
            for x in i.regions]
    assert done and all(x.landed == x.checksum and x.plan is not None for x in done)
    assert not [e for s, e in seen if s == "decode:1" and isinstance(e, HashSpans)]
    c = d.session.counters
    assert c["checksums_verified"] == c["checksums_writer_verified"] == 4 + 2


def test_a_writer_plan_other_than_the_decodes_fails_the_room() -> None:
    """Bytes read back intact but written by a plan whose digest is not the decode's: a
    mismatch like any other, rewritten once and then Failed on both sides naming the layer and
    region, never Success."""
    w, p, d = pair()
    read_back_writes(w, plan_skew=True)
    open_room(w, p, d, 1)
    w.run()
    all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Failed, KVPoll.Failed)
    first = layers(p.session.layout)[0]
    failure = d.views[1].failure
    assert failure is not None and f"checksum mismatch on layer {first}" in failure.reason
    assert d.session.counters["checksums_writer_verified"] == 0


def batched_room(w: MemoryWire, p: Side, room: int) -> None:
    """The layers ready as one `events.Batch` and their write jobs' completions as one, as the
    driver feeds them (`runtime.batching`: the queue's LayerReadys of a room, the Writtens of
    one transport job)."""
    w.feed(p, ev.Batch(tuple(ev.LayerReady(room, room, lid) for lid in layers(p.session.layout))))
    held = [done for side, done in w.completions if side is p and isinstance(done, ev.Written)]
    assert len(held) == len(w.completions) == len(layers(p.session.layout))  # a job per layer
    w.completions.clear()
    w.feed(p, ev.Batch(tuple(held)))
    w.run()


def layer_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Every layer step of every room machine from now on: (role, layers), one per
    `apply_layers` and one per single `LayerSent` / `LayerLanded`."""
    from kvhandoff.state_machine import LayerLanded, LayerSent, LegMachine

    steps: list[tuple[str, tuple[int, ...]]] = []
    apply, apply_layers = LegMachine.apply, LegMachine.apply_layers

    def one(self: LegMachine, event: object, now: float) -> bool:
        if isinstance(event, LayerSent | LayerLanded):
            steps.append((self.role.value, (event.layer,)))
        return apply(self, event, now)  # type: ignore[arg-type]

    def many(self: LegMachine, lids: list[int], now: float) -> bool:
        steps.append((self.role.value, tuple(lids)))
        return apply_layers(self, lids, now)

    monkeypatch.setattr(LegMachine, "apply", one)
    monkeypatch.setattr(LegMachine, "apply_layers", many)
    return steps


def test_a_batch_of_layers_is_one_step_on_each_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's layers ready together, written by one job: the prefill's machine takes
    them sent in one step, the decode's (their one LayerDone, each layer's sums compared with
    the writer's read-back) landed in one step; every layer counted, fenced and checked."""
    w, p, d = pair()
    read_back_writes(w)
    open_room(w, p, d, 1)
    w.run()
    steps = layer_steps(monkeypatch)
    batched_room(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    every = tuple(layers(p.session.layout))
    assert steps == [("prefill", every), ("decode", every)]
    done = [m for _, _, m in w.sent if isinstance(m, P.LayerDone)]
    assert len(done) == 1 and sorted(i.layer for i in done[0].layers) == list(every)
    c = d.session.counters
    assert c["checksums_verified"] == c["checksums_writer_verified"] == 4 + 2
    sent = p.session.counters["bytes_sent"]
    assert sent == d.session.counters["bytes_received"] > 0
    assert not p.session.legs[(1, "decode:1")].state.fence.tags  # every write's tags cleared


def test_a_corrupt_layer_in_a_batch_is_written_again_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer of the batch lands corrupt: the layers before and after it land in steps
    around it, it alone is asked again (LayerNack) and lands once rewritten."""
    w, p, d = pair()
    read_back_writes(w)
    open_room(w, p, d, 1)
    w.run()
    lay = p.session.layout
    every = layers(lay)
    bad = every[1]
    w.corrupt_next(bad, next(r.name for r in lay.regions if bad in r.layer_ids))
    steps = layer_steps(monkeypatch)
    batched_room(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    nacks = [m for _, _, m in w.sent if isinstance(m, P.LayerNack)]
    assert [(m.layer, m.attempt) for m in nacks] == [(bad, 0)]
    decode = [lids for role, lids in steps if role == "decode"]
    assert decode == [tuple(every[:1]), tuple(every[2:]), (bad,)]
    assert [lids for role, lids in steps if role == "prefill"] == [tuple(every)]
    assert d.session.counters["retransmits"] == 1
