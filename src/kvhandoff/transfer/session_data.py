"""The data path of `session.TransferSession`: span plans, posting layers, completions,
checksums and verification. Sans-IO like the session (a mixin of it, split out for size):
transfers and hashing jobs leave as effects, their completions come back as events.

Per layer and leg: prefill posts the sends of every region of the layer and, while the bytes
are on the wire, asks for the checksums of the source spans; `LayerDone` (several layers in
one message when they complete together) announces them at once, so the tail after the last
layer is one transfer plus one check. Decode posts every receive when the transfer is
accepted, verifies a layer once its bytes and its `LayerDone` are both in, asks for one
retransmit on a mismatch (`LayerNack`), and fails the room naming layer and region when the
retransmit does not verify either.

Chunked prefill: `session_chunks.ChunkedPrefill` (a mixin of this one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, SendFrom, build_spans, page_aligned
from kvhandoff.state_machine import (
    AllLayersAcked,
    AllLayersLanded,
    ChecksumMismatch,
    KVPoll,
    LayerLanded,
    LayerSent,
    LeaseRenewed,
    PeerLost,
    PeerMatched,
    RemoteFailed,
    Role,
    TransferAccepted,
)
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.checksum import wants_checksum
from kvhandoff.transfer.effects import Effect, HashSpans, Notify, PostRecv, PostSend, PostWrite
from kvhandoff.transfer.handshake import Refusal, admission_of, checksum_alg
from kvhandoff.transfer.rooms import Group, Leg
from kvhandoff.transfer.session_chunks import _LAYER_MASK, ChunkedPrefill, split_unit

if TYPE_CHECKING:
    from kvhandoff.errors import FailureKind as _Kind
    from kvhandoff.settings import Settings
    from kvhandoff.state_machine import FailureEvent
    from kvhandoff.transfer.handshake import Identity, Peer

MAX_ATTEMPTS = 2  # one retransmit after a checksum mismatch, then the room fails
def buffer_name(region: str, layer: int) -> str:
    """The transport name of the buffer of (region, layer) (`buffers.BufferSet.name`)."""
    return f"{region}/{layer}"


@dataclass(frozen=True, slots=True)
class _Op:
    leg: Leg
    tag: int
    send: bool
    layer: int
    attempt: int
    region: str


@dataclass(frozen=True, slots=True)
class _Job:
    leg: Leg
    verify: bool  # False: announce (source sums), True: verify (landed sums)
    layer: int
    attempt: int
    regions: tuple[str, ...]  # the regions of the layer this leg moves
    hashed: tuple[str, ...]  # the regions hashed (in `Hashed.sums` order)
    want: tuple[int | None, ...] = ()  # verify: the sender's sums of `hashed`


class DataPath(ChunkedPrefill):
    """Mixin of `TransferSession` (see the module doc)."""

    if TYPE_CHECKING:  # what the session provides
        me: Identity
        layout: LayoutSpec
        settings: Settings
        peers: dict[str, Peer]
        counters: dict[str, int]
        region_bytes: dict[tuple[str, str], int]
        region_descriptors: dict[tuple[str, str], int]
        region_index: dict[str, int]
        layer_order: dict[int, int]
        layers: tuple[int, ...]
        hb: float
        _now: float
        _dirty: dict[int, Group]
        _xfer: Any
        groups: dict[int, Group]

        def _send(self, addr: str, msg: P.Message) -> None: ...
        def _emit(self, effect: Effect) -> None: ...
        def _later(self, delay_s: float, fn: Callable[[], None]) -> None: ...
        def _apply(self, r: Leg, event: Any) -> None: ...
        def _maybe_release(self, r: Leg) -> None: ...
        def _group(self, room: int, token: object) -> Group | None: ...
        def _fail_group(self, g: Group, failure: Failure) -> None: ...
        def suffix_pages(self, r: Leg) -> dict[str, np.ndarray]: ...
        def _fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
                  kind: _Kind | None = None, failure: Failure | None = None) -> None: ...

    def __init__(self) -> None:
        self._ops: dict[int, _Op] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_op = 0
        self._pending_done: dict[tuple[int, str], list[P.LayerInfo]] = {}
        self._pending_ack: dict[str, bool] = {}

    # ------------------------------------------------------------------ request / accept

    def _on_request(self, r: Leg, msg: P.TransferRequest) -> None:
        """Prefill: validate the request, plan, accept, and send the layers already ready."""
        p = self.peers.get(msg.src)
        if msg.peer_gen != self.me.generation:
            self._send(msg.src, P.Failed(
                src=self.me.address, gen=self.me.generation, room=r.room,
                reason="stale request: it names a previous generation of this prefill agent",
                failure_kind=FailureKind.PEER_LOST.value))
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
            r.xfer, r.prefix_len, r.peer_gen = msg.xfer, msg.decode_prefix_len, msg.gen
            r.pages = self.suffix_pages(r)
            if p is None or p.layout is None:
                raise ConfigError("transfer request before the decode's Hello")
            refusal = admission_of(msg, decode_layout=p.layout,  # before any byte moves
                                   policy=self.settings.allocation_policy,
                                   prompt_tokens=r.group.prompt_tokens, prompt=r.group.prompt)
            if refusal is not None:
                raise Refusal(refusal)
            r.planes = msg.planes
            r.dst_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.dst_pages.items()}
            r.dst_page_size = msg.page_size
            r.one_sided = p.writes
            end = r.group.chunk_end or r.seq_len
            r.plans = self._plans(r, src_pages=r.pages, src_ps=r.page_size,
                                  dst_pages=r.dst_table, dst_ps=msg.page_size,
                                  src_layout=self.layout, dst_layout=p.layout, end=end)
            self._first_chunk(r, end, msg.xfer)
        except Refusal as e:
            self._fail(r, RemoteFailed(reason=str(e)), notify=Notify.FAILED,
                       failure=Failure(FailureKind.ADMISSION, str(e)))
            return
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid transfer request: {e}"),
                       notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        if not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), self._now)
        r.machine.apply(TransferAccepted(), self._now)
        r.machine.apply(LeaseRenewed(), self._now)
        self._dirty[id(r.group)] = r.group
        r.accepted = True
        if r.one_sided:
            self.counters["rooms_one_sided"] += 1
        self._send(msg.src, P.TransferAccepted(
            src=self.me.address, gen=self.me.generation, room=r.room, page_size=r.page_size,
            src_pages={k: v.tolist() for k, v in r.pages.items()},
            chunk_end=-1 if end >= r.seq_len else end, one_sided=r.one_sided))
        for layer in r.group.ready:
            self._post_layer(r, layer, 0)

    def _plans(self, r: Leg, *, src_pages: Mapping[str, np.ndarray], src_ps: int,
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
        for reg in self.layout.regions:
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

    def _on_accepted(self, r: Leg, msg: P.TransferAccepted) -> None:
        """Decode: plan, post every receive, WaitingForInput."""
        if r.accepted:
            return
        try:
            p = self.peers.get(r.peer)
            if p is None or p.layout is None:
                raise ConfigError("TransferAccepted before the prefill's Hello")
            end = r.seq_len if msg.chunk_end < 0 else msg.chunk_end
            if msg.one_sided and not self.me.writes:
                raise ConfigError("one_sided: this decode offered no buffers for writes")
            if not 0 < end <= r.seq_len:
                raise ConfigError(f"chunk_end: {msg.chunk_end} not in 1..{r.seq_len}")
            r.src_table = {k: np.asarray(v, dtype=np.int64) for k, v in msg.src_pages.items()}
            r.plans = self._plans(r, src_pages=r.src_table, src_ps=msg.page_size,
                                  dst_pages=r.pages, dst_ps=r.page_size,
                                  src_layout=p.layout, dst_layout=self.layout, end=end)
            self._first_chunk(r, end, r.xfer)
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid TransferAccepted: {e}"),
                       notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        r.accepted = True
        if msg.one_sided:
            r.one_sided = r.remote_writes = True
            self.counters["rooms_one_sided"] += 1
        self._apply(r, TransferAccepted())
        for layer in r.layers:
            self._post_recv_layer(r, layer, 0)

    # ------------------------------------------------------------------ posting

    def _regions_of(self, r: Leg, unit: int) -> list[str]:
        """The regions of `unit`'s layer this leg moves in its chunk."""
        plans = self._chunk_plans(r, unit)
        return [reg.name for reg in self.layout.regions_of_layer(unit & _LAYER_MASK)
                if reg.name in plans]

    def _op(self, r: Leg, tag: int, *, send: bool, layer: int, attempt: int,
            region: str) -> int:
        self._next_op += 1
        self._ops[self._next_op] = _Op(r, tag, send, layer, attempt, region)
        r.inflight_tags[tag] = r.inflight_tags.get(tag, 0) + 1
        return self._next_op

    def _hash(self, job: _Job) -> None:
        self._next_op += 1
        self._jobs[self._next_op] = job
        plans = self._chunk_plans(job.leg, job.layer)
        layer = job.layer & _LAYER_MASK
        spans = tuple((buffer_name(n, layer), plans[n].src_offsets
                       if not job.verify else plans[n].dst_offsets,
                       plans[n].nbytes) for n in job.hashed)
        self._emit(HashSpans(self._next_op, spans, self._checksum_alg(job.leg)))

    def _checksum_alg(self, r: Leg) -> str:
        """The room's checksum algorithm (`handshake.checksum_alg`) from this side's memory
        kind and the peer's Hello; a peer no longer known counts as host (its rooms are
        failing: nothing it sent is verified any more)."""
        p = self.peers.get(r.peer)
        return checksum_alg(self.me.memory, p.memory if p is not None else "host")

    def _post_layer(self, r: Leg, layer: int, attempt: int) -> None:
        """Prefill: send every region of `layer`, checksum the source spans while the bytes
        are on the wire, and announce the layer (`LayerDone`) once the sums are in."""
        r.posted[layer] = attempt
        regions = self._regions_of(r, layer)
        key = (layer, attempt)
        r.sums[key] = {}
        if not regions:  # another leg of the room brings this layer's planes
            r.outstanding[key] = 1
            self._queue_done(r, layer, attempt, (), ())
            self._sent(r, layer, attempt, "", None)
            return
        r.outstanding[key] = len(regions)
        plans = self._chunk_plans(r, layer)
        real = layer & _LAYER_MASK
        want = wants_checksum(self.settings.checksum, self.layer_order[real], len(self.layers))
        if r.one_sided:  # straight into the decode's pages, hashed while copying
            r.write_sums[key] = {}
            for name in regions:
                plan = plans[name]
                tag = self._tag(r, layer, name, attempt)
                op = self._op(r, tag, send=True, layer=layer, attempt=attempt, region=name)
                self._emit(PostWrite(op, r.peer, tag, buffer_name(name, real), plan.src_offsets,
                                     plan.nbytes, plan.dst_offsets, want,
                                     self._checksum_alg(r)))
            return
        for name in regions:
            plan = plans[name]
            tag = self._tag(r, layer, name, attempt)
            op = self._op(r, tag, send=True, layer=layer, attempt=attempt, region=name)
            self._emit(PostSend(op, r.peer, tag, buffer_name(name, real), plan.src_offsets,
                                plan.nbytes))
        if want:
            self._hash(_Job(r, False, layer, attempt, tuple(regions), tuple(regions)))
        else:
            self._queue_done(r, layer, attempt, tuple(regions), (None,) * len(regions))

    def _queue_done(self, r: Leg, layer: int, attempt: int, regions: tuple[str, ...],
                    sums: tuple[int | None, ...]) -> None:
        """Queues the LayerDone of a posted layer (several layers of a room leave in one
        message, at the next Tick)."""
        r.sums[(layer, attempt)] = dict(zip(regions, sums, strict=True))
        plans = self._chunk_plans(r, layer)
        chunk, real = split_unit(layer)
        self._pending_done.setdefault((r.room, r.peer), []).append(P.LayerInfo(
            layer=real, attempt=attempt, chunk=chunk, regions=[
                P.RegionDone(region=n, nbytes=plans[n].total_bytes, checksum=s)
                for n, s in zip(regions, sums, strict=True)]))

    def _flush_done(self) -> None:
        for (room, peer), infos in self._pending_done.items():
            self._send(peer, P.LayerDone(src=self.me.address, gen=self.me.generation,
                                         room=room, layers=infos))
        self._pending_done.clear()

    def _post_recv_layer(self, r: Leg, layer: int, attempt: int) -> None:
        r.posted[layer] = attempt
        r.recv_done[(layer, attempt)] = set()
        regions = self._regions_of(r, layer)
        if r.one_sided:  # nothing to post: the bytes are in once the layer's LayerDone is
            r.recv_done[(layer, attempt)] = set(regions)
            self._try_verify(r, layer, attempt)
            return
        if not regions:
            self._try_verify(r, layer, attempt)
        plans = self._chunk_plans(r, layer)
        for name in regions:
            plan = plans[name]
            tag = self._tag(r, layer, name, attempt)
            op = self._op(r, tag, send=False, layer=layer, attempt=attempt, region=name)
            self._emit(PostRecv(op, r.peer, tag, buffer_name(name, layer & _LAYER_MASK),
                                plan.dst_offsets, plan.nbytes))

    # ------------------------------------------------------------------ completions

    def _on_op_done(self, e: ev.OpDone) -> None:
        op = self._ops.pop(e.op, None)
        if op is None:
            return
        r = op.leg
        self._op_ended(r, op.tag)
        if r.machine.is_terminal:
            self._maybe_release(r)
        elif op.send:
            self._sent(r, op.layer, op.attempt, op.region, e.error)
        else:
            self._received(r, op.layer, op.attempt, op.region, e.error)

    def _on_written(self, e: ev.Written) -> None:
        """Prefill: a one-sided write of (layer, region) landed (or failed). LayerDone leaves
        once every region of the layer landed, with the sums computed while copying."""
        op = self._ops.pop(e.op, None)
        if op is None:
            return
        r = op.leg
        self._op_ended(r, op.tag)
        if r.machine.is_terminal:
            self._maybe_release(r)
            return
        error = e.error
        key = (op.layer, op.attempt)
        sums = r.write_sums.get(key)
        if error is None and sums is not None:
            real = op.layer & _LAYER_MASK
            want = wants_checksum(self.settings.checksum, self.layer_order[real],
                                  len(self.layers))
            if want and e.digest is None:
                error = "the transport returned no checksum for a write that asked for one"
            else:
                sums[op.region] = e.digest if want else None
                regions = tuple(self._regions_of(r, op.layer))
                if len(sums) == len(regions):
                    del r.write_sums[key]
                    self._queue_done(r, op.layer, op.attempt, regions,
                                     tuple(sums[n] for n in regions))
        self._sent(r, op.layer, op.attempt, op.region, error)

    def _op_ended(self, r: Leg, tag: int) -> None:
        left = r.inflight_tags.get(tag, 1) - 1
        if left:
            r.inflight_tags[tag] = left
        else:
            r.inflight_tags.pop(tag, None)

    def _sent(self, r: Leg, layer: int, attempt: int, region: str, error: str | None) -> None:
        if error is not None:
            self._fail_after_grace(r, f"send of layer {layer & _LAYER_MASK} {region} failed: "
                                      f"{error}")
            return
        plan = self._chunk_plans(r, layer)[region] if region else None
        nbytes = plan.total_bytes if plan is not None else 0
        r.bytes_moved += nbytes
        self.counters["bytes_sent"] += nbytes
        if plan is not None:
            k = ("sent", region)
            self.region_bytes[k] = self.region_bytes.get(k, 0) + nbytes
            self.region_descriptors[k] = self.region_descriptors.get(k, 0) + plan.count
        key = (layer, attempt)
        r.outstanding[key] -= 1
        if r.outstanding[key]:
            return
        del r.outstanding[key]
        if attempt == 0:
            whole = self._layer_complete(r, layer)
            if whole is not None:
                self._apply(r, LayerSent(layer=whole))
                self._maybe_acked(r)

    def _maybe_acked(self, r: Leg) -> None:
        """Prefill: Success once the RoomAck came AND every layer's send completed (LayerDone
        goes out early, so the decode can verify and ack before our completions arrive)."""
        if (r.acked and r.machine.state is KVPoll.Transferring
                and r.machine.layers >= set(r.layers)):
            self._apply(r, AllLayersAcked())

    def _fail_after_grace(self, r: Leg, reason: str) -> None:
        """A data op failed. When the peer failed or aborted the room, its cancelled ops
        usually reach us on the data lane before its Failed/Abort (with the real reason) on
        the control lane: give that message one heartbeat, then fail with ours. A dead peer
        is still caught within 2 heartbeats."""
        self._later(self.hb, lambda: self._fail(r, PeerLost(reason=reason),
                                                notify=Notify.FAILED,
                                                kind=FailureKind.TRANSPORT))

    def _received(self, r: Leg, layer: int, attempt: int, region: str,
                  error: str | None) -> None:
        if error is not None:
            self._fail_after_grace(r, f"receive of layer {layer & _LAYER_MASK} {region} "
                                      f"failed: {error}")
            return
        r.recv_done.setdefault((layer, attempt), set()).add(region)
        self._try_verify(r, layer, attempt)

    # ------------------------------------------------------------------ checksums

    def _try_verify(self, r: Leg, layer: int, attempt: int) -> None:
        """Decode: once a layer's bytes and its LayerDone are both here, verify."""
        if r.role is not Role.DECODE or r.machine.is_terminal or r.posted.get(layer) != attempt:
            return
        key = (layer, attempt)
        regions = tuple(self._regions_of(r, layer))
        sums = r.sums.get(key)
        if sums is None or len(r.recv_done.get(key, ())) < len(regions) or key in r.verifying:
            return
        hashed = tuple(n for n in regions if sums.get(n) is not None)
        if not hashed:
            self._verified(r, layer, attempt, regions, bad=None, checked=0)
            return
        r.verifying.add(key)
        self._hash(_Job(r, True, layer, attempt, regions, hashed,
                        tuple(sums.get(n) for n in hashed)))

    def _on_hashed(self, e: ev.Hashed) -> None:
        job = self._jobs.pop(e.job, None)
        if job is None:
            return
        r = job.leg
        r.verifying.discard((job.layer, job.attempt))
        if r.machine.is_terminal or r.posted.get(job.layer) != job.attempt:
            return
        if e.error is not None:
            what = "verification" if job.verify else "checksum"
            real = job.layer & _LAYER_MASK
            self._fail(r, RemoteFailed(reason=f"{what} of layer {real} failed: "
                                              f"{e.error}"),
                       notify=Notify.FAILED, failure=Failure(
                           FailureKind.TRANSPORT, f"{what} of layer {real} could not be "
                           f"computed: {e.error}"))
            return
        if not job.verify:
            self._queue_done(r, job.layer, job.attempt, job.regions, e.sums)
            return
        bad = next((n for n, got, want in zip(job.hashed, e.sums, job.want, strict=True)
                    if got != want), None)
        self._verified(r, job.layer, job.attempt, job.regions, bad=bad,
                       checked=len(job.hashed))

    def _verified(self, r: Leg, layer: int, attempt: int, regions: tuple[str, ...], *,
                  bad: str | None, checked: int) -> None:
        """Acts on a layer's verification: landed, retransmit once, or Failed."""
        chunk, real = split_unit(layer)
        if bad is not None:
            self.counters["checksum_failures"] += 1
            if attempt + 1 < MAX_ATTEMPTS:
                r.retransmits += 1
                self.counters["retransmits"] += 1
                self._send(r.peer, P.LayerNack(
                    src=self.me.address, gen=self.me.generation, room=r.room, layer=real,
                    attempt=attempt, reason=f"checksum mismatch in {bad}", chunk=chunk))
                self._post_recv_layer(r, layer, attempt + 1)
            else:
                self._fail(r, ChecksumMismatch(layer=real, region=bad), notify=Notify.FAILED)
            return
        r.checksums_verified += checked
        self.counters["checksums_verified"] += checked
        plans = self._chunk_plans(r, layer)
        for name in regions:
            n = plans[name].total_bytes
            r.bytes_moved += n
            self.counters["bytes_received"] += n
            k = ("received", name)
            self.region_bytes[k] = self.region_bytes.get(k, 0) + n
            self.region_descriptors[k] = self.region_descriptors.get(k, 0) + plans[name].count
        whole = self._layer_complete(r, layer)
        if whole is None:
            self._rearm_stall(r)
            return
        layer = whole
        self._apply(r, LayerLanded(layer=layer))
        g = r.group
        if g.expected is not None and len(g.legs) == g.expected and all(
                layer in leg.machine.layers for leg in g.legs):
            g.landed.add(layer)
            self._dirty[id(g)] = g
        if r.machine.layers >= set(r.layers):
            r.remote_writes = False  # every layer verified: the prefill writes nothing more
            self._apply(r, AllLayersLanded())
            self._send(r.peer, P.RoomAck(src=self.me.address, gen=self.me.generation,
                                         room=r.room))
