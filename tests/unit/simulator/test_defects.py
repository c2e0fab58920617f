"""One scripted schedule per known page-reuse defect, run through the simulator
(`kvhandoff.testing.simulator`): the test drives the schedule up to the moment that matters,
then lets the simulator run the rest (its PRNG, every invariant checked after every step).

Each test is a plain assertion of what users need (no `xfail`): it fails while the defect it
names is in the code and passes once the fix is in. The defects (issue 35):
(a) a decode that gives up a room after its TransferRequest and before it read the prefill's
    TransferAccepted released its pages at once, while the prefill writes into them;
(b) the decode's write_quarantine_s (10 s) is shorter than the bound on a paused prefill's
    writes (stall_timeout_s, 30 s): the prefill resumes writing into released pages;
(c) a room id reopened before its pages came back: a late AbortAck of the old room reaches
    the new one and lets its pages go while its writes are in flight;
(d) a decode with checksum=full paired with a prefill with checksum=off ends Success without
    verifying a byte;
and two found with those fixed: a late Failed, and a late LayerDone, of an earlier use of a
reopened room id reaching the new one (room messages now name their request, `xfer`).
"""

from __future__ import annotations

from typing import Any

from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.simulator import SimConfig, Simulation
from kvhandoff.testing.simulator.core import Instance

SEED = 11  # the PRNG only schedules what follows the scripted part
PREFILL, DECODE = "prefill:0", "decode:0"


def scripted(cls: type[Simulation] = Simulation, **force: Any) -> Simulation:
    """One prefill, one decode, one-sided writes, checksums full, no room or fault of the
    seed's own: the test opens its rooms."""
    base = {"prefills": 1, "decodes": 1, "writes": True, "checksum_prefill": "full",
            "checksum_decode": "full", "instances": 0, "faults": 0}
    return cls(SEED, SimConfig(force=tuple({**base, **force}.items())), trace=True)


def accepted_queued(sim: Simulation) -> bool:
    return any(isinstance(m, P.TransferAccepted) for m in sim.queued(PREFILL, DECODE))


def open_until_accepted(sim: Simulation, room: int = 7, *, required: bool = True
                        ) -> Instance:
    """Opens a room on both sides with every layer ready on the prefill, and runs the
    handshake until the prefill accepted (its writes posted, none landed, its
    TransferAccepted on its way to the decode). Not `required`: or until nothing is left to
    run (the agents refused each other)."""
    inst = sim.add_instance(room, [PREFILL], [DECODE])
    sim.engine(inst, PREFILL)
    sim.engine(inst, DECODE)
    if required:
        sim.drain(land=False, until=lambda: accepted_queued(sim))
        assert sim.flights, "the prefill has posted its writes"
    else:
        sim.drain(land=False, until=lambda: accepted_queued(sim) or not sim.busy())
    return inst


def run(sim: Simulation) -> None:
    try:
        sim.play()
    except AssertionError:
        print("\n".join(sim.trace[-60:]))
        raise


def test_defect_a_a_decode_abort_before_the_accept_holds_the_pages_until_writes_stop() -> None:
    sim = scripted()
    inst = open_until_accepted(sim)
    sim.abort(inst, DECODE)  # the engine gives up; the TransferAccepted is still on its way
    run(sim)
    view = sim.views[inst.tokens[DECODE]]
    assert view.state is KVPoll.Failed and view.releases == 1


def test_defect_b_a_paused_prefill_cannot_write_into_pages_the_quarantine_gave_back() -> None:
    sim = scripted()
    inst = open_until_accepted(sim)
    sim.deliver(PREFILL, DECODE, len(sim.queued(PREFILL, DECODE)))  # the decode accepted
    # stopped with its writes posted, longer than the decode's quarantine, shorter than the
    # bound the transport puts on a write (stall_timeout_s)
    quarantine = sim.agents[DECODE].side.session.settings.write_quarantine_s
    stall = sim.agents[PREFILL].side.session.settings.stall_timeout_s
    sim.pause(PREFILL, min(quarantine + 5.0, (quarantine + stall) / 2)
              if stall > quarantine else quarantine + 5.0)
    run(sim)
    assert sim.views[inst.tokens[DECODE]].releases == 1


def test_defect_c_a_reopened_room_id_is_not_released_by_the_old_rooms_abort_ack() -> None:
    sim = scripted()
    sim.cancel_roll = 0.8  # every cancel lets its write land first, and is confirmed after
    old = open_until_accepted(sim)
    sim.deliver(PREFILL, DECODE, len(sim.queued(PREFILL, DECODE)))
    sim.abort(old, DECODE)
    sim.deliver(DECODE, PREFILL, len(sim.queued(DECODE, PREFILL)))  # the prefill cancels
    assert sim.views[old.tokens[PREFILL]].done and sim.views[old.tokens[DECODE]].done
    # both engines saw the room end: the same id is opened again for a new request
    new = sim.add_instance(old.room, [PREFILL], [DECODE])
    sim.engine(new, PREFILL)
    sim.engine(new, DECODE)
    sim.drain(land=False, until=lambda: accepted_queued(sim) or not sim.busy())
    sim.deliver(PREFILL, DECODE, len(sim.queued(PREFILL, DECODE)))
    # the old room's writes land, its cancels are confirmed: its AbortAck goes out
    for fl in [f for f in sim.flights.values() if f.dst_token is old.tokens[DECODE]]:
        while fl.fid in sim.flights:
            sim._land(fl)
    sim.drain(land=False)
    if not sim.views[new.tokens[DECODE]].done:
        sim.abort(new, DECODE)  # the new room's writes are in flight
    run(sim)
    assert sim.views[new.tokens[DECODE]].releases == 1


def test_defect_d_a_decode_with_full_checksums_never_ends_success_unverified() -> None:
    sim = scripted(checksum_prefill="off")
    inst = open_until_accepted(sim, required=False)
    sim.flip_next = True  # the next write that lands has one byte flipped
    run(sim)
    view = sim.views[inst.tokens[DECODE]]
    assert view.done and view.releases == 1


def test_a_late_failed_of_an_ended_fan_out_room_does_not_unfence_its_reopened_id() -> None:
    """Found by the simulator with the fixes of (a)-(d) in (seeds 169, 1488, 1551, 2197 of
    `make test`'s range). A prefill serving one room to two decode ranks fails it when one
    rank aborts, and tells the other rank, whose own room had already ended Success and been
    released. That rank's engine has reopened the id meanwhile (allowed: the old use is
    released); the late `Failed` (writes_stopped=True) named only the room id, so it failed
    the new room and let its pages go while the new room's TransferRequest was on its way,
    and the prefill then accepted and wrote into them. Fixed: it names the old request
    (`xfer`), which the new leg ignores as stale."""
    other = "decode:1"
    sim = scripted(decodes=2)
    inst = sim.add_instance(7, [PREFILL], [DECODE, other])
    for side in (PREFILL, DECODE, other):
        sim.engine(inst, side)
    sim.pause(DECODE, 1.0)  # decode:0 lags (nothing is delivered to it while it is stopped)
    # decode:1 gets every layer and ends Success; its RoomAck is still on its way
    sim.drain(until=lambda: inst.tokens[other] in sim.views
              and sim.views[inst.tokens[other]].done)
    assert sim.views[inst.tokens[other]].state is KVPoll.Success
    assert sim.views[inst.tokens[other]].releases == 1
    sim.agents[DECODE].paused_until = None
    sim.abort(inst, DECODE)
    sim.deliver(DECODE, PREFILL, len(sim.queued(DECODE, PREFILL)))  # the prefill fails it
    assert any(isinstance(m, P.Failed) for m in sim.queued(PREFILL, other))
    new = sim.add_instance(inst.room, [PREFILL], [other])  # a new request, the same id
    sim.engine(new, other)
    sim.deliver(PREFILL, other, len(sim.queued(PREFILL, other)))  # the late Failed
    sim.engine(new, PREFILL)  # the prefill's engine reopens the id too (its old use released)
    sim.deliver(other, PREFILL, len(sim.queued(other, PREFILL)))  # RoomAck, TransferRequest
    run(sim)
    assert sim.views[new.tokens[other]].releases == 1


def test_a_layer_done_of_an_earlier_use_of_the_id_never_lands_a_layer_of_the_new() -> None:
    """Found by the simulator with the fixes of (a)-(d) in (seed 10128, in the long range).
    In a TP fan-in room the prefill rank that brings no planes announces each layer
    with an empty LayerDone, flushed at its next tick, so after its AbortAck when the room was
    aborted. The decode reopens the id meanwhile (its old use is released) and asks that rank
    for every plane this time; the old empty LayerDone reaches the new leg before its
    TransferAccepted, and each layer it names counts as landed: the decode ends Success with
    pages the prefill never wrote. (A decode running checksum=full fails the room instead,
    since h-fence: no sum for a layer it verifies; one running checksum=off, a supported mode,
    ends Success.) Fixed: a decode ignores a LayerDone of another request (`xfer`) or one that
    reaches a leg not yet accepted."""
    other = "prefill:1"
    sim = scripted(prefills=2, checksum_decode="off")
    warm = sim.add_instance(5, [PREFILL, other], [DECODE])  # both handshakes done
    for side in (PREFILL, other, DECODE):
        sim.engine(warm, side)
    sim.drain()
    assert sim.views[warm.tokens[DECODE]].state is KVPoll.Success
    # room 7: prefill:1 is asked first (it brings every plane), prefill:0 brings none
    old = sim.add_instance(7, [other, PREFILL], [DECODE])
    sim.engine(old, other)
    sim.engine(old, PREFILL, calls=1)  # opened; its layers are marked ready later
    sim.engine(old, DECODE)
    sim.drain()
    sim.engine(old, PREFILL)  # its layers: empty LayerDones wait for its next tick
    sim.abort(old, DECODE)
    for src in (PREFILL, other):
        sim.deliver(DECODE, src, len(sim.queued(DECODE, src)))  # AbortAcks out
        sim.deliver(src, DECODE, len(sim.queued(src, DECODE)))
    assert sim.views[old.tokens[DECODE]].releases == 1
    # the same id for a new request: prefill:0 is asked first now, it brings every plane
    new = sim.add_instance(7, [PREFILL, other], [DECODE])
    sim.engine(new, DECODE)
    sim._tick(sim.agents[PREFILL])  # the old room's empty LayerDones go out
    assert any(isinstance(m, P.LayerDone) for m in sim.queued(PREFILL, DECODE))
    sim.engine(new, PREFILL)
    sim.engine(new, other)
    run(sim)
    assert sim.views[new.tokens[DECODE]].releases == 1


def test_writes_held_by_a_pass_that_stalls_past_the_quarantine_are_never_posted() -> None:
    """Found by the simulator once it ran production's executor (seed 1241): the prefill
    accepts a request, and its one-sided writes wait in the pass's batch for the end of the
    pass (`PassBatch`); the process is stopped right there for longer than the decode's write
    quarantine, while the decode's engine aborts the room. The decode gives its pages back
    once the quarantine passed; the prefill, waking, used to post the held writes then (their
    bound counting from that post), into pages the decode no longer holds. A write held longer
    than two heartbeats is now never posted."""
    sim = scripted()
    inst = sim.add_instance(7, [PREFILL], [DECODE])
    sim.engine(inst, PREFILL)
    sim.engine(inst, DECODE)
    sim.drain(land=False, until=lambda: any(isinstance(m, P.TransferRequest)
                                           for m in sim.queued(DECODE, PREFILL)))
    prefill = sim.agents[PREFILL]
    while not prefill.executor.batch.pending:  # read in a pass that has not ended yet
        sim._deliver((DECODE, PREFILL))
    quarantine = sim.agents[DECODE].side.session.settings.write_quarantine_s
    stall = prefill.side.session.settings.stall_timeout_s
    sim.pause(PREFILL, max(quarantine, stall) + 10.0)
    sim.abort(inst, DECODE)
    run(sim)
    assert sim.views[inst.tokens[DECODE]].releases == 1
    assert sim.views[inst.tokens[PREFILL]].state is KVPoll.Failed
