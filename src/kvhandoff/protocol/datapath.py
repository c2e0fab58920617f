"""`DataPath`: span plans, posting layers, completions, checksums and verification of one
session, sans-IO: transfers and hashing jobs leave as effects, their completions come back as
events.

It owns the transport ops and hashing jobs in flight and the `LayerDone`s not yet sent; the
legs' own progress (what is posted, landed, verified) lives on the legs (`rooms.Leg`). Per
layer and leg: prefill posts the sends of every region of the layer and, while the bytes are on
the wire, asks for the checksums of the source spans; `LayerDone` (several layers in one
message when they complete together) announces them at once, so the tail after the last layer
is one transfer plus one check. Decode posts every receive when the transfer is accepted,
verifies a layer once its bytes and its `LayerDone` are both in, asks for one retransmit on a
mismatch (`LayerNack`), and fails the room naming layer and region when the retransmit does not
verify either. With one-sided writes the prefill writes straight into the decode's pages
(`PostWrite`, hashed while copying) and the decode posts nothing.

Chunked prefill (`chunks.ChunkedPrefill`) plans and posts each later chunk through
`plans`, `post_layer` and `post_recv_layer`.

Why this file is a little over 600 lines: it is one owner (the ops and hashing jobs in
flight) and the request, the posts, the completions and the verification all read and write
that table; cutting it would hand one object's state to two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.buffers.bufferset import buffer_name
from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, SendFrom, build_spans, page_aligned
from kvhandoff.kv_layout.admission import AllocationPolicy
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.admission import Refusal, admission_of, digest_to_wire, reserved_pages
from kvhandoff.protocol.checksums import ChecksumAlg, checksum_alg, wants_checksum
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import HashSpans, Notify, PostRecv, PostSend, PostWrite, WritePart
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import PeerTable
from kvhandoff.protocol.reports import ReadOuts
from kvhandoff.protocol.rooms import Leg, LegPhase, Unit
from kvhandoff.state_machine import (
    AllLayersAcked,
    AllLayersLanded,
    ChecksumsDiffered,
    KVPoll,
    LayerLanded,
    LayerSent,
    LeaseRenewed,
    PeerFailedRoom,
    PeerMatched,
    PeerWasLost,
    Role,
    TransferAccepted,
)

MAX_ATTEMPTS = 2  # one retransmit after a checksum mismatch, then the room fails


@dataclass(frozen=True, slots=True)
class _Op:
    leg: Leg
    tags: tuple[int, ...]  # one per region (a one-sided write job: every region of its layer)
    send: bool
    unit: Unit
    attempt: int
    regions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Job:
    leg: Leg
    verify: bool  # False: announce (source sums), True: verify (landed sums)
    unit: Unit
    attempt: int
    regions: tuple[str, ...]  # the regions of the layer this leg moves
    hashed: tuple[str, ...]  # the regions hashed (in `Hashed.sums` order)
    want: tuple[int | None, ...] = ()  # verify: the sender's sums of `hashed`
    trusted: int = 0  # verify: regions besides `hashed` the writer verified (counted as checked)


class DataPath:
    """The data path of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, peers: PeerTable,
                 readouts: ReadOuts) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.peers = peers
        self.readouts = readouts
        self._ops: dict[int, _Op] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_op = 0
        # (room, peer, xfer) -> the layers to announce (xfer: the request they answer)
        self._pending_done: dict[tuple[int, str, int], list[P.LayerInfo]] = {}

    def leg_of(self, e: ev.OpDone | ev.Written | ev.Hashed) -> Leg | None:
        """The leg a completion is about (None: forgotten, its room ended)."""
        item = self._jobs.get(e.job) if isinstance(e, ev.Hashed) else self._ops.get(e.op)
        return item.leg if item is not None else None

    @property
    def done_pending(self) -> bool:
        """LayerDones wait for the next `Tick` (`flush_done`)."""
        return bool(self._pending_done)

    # ------------------------------------------------------------------ decode: request

    def init_leg(self, r: Leg) -> None:
        """Decode: give a leg the engine's pages once both exist; maybe request."""
        g = r.group
        if g.pages is None or r.phase is not LegPhase.NEW:
            return
        table, prefix = g.pages
        r.seq_len, r.prefix_len, r.pages = g.seq_len, prefix, table
        r.page_size = self.ctx.layout.page_size_tokens
        r.advance(LegPhase.READY)
        self.maybe_request(r)

    def maybe_request(self, r: Leg) -> None:
        """Decode: send the TransferRequest once matched and initialised."""
        if (r.role is not Role.DECODE or r.phase is not LegPhase.READY
                or not r.machine.peer_matched or r.machine.is_terminal):
            return
        p = self.peers.get(r.peer)
        if p is None or p.layout is None:
            return
        # Claim the planes this leg brings: those the source holds that no other leg of the
        # room claimed yet (replicated regions: the first leg takes all; head slices: by name).
        g = r.group
        claimed: dict[str, set[str]] = {name: set() for name in self.ctx.region_index}
        for other in g.legs:
            if other is not r and other.planes:
                for name, pl in other.planes.items():
                    claimed[name].update(pl)
        planes: dict[str, list[str]] = {}
        for reg in self.ctx.layout.regions:
            try:
                theirs = {pl.name for pl in p.layout.region(reg.name).planes}
            except KVHandoffError:
                theirs = set()
            planes[reg.name] = [pl.name for pl in reg.planes
                                if pl.name in theirs and pl.name not in claimed[reg.name]]
        r.planes = planes
        r.advance(LegPhase.REQUESTED)
        r.xfer = self.ctx.next_xfer()
        # This request carries our buffers' descriptors (offered in our Hello): the prefill
        # may write into the pages it names from the moment it accepts, which can be before
        # its TransferAccepted reaches us. The pages are fenced from now on (released only
        # once its writes stopped, or after the quarantine), cleared by a two-sided accept.
        r.remote_writes = r.remote_writes or self.ctx.me.writes
        # admission (issue 17): the policy, and what was reserved (early) or is free
        policy = self.ctx.settings.allocation_policy
        early = policy is AllocationPolicy.EARLY
        self.ctx.send(r.peer, P.TransferRequest(
            src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room, xfer=r.xfer,
            peer_gen=r.peer_gen, seq_len=r.seq_len, decode_prefix_len=r.prefix_len,
            page_size=r.page_size, dst_pages={k: v.tolist() for k, v in r.pages.items()},
            lease_s=self.ctx.settings.lease_s, planes=planes, allocation_policy=policy.value,
            reserved_pages=reserved_pages(self.ctx.layout, r.pages, r.prefix_len, r.page_size)
            if early else None, free_pages=None if early else g.free_pages,
            prompt=digest_to_wire(g.prompt), cached_prefix=digest_to_wire(g.cached_prefix),
            readers=g.readers))
        if g.expected is not None and len(g.legs) == g.expected and all(
                leg.requested for leg in g.legs):
            for reg in self.ctx.layout.regions:
                have = set().union(*(set((leg.planes or {}).get(reg.name, [])) for leg in g.legs))
                missing = [pl.name for pl in reg.planes if pl.name not in have]
                if missing:
                    self.rooms.fail(r, PeerFailedRoom(
                        reason=f"{reg.name}: no prefill rank of this room holds planes "
                               f"{missing}"), notify=Notify.FAILED,
                        kind=FailureKind.INVALID_REQUEST)
                    return


    # ------------------------------------------------------------------ request / accept

    def on_request(self, r: Leg, msg: P.TransferRequest) -> None:
        """Prefill: validate the request, plan, accept, and send the layers already ready."""
        p = self.peers.get(msg.src)
        if not r.accepted:  # every message about this leg names this request from now on
            r.xfer = msg.xfer
        if msg.peer_gen != self.ctx.me.generation:
            self.ctx.send(msg.src, P.Failed(
                src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room,
                reason="stale request: it names a previous generation of this prefill agent",
                failure_kind=FailureKind.PEER_LOST.value, xfer=msg.xfer))
            return
        if r.accepted:
            return
        try:
            if msg.seq_len != r.seq_len:
                raise ConfigError(f"seq_len: prefill={r.seq_len} decode={msg.seq_len}")
            if not 0 <= msg.decode_prefix_len <= r.seq_len:
                raise ConfigError(f"decode_prefix_len: {msg.decode_prefix_len} not in "
                                  f"0..{r.seq_len}")
            if msg.page_size <= 0 or msg.decode_prefix_len % msg.page_size:
                raise ConfigError(f"decode_prefix_len: {msg.decode_prefix_len} is not aligned "
                                  f"to the decode page size {msg.page_size}")
            r.prefix_len, r.peer_gen = msg.decode_prefix_len, msg.gen
            r.pages = self.suffix_pages(r)
            if p is None or p.layout is None:
                raise ConfigError("transfer request before the decode's Hello")
            refusal = admission_of(msg, decode_layout=p.layout,  # before any byte moves
                                   policy=self.ctx.settings.allocation_policy,
                                   prompt_tokens=r.group.prompt_tokens, prompt=r.group.prompt)
            if refusal is not None:
                raise Refusal(refusal)
            r.planes = msg.planes
            r.dst_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.dst_pages.items()}
            r.dst_page_size = msg.page_size
            r.one_sided = p.writes
            end = r.group.chunk_end or r.seq_len
            r.plans = self.plans(r, src_pages=r.pages, src_ps=r.page_size,
                                  dst_pages=r.dst_table, dst_ps=msg.page_size,
                                  src_layout=self.ctx.layout, dst_layout=p.layout, end=end)
            r.first_chunk(end, msg.xfer)
        except Refusal as e:
            self.rooms.fail(r, PeerFailedRoom(reason=str(e)), notify=Notify.FAILED,
                            failure=Failure(FailureKind.ADMISSION, str(e)))
            return
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid transfer request: {e}"),
                            notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        if not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), self.ctx.now)
        r.machine.apply(TransferAccepted(), self.ctx.now)
        r.machine.apply(LeaseRenewed(), self.ctx.now)
        self.rooms.changed(r.group)
        r.advance(LegPhase.ACCEPTED)
        if r.one_sided:
            self.ctx.counters["rooms_one_sided"] += 1
        self.ctx.send(msg.src, P.TransferAccepted(
            src=self.ctx.me.address, gen=self.ctx.me.generation, room=r.room, page_size=r.page_size,
            src_pages={k: v.tolist() for k, v in r.pages.items()},
            chunk_end=-1 if end >= r.seq_len else end, one_sided=r.one_sided, xfer=r.xfer))
        for layer in r.group.ready:
            self.post_layer(r, Unit(layer), 0)

    def plans(self, r: Leg, *, src_pages: Mapping[str, np.ndarray], src_ps: int,
               dst_pages: Mapping[str, np.ndarray], dst_ps: int, src_layout: LayoutSpec,
               dst_layout: LayoutSpec, end: int | None = None) -> dict[str, Any]:
        """The span plan of each region this leg moves (the same for every layer of the
        region): both sides call this with the same arguments. Regions whose planes this leg
        does not bring (another leg does) are left out.

        Chunked prefill (`end` < seq_len, or a later chunk): each region moves from where its
        previous chunk stopped (`r.covered`) up to `end` or as far as the source pages reach,
        whichever is less (on a row boundary); `r.covered` is advanced and regions with
        nothing to move in this chunk are left out. The last chunk (`end` = seq_len) needs
        every region's pages to reach the end."""
        end = r.seq_len if end is None else end
        chunked = end < r.seq_len or bool(r.chunk_ends)
        plans = {}
        covered = dict(r.covered)
        for reg in self.ctx.layout.regions:
            wanted = (r.planes or {}).get(reg.name)
            if r.planes is not None and not wanted:
                continue
            if reg.name not in src_pages or reg.name not in dst_pages:
                raise ConfigError(f"pages: region {reg.name!r} missing")
            first = r.prefix_len if reg.send_from is SendFrom.DECODE_PREFIX else 0
            start, stop = max(first, covered.get(reg.name, 0)), end
            if end < r.seq_len:
                reach = page_aligned(first, src_ps) + len(src_pages[reg.name]) * src_ps
                k = src_layout.region(reg.name).tokens_per_row
                stop = min(end, reach) // k * k
            stop = max(start, stop)
            covered[reg.name] = stop
            if chunked and stop == start:
                continue
            plans[reg.name] = build_spans(
                src_layout.region(reg.name), token_start=start, token_end=stop,
                src_pages=src_pages[reg.name], src_page_size=src_ps,
                src_first_token=page_aligned(first, src_ps),
                dst_pages=dst_pages[reg.name], dst_page_size=dst_ps,
                dst_first_token=page_aligned(first, dst_ps),
                dst_region=dst_layout.region(reg.name), planes=wanted)
        r.covered = covered
        return plans

    def on_accepted(self, r: Leg, msg: P.TransferAccepted) -> None:
        """Decode: plan, post every receive, WaitingForInput."""
        if r.accepted:
            return
        try:
            p = self.peers.get(r.peer)
            if p is None or p.layout is None:
                raise ConfigError("TransferAccepted before the prefill's Hello")
            end = r.seq_len if msg.chunk_end < 0 else msg.chunk_end
            if msg.one_sided and not self.ctx.me.writes:
                raise ConfigError("one_sided: this decode offered no buffers for writes")
            if not 0 < end <= r.seq_len:
                raise ConfigError(f"chunk_end: {msg.chunk_end} not in 1..{r.seq_len}")
            r.src_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.src_pages.items()}
            r.plans = self.plans(r, src_pages=r.src_table, src_ps=msg.page_size,
                                  dst_pages=r.pages, dst_ps=r.page_size,
                                  src_layout=p.layout, dst_layout=self.ctx.layout, end=end)
            r.first_chunk(end, r.xfer)
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid TransferAccepted: {e}"),
                            notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        r.advance(LegPhase.ACCEPTED)
        if msg.one_sided:
            r.one_sided = r.remote_writes = True
            self.ctx.counters["rooms_one_sided"] += 1
        else:  # the prefill sends two-sided: it never writes into our pages
            r.remote_writes = False
        self.rooms.apply(r, TransferAccepted())
        for layer in r.layers:
            self.post_recv_layer(r, Unit(layer), 0)

    # ------------------------------------------------------------------ posting

    def _regions_of(self, r: Leg, unit: Unit) -> list[str]:
        """The regions of `unit`'s layer this leg moves in its chunk."""
        plans = r.plans_of(unit)
        return [name for name in self.ctx.layer_regions.get(unit.layer, ()) if name in plans]

    def _op(self, r: Leg, tags: tuple[int, ...], *, send: bool, unit: Unit, attempt: int,
            regions: tuple[str, ...]) -> int:
        self._next_op += 1
        self._ops[self._next_op] = _Op(r, tags, send, unit, attempt, regions)
        for tag in tags:  # (a failing leg cancels each: a transport may have split the job)
            r.inflight_tags[tag] = r.inflight_tags.get(tag, 0) + 1
        return self._next_op

    def _hash(self, job: _Job) -> None:
        self._next_op += 1
        self._jobs[self._next_op] = job
        plans = job.leg.plans_of(job.unit)
        spans = tuple((buffer_name(n, job.unit.layer), plans[n].src_offsets
                       if not job.verify else plans[n].dst_offsets,
                       plans[n].nbytes) for n in job.hashed)
        self.ctx.emit(HashSpans(self._next_op, spans, self._checksum_alg(job.leg)))

    def _checksum_alg(self, r: Leg) -> ChecksumAlg:
        """The room's checksum algorithm (`checksums.checksum_alg`) from this side's memory
        kind and the peer's Hello; a peer no longer known counts as host (its rooms are
        failing: nothing it sent is verified any more)."""
        p = self.peers.get(r.peer)
        return checksum_alg(self.ctx.me.memory, p.memory if p is not None else "host")

    def post_layer(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Prefill: send every region of `unit`, checksum the source spans while the bytes
        are on the wire, and announce it (`LayerDone`) once the sums are in."""
        ctx = self.ctx
        r.posted[unit] = attempt
        regions = self._regions_of(r, unit)
        key = (unit, attempt)
        r.sums[key] = {}
        if not regions:  # another leg of the room brings this layer's planes
            r.outstanding[key] = 1
            self._queue_done(r, unit, attempt, (), ())
            self._sent(r, unit, attempt, (), None)
            return
        plans = r.plans_of(unit)
        want = wants_checksum(ctx.settings.checksum, ctx.layer_order[unit.layer],
                              len(ctx.layers))
        if r.one_sided:  # straight into the decode's pages, hashed while copying: one job
            r.outstanding[key] = 1  # for the layer's regions, one completion, a sum per region
            parts = tuple(WritePart(r.tag(unit, ctx.region_index[name], attempt),
                                    buffer_name(name, unit.layer), plans[name])
                          for name in regions)
            op = self._op(r, tuple(x.tag for x in parts), send=True, unit=unit,
                          attempt=attempt, regions=tuple(regions))
            ctx.emit(PostWrite(op, r.peer, parts, want, self._checksum_alg(r), r.room))
            return
        r.outstanding[key] = len(regions)
        for name in regions:
            plan = plans[name]
            tag = r.tag(unit, ctx.region_index[name], attempt)
            op = self._op(r, (tag,), send=True, unit=unit, attempt=attempt, regions=(name,))
            ctx.emit(PostSend(op, r.peer, tag, buffer_name(name, unit.layer), plan.src_offsets,
                              plan.nbytes))
        if want:
            self._hash(_Job(r, False, unit, attempt, tuple(regions), tuple(regions)))
        else:
            self._queue_done(r, unit, attempt, tuple(regions), (None,) * len(regions))

    def _queue_done(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...],
                    sums: tuple[int | None, ...],
                    landed: tuple[int | None, ...] = ()) -> None:
        """Queues the LayerDone of a posted unit (several layers of a room leave in one
        message, at the next Tick). `landed`: the writer's read-back sum of each region (one
        per region, None where it has none; empty: none at all), said with the digest of the
        plan it wrote by."""
        r.sums[(unit, attempt)] = dict(zip(regions, sums, strict=True))
        plans = r.plans_of(unit)
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

    def post_recv_layer(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Decode: post the receives of every region of `unit` (none when the prefill writes
        one-sided: its bytes are in once its LayerDone is)."""
        r.posted[unit] = attempt
        r.recv_done[(unit, attempt)] = set()
        regions = self._regions_of(r, unit)
        if r.one_sided:
            r.recv_done[(unit, attempt)] = set(regions)
            self.try_verify(r, unit, attempt)
            return
        if not regions:
            self.try_verify(r, unit, attempt)
        plans = r.plans_of(unit)
        for name in regions:
            plan = plans[name]
            tag = r.tag(unit, self.ctx.region_index[name], attempt)
            op = self._op(r, (tag,), send=False, unit=unit, attempt=attempt, regions=(name,))
            self.ctx.emit(PostRecv(op, r.peer, tag, buffer_name(name, unit.layer),
                                   plan.dst_offsets, plan.nbytes))

    # ------------------------------------------------------------------ completions

    def on_op_done(self, e: ev.OpDone) -> None:
        op = self._ops.pop(e.op, None)
        if op is None:
            return
        r = op.leg
        self._op_ended(r, op.tags)
        if r.machine.is_terminal:
            self.rooms.maybe_release(r)
        elif op.send:
            self._sent(r, op.unit, op.attempt, op.regions, e.error)
        else:
            self._received(r, op.unit, op.attempt, op.regions[0], e.error)

    def on_written(self, e: ev.Written) -> None:
        """Prefill: the one-sided write job of a unit's regions landed (or failed). Its
        LayerDone leaves now, with the sums computed while copying (one per region)."""
        op = self._ops.pop(e.op, None)
        if op is None:
            return
        r = op.leg
        self._op_ended(r, op.tags)
        if r.machine.is_terminal:
            self.rooms.maybe_release(r)
            return
        error = e.error
        if error is None:
            ctx = self.ctx
            want = wants_checksum(ctx.settings.checksum, ctx.layer_order[op.unit.layer],
                                  len(ctx.layers))
            n = len(op.regions)
            digests, landed = e.digests, e.landed
            if want and (len(digests) != n or None in digests):
                error = (f"the transport returned {len(digests)} checksum(s), some missing, "
                         f"for a write of {n} region(s) that asked for one each")
            elif landed and len(landed) != n:
                error = f"the transport read back {len(landed)} region(s) of a write of {n}"
            elif want:
                self._queue_done(r, op.unit, op.attempt, op.regions, digests, landed)
            else:
                self._queue_done(r, op.unit, op.attempt, op.regions, (None,) * n)
        self._sent(r, op.unit, op.attempt, op.regions, error)

    def _op_ended(self, r: Leg, tags: tuple[int, ...]) -> None:
        for tag in tags:
            left = r.inflight_tags.get(tag, 1) - 1
            if left:
                r.inflight_tags[tag] = left
            else:
                r.inflight_tags.pop(tag, None)

    def _sent(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...],
              error: str | None) -> None:
        """One op of `unit` (a send of one region, or the write job of all of them) ended."""
        if error is not None:
            self._fail_after_grace(r, f"send of layer {unit.layer} {', '.join(regions)} "
                                      f"failed: {error}")
            return
        r.bytes_moved += self._moved(r, unit, regions, "sent")
        key = (unit, attempt)
        left = r.outstanding[key] - 1
        if left:
            r.outstanding[key] = left
            return
        del r.outstanding[key]
        if attempt == 0:
            whole = r.unit_done(unit)
            if whole is not None:
                self.rooms.apply(r, LayerSent(layer=whole))
                self.maybe_acked(r)

    def _moved(self, r: Leg, unit: Unit, regions: tuple[str, ...], direction: str) -> int:
        """Counts the bytes of `unit`'s `regions` as sent / received; returns them."""
        plans = r.plans_of(unit)
        moved = self.readouts.moved
        total = 0
        for region in regions:
            plan = plans[region]
            nbytes = plan.total_bytes
            total += nbytes
            moved(direction, region, nbytes, plan.count)
        self.ctx.counters[f"bytes_{direction}"] += total
        return total

    def acked(self, r: Leg) -> None:
        """Prefill: the decode's RoomAck came."""
        if r.phase is LegPhase.ACCEPTED:
            r.advance(LegPhase.ACKED)
            self.maybe_acked(r)

    def maybe_acked(self, r: Leg) -> None:
        """Prefill: Success once the RoomAck came AND every layer's send completed (LayerDone
        goes out early, so the decode can verify and ack before our completions arrive)."""
        if (r.phase is LegPhase.ACKED and r.machine.state is KVPoll.Transferring
                and r.machine.has_layers(r.layers)):
            self.rooms.apply(r, AllLayersAcked())

    def _fail_after_grace(self, r: Leg, reason: str) -> None:
        """A data op failed. When the peer failed or aborted the room, its cancelled ops
        usually reach us on the data lane before its Failed/Abort (with the real reason) on
        the control lane: give that message one heartbeat, then fail with ours. A dead peer
        is still caught within 2 heartbeats."""
        self.ctx.later(self.ctx.hb, lambda: self.rooms.fail(
            r, PeerWasLost(reason=reason), notify=Notify.FAILED, kind=FailureKind.TRANSPORT))

    def _received(self, r: Leg, unit: Unit, attempt: int, region: str,
                  error: str | None) -> None:
        if error is not None:
            self._fail_after_grace(r, f"receive of layer {unit.layer} {region} failed: {error}")
            return
        r.recv_done.setdefault((unit, attempt), set()).add(region)
        self.try_verify(r, unit, attempt)

    # ------------------------------------------------------------------ checksums

    def try_verify(self, r: Leg, unit: Unit, attempt: int) -> None:
        """Decode: once a unit's bytes and its LayerDone are both here, verify."""
        if r.role is not Role.DECODE or r.machine.is_terminal or r.posted.get(unit) != attempt:
            return
        key = (unit, attempt)
        sums = r.sums.get(key)
        if sums is None or key in r.verifying:
            return
        regions = tuple(self._regions_of(r, unit))
        if len(r.recv_done.get(key, ())) < len(regions):
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
            self.rooms.fail(r, PeerFailedRoom(reason=why), notify=Notify.FAILED,
                            failure=Failure(FailureKind.CHECKSUM, why))
            return
        # the writer's verification (one-sided, same host): its read-back must equal the
        # source sum, and the plan it wrote by must be this side's; those regions are not
        # read again here. A disagreement is a mismatch like any other (rewrite, then fail).
        checked = r.landed.get(key) if r.one_sided else None
        hashed: list[str] = []  # the regions with a source sum
        own: list[str] = []  # those this side hashes (the writer did not verify them)
        bad = None  # the first region whose writer's verification disagrees
        plans = r.plans_of(unit)
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
        if bad is not None or not own:
            self._verified(r, unit, attempt, regions, bad=bad, checked=len(hashed))
            return
        r.verifying.add(key)
        self._hash(_Job(r, True, unit, attempt, regions, tuple(own),
                        tuple(sums.get(n) for n in own), trusted=len(hashed) - len(own)))

    def on_hashed(self, e: ev.Hashed) -> None:
        job = self._jobs.pop(e.job, None)
        if job is None:
            return
        r = job.leg
        r.verifying.discard((job.unit, job.attempt))
        if r.machine.is_terminal or r.posted.get(job.unit) != job.attempt:
            return
        if e.error is not None:
            what = "verification" if job.verify else "checksum"
            layer = job.unit.layer
            self.rooms.fail(r, PeerFailedRoom(reason=f"{what} of layer {layer} failed: {e.error}"),
                            notify=Notify.FAILED, failure=Failure(
                                FailureKind.TRANSPORT, f"{what} of layer {layer} could not be "
                                f"computed: {e.error}"))
            return
        if not job.verify:
            self._queue_done(r, job.unit, job.attempt, job.regions, e.sums)
            return
        bad = next((n for n, got, want in zip(job.hashed, e.sums, job.want, strict=True)
                    if got != want), None)
        self._verified(r, job.unit, job.attempt, job.regions, bad=bad,
                       checked=len(job.hashed) + job.trusted)

    def _verified(self, r: Leg, unit: Unit, attempt: int, regions: tuple[str, ...], *,
                  bad: str | None, checked: int) -> None:
        """Acts on a unit's verification: landed, retransmit once, or Failed."""
        ctx = self.ctx
        if bad is not None:
            ctx.counters["checksum_failures"] += 1
            if attempt + 1 < MAX_ATTEMPTS:
                r.retransmits += 1
                ctx.counters["retransmits"] += 1
                ctx.send(r.peer, P.LayerNack(
                    src=ctx.me.address, gen=ctx.me.generation, room=r.room, layer=unit.layer,
                    attempt=attempt, reason=f"checksum mismatch in {bad}", chunk=unit.chunk))
                self.post_recv_layer(r, unit, attempt + 1)
            else:
                self.rooms.fail(r, ChecksumsDiffered(layer=unit.layer, region=bad),
                                notify=Notify.FAILED)
            return
        r.checksums_verified += checked
        ctx.counters["checksums_verified"] += checked
        r.bytes_moved += self._moved(r, unit, regions, "received")
        layer = r.unit_done(unit)
        if layer is None:
            r.machine.progressed(ctx.now)
            return
        self.rooms.apply(r, LayerLanded(layer=layer))
        g = r.group
        if g.expected is not None and len(g.legs) == g.expected and all(
                leg.machine.has_layers((layer,)) for leg in g.legs):
            g.landed.add(layer)
            self.rooms.changed(g)
        if r.machine.has_layers(r.layers):
            r.remote_writes = False  # every layer verified: the prefill writes nothing more
            self.rooms.apply(r, AllLayersLanded())
            ctx.send(r.peer, P.RoomAck(src=ctx.me.address, gen=ctx.me.generation, room=r.room))

    # ------------------------------------------------------------------ messages

    def on_layer_done(self, r: Leg, msg: P.LayerDone) -> None:
        """Decode: the prefill's sums of the layers it posted."""
        for info in msg.layers:
            unit = Unit(info.layer, info.chunk)
            key = (unit, info.attempt)
            sums: dict[str, int | None] = {}
            checked: dict[str, tuple[int, int]] = {}
            for x in info.regions:
                sums[x.region] = x.checksum
                if x.checksum is not None and x.landed is not None and x.plan is not None:
                    checked[x.region] = (x.landed, x.plan)
            r.sums[key] = sums
            if checked:
                r.landed[key] = checked
            self.try_verify(r, unit, info.attempt)

    def on_nack(self, r: Leg, msg: P.LayerNack) -> None:
        """Prefill: the decode asks for a layer again (its checksum did not match)."""
        unit = Unit(msg.layer, msg.chunk)
        if msg.attempt + 1 < 1 << P.ATTEMPT_BITS and r.posted.get(unit) == msg.attempt:
            self.ctx.counters["retransmits"] += 1
            r.retransmits += 1
            self.post_layer(r, unit, msg.attempt + 1)

    def suffix_pages(self, r: Leg) -> dict[str, np.ndarray]:
        """Prefill: the leg's pages per region, suffix-only regions from the page-aligned
        decode prefix on."""
        return {reg.name: r.pages[reg.name][
            page_aligned(r.prefix_len, r.page_size) // r.page_size
            if reg.send_from is SendFrom.DECODE_PREFIX else 0:]
            for reg in self.ctx.layout.regions}
