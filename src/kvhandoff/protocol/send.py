"""`SendPath`: the prefill's side of the data path, sans-IO: it accepts a decode's transfer
request, posts each layer as the engine marks it ready, announces it (`LayerDone`) with the
checksums of its source spans, sends a layer again when the decode asks (`LayerNack`), and
ends a leg Success once the decode's `RoomAck` came and every send completed.

Per layer and leg: the sends of every region of the layer are posted and, while the bytes are
on the wire, the checksums of the source spans are asked for; `LayerDone` (several layers in
one message when they complete together, at the next `Tick`) announces them at once, so the
tail after the last layer is one transfer plus one check. With one-sided writes the layer is
written straight into the decode's pages (`PostWrite`, one job for the layer's regions, hashed
while copying) and its `LayerDone` leaves once the write landed.

Rules:
- Its own state is the `LayerDone`s not yet sent; the ops and hashing jobs in flight are
  `inflight.InFlight`'s, a leg's progress (posted, outstanding, sums) is its
  `rooms.Progress`, what it moves its `rooms.LegPlan`.
- Admission (`admission.admission_of`) runs before any plan or op: a refused request moves no
  byte.
- Chunked prefill (`chunks.ChunkedPrefill`) posts each later chunk through `post_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvhandoff.buffers.bufferset import buffer_name
from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.kv_layout import page_aligned
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.admission import Refusal, admission_of, region_starts
from kvhandoff.protocol.checksums import wants_checksum
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import Notify, PostSend, PostWrite, WritePart
from kvhandoff.protocol.inflight import InFlight, Job, Op
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import PeerTable
from kvhandoff.protocol.planning import regions_of, span_plans
from kvhandoff.protocol.rooms import Leg, LegPlan, Unit
from kvhandoff.protocol.roomstate import LegPhase
from kvhandoff.state_machine import (
    AllLayersAcked,
    KVPoll,
    LeaseRenewed,
    PeerFailedRoom,
    RequestAccepted,
)


class SendPath:
    """The prefill's data path of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, peers: PeerTable,
                 ops: InFlight) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.peers = peers
        self.ops = ops
        # (room, peer, xfer) -> the layers to announce (xfer: the request they answer)
        self._pending_done: dict[tuple[int, str, int], list[P.LayerInfo]] = {}

    @property
    def done_pending(self) -> bool:
        """LayerDones wait for the next `Tick` (`flush_done`)."""
        return bool(self._pending_done)

    def on_request(self, r: Leg, msg: P.TransferRequest) -> None:
        """Prefill: validate the request, plan, accept, and send the layers already ready."""
        p = self.peers.get(msg.src)
        if not r.state.accepted:  # every message about this leg names this request from now on
            r.xfer = msg.xfer
        if msg.peer_gen != self.ctx.me.generation:
            self.ctx.send(msg.src, P.Failed(
                src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room,
                reason="stale request: it names a previous generation of this prefill agent",
                failure_kind=FailureKind.PEER_LOST.value, xfer=msg.xfer))
            return
        if r.state.accepted:
            return
        plan, given = r.plan, r.parent.given
        try:
            if msg.seq_len != plan.seq_len:
                raise ConfigError(f"seq_len: prefill={plan.seq_len} decode={msg.seq_len}")
            if not 0 <= msg.decode_prefix_len <= plan.seq_len:
                raise ConfigError(f"decode_prefix_len: {msg.decode_prefix_len} not in "
                                  f"0..{plan.seq_len}")
            if msg.page_size <= 0 or msg.decode_prefix_len % msg.page_size:
                raise ConfigError(f"decode_prefix_len: {msg.decode_prefix_len} is not aligned "
                                  f"to the decode page size {msg.page_size}")
            plan.prefix_len, r.peer_gen = msg.decode_prefix_len, msg.gen
            plan.starts = region_starts(msg, self.ctx.layout)
            plan.pages = self.suffix_pages(plan)
            if p is None or p.layout is None:
                raise ConfigError("transfer request before the decode's Hello")
            refusal = admission_of(msg, decode_layout=p.layout,  # before any byte moves
                                   policy=self.ctx.settings.allocation_policy,
                                   prompt_tokens=given.prompt_tokens, prompt=given.prompt)
            if refusal is not None:
                raise Refusal(refusal)
            plan.planes = msg.planes
            plan.dst_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.dst_pages.items()}
            plan.dst_page_size = msg.page_size
            r.one_sided = p.writes
            end = given.chunk_end or plan.seq_len
            plan.first_chunk(end, msg.xfer, span_plans(
                self.ctx, plan, src_pages=plan.pages, src_ps=plan.page_size,
                dst_pages=plan.dst_table, dst_ps=msg.page_size, src_layout=self.ctx.layout,
                dst_layout=p.layout, end=end))
        except Refusal as e:
            self.rooms.fail(r, PeerFailedRoom(reason=str(e)), notify=Notify.FAILED,
                            failure=Failure(FailureKind.ADMISSION, str(e)))
            return
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid transfer request: {e}"),
                            notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        r.state.match(self.ctx.now)
        r.state.apply(RequestAccepted(), self.ctx.now)
        r.state.apply(LeaseRenewed(), self.ctx.now)
        self.rooms.changed(r.parent)
        r.state.advance(LegPhase.ACCEPTED)
        if r.one_sided:
            self.ctx.counters["rooms_one_sided"] += 1
        self.ctx.send(msg.src, P.TransferAccepted(
            src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room,
            page_size=plan.page_size, src_pages={k: v.tolist() for k, v in plan.pages.items()},
            chunk_end=-1 if end >= plan.seq_len else end, one_sided=r.one_sided, xfer=r.xfer))
        self.post_layers(r, [Unit(layer) for layer in given.ready], 0)

    def post_layer(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Prefill: send every region of `unit`, checksum the source spans while the bytes
        are on the wire, and announce it (`LayerDone`) once the sums are in."""
        self.post_layers(r, (unit,), attempt)

    def post_layers(self, r: Leg, units: Sequence[Unit], attempt: int) -> None:
        """Prefill: `post_layer` of each of `units` (the layers the engine marked ready
        together), their ops recorded in one pass. One-sided: one write job per unit (the
        driver packs a pass's jobs into transport jobs), each part under its own tag."""
        if not r.one_sided:
            for unit in units:
                self._post_two_sided(r, unit, attempt)
            return
        ctx, plan, prog = self.ctx, r.plan, r.progress
        mode, order, nlayers = ctx.settings.checksum, ctx.layer_order, len(ctx.layers)
        layer_regions, region_index = ctx.layer_regions, ctx.region_index
        writes: list[tuple[Unit, tuple[int, ...], tuple[str, ...]]] = []
        parts_of: list[tuple[WritePart, ...]] = []
        wants: list[bool] = []
        for unit in units:
            prog.posted[unit] = attempt
            key = (unit, attempt)
            prog.sums[key] = {}
            prog.outstanding[key] = 1  # one job for the layer's regions: one completion
            plans = plan.plans_of(unit)
            layer = unit.layer
            regions = tuple(n for n in layer_regions.get(layer, ()) if n in plans)
            if not regions:  # another leg of the room brings this layer's planes
                self._queue_done(r, unit, attempt, (), ())
                self._sent(r, unit, attempt, (), None)
                continue
            xfer = plan.chunk_xfers[unit.chunk]
            assert xfer is not None  # units of a chunk are posted once its transfer id is known
            parts = tuple(WritePart(P.data_tag(xfer, layer, region_index[n], attempt),
                                    buffer_name(n, layer), plans[n]) for n in regions)
            writes.append((unit, tuple(x.tag for x in parts), regions))
            parts_of.append(parts)
            wants.append(wants_checksum(mode, order[layer], nlayers))
        if not writes:
            return
        r.state.started(ctx.now)  # a first write that never completes fails at the stall bound
        alg = self.ops.checksum_alg(r)
        emit, peer, room = ctx.emit, r.peer, r.room
        ids = self.ops.post_many(r, writes, send=True, attempt=attempt)
        for op, parts, want in zip(ids, parts_of, wants, strict=True):
            emit(PostWrite(op, peer, parts, want, alg, room))

    def _post_two_sided(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Prefill, two-sided: a send per region of `unit`, its source sums asked for."""
        ctx = self.ctx
        r.state.started(ctx.now)  # a first write that never completes fails at the stall bound
        r.progress.posted[unit] = attempt
        regions = regions_of(self.ctx, r.plan, unit)
        key = (unit, attempt)
        r.progress.sums[key] = {}
        if not regions:  # another leg of the room brings this layer's planes
            r.progress.outstanding[key] = 1
            self._queue_done(r, unit, attempt, (), ())
            self._sent(r, unit, attempt, (), None)
            return
        plans = r.plan.plans_of(unit)
        want = wants_checksum(ctx.settings.checksum, ctx.layer_order[unit.layer],
                              len(ctx.layers))
        r.progress.outstanding[key] = len(regions)
        for name in regions:
            plan = plans[name]
            tag = r.plan.tag(unit, ctx.region_index[name], attempt)
            op = self.ops.post(r, (tag,), send=True, unit=unit, attempt=attempt, regions=(name,))
            ctx.emit(PostSend(op, r.peer, tag, buffer_name(name, unit.layer), plan.src_offsets,
                              plan.nbytes))
        if want:
            self.ops.hash(Job(r, False, unit, attempt, tuple(regions), tuple(regions)))
        else:
            self._queue_done(r, unit, attempt, tuple(regions), (None,) * len(regions))

    def _queue_done(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...],
                    sums: tuple[int | None, ...],
                    landed: tuple[int | None, ...] = ()) -> None:
        """Queues the LayerDone of a posted unit (several layers of a room leave in one
        message, at the next Tick). `landed`: the writer's read-back sum of each region (one
        per region, None where it has none; empty: none at all), said with the digest of the
        plan it wrote by."""
        r.progress.sums[(unit, attempt)] = dict(zip(regions, sums, strict=True))
        plans = r.plan.plans_of(unit)
        done = self._pending_done.get((r.room, r.peer, r.xfer))
        if done is None:
            done = self._pending_done[(r.room, r.peer, r.xfer)] = []
        parts = [P.RegionDone(region=n, nbytes=plans[n].total_bytes, checksum=s, landed=got,
                              plan=None if got is None else plans[n].digest())
                 for n, s, got in zip(regions, sums, landed or (None,) * len(regions),
                                      strict=True)]
        done.append(P.LayerInfo(layer=unit.layer, attempt=attempt, chunk=unit.chunk,
                                regions=parts))

    def flush_done(self) -> None:
        me = self.ctx.me
        for (room, peer, xfer), infos in self._pending_done.items():
            self.ctx.send(peer, P.LayerDone(src=me.address, gen=me.generation, room=room,
                                            layers=infos, xfer=xfer))
        self._pending_done.clear()

    def on_written(self, e: ev.Written) -> None:
        """Prefill: the one-sided write job of a unit's regions landed (or failed). Its
        LayerDone leaves now, with the sums computed while copying (one per region)."""
        self.on_written_many((e,))

    def on_written_many(self, events: Sequence[ev.Written]) -> None:
        """Prefill: `on_written` of each of `events` (the write jobs of one transport job,
        `events.Batch`), every write's sums checked and queued for its `LayerDone`, then one
        completion pass per leg: byte counters once, the units whole as one state-machine
        step (`RoomTable.apply_layers`)."""
        ctx = self.ctx
        mode, order, nlayers = ctx.settings.checksum, ctx.layer_order, len(ctx.layers)
        done: dict[int, tuple[Leg, list[tuple[Unit, int, tuple[str, ...]]]]] = {}
        for e in events:
            op = self.ops.take_op(e.op)
            if op is None:
                continue
            r, unit, regions = op.leg, op.unit, op.regions
            error = e.error
            if error is None:
                want = wants_checksum(mode, order[unit.layer], nlayers)
                n = len(regions)
                digests, landed = e.digests, e.landed
                if want and (len(digests) != n or None in digests):
                    error = (f"the transport returned {len(digests)} checksum(s), some "
                             f"missing, for a write of {n} region(s) that asked for one each")
                elif landed and len(landed) != n:
                    error = f"the transport read back {len(landed)} region(s) of a write of {n}"
                elif want:
                    self._queue_done(r, unit, op.attempt, regions, digests, landed)
                else:
                    self._queue_done(r, unit, op.attempt, regions, (None,) * n)
            if error is not None:
                self._sent(r, unit, op.attempt, regions, error)
                continue
            leg = done.get(id(r))
            if leg is None:
                leg = done[id(r)] = (r, [])
            leg[1].append((unit, op.attempt, regions))
        for r, units in done.values():
            if not r.state.terminal:
                self._sent_many(r, units)

    def _sent(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...],
              error: str | None) -> None:
        """One op of `unit` (a send of one region, or the write job of all of them) ended."""
        if error is not None:
            self.ops.failed(r, f"send of layer {unit.layer} {', '.join(regions)} "
                                      f"failed: {error}")
            return
        self._sent_many(r, [(unit, attempt, regions)])

    def _sent_many(self, r: Leg, ops: list[tuple[Unit, int, tuple[str, ...]]]) -> None:
        """Ops of `r` that ended well, (unit, attempt, regions) each: bytes counted once, the
        units every op of which ended are sent, their layers (first attempts whose every
        chunk is sent) one state-machine step."""
        r.stats.bytes_moved += self.ops.moved_units(
            r, [(unit, regions) for unit, _, regions in ops], "sent")
        prog, outstanding = r.progress, r.progress.outstanding
        whole: list[int] = []
        for unit, attempt, _ in ops:
            key = (unit, attempt)
            left = outstanding[key] - 1
            if left:
                outstanding[key] = left
                continue
            del outstanding[key]
            if attempt == 0:
                layer = prog.unit_done(unit, r.plan)
                if layer is not None:
                    whole.append(layer)
        if whole:
            self.rooms.apply_layers(r, whole)
            self.maybe_acked(r)

    def acked(self, r: Leg) -> None:
        """Prefill: the decode's RoomAck came."""
        if r.state.phase is LegPhase.ACCEPTED:
            r.state.advance(LegPhase.ACKED)
            self.maybe_acked(r)

    def maybe_acked(self, r: Leg) -> None:
        """Prefill: Success once the RoomAck came AND every layer's send completed (LayerDone
        goes out early, so the decode can verify and ack before our completions arrive)."""
        if (r.state.phase is LegPhase.ACKED and r.state.poll is KVPoll.Transferring
                and r.state.has_layers(r.layers)):
            self.rooms.apply(r, AllLayersAcked())

    def on_nack(self, r: Leg, msg: P.LayerNack) -> None:
        """Prefill: the decode asks for a layer again (its checksum did not match)."""
        unit = Unit(msg.layer, msg.chunk)
        if msg.attempt + 1 < 1 << P.ATTEMPT_BITS and r.progress.posted.get(unit) == msg.attempt:
            self.ctx.counters["retransmits"] += 1
            r.stats.retransmits += 1
            self.post_layer(r, unit, msg.attempt + 1)

    def suffix_pages(self, plan: LegPlan) -> dict[str, np.ndarray]:
        """Prefill: the leg's pages per region, suffix-only regions from the page-aligned
        decode prefix on."""
        return {reg.name: plan.pages[reg.name][
            page_aligned(plan.first_token(reg), plan.page_size) // plan.page_size:]
            for reg in self.ctx.layout.regions}

    def on_send_done(self, op: Op, error: str | None) -> None:
        """One send of `op` (one region of a unit) completed (`InFlight.take_op`)."""
        self._sent(op.leg, op.unit, op.attempt, op.regions, error)

    def on_source_hashed(self, job: Job, sums: tuple[int | None, ...]) -> None:
        """The source sums of a posted unit are in: announce it (`LayerDone`)."""
        self._queue_done(job.leg, job.unit, job.attempt, job.regions, sums)
