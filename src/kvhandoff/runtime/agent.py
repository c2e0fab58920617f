"""`TransferAgent`: one per engine rank; moves the KV of its rooms per layer. A facade.

Layers (docs/ARCHITECTURE.md has the picture):
- `protocol.session.TransferSession`: the protocol, sans-IO: rooms, legs, peers, handshake,
  per-layer flow, checksums, failures, deadlines. Events in, effects out.
- `runtime.loop.ControlLoop`: the one thread that drives the session: ZMQ sockets, wake pipe,
  event queue, timers, peer-call and hasher pools; executes the effects.
- this module: construction, the public API (`sender`, `receiver`, `status`, `close`), page
  table validation, bootstrap registration / lookups, metrics.
- `runtime.handles`: the `Sender` / `Receiver` engines hold; they post events and wait on
  their room's view, never on the session.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np

from kvhandoff.buffers.bufferset import BufferSet
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.kv_layout import (
    LayoutSpec,
    SendFrom,
    layout_hash,
    page_aligned,
    require_page_rules,
)
from kvhandoff.kv_layout.admission import AllocationPolicy, prefix_digest, prompt_digest
from kvhandoff.netaddr import bare_host, join_host_port, split_host_port
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import EffectFilter
from kvhandoff.protocol.handshake import Identity, buffer_descs
from kvhandoff.protocol.session import TransferSession
from kvhandoff.protocol.wire import BufferDesc
from kvhandoff.runtime.eventwait import EventWaiter
from kvhandoff.runtime.handles import ChunkState, Receiver, RoomView, Sender, chunk_table
from kvhandoff.runtime.loop import ControlLoop
from kvhandoff.runtime.seam import Filtered
from kvhandoff.runtime.staging import StagedTransport, stage
from kvhandoff.runtime.tracing import RoomTimelines
from kvhandoff.settings import Settings, listener_auth
from kvhandoff.state_machine import Role
from kvhandoff.transports.base import OneSidedTransport, Transport, load_transport

log = logging.getLogger("kvhandoff.agent")

_ABORT_WAIT_S = 5.0  # bound on abort() waiting for the control thread to end the room


def _prompt_tokens(tokens: Any, seq_len: int | None, name: str) -> np.ndarray | None:
    """Prompt token ids as int64 (None stays None); `ConfigError` naming `name` otherwise."""
    if tokens is None:
        return None
    try:
        arr = np.asarray(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}: expected a sequence of token ids") from None
    if arr.ndim != 1:
        raise ConfigError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if seq_len is not None and len(arr) != seq_len:
        raise ConfigError(f"{name}: {len(arr)} token ids for seq_len={seq_len}")
    if arr.size and arr.min() < 0:
        raise ConfigError(f"{name}: token ids must be >= 0")
    return arr


class TransferAgent:
    """Moves KV pages of rooms between a prefill and a decode engine rank.

    Args:
        role: `Role.PREFILL` or `Role.DECODE` (a string "prefill" / "decode" is parsed here).
        layout: this rank's KV layout; one that breaks its own kernel page-size rules
            (`LayoutSpec.page_rules`) is refused here with a `ConfigError` naming region, rule
            and value (`.without_page_rules()` for a deliberate P != D page experiment).
        buffers: the KV buffers, one per (region, layer): a dict region -> {layer_id: buffer}
            or region -> sequence aligned with the region's layer ids. Buffers are torch tensors
            or numpy arrays holding whole pages (``pages x page_nbytes`` bytes, contiguous).
        settings: process settings (transport, heartbeat, checksums ...).
        transport: an already built transport (tests); by default `settings.transport`.
        effect_filter: sees every effect of the session before it is executed (tests drop or
            delay messages with `kvhandoff.testing.faults`); None in production.
        engine_id, dp_rank, tp_rank, tp_size: identity registered with the bootstrap server.
    """

    def __init__(
        self,
        role: Role | str,
        layout: LayoutSpec,
        buffers: Mapping[str, Any],
        settings: Settings | None = None,
        *,
        transport: Transport | None = None,
        effect_filter: EffectFilter | None = None,
        engine_id: str = "default",
        dp_rank: int = 0,
        dp_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        try:
            self.role = role if isinstance(role, Role) else Role(role)
        except ValueError:
            raise ConfigError(f"role: expected 'prefill' or 'decode', got {role!r}") from None
        require_page_rules(layout)  # kernel page-size rules are hard: refuse to start
        self.layout = layout
        self.layout_hash = layout_hash(layout)
        self.settings = settings or Settings()
        # before anything binds: no secret on a non-loopback address is a refusal
        self.auth = listener_auth(self.settings, what=f"{self.role.value} agent",
                                  host_setting="agent_host", secret_setting="hmac_secret")
        self.engine_id = engine_id
        self.dp_rank, self.dp_size, self.tp_rank, self.tp_size = dp_rank, dp_size, tp_rank, tp_size
        self.generation = secrets.randbits(62) | 1
        self.agent_id = f"{self.role.value}-{secrets.token_hex(4)}"
        self.buffers = BufferSet(layout, buffers)
        self._layers = frozenset(lid for r in layout.regions for lid in r.layer_ids)
        self._open: dict[int, RoomView] = {}  # engine threads only: rooms by id
        self._open_lock = threading.Lock()
        self._closed = False
        self.transport = transport or load_transport(self.settings.transport, self.settings)
        # device buffers on a transport that cannot reach device memory: host staging (or a
        # refusal naming host_staging); the transport is closed on a refusal
        self.transport = stage(self.transport, self.settings, self.buffers, log.warning)
        if self.settings.require_rdma and self.transport.status().degraded:
            st = self.transport.status()
            self.transport.close()
            raise ConfigError(f"require_rdma is set but the {st.kind} transport is degraded: "
                              f"{st.reason}")
        views = dict(self.buffers.views())
        try:
            for name, arr in views.items():
                self.transport.register(name, arr)
            descs = self._buffer_descs(views)  # a decode's describe() may refuse a buffer
        except BaseException:  # e.g. CUDA buffers on a host-only transport: no leaked thread
            self.transport.close()
            raise
        self._registration: Any = None
        self._route_lookups: Any = None
        self._metrics_server: Any = None
        self.metrics_address: str | None = None
        try:
            self._start(layout, views, descs, effect_filter)
        except BaseException:  # e.g. a control host not of this host: nothing left running
            self._release()
            raise

    def _start(self, layout: LayoutSpec, views: dict[str, Any], descs: tuple[BufferDesc, ...],
               effect_filter: EffectFilter | None) -> None:
        """The rest of the constructor: the control loop and its session, registration with
        the bootstrap server, the metrics endpoint."""
        self._timelines = RoomTimelines(role=self.role, agent_id=self.agent_id,
                                        transport=self.transport.kind.value)
        self._loop = ControlLoop(transport=self.transport, buffers=views,
                                 settings=self.settings, timelines=self._timelines)
        self.address = self._loop.address
        # device events of marked layers are waited for here, not on the engine thread
        self._events = EventWaiter(self._loop.post, closed=lambda: self._closed,
                                   name=f"kvh-ev-{self.agent_id}")
        secret = self.settings.hmac_secret
        self._session = TransferSession(identity=Identity(
            address=self.address, generation=self.generation, agent_id=self.agent_id,
            role=self.role, transport_kind=self.transport.kind,
            transport_address=self.transport.address, layout=layout,
            layout_hash=self.layout_hash, buffers=descs,
            writes=self._writes(),
            hmac_secret=secret.get_secret_value().encode() if secret else None),
            settings=self.settings, now=time.monotonic())
        # a test's filter stands in front of the session (runtime.seam), not in the loop
        self._loop.start(self._session, self.agent_id, step=None if effect_filter is None
                         else Filtered(self._session, effect_filter))
        if self.role is Role.PREFILL and self.settings.bootstrap_url:
            from kvhandoff.runtime.registration import Registration

            self._registration = Registration(self)
        if self.role is Role.DECODE:  # its lookup thread and client ready before a room needs
            self._lookups().warm()  # them (they took ~2 s of a first room on a loaded host)
        st = self.transport.status()
        log.info("agent %s (%s) on %s, transport %s", self.agent_id, self.role.value,
                 self.address, st)
        if st.degraded:
            log.warning("agent %s: transport %s is DEGRADED: %s", self.agent_id, st.kind,
                        st.reason)
        if self.settings.agent_metrics_port is not None:
            from prometheus_client import start_http_server

            from kvhandoff.runtime.metrics import registry_for

            server, _ = start_http_server(self.settings.agent_metrics_port,
                                          addr=bare_host(self.settings.agent_host),
                                          registry=registry_for(self))
            self._metrics_server = server
            self.metrics_address = join_host_port(self.settings.agent_host,
                                                  server.server_port)

    # ------------------------------------------------------------------ public API

    def sender(
        self,
        room: int,
        *,
        pages: np.ndarray | list[int] | Mapping[str, np.ndarray | list[int]],
        seq_len: int,
        on_release: Callable[[int], None] | None = None,
        num_decode_ranks: int | None = 1,
        chunk_end: int | None = None,
        prompt_tokens: Any = None,
        request_id: str | None = None,
    ) -> Sender:
        """Opens the prefill side of `room`: `pages` is the page table of the sequence (token 0
        on; or a dict per region), `seq_len` its length in tokens. `num_decode_ranks` decode
        ranks will read this room from this rank (decode TP > prefill TP: several; 0: none; None:
        the readers say, the first decode rank's count stands and the others must agree).
        Chunked prefill: `chunk_end` < `seq_len` opens the room with the first chunk, `pages`
        covering (at most) its `chunk_end` tokens; `Sender.add_chunk` gives the next ones.
        `prompt_tokens` (the `seq_len` prompt token ids, optional): when the decode gives its
        prompt too, a difference fails the room naming the first differing page.
        `request_id`: the engine's id of the request (the room's trace attribute)."""
        self._need(Role.PREFILL, "sender")
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        if num_decode_ranks is not None and num_decode_ranks < 0:
            raise ConfigError(f"num_decode_ranks: expected >= 0, got {num_decode_ranks}")
        if chunk_end is None:
            table = self._page_table(pages, seq_len, 0, side="pages")
        else:
            table = chunk_table(self.layout, self.buffers.num_pages, pages, seq_len=seq_len,
                                chunk_end=chunk_end, have={})
        tokens = _prompt_tokens(prompt_tokens, seq_len, "prompt_tokens")
        v = self._new_view(room, on_release)
        if chunk_end is not None and chunk_end < seq_len:
            v.chunk = ChunkState(seq_len, chunk_end, {k: len(a) for k, a in table.items()})
        self._timelines.engine_opened(v, request_id)
        self._loop.post(ev.OpenSender(room, v, table, seq_len, num_decode_ranks,
                                      chunk_end=chunk_end or 0, prompt_tokens=tokens))
        return Sender(self, v)

    def receiver(
        self,
        room: int,
        bootstrap_addr: str | None = None,
        *,
        peer: str | list[str] | None = None,
        on_release: Callable[[int], None] | None = None,
        request_id: str | None = None,
        readers: int = 0,
    ) -> Receiver:
        """Opens the decode side of `room`. The prefill rank(s) are found through the bootstrap
        server at `bootstrap_addr` (host:port or URL), or given directly as agent `peer`
        address(es) (several when this rank gathers heads from several prefill ranks).
        `request_id`: the engine's id of the request (the room's trace attribute).
        `readers`: how many decode ranks read each prefill rank this rank reads (told to the
        prefill, which needs it when it opened the room without a count; 0: not said)."""
        self._need(Role.DECODE, "receiver")
        if readers < 0:
            raise ConfigError(f"readers: expected >= 0, got {readers}")
        if peer is None and bootstrap_addr is None:
            raise ConfigError("receiver: give bootstrap_addr (the prefill's bootstrap server) "
                              "or peer (the prefill agent's control address)")
        peers = [] if peer is None else [peer] if isinstance(peer, str) else list(peer)
        for a in peers:  # before the room is open: a refused call leaves nothing behind
            try:
                split_host_port(a)
            except (TypeError, AttributeError, ValueError) as e:
                raise ConfigError(f"peer: expected an agent address host:port ([v6]:port "
                                  f"for IPv6), {e}") from None
        v = self._new_view(room, on_release)
        self._timelines.engine_opened(v, request_id)
        if peer is not None:
            self._loop.post(ev.OpenReceiver(room, v, tuple((a, 0) for a in peers), readers))
        else:
            assert bootstrap_addr is not None
            self._loop.post(ev.OpenReceiver(room, v, None, readers))
            self._lookups().submit(room, bootstrap_addr, functools.partial(self._resolved, v))
        return Receiver(self, v)

    def wait_registered(self, timeout_s: float) -> bool | None:
        """Whether the bootstrap server holds this prefill's registration, waiting up to
        `timeout_s` for it; None when this agent does not register (a decode, or no
        ``bootstrap_url``)."""
        reg = self._registration
        if reg is None:
            return None
        ok: bool = reg.registered.wait(timeout_s)
        return ok

    def status(self) -> dict[str, Any]:
        """What this agent is and how it fares (for /ready, metrics and the CLI)."""
        st = self.transport.status()
        s = self._loop.query(TransferSession.status)
        s["counters"].update(self._loop.counters)
        s["counters"].update(st.counters)
        return {
            "agent_id": self.agent_id, "role": self.role.value, "address": self.address,
            "generation": self.generation, "layout_hash": self.layout_hash,
            "auth": self.auth.value,
            # "host": device pages move through pinned host buffers (runtime.staging)
            "staging": self.status_staging(),
            "transport": {"kind": st.kind, "lanes": list(st.lanes), "degraded": st.degraded,
                          "reason": st.reason, "bytes_sent": st.bytes_sent,
                          "bytes_received": st.bytes_received, "counters": st.counters},
            **s,
        }

    def status_staging(self) -> str:
        """"host" when this agent's device pages move through host staging
        (`runtime.staging`), else "none"."""
        return "host" if isinstance(self.transport, StagedTransport) else "none"

    def close(self) -> None:
        """Fails open rooms, stops the threads, closes sockets and the transport. Idempotent."""
        with self._open_lock:
            if self._closed:
                return
            self._closed = True
            views = [v for v in self._open.values() if not v.done]
        for v in views:
            self._loop.post(ev.AbortRoom(v.room, v, "agent closed"))
        self._release()

    def _release(self) -> None:
        """Stops what the agent runs, in reverse order of start: also for a constructor that
        failed part way (what it did not start yet is not there)."""
        if self._registration is not None:
            self._registration.close()
        if self._route_lookups is not None:
            self._route_lookups.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.close()
        self.transport.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TransferAgent({self.role.value}, {self.agent_id}, {self.address}, "
                f"transport={self.transport.kind})")

    # ------------------------------------------------------------------ engine side
    # `layer_ready`, `init_receiver`, `abort_room` and `room_stats` are the `handles.RoomOps`
    # the handles call (by room view); engines call them through their Sender / Receiver.

    def _need(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise ConfigError(f"{what}(): only a {role.value} agent opens {what}s; this agent is "
                              f"{self.role.value}")
        if self._closed:
            raise KVHandoffError("agent is closed")

    def _new_view(self, room: int, on_release: Callable[[int], None] | None) -> RoomView:
        if not 0 <= room < 1 << 64:
            raise ConfigError(f"room: expected an unsigned 64-bit id, got {room}")
        v = RoomView(room, tuple(sorted(self._layers)), on_release)
        with self._open_lock:
            old = self._open.get(room)
        if old is not None and old.done and not old.released and self._loop.running_elsewhere():
            # its release usually follows the end at once (cancels confirmed, the peer's
            # AbortAck): wait for it, bounded, rather than refuse
            prev = old
            prev.wait_until(lambda: prev.released, self.settings.heartbeat_interval_s)
        with self._open_lock:
            old = self._open.get(room)
            if old is not None and not old.done:
                raise ConfigError(f"room {room}: already open on this agent")
            if old is not None and not old.released:
                raise ConfigError(
                    f"room {room}: its previous use ended ({old.state.name}) but its pages are "
                    "not released yet (a one-sided writer may still write into them); open "
                    "the id again once that handle's `released` is true (`wait_released()`)")
            self._open[room] = v
            if len(self._open) > self._open_high:  # forget released rooms' views
                self._open = {k: o for k, o in self._open.items() if not o.released}
                self._open_high = max(256, 2 * len(self._open))
        return v

    _open_high = 256

    def _page_table(self, pages: Any, seq_len: int, prefix: int, *, side: str,
                    starts: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """Per region, the pages that take part, validated against the buffers. `starts`:
        per region, a later token it starts at (`Receiver.init`'s ``region_starts``)."""
        ps = self.layout.page_size_tokens
        out: dict[str, np.ndarray] = {}
        for reg in self.layout.regions:
            start_tok = page_aligned(prefix, ps) if reg.send_from is SendFrom.DECODE_PREFIX else 0
            if starts and reg.name in starts:
                start_tok = max(start_tok, page_aligned(starts[reg.name], ps))
            need = -(-seq_len // ps) - start_tok // ps
            if isinstance(pages, Mapping):
                if reg.name not in pages:
                    raise ConfigError(f"{side}: no pages for region {reg.name!r}")
                arr = np.asarray(pages[reg.name], dtype=np.int64)
                if len(arr) == need + start_tok // ps:  # a full table: cut the suffix
                    arr = arr[start_tok // ps:]
            else:
                arr = np.asarray(pages, dtype=np.int64)[start_tok // ps:]
            if arr.ndim != 1 or len(arr) < need:
                raise ConfigError(f"{side}[{reg.name}]: {seq_len} tokens from token {start_tok} "
                                  f"need {need} pages of {ps}, got {len(arr)}")
            arr = arr[:need]
            cap = self.buffers.num_pages(reg.name)
            if need and (arr.min() < 0 or arr.max() >= cap):
                raise ConfigError(f"{side}[{reg.name}]: page ids must be in [0, {cap}), got "
                                  f"[{arr.min()}, {arr.max()}]")
            if len(np.unique(arr)) != len(arr):
                raise ConfigError(f"{side}[{reg.name}]: a page id appears twice")
            out[reg.name] = arr
        return out

    def _region_starts(self, starts: Mapping[str, int] | None, seq_len: int, prefix: int
                       ) -> dict[str, int]:
        """`Receiver.init`'s ``region_starts`` validated and page-aligned down; regions whose
        start is not past the page-aligned prefix are left out (they start there anyway)."""
        ps = self.layout.page_size_tokens
        names = {reg.name for reg in self.layout.regions}
        out: dict[str, int] = {}
        for name, tok in (starts or {}).items():
            if name not in names:
                raise ConfigError(f"region_starts[{name!r}]: not a region of the layout "
                                  f"({sorted(names)})")
            if not 0 <= int(tok) <= seq_len:
                raise ConfigError(f"region_starts[{name!r}]: expected 0..{seq_len}, got {tok}")
            start = page_aligned(int(tok), ps)
            if start > page_aligned(prefix, ps):
                out[name] = start
        return out

    def _writes(self) -> bool:
        return self.settings.one_sided_writes and isinstance(self.transport, OneSidedTransport)

    def _buffer_descs(self, views: dict[str, Any]) -> tuple[BufferDesc, ...]:
        """The buffers this agent announces in its Hello; a decode whose transport can take
        one-sided writes (and `one_sided_writes` is on) adds each buffer's descriptor."""
        descs = buffer_descs(self.buffers.extents())
        tr = self.transport
        if not (self.role is Role.DECODE and self._writes() and isinstance(tr, OneSidedTransport)):
            return tuple(descs)
        out = []
        for d in descs:
            name = BufferSet.name(d.region, d.layer)
            blob = tr.describe(name) if name in views else b""
            out.append(msgspec.structs.replace(d, descriptor=blob))
        return tuple(out)

    def layer_ready(self, v: RoomView, layer: int, event: Any = None) -> None:
        """Marks `layer` ready; with a device `event` the layer is sent once the event
        completed (the event waiter polls it; this never blocks). A room's marks keep
        their order."""
        if layer not in self._layers:
            raise ConfigError(f"layer_ready({layer}): not a layer of the layout")
        self._events.submit(v, event, ev.LayerReady(v.room, v, layer), layer=layer)

    def layers_ready(self, v: RoomView, layers: tuple[int, ...], event: Any = None) -> None:
        """Marks `layers` ready at once, in that order (`Sender.layers_ready`): one post, fed
        to the session as one `events.Batch` (its writes leave together and its layers are
        announced in one `LayerDone`), instead of one post per layer that the control loop
        may start on before the engine marked the last one."""
        bad = [lid for lid in layers if lid not in self._layers]
        if bad:
            raise ConfigError(f"layers_ready: {bad[:8]} not layers of the layout")
        if not layers:
            return
        marks = tuple(ev.LayerReady(v.room, v, lid) for lid in layers)
        self._events.submit(v, event, marks[0] if len(marks) == 1 else ev.Batch(marks),
                            layer=layers[0])

    def init_receiver(self, v: RoomView, dst_pages: Any, seq_len: int, prefix: int, *,
                      prompt_tokens: Any = None, prefix_tokens: Any = None,
                      free_pages: int | None = None,
                      region_starts: Mapping[str, int] | None = None) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        if not 0 <= prefix <= seq_len:
            raise ConfigError(f"decode_prefix_len: expected 0..{seq_len}, got {prefix}")
        ps = self.layout.page_size_tokens
        starts = self._region_starts(region_starts, seq_len, prefix)
        table = self._page_table(dst_pages, seq_len, prefix, side="dst_pages", starts=starts)
        if self.settings.allocation_policy is AllocationPolicy.PREFILL_COMPLETE:
            if free_pages is None or free_pages < 0:
                raise ConfigError(f"free_pages: required (>= 0) under allocation_policy="
                                  f"prefill_complete, got {free_pages!r}")
        tokens = _prompt_tokens(prompt_tokens, seq_len, "prompt_tokens")
        prompt = cached = None
        if tokens is not None:  # hashed here, on the engine thread, not the control thread
            prompt = prompt_digest(tokens, ps)
            held = page_aligned(prefix, ps)
            if held:
                src = tokens if prefix_tokens is None else _prompt_tokens(
                    prefix_tokens, None, "prefix_tokens")
                if src is None or len(src) < held:
                    raise ConfigError(f"prefix_tokens: expected >= {held} token ids (the "
                                      f"page-aligned decode_prefix_len), got "
                                      f"{0 if src is None else len(src)}")
                cached = prefix_digest(src, held, ps)
        elif prefix_tokens is not None:
            raise ConfigError("prefix_tokens: given without prompt_tokens")
        with self._open_lock:
            if v.inited:
                raise ConfigError(f"room {v.room}: init() called twice")
            v.inited = True
        self._loop.post(ev.ReceiverInit(v.room, v, table, seq_len, page_aligned(prefix, ps),
                                        starts=starts or None,
                                        prompt=prompt, cached_prefix=cached,
                                        free_pages=free_pages))

    def add_chunk(self, v: RoomView, pages: Any, *, seq_len: int, chunk_end: int,
                  have: dict[str, int]) -> dict[str, np.ndarray]:
        """The next chunk's page table (validated), sent behind this room's layers still
        waiting for their device events."""
        table = chunk_table(self.layout, self.buffers.num_pages, pages, seq_len=seq_len,
                            chunk_end=chunk_end, have=have)
        self._events.submit(v, None, ev.AddChunk(v.room, v, table, chunk_end))
        return table

    def abort_room(self, v: RoomView, reason: str) -> None:
        """Aborts the room and returns once it is terminal (as the engine expects: `poll()`
        says Failed; the room id may be opened again once it is also released), bounded; from
        the control thread itself (an `on_release` callback) it only posts."""
        if v.done:
            return
        self._loop.post_ahead(ev.AbortRoom(v.room, v, reason))  # not behind a backlog
        if self._loop.running_elsewhere():
            v.wait_until(lambda: v.done, _ABORT_WAIT_S)

    def hold_rooms(self, peer: str, rooms: Any, hold_s: float | None = None) -> None:
        """Decode: the engine has the requests of `rooms` queued and will read them from the
        prefill agent at `peer`: this agent asks it, at every heartbeat while the handshake
        with it stands, to keep those rooms waiting `hold_s` (default: 4 heartbeats) past
        their bootstrap bound. Replaces the rooms held with `peer` (empty: none); a room this
        agent opens a receiver for stops being held. A hold not renewed (this agent stopped
        holding or died) lapses on the prefill, which then fails the room and counts it
        (``holds_expired``)."""
        hs = 4 * self.settings.heartbeat_interval_s if hold_s is None else float(hold_s)
        self._loop.post(ev.HoldRooms(str(peer), tuple(int(r) for r in rooms), hs))

    def room_timings(self, room: int) -> dict[str, Any] | None:
        """When `room` did what on this side, in ms (`runtime.tracing.RoomTimeline.timings`:
        the figures its trace spans have); None for a room this agent does not know (or
        forgot: it keeps the last `tracing.KEEP`)."""
        timings: dict[str, Any] | None = self._loop.query(
            lambda _s: self._timelines.timings(room))
        return timings

    def room_stats(self, v: RoomView) -> dict[str, Any]:
        stats: dict[str, Any] | None = self._loop.query(lambda s: s.room_stats(v.room, v))
        if stats is None:  # forgotten after its retention: what the view still knows
            f = v.failure
            stats = {"room": v.room, "state": v.state.name, "failure": f and f.reason,
                     "failure_kind": f and f.kind.value}
        stats["t_seen"] = v.t_seen
        return stats

    def _lookups(self) -> Any:
        """The decode's route lookups (one thread for all its rooms), made on first use."""
        with self._open_lock:
            if self._route_lookups is None:
                from kvhandoff.runtime.registration import RouteLookups

                self._route_lookups = RouteLookups(self)
            return self._route_lookups

    def _resolved(self, v: RoomView, sources: tuple[tuple[str, int], ...],
                  error: str | None) -> None:
        """(route-lookup thread) The bootstrap server named the room's prefill ranks."""
        self._loop.post(ev.PeersResolved(v.room, v, sources, error=error))
