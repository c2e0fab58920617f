"""`ChunkedPrefill`: a room whose pages come in chunks, sans-IO like the session.

A room's pages may come in chunks (`events.AddChunk`). A leg's chunk 0 is what its
`TransferAccepted` covers (`chunk_end`); each later chunk goes to the decode as `ChunkAdded`
(its new source pages), the decode plans it over its token range, posts its receives (none
when the prefill writes one-sided) under a fresh transfer id and answers `ChunkAccepted`; the
prefill then sends the chunk's ready layers. Per region, a chunk moves the tokens from where the
previous one stopped to where this side's pages reach (so a region whose pages come late, e.g.
an indexer given with the last chunk only, moves everything at once then): no byte moves twice.
Every (chunk, layer) is a `rooms.Unit`, checksummed and verified on its own; a layer lands
(`LayerSent` / `LayerLanded`) once its unit of the last chunk and of every earlier one did
(`rooms.LegPlan` keeps a leg's chunks).

It keeps no state of its own: the chunks are the legs', the posts the role paths'
(`send.SendPath`, `receive.ReceivePath`), the plans `planning.span_plans`.
"""

from __future__ import annotations

import numpy as np

from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.context import Context
from kvhandoff.protocol.effects import Notify
from kvhandoff.protocol.lifecycle import RoomTable
from kvhandoff.protocol.peers import PeerTable
from kvhandoff.protocol.planning import span_plans
from kvhandoff.protocol.receive import ReceivePath
from kvhandoff.protocol.rooms import Leg, Unit
from kvhandoff.protocol.send import SendPath
from kvhandoff.state_machine import PeerFailedRoom


class ChunkedPrefill:
    """The chunk exchange of one session (see the module doc). Keyword-only arguments."""

    def __init__(self, *, ctx: Context, rooms: RoomTable, peers: PeerTable,
                 send_path: SendPath, receive_path: ReceivePath) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.peers = peers
        self.send_path = send_path
        self.receive_path = receive_path

    def post_ready(self, r: Leg, layers: list[int]) -> None:
        """Prefill: the engine marked `layers` ready (together): send them in the leg's
        current chunk (once the decode accepted that chunk)."""
        c = len(r.plan.chunk_ends) - 1
        if c <= 0 or r.plan.chunk_xfers[c] is not None:
            chunk = max(c, 0)
            self.send_path.post_layers(r, [Unit(layer, chunk) for layer in layers], 0)

    def on_add_chunk(self, e: ev.AddChunk) -> None:
        """Prefill engine: the next chunk's pages (every layer of the previous chunk was ready,
        which the agent checked)."""
        g = self.rooms.find(e.room, e.token)
        if g is None or g.state.done:
            return
        given = g.given
        if len(given.ready) < len(g.layers) or not given.chunk_end < e.chunk_end <= given.seq_len:
            self.rooms.fail_room(g, Failure(
                FailureKind.INVALID_REQUEST,
                f"add_chunk(chunk_end={e.chunk_end}): after {given.chunk_end} of "
                f"{given.seq_len} tokens with {len(given.ready)} of {len(g.layers)} layers "
                "ready"))
            return
        given.pages = {k: np.concatenate([v, np.asarray(e.pages.get(k, ()), dtype=np.int64)])
                       for k, v in given.pages.items()}
        given.chunk_end = e.chunk_end
        given.ready = []
        for r in g.legs:
            if r.state.accepted and not r.state.terminal:
                self._add_leg_chunk(r)

    def _add_leg_chunk(self, r: Leg) -> None:
        """Prefill: plan the leg's next chunk and offer it to the decode (`ChunkAdded`)."""
        g, plan = r.parent, r.plan
        old = plan.pages
        plan.pages = g.given.pages
        plan.pages = self.send_path.suffix_pages(plan)
        delta = {k: v[len(old.get(k, ())):].tolist() for k, v in plan.pages.items()}
        p = self.peers.get(r.peer)
        end = g.given.chunk_end
        try:
            if p is None or p.layout is None:
                raise ConfigError("the decode's Hello is gone")
            plans = span_plans(self.ctx, plan, src_pages=plan.pages, src_ps=plan.page_size,
                               dst_pages=plan.dst_table, dst_ps=plan.dst_page_size,
                               src_layout=self.ctx.layout, dst_layout=p.layout, end=end)
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid chunk: {e}"), notify=Notify.FAILED,
                            kind=FailureKind.INVALID_REQUEST)
            return
        c = plan.add_chunk(end, None, plans)
        r.state.progressed(self.ctx.now)
        self.ctx.send(r.peer, P.ChunkAdded(src=self.ctx.me.address, gen=self.ctx.me.generation,
                                           room=r.room, chunk=c, chunk_end=end,
                                           src_pages=delta, xfer=r.xfer))

    def on_chunk_added(self, r: Leg, msg: P.ChunkAdded) -> None:
        """Decode: plan the chunk, post its receives, answer `ChunkAccepted`."""
        plan = r.plan
        try:
            if not r.state.accepted or msg.chunk != len(plan.chunk_ends):
                raise ConfigError(f"chunk: {msg.chunk} out of order (expected "
                                  f"{len(plan.chunk_ends)})")
            if not plan.chunk_ends[-1] < msg.chunk_end <= plan.seq_len:
                raise ConfigError(f"chunk_end: {msg.chunk_end} not in "
                                  f"{plan.chunk_ends[-1] + 1}..{plan.seq_len}")
            p = self.peers.get(r.peer)
            if p is None or p.layout is None:
                raise ConfigError("ChunkAdded before the prefill's Hello")
            for k, v in msg.src_pages.items():
                if k not in plan.src_table:
                    raise ConfigError(f"src_pages: unknown region {k!r}")
                plan.src_table[k] = np.concatenate([plan.src_table[k], np.asarray(v, np.int64)])
            plans = span_plans(self.ctx, plan, src_pages=plan.src_table,
                               src_ps=p.layout.page_size_tokens, dst_pages=plan.pages,
                               dst_ps=plan.page_size, src_layout=p.layout,
                               dst_layout=self.ctx.layout, end=msg.chunk_end)
        except KVHandoffError as e:
            self.rooms.fail(r, PeerFailedRoom(reason=f"invalid ChunkAdded: {e}"),
                            notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        xfer = self.ctx.next_xfer()
        plan.add_chunk(msg.chunk_end, xfer, plans)
        r.state.progressed(self.ctx.now)
        self.ctx.send(r.peer, P.ChunkAccepted(src=self.ctx.me.address, gen=self.ctx.me.generation,
                                           room=r.room, chunk=msg.chunk, xfer=xfer))
        for layer in r.layers:
            self.receive_path.post_recv_layer(r, Unit(layer, msg.chunk), 0)

    def on_chunk_accepted(self, r: Leg, msg: P.ChunkAccepted) -> None:
        """Prefill: the decode posted the chunk's receives: send its ready layers."""
        c = msg.chunk
        if not r.plan.chunk_accepted(c, msg.xfer):
            return
        latest = c == len(r.plan.chunk_ends) - 1
        self.send_path.post_layers(
            r, [Unit(layer, c) for layer in (r.parent.given.ready if latest else r.layers)], 0)
