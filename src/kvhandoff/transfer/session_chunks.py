"""Chunked prefill in `session.TransferSession` (a mixin of its data path, split out for
size; sans-IO like the session).

A room's pages may come in chunks (`events.AddChunk`). A leg's chunk 0 is what its
`TransferAccepted` covers (`chunk_end`); each later chunk goes to the decode as `ChunkAdded`
(its new source pages), the decode plans it over its token range, posts its receives (none
when the prefill writes one-sided) under a fresh transfer id and answers `ChunkAccepted`; the
prefill then sends the chunk's ready layers. Per region, a chunk moves the tokens from where the
previous one stopped to where this side's pages reach (so a region whose pages come late, e.g.
an indexer given with the last chunk only, moves everything at once then): no byte moves twice.
Every (chunk, layer) is checksummed and verified on its own; a layer lands (`LayerSent` /
`LayerLanded`) once the last chunk's unit of it and every earlier one did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.state_machine import Deadline, RemoteFailed
from kvhandoff.transfer import events as ev
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.effects import Notify

if TYPE_CHECKING:
    from kvhandoff.errors import FailureKind as _Kind
    from kvhandoff.kv_layout import LayoutSpec
    from kvhandoff.state_machine import FailureEvent
    from kvhandoff.transfer.handshake import Identity, Peer
    from kvhandoff.transfer.rooms import Group, Leg

_LAYER_MASK = (1 << P.LAYER_BITS) - 1


def unit_of(chunk: int, layer: int) -> int:
    """The internal key of (chunk, layer) of a leg (the layer itself for chunk 0)."""
    return chunk << P.LAYER_BITS | layer


def split_unit(unit: int) -> tuple[int, int]:
    """(chunk, layer) of a `unit_of`."""
    return unit >> P.LAYER_BITS, unit & _LAYER_MASK


class ChunkedPrefill:
    """Mixin of `session_data.DataPath` (see the module doc)."""

    if TYPE_CHECKING:  # what the session provides
        me: Identity
        layout: LayoutSpec
        peers: dict[str, Peer]
        region_index: dict[str, int]
        _now: float
        _xfer: Any

        def _send(self, addr: str, msg: P.Message) -> None: ...
        def _group(self, room: int, token: object) -> Group | None: ...
        def _fail_group(self, g: Group, failure: Failure) -> None: ...
        def suffix_pages(self, r: Leg) -> dict[str, np.ndarray]: ...
        def _fail(self, r: Leg, fe: FailureEvent, *, notify: Notify,
                  kind: _Kind | None = None, failure: Failure | None = None) -> None: ...
        def _plans(self, r: Leg, *, src_pages: Any, src_ps: int, dst_pages: Any, dst_ps: int,
                   src_layout: LayoutSpec, dst_layout: LayoutSpec,
                   end: int | None = None) -> dict[str, Any]: ...
        def _post_layer(self, r: Leg, layer: int, attempt: int) -> None: ...
        def _post_recv_layer(self, r: Leg, layer: int, attempt: int) -> None: ...

    def _first_chunk(self, r: Leg, end: int, xfer: int) -> None:
        r.chunk_ends, r.chunk_plans, r.chunk_xfers = [end], [r.plans], [xfer]

    def _chunk_plans(self, r: Leg, unit: int) -> dict[str, Any]:
        return r.chunk_plans[unit >> P.LAYER_BITS] if r.chunk_plans else r.plans

    def _tag(self, r: Leg, unit: int, region: str, attempt: int) -> int:
        chunk, layer = split_unit(unit)
        xfer = r.chunk_xfers[chunk] if r.chunk_xfers else r.xfer
        assert xfer is not None  # units of a chunk are posted once its transfer id is known
        return P.data_tag(xfer, layer, self.region_index[region], attempt)

    def _rearm_stall(self, r: Leg) -> None:
        """A chunk is progress: the stall deadline counts from it (the RoomMachine arms it
        only on whole layers, which land after the last chunk)."""
        if r.machine.deadline(Deadline.TRANSFER_STALL) is not None:
            r.machine._arm(Deadline.TRANSFER_STALL, self._now)

    def _post_ready(self, r: Leg, layer: int) -> None:
        """Prefill: the engine marked `layer` ready: send it in the leg's current chunk (once
        the decode accepted that chunk)."""
        c = len(r.chunk_ends) - 1
        if c <= 0 or r.chunk_xfers[c] is not None:
            self._post_layer(r, unit_of(max(c, 0), layer), 0)

    def _on_add_chunk(self, e: ev.AddChunk) -> None:
        """Prefill engine: the next chunk's pages (every layer of the previous chunk was ready,
        which the agent checked)."""
        g = self._group(e.room, e.token)
        if g is None or g.done:
            return
        if len(g.ready) < len(g.layers) or not g.chunk_end < e.chunk_end <= g.seq_len:
            self._fail_group(g, Failure(
                FailureKind.INVALID_REQUEST,
                f"add_chunk(chunk_end={e.chunk_end}): after {g.chunk_end} of {g.seq_len} "
                f"tokens with {len(g.ready)} of {len(g.layers)} layers ready"))
            return
        g.pages = {k: np.concatenate([v, np.asarray(e.pages.get(k, ()), dtype=np.int64)])
                   for k, v in g.pages.items()}
        g.chunk_end = e.chunk_end
        g.ready = []
        for r in g.legs:
            if r.accepted and not r.machine.is_terminal:
                self._add_leg_chunk(r)

    def _add_leg_chunk(self, r: Leg) -> None:
        """Prefill: plan the leg's next chunk and offer it to the decode (`ChunkAdded`)."""
        g = r.group
        old = r.pages
        r.pages = g.pages
        r.pages = self.suffix_pages(r)
        delta = {k: v[len(old.get(k, ())):].tolist() for k, v in r.pages.items()}
        p = self.peers.get(r.peer)
        try:
            if p is None or p.layout is None:
                raise ConfigError("the decode's Hello is gone")
            plans = self._plans(r, src_pages=r.pages, src_ps=r.page_size,
                                dst_pages=r.dst_table, dst_ps=r.dst_page_size,
                                src_layout=self.layout, dst_layout=p.layout, end=g.chunk_end)
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid chunk: {e}"), notify=Notify.FAILED,
                       kind=FailureKind.INVALID_REQUEST)
            return
        r.chunk_ends.append(g.chunk_end)
        r.chunk_plans.append(plans)
        r.chunk_xfers.append(None)
        self._rearm_stall(r)
        self._send(r.peer, P.ChunkAdded(src=self.me.address, gen=self.me.generation,
                                        room=r.room, chunk=len(r.chunk_ends) - 1,
                                        chunk_end=g.chunk_end, src_pages=delta))

    def _on_chunk_added(self, r: Leg, msg: P.ChunkAdded) -> None:
        """Decode: plan the chunk, post its receives, answer `ChunkAccepted`."""
        try:
            if not r.accepted or msg.chunk != len(r.chunk_ends):
                raise ConfigError(f"chunk: {msg.chunk} out of order (expected "
                                  f"{len(r.chunk_ends)})")
            if not r.chunk_ends[-1] < msg.chunk_end <= r.seq_len:
                raise ConfigError(f"chunk_end: {msg.chunk_end} not in "
                                  f"{r.chunk_ends[-1] + 1}..{r.seq_len}")
            p = self.peers.get(r.peer)
            if p is None or p.layout is None:
                raise ConfigError("ChunkAdded before the prefill's Hello")
            for k, v in msg.src_pages.items():
                if k not in r.src_table:
                    raise ConfigError(f"src_pages: unknown region {k!r}")
                r.src_table[k] = np.concatenate([r.src_table[k], np.asarray(v, np.int64)])
            plans = self._plans(r, src_pages=r.src_table, src_ps=p.layout.page_size_tokens,
                                dst_pages=r.pages, dst_ps=r.page_size, src_layout=p.layout,
                                dst_layout=self.layout, end=msg.chunk_end)
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid ChunkAdded: {e}"),
                       notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        xfer = next(self._xfer)
        r.chunk_ends.append(msg.chunk_end)
        r.chunk_plans.append(plans)
        r.chunk_xfers.append(xfer)
        self._rearm_stall(r)
        self._send(r.peer, P.ChunkAccepted(src=self.me.address, gen=self.me.generation,
                                           room=r.room, chunk=msg.chunk, xfer=xfer))
        for layer in r.layers:
            self._post_recv_layer(r, unit_of(msg.chunk, layer), 0)

    def _on_chunk_accepted(self, r: Leg, msg: P.ChunkAccepted) -> None:
        """Prefill: the decode posted the chunk's receives: send its ready layers."""
        c = msg.chunk
        if not 0 < c < len(r.chunk_xfers) or r.chunk_xfers[c] is not None:
            return
        r.chunk_xfers[c] = msg.xfer
        latest = c == len(r.chunk_ends) - 1
        for layer in (r.group.ready if latest else r.layers):
            self._post_layer(r, unit_of(c, layer), 0)

    def _layer_complete(self, r: Leg, unit: int) -> int | None:
        """The layer of `unit` when every chunk of it is sent / landed (the last chunk is
        known), else None."""
        r.units_done.add(unit)
        layer = unit & _LAYER_MASK
        n = len(r.chunk_ends) or 1
        if (r.chunk_ends and r.chunk_ends[-1] < r.seq_len) or any(
                unit_of(c, layer) not in r.units_done for c in range(n)):
            return None
        return layer
