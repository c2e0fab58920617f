"""`InFlight`: the transport ops and hashing jobs one session has in flight, sans-IO.

Both roles' data paths (`send.SendPath`, `receive.ReceivePath`) post through it: an op is a
send, a receive or a one-sided write job (`Op`), a job hashes span lists (`Job`); each gets an
id its completion event names (`events.OpDone` / `Written` / `Hashed`). It also keeps the
count of each leg's ops per data tag (`Fence.tags`, what a failing leg cancels and what
the release of its pages waits for).

Rules:
- The one owner of the op and job tables: the role paths never keep op ids of their own, and
  a completion is looked up here first (`take_op` / `take_job`), which forgets it and settles
  what every completion settles (the leg's tag count; a terminal leg's release; a hashing job
  that failed or is stale) before the session hands it to the role that posted it.
- A data op that failed fails its room only a heartbeat later (`failed`): the peer's own word
  (its Failed or Abort, with the real reason) usually follows its cancelled ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.buffers.bufferset import buffer_name
from kvhandoff.errors import Failure, FailureKind
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.checksums import ChecksumAlg, checksum_alg
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import HashSpans, Notify
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import PeerTable
from kvhandoff.protocol.reports import ReadOuts
from kvhandoff.protocol.rooms import Leg, Unit
from kvhandoff.state_machine import PeerFailedRoom, PeerWasLost


@dataclass(frozen=True, slots=True)
class Op:
    """A transport op in flight: a send or receive of one region, or a one-sided write job of
    every region of a unit's layer."""

    leg: Leg
    tags: tuple[int, ...]  # one per region (a one-sided write job: every region of its layer)
    send: bool
    unit: Unit
    attempt: int
    regions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Job:
    """A hashing job in flight: the source sums a prefill announces, or the landed sums a
    decode verifies."""

    leg: Leg
    verify: bool  # False: announce (source sums), True: verify (landed sums)
    unit: Unit
    attempt: int
    regions: tuple[str, ...]  # the regions of the layer this leg moves
    hashed: tuple[str, ...]  # the regions hashed (in `Hashed.sums` order)
    want: tuple[int | None, ...] = ()  # verify: the sender's sums of `hashed`
    trusted: int = 0  # verify: regions besides `hashed` the writer verified (counted as checked)


class InFlight:
    """The ops and hashing jobs of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, peers: PeerTable,
                 readouts: ReadOuts) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.peers = peers
        self.readouts = readouts
        self.ops: dict[int, Op] = {}
        self.jobs: dict[int, Job] = {}
        self._next = 0

    def leg_of(self, e: ev.OpDone | ev.Written | ev.Hashed) -> Leg | None:
        """The leg a completion is about (None: forgotten, its room ended)."""
        item = self.jobs.get(e.job) if isinstance(e, ev.Hashed) else self.ops.get(e.op)
        return item.leg if item is not None else None

    # ------------------------------------------------------------------ posting

    def post(self, r: Leg, tags: tuple[int, ...], *, send: bool, unit: Unit, attempt: int,
             regions: tuple[str, ...]) -> int:
        """Records an op of `r` about to be posted; its id."""
        return self.post_many(r, [(unit, tags, regions)], send=send, attempt=attempt)[0]

    def post_many(self, r: Leg, posts: list[tuple[Unit, tuple[int, ...], tuple[str, ...]]],
                  *, send: bool, attempt: int) -> range:
        """Records ops of `r` about to be posted together ((unit, tags, regions) each: a
        one-sided write job per unit of the layers the engine marked ready at once), in one
        pass; their ids, in order."""
        ops, first = self.ops, self._next + 1
        tags: list[int] = []
        for i, (unit, unit_tags, regions) in enumerate(posts, first):
            ops[i] = Op(r, unit_tags, send, unit, attempt, regions)
            tags.extend(unit_tags)
        self._next += len(posts)
        # (a failing leg cancels each tag: a transport may have split the job)
        r.state.fence.posted(tags)
        return range(first, self._next + 1)

    def hash(self, job: Job) -> None:
        """Asks for the sums of `job` (`HashSpans`) with the room's algorithm."""
        self._next += 1
        self.jobs[self._next] = job
        plans = job.leg.plan.plans_of(job.unit)
        spans = tuple((buffer_name(n, job.unit.layer), plans[n].src_offsets
                       if not job.verify else plans[n].dst_offsets,
                       plans[n].nbytes) for n in job.hashed)
        self.ctx.emit(HashSpans(self._next, spans, self.checksum_alg(job.leg)))

    def checksum_alg(self, r: Leg) -> ChecksumAlg:
        """The room's checksum algorithm (`checksums.checksum_alg`) from this side's memory
        kind and the peer's Hello; a peer no longer known counts as host (its rooms are
        failing: nothing it sent is verified any more)."""
        p = self.peers.get(r.peer)
        return checksum_alg(self.ctx.me.memory, p.memory if p is not None else "host")

    # ------------------------------------------------------------------ completions

    def take_op(self, op_id: int) -> Op | None:
        """The op a completion names, forgotten; None when there is nothing more to do with
        it (unknown, or its leg is terminal: then its pages may go back)."""
        op = self.ops.pop(op_id, None)
        if op is None:
            return None
        r = op.leg
        r.state.fence.completed(op.tags)
        if r.state.terminal:
            self.rooms.maybe_release(r)
            return None
        return op

    def take_job(self, e: ev.Hashed) -> Job | None:
        """The job `e` answers, forgotten; None when there is nothing more to do with it
        (unknown, its leg terminal, its unit posted again since, or the hashing failed: the
        room fails, naming the layer)."""
        job = self.jobs.pop(e.job, None)
        if job is None:
            return None
        r = job.leg
        r.progress.verifying.discard((job.unit, job.attempt))
        if r.state.terminal or r.progress.posted.get(job.unit) != job.attempt:
            return None
        if e.error is not None:
            what = "verification" if job.verify else "checksum"
            layer = job.unit.layer
            self.rooms.fail(r, PeerFailedRoom(reason=f"{what} of layer {layer} failed: {e.error}"),
                            notify=Notify.FAILED, failure=Failure(
                                FailureKind.TRANSPORT, f"{what} of layer {layer} could not be "
                                f"computed: {e.error}"))
            return None
        return job

    def moved(self, r: Leg, unit: Unit, regions: tuple[str, ...], direction: str) -> int:
        """Counts the bytes of `unit`'s `regions` as sent / received; returns them."""
        plans = r.plan.plans_of(unit)
        moved = self.readouts.moved
        total = 0
        for region in regions:
            plan = plans[region]
            nbytes = plan.total_bytes
            total += nbytes
            moved(direction, region, nbytes, plan.count)
        self.ctx.counters[f"bytes_{direction}"] += total
        return total

    def moved_units(self, r: Leg, done: list[tuple[Unit, tuple[str, ...]]],
                    direction: str) -> int:
        """Counts the bytes of several units' regions as sent / received, in one pass (one
        counter update per region); returns them."""
        plan = r.plan
        nbytes: dict[str, int] = {}
        pieces: dict[str, int] = {}
        chunks = plan.chunk_plans
        for unit, regions in done:
            plans = chunks[unit.chunk]
            for region in regions:
                p = plans[region]
                nbytes[region] = nbytes.get(region, 0) + p.total_bytes
                pieces[region] = pieces.get(region, 0) + p.count
        moved = self.readouts.moved
        for region, n in nbytes.items():
            moved(direction, region, n, pieces[region])
        total = sum(nbytes.values())
        self.ctx.counters[f"bytes_{direction}"] += total
        return total

    def failed(self, r: Leg, reason: str) -> None:
        """A data op of `r` failed. When the peer failed or aborted the room, its cancelled
        ops usually reach us on the data lane before its Failed/Abort (with the real reason)
        on the control lane: give that message one heartbeat, then fail with ours. A dead
        peer is still caught within 2 heartbeats."""
        self.ctx.later(self.ctx.hb, lambda: self.rooms.fail(
            r, PeerWasLost(reason=reason), notify=Notify.FAILED, kind=FailureKind.TRANSPORT))
