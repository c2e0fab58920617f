"""`ReceivePath`: the decode's side of the data path, sans-IO: it asks for a room
(`TransferRequest`, once the handshake is done and the engine gave its pages), posts every
receive when the prefill accepts, verifies each layer once its bytes and its `LayerDone` are
both in, asks once for a retransmit on a mismatch (`LayerNack`), fails the room naming layer
and region when the retransmit does not verify either, and ends with `RoomAck`.

With one-sided writes the prefill writes straight into this side's pages and nothing is
posted: a layer's bytes are in once its `LayerDone` is. A writer that read its write back
(same host) says so in the `LayerDone` (the landed sum and the digest of the plan it wrote
by); those regions are not read again here, a disagreement is a mismatch like any other.

Rules:
- It keeps no state of its own: the ops and hashing jobs in flight are `inflight.InFlight`'s,
  a leg's progress (posted, received, sums, verifying) is its `rooms.Progress`, what it
  moves its `rooms.LegPlan`.
- A layer lands (`LayerLanded`) only verified (or unsummed by the checksum mode both sides
  agreed on); a unit posted again (a retransmit) makes every word about the earlier attempt
  stale.
- From the `TransferRequest` that offered this side's buffers on, the leg's pages count as
  written into (`Fence.remote_writes`) until every layer verified or the prefill says its writes
  stopped.
- Chunked prefill (`chunks.ChunkedPrefill`) posts each later chunk's receives through
  `post_recv_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvhandoff.buffers.bufferset import buffer_name
from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.kv_layout.admission import AllocationPolicy
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.admission import digest_to_wire, reserved_pages
from kvhandoff.protocol.checksums import wants_checksum
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import Notify, PostRecv
from kvhandoff.protocol.inflight import InFlight, Job, Op
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import PeerTable
from kvhandoff.protocol.planning import regions_of, span_plans
from kvhandoff.protocol.rooms import Leg, Unit
from kvhandoff.protocol.roomstate import LegPhase
from kvhandoff.state_machine import (
    AllLayersLanded,
    ChecksumsDiffered,
    KVPoll,
    PeerFailedRoom,
    RequestAccepted,
    Role,
)

MAX_ATTEMPTS = 2  # one retransmit after a checksum mismatch, then the room fails


class ReceivePath:
    """The decode's data path of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, peers: PeerTable,
                 ops: InFlight) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.peers = peers
        self.ops = ops

    def init_leg(self, r: Leg) -> None:
        """Decode: give a leg the engine's pages once both exist; maybe request."""
        g = r.parent
        if g.given.pages is None or r.state.phase is not LegPhase.NEW:
            return
        plan = r.plan
        plan.pages, plan.prefix_len, plan.starts = g.given.pages
        plan.seq_len, plan.page_size = g.given.seq_len, self.ctx.layout.page_size_tokens
        r.state.advance(LegPhase.READY)
        self.maybe_request(r)

    def maybe_request(self, r: Leg) -> None:
        """Decode: send the TransferRequest once matched and initialised."""
        if (r.role is not Role.DECODE or r.state.phase is not LegPhase.READY
                or not r.state.matched or r.state.terminal):
            return
        p = self.peers.get(r.peer)
        if p is None or p.layout is None:
            return
        # Claim the planes this leg brings: those the source holds that no other leg of the
        # room claimed yet (replicated regions: the first leg takes all; head slices: by name).
        g = r.parent
        claimed: dict[str, set[str]] = {name: set() for name in self.ctx.region_index}
        for other in g.legs:
            if other is not r and other.plan.planes:
                for name, pl in other.plan.planes.items():
                    claimed[name].update(pl)
        planes: dict[str, list[str]] = {}
        for reg in self.ctx.layout.regions:
            try:
                theirs = {pl.name for pl in p.layout.region(reg.name).planes}
            except KVHandoffError:
                theirs = set()
            planes[reg.name] = [pl.name for pl in reg.planes
                                if pl.name in theirs and pl.name not in claimed[reg.name]]
        r.plan.planes = planes
        if g.state.all_legs and all(leg.state.requested for leg in g.legs if leg is not r):
            # the last leg to ask: every plane must be someone's, checked before this request
            # goes out (a room that cannot complete moves no byte)
            for reg in self.ctx.layout.regions:
                have = set().union(*(set((leg.plan.planes or {}).get(reg.name, []))
                                     for leg in g.legs))
                missing = [pl.name for pl in reg.planes if pl.name not in have]
                if missing:
                    self.rooms.fail(r, PeerFailedRoom(
                        reason=f"{reg.name}: no prefill rank of this room holds planes "
                               f"{missing}"), notify=Notify.FAILED,
                        kind=FailureKind.INVALID_REQUEST)
                    return
        r.state.advance(LegPhase.REQUESTED)
        r.xfer = self.ctx.next_xfer()
        # This request carries our buffers' descriptors (offered in our Hello): the prefill
        # may write into the pages it names from the moment it accepts, which can be before
        # its TransferAccepted reaches us. The pages are fenced from now on (released only
        # once its writes stopped, or after the quarantine), cleared by a two-sided accept.
        r.state.fence.buffers_offered(self.ctx.me.writes)
        # admission (issue 17): the policy, and what was reserved (early) or is free
        policy = self.ctx.settings.allocation_policy
        early = policy is AllocationPolicy.EARLY
        plan, given = r.plan, g.given
        self.ctx.send(r.peer, P.TransferRequest(
            src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room, xfer=r.xfer,
            peer_gen=r.peer_gen, seq_len=plan.seq_len, decode_prefix_len=plan.prefix_len,
            page_size=plan.page_size, dst_pages={k: v.tolist() for k, v in plan.pages.items()},
            lease_s=self.ctx.settings.lease_s, planes=planes, allocation_policy=policy.value,
            region_starts=dict(plan.starts) or None,
            reserved_pages=reserved_pages(self.ctx.layout, plan.pages, plan.prefix_len,
                                          plan.page_size, plan.starts) if early else None,
            free_pages=None if early else given.free_pages, prompt=digest_to_wire(given.prompt),
            cached_prefix=digest_to_wire(given.cached_prefix), readers=given.readers))

    def on_accepted(self, r: Leg, msg: P.TransferAccepted) -> None:
        """Decode: plan, post every receive, WaitingForInput."""
        if r.state.accepted:
            return
        plan = r.plan
        try:
            p = self.peers.get(r.peer)
            if p is None or p.layout is None:
                raise ConfigError("TransferAccepted before the prefill's Hello")
            end = plan.seq_len if msg.chunk_end < 0 else msg.chunk_end
            if msg.one_sided and not self.ctx.me.writes:
                raise ConfigError("one_sided: this decode offered no buffers for writes")
            if not 0 < end <= plan.seq_len:
                raise ConfigError(f"chunk_end: {msg.chunk_end} not in 1..{plan.seq_len}")
            plan.src_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.src_pages.items()}
            plan.first_chunk(end, r.xfer, span_plans(
                self.ctx, plan, src_pages=plan.src_table, src_ps=msg.page_size,
                dst_pages=plan.pages, dst_ps=plan.page_size, src_layout=p.layout,
                dst_layout=self.ctx.layout, end=end))
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid TransferAccepted: {e}"),
                            notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        r.state.advance(LegPhase.ACCEPTED)
        r.state.fence.accepted(msg.one_sided)
        if msg.one_sided:
            r.one_sided = True
            self.ctx.counters["rooms_one_sided"] += 1
        self.rooms.apply(r, RequestAccepted())
        self.post_recv_layers(r, [Unit(layer) for layer in r.layers], 0)

    def post_recv_layers(self, r: Leg, units: Sequence[Unit], attempt: int) -> None:
        """Decode: `post_recv_layer` of each of `units` (a leg's layers at its acceptance).
        One-sided, nothing is posted: each unit is marked posted with every region it moves
        in, in one pass; `try_verify` is asked only of a unit whose sums are here (none at
        the acceptance: a `LayerDone` read before it is stale, `session._stale_for_decode`)."""
        if not r.one_sided:
            for unit in units:
                self.post_recv_layer(r, unit, attempt)
            return
        prog, layer_regions = r.progress, self.ctx.layer_regions
        posted, recv_done, sums = prog.posted, prog.recv_done, prog.sums
        plans_of = r.plan.plans_of
        for unit in units:
            plans = plans_of(unit)
            posted[unit] = attempt
            key = (unit, attempt)
            recv_done[key] = {n for n in layer_regions.get(unit.layer, ()) if n in plans}
            if key in sums:  # try_verify waits for the unit's sums
                self.try_verify(r, unit, attempt)

    def post_recv_layer(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Decode: post the receives of every region of `unit` (none when the prefill writes
        one-sided: its bytes are in once its LayerDone is)."""
        r.progress.posted[unit] = attempt
        r.progress.recv_done[(unit, attempt)] = set()
        regions = regions_of(self.ctx, r.plan, unit)
        if r.one_sided:
            r.progress.recv_done[(unit, attempt)] = set(regions)
            self.try_verify(r, unit, attempt)
            return
        if not regions:
            self.try_verify(r, unit, attempt)
        plans = r.plan.plans_of(unit)
        for name in regions:
            plan = plans[name]
            tag = r.plan.tag(unit, self.ctx.region_index[name], attempt)
            op = self.ops.post(r, (tag,), send=False, unit=unit, attempt=attempt, regions=(name,))
            self.ctx.emit(PostRecv(op, r.peer, tag, buffer_name(name, unit.layer),
                                   plan.dst_offsets, plan.nbytes))

    def _received(self, r: Leg, unit: Unit, attempt: int, region: str,
                  error: str | None) -> None:
        if error is not None:
            self.ops.failed(r, f"receive of layer {unit.layer} {region} failed: {error}")
            return
        r.progress.recv_done.setdefault((unit, attempt), set()).add(region)
        self.try_verify(r, unit, attempt)

    def try_verify(self, r: Leg, unit: Unit, attempt: int,
                   landed: list[tuple[Unit, tuple[str, ...], int]] | None = None) -> None:
        """Decode: once a unit's bytes and its LayerDone are both here, verify. `landed`: a
        unit verified here (nothing left to hash) joins it, (unit, regions, sums checked), to
        land with the others of its `LayerDone` (`_land`); those before it land first when
        this one is a mismatch or fails."""
        prog = r.progress
        if r.role is not Role.DECODE or r.state.terminal or prog.posted.get(unit) != attempt:
            return
        key = (unit, attempt)
        sums = prog.sums.get(key)
        if sums is None or key in prog.verifying:
            return
        regions = tuple(regions_of(self.ctx, r.plan, unit))
        if len(prog.recv_done.get(key, ())) < len(regions):
            return
        ctx = self.ctx
        unsummed = [n for n in regions if sums.get(n) is None]
        if unsummed and wants_checksum(ctx.settings.checksum, ctx.layer_order[unit.layer],
                                       len(ctx.layers)):
            # a prefill that did not say its mode in its Hello (older) and sums less than
            # this decode verifies: never end Success with these bytes unchecked
            why = (f"checksum: decode={ctx.settings.checksum.value!r} verifies layer "
                   f"{unit.layer} but the prefill sent no sum of {unsummed[0]!r} (its "
                   "checksum mode sums fewer layers)")
            self._land_now(r, landed)
            self.rooms.fail(r, PeerFailedRoom(reason=why), notify=Notify.FAILED,
                            failure=Failure(FailureKind.CHECKSUM, why))
            return
        # the writer's verification (one-sided, same host): its read-back must equal the
        # source sum, and the plan it wrote by must be this side's; those regions are not
        # read again here. A disagreement is a mismatch like any other (rewrite, then fail).
        checked = prog.landed.get(key) if r.one_sided else None
        hashed: list[str] = []  # the regions with a source sum
        own: list[str] = []  # those this side hashes (the writer did not verify them)
        bad = None  # the first region whose writer's verification disagrees
        plans = r.plan.plans_of(unit)
        for n in regions:
            want = sums.get(n)
            if want is None:
                continue
            hashed.append(n)
            got = checked.get(n) if checked else None
            if got is None:
                own.append(n)
            elif bad is None and (got[0] != want or got[1] != plans[n].digest()):
                bad = n
        if bad is None:
            self.ctx.counters["checksums_writer_verified"] += len(hashed) - len(own)
        if bad is None and not own and landed is not None:
            landed.append((unit, regions, len(hashed)))
            return
        if bad is not None or not own:
            self._land_now(r, landed)
            self._verified(r, unit, attempt, regions, bad=bad, checked=len(hashed))
            return
        prog.verifying.add(key)
        self.ops.hash(Job(r, True, unit, attempt, regions, tuple(own),
                        tuple(sums.get(n) for n in own), trusted=len(hashed) - len(own)))

    def _verified(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...], *,
                  bad: str | None, checked: int) -> None:
        """Acts on a unit's verification: landed, retransmit once, or Failed."""
        ctx = self.ctx
        if bad is not None:
            ctx.counters["checksum_failures"] += 1
            if attempt + 1 < MAX_ATTEMPTS:
                r.stats.retransmits += 1
                ctx.counters["retransmits"] += 1
                ctx.send(r.peer, P.LayerNack(
                    src=ctx.me.address, gen=ctx.me.generation, room=r.room, layer=unit.layer,
                    attempt=attempt, reason=f"checksum mismatch in {bad}", chunk=unit.chunk))
                self.post_recv_layer(r, unit, attempt + 1)
            else:
                self.rooms.fail(r, ChecksumsDiffered(layer=unit.layer, region=bad),
                                notify=Notify.FAILED)
            return
        self._land(r, [(unit, regions, checked)])

    def _land_now(self, r: Leg, landed: list[tuple[Unit, tuple[str, ...], int]] | None
                  ) -> None:
        """Lands the units verified so far in `landed` (emptied), before what follows them."""
        if landed:
            units = landed[:]
            landed.clear()
            self._land(r, units)

    def _land(self, r: Leg, units: list[tuple[Unit, tuple[str, ...], int]]) -> None:
        """Verified units of `r`, (unit, regions, sums checked) each: counted in one pass,
        their layers (every chunk landed) one state-machine step (`RoomTable.apply_layers`);
        then the room's view, and Success and `RoomAck` once every layer landed."""
        if r.state.terminal:
            return
        ctx = self.ctx
        checked = sum(n for _, _, n in units)
        r.stats.checksums_verified += checked
        ctx.counters["checksums_verified"] += checked
        r.stats.bytes_moved += self.ops.moved_units(
            r, [(unit, regions) for unit, regions, _ in units], "received")
        prog, plan = r.progress, r.plan
        layers = [layer for layer in (prog.unit_done(unit, plan) for unit, _, _ in units)
                  if layer is not None]
        if len(layers) < len(units):
            r.state.progressed(ctx.now)  # a chunk of a layer landed
        if not layers:
            return
        self.rooms.apply_layers(r, layers)
        g = r.parent
        if g.state.all_legs:
            if len(g.legs) == 1:
                g.landed.update(layers)
            else:
                g.landed.update(layer for layer in layers
                                if all(leg.state.has_layers((layer,)) for leg in g.legs))
            self.rooms.changed(g)
        if r.state.has_layers(r.layers):
            # every layer verified: the prefill writes nothing more
            r.state.fence.writer_stopped()
            self.finish(r)

    def finish(self, r: Leg) -> None:
        """Decode: every layer of `r` verified: Success and `RoomAck`, unless this agent woke
        from a stall and its prefill has not answered yet whether it still holds this agent
        (`PeerTable.woke`): a layer's sums read before the stall and its bytes hashed after it
        would otherwise end a room Success that the prefill gave up meanwhile. The answer
        finishes it (`finish_rechecked`); no answer fails it with the peer."""
        p = self.peers.get(r.peer)
        if r.state.terminal or (p is not None and p.state.recheck is not None):
            return
        ctx = self.ctx
        self.rooms.apply(r, AllLayersLanded())
        ctx.send(r.peer, P.RoomAck(src=ctx.me.address, gen=ctx.me.generation, room=r.room))

    def finish_rechecked(self, peer: str) -> None:
        """Decode: `peer` answered this agent's recheck: the legs with it whose every layer
        was verified meanwhile end Success now."""
        for r in self.rooms.open_legs():
            if r.peer == peer and r.role is Role.DECODE and r.state.poll is KVPoll.Transferring \
                    and r.state.has_layers(r.layers):
                self.finish(r)

    def on_layer_done(self, r: Leg, msg: P.LayerDone) -> None:
        """Decode: the prefill's sums of the layers it posted, each layer checked; those
        verified without hashing land together (`_land`: one state-machine step)."""
        landed: list[tuple[Unit, tuple[str, ...], int]] = []
        for info in msg.layers:
            unit = Unit(info.layer, info.chunk)
            key = (unit, info.attempt)
            sums: dict[str, int | None] = {}
            checked: dict[str, tuple[int, int]] = {}
            for x in info.regions:
                sums[x.region] = x.checksum
                if x.checksum is not None and x.landed is not None and x.plan is not None:
                    checked[x.region] = (x.landed, x.plan)
            r.progress.sums[key] = sums
            if checked:
                r.progress.landed[key] = checked
            self.try_verify(r, unit, info.attempt, landed)
        self._land_now(r, landed)

    def on_recv_done(self, op: Op, error: str | None) -> None:
        """The receive of `op` (one region of a unit) completed (`InFlight.take_op`)."""
        self._received(op.leg, op.unit, op.attempt, op.regions[0], error)

    def on_verify_hashed(self, job: Job, sums: tuple[int | None, ...]) -> None:
        """The landed sums of a unit are in: compare them with the sender's."""
        bad = next((n for n, got, want in zip(job.hashed, sums, job.want, strict=True)
                    if got != want), None)
        self._verified(job.leg, job.unit, job.attempt, job.regions, bad=bad,
                       checked=len(job.hashed) + job.trusted)
