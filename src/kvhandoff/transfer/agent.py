"""`TransferAgent`: one per engine rank; moves the KV of its rooms per layer.

How it works:
- State: rooms (`rooms._Group`, one per room) made of legs (`rooms._Room`, one per peer),
  peers (`_Peer`), guarded by one lock (`self._lock`). Engine
  threads, the control thread and transport callbacks all take it briefly; nothing blocking
  happens under it except posting non-blocking transport ops.
- Control thread: owns every ZMQ socket (a ROUTER bound on the control address; one DEALER per
  peer). Other threads put outgoing messages in `self._outbox` and wake it through a pipe. It
  also runs the timers: heartbeats, peer liveness (2 missed heartbeats = dead) and the rooms'
  deadlines (fed to their `RoomMachine` as `DeadlineExpired`).
- Data moves on the transport (ucx / tcp / inproc). Both sides compute the same span plan from
  (layout, source pages, destination pages) with `kv_layout.build_spans`; the receiver posts
  its receives for every layer as soon as the transfer is accepted, the sender posts a layer's
  sends as soon as `layer_ready` is called, and reports `LayerDone` with checksums once they
  complete (layers completing together share one message).
- Failure always reaches the peer as a message (`Failed` / `Abort`) with its reason; a dead peer
  is detected by heartbeats. Pages are released only when a room is terminal and none of its
  transport ops is still in flight.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvhandoff.errors import ConfigError, Failure, FailureKind, KVHandoffError, ProtocolError
from kvhandoff.kv_layout import (
    LayoutSpec,
    SendFrom,
    build_spans,
    layout_diff,
    layout_hash,
    page_aligned,
)
from kvhandoff.settings import Settings
from kvhandoff.state_machine import (
    Aborted,
    AllLayersAcked,
    AllLayersLanded,
    ChecksumMismatch,
    DeadlineConfig,
    DeadlineExpired,
    FailureEvent,
    KVPoll,
    LayerLanded,
    LayerSent,
    LayoutMismatch,
    LeaseRenewed,
    PeerLost,
    PeerMatched,
    RemoteFailed,
    Role,
    RoomMachine,
    TransferAccepted,
)
from kvhandoff.transfer import protocol as P
from kvhandoff.transfer.buffers import BufferSet
from kvhandoff.transfer.checksum import span_checksum, wants_checksum
from kvhandoff.transfer.effects import Delayed, EffectFilter, Notify, Send
from kvhandoff.transfer.failures import failure_of, remote_failure
from kvhandoff.transfer.rooms import Receiver, Sender, _Group, _Room
from kvhandoff.transfer.transports.base import Transport, load_transport

log = logging.getLogger("kvhandoff.agent")

_EARLY_LIMIT = 4096  # messages kept for rooms the engine has not opened yet
_FORGOTTEN_KEEP_S = 60.0  # how long a lost peer is remembered, to tell it so if it talks on
_NO_HANDSHAKE = "no handshake"


@dataclass(eq=False)
class _Peer:
    addr: str
    gen: int = 0
    agent_id: str = ""
    matched: bool = False
    hello_sent: bool = False
    rejected: Failure | None = None
    authenticated: bool = False  # its Hello verified (or no shared secret is configured)
    layout: LayoutSpec | None = None
    last_seen: float = 0.0
    waiting: list[_Room] = field(default_factory=list)  # rooms waiting for the handshake


def _layout_compat_diff(mine: LayoutSpec, theirs: LayoutSpec, names: tuple[str, str]) -> list[str]:
    """Differences that make a handoff impossible. Page sizes may differ (the span builder pairs
    pages token by token) and TP ranks hold different heads of head-sharded regions (planes pair
    by head name), so both are compared in their TP-invariant form with equal page sizes."""
    return layout_diff(mine.with_page_size(1).tp_invariant(),
                       theirs.with_page_size(1).tp_invariant(), names)


class TransferAgent:
    """Moves KV pages of rooms between a prefill and a decode engine rank.

    Args:
        role: `Role.PREFILL` or `Role.DECODE` (or "prefill" / "decode").
        layout: this rank's KV layout.
        buffers: the KV buffers, one per (region, layer): a dict region -> {layer_id: buffer}
            or region -> sequence aligned with the region's layer ids. Buffers are torch tensors
            or numpy arrays holding whole pages (``pages x page_nbytes`` bytes, contiguous).
        settings: process settings (transport, heartbeat, checksums ...).
        transport: an already built transport (tests); by default `settings.transport`.
        effect_filter: sees every control message before it leaves (tests drop or delay
            messages with `kvhandoff.testing.faults`); None in production.
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
        self.role = role if isinstance(role, Role) else Role(role)
        self.layout = layout
        self.layout_hash = layout_hash(layout)
        self.settings = settings or Settings()
        self.engine_id = engine_id
        self.dp_rank, self.dp_size, self.tp_rank, self.tp_size = dp_rank, dp_size, tp_rank, tp_size
        self.generation = secrets.randbits(62) | 1
        self.agent_id = f"{self.role.value}-{secrets.token_hex(4)}"
        self.buffers = BufferSet(layout, buffers)
        self._region_index = {r.name: i for i, r in enumerate(layout.regions)}
        self._layer_order = {lid: i for i, lid in enumerate(sorted(
            {lid for r in layout.regions for lid in r.layer_ids}))}
        self._lock = threading.RLock()
        # checksums run here, off the lock: the engine and control threads never wait on xxh3
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvh-hash")
        self._groups: dict[int, _Group] = {}
        self._legs: dict[tuple[int, str], _Room] = {}
        self._peers: dict[str, _Peer] = {}
        self._early: dict[int, list[Any]] = {}  # room -> messages before the engine opened it
        self._early_t: dict[int, float] = {}
        self._forgotten: dict[str, float] = {}  # peers declared lost -> when
        self._forgotten_told: dict[str, float] = {}
        self._xfer = itertools.count(1)
        self._outbox: deque[tuple[str, P.Message]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._pending_done: dict[tuple[int, str], list[P.LayerInfo]] = {}
        self._counters: dict[str, int] = {
            "messages_in": 0, "messages_out": 0, "rejected_messages": 0, "stale_messages": 0,
            "retransmits": 0, "checksum_failures": 0, "checksums_verified": 0, "bytes_sent": 0,
            "bytes_received": 0, "rooms_success": 0, "rooms_failed": 0, "peers_lost": 0,
        }
        self._effect_filter = effect_filter
        self._closed = False
        self._routes: Any = None  # bootstrap client, created lazily

        self.transport = transport or load_transport(self.settings.transport, self.settings)
        if self.settings.require_rdma and self.transport.status().degraded:
            st = self.transport.status()
            self.transport.close()
            raise ConfigError(f"require_rdma is set but the {st.kind} transport is degraded: "
                              f"{st.reason}")
        for name, arr in self.buffers.views():
            self.transport.register(name, arr)

        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes + 64)
        self._router.setsockopt(zmq.RCVHWM, 0)
        port = self.settings.agent_port
        host = self.settings.agent_host
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._next_heartbeat = 0.0
        self._drained_at = time.monotonic()  # when the control socket was last read empty
        self._thread = threading.Thread(target=self._run, name=f"kvh-{self.agent_id}",
                                        daemon=True)
        self._thread.start()
        self._registration: Any = None
        if self.role is Role.PREFILL and self.settings.bootstrap_url:
            from kvhandoff.transfer.registration import Registration

            self._registration = Registration(self)
        st = self.transport.status()
        log.info("agent %s (%s) on %s, transport %s", self.agent_id, self.role.value,
                 self.address, st)
        if st.degraded:
            log.warning("agent %s: transport %s is DEGRADED: %s", self.agent_id, st.kind,
                        st.reason)
        self.metrics_address: str | None = None
        self._metrics_server: Any = None
        if self.settings.agent_metrics_port is not None:
            from prometheus_client import start_http_server

            from kvhandoff.transfer.metrics import registry_for

            server, _ = start_http_server(self.settings.agent_metrics_port,
                                          addr=self.settings.agent_host,
                                          registry=registry_for(self))
            self._metrics_server = server
            self.metrics_address = f"{self.settings.agent_host}:{server.server_port}"

    # ------------------------------------------------------------------ public API

    def sender(
        self,
        room: int,
        *,
        pages: np.ndarray | list[int] | Mapping[str, np.ndarray | list[int]],
        seq_len: int,
        on_release: Callable[[int], None] | None = None,
        num_decode_ranks: int = 1,
    ) -> Sender:
        """Opens the prefill side of `room`: `pages` is the page table of the sequence (token 0
        on; or a dict per region), `seq_len` its length in tokens. `num_decode_ranks` decode
        ranks will read this room from this rank (decode TP > prefill TP: several; 0: none)."""
        self._need(Role.PREFILL, "sender")
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        if num_decode_ranks < 0:
            raise ConfigError(f"num_decode_ranks: expected >= 0, got {num_decode_ranks}")
        table = self._page_table(pages, seq_len, 0, side="pages")
        g = self._new_group(room, on_release, expected=num_decode_ranks)
        with self._lock:
            g.seq_len = seq_len
            g.pages = table
            self._early_t.pop(room, None)
            for msg in self._early.pop(room, []):
                self._room_msg(msg)
            self._group_update(g)
        self._wake()
        return Sender(self, g)

    def receiver(
        self,
        room: int,
        bootstrap_addr: str | None = None,
        *,
        peer: str | list[str] | None = None,
        on_release: Callable[[int], None] | None = None,
    ) -> Receiver:
        """Opens the decode side of `room`. The prefill rank(s) are found through the bootstrap
        server at `bootstrap_addr` (host:port or URL), or given directly as agent `peer`
        address(es) (several when this rank gathers heads from several prefill ranks)."""
        self._need(Role.DECODE, "receiver")
        if peer is None and bootstrap_addr is None:
            raise ConfigError("receiver: give bootstrap_addr (the prefill's bootstrap server) "
                              "or peer (the prefill agent's control address)")
        g = self._new_group(room, on_release, expected=None)
        if peer is not None:
            peers = [peer] if isinstance(peer, str) else list(peer)
            self._call(lambda: self._attach_peers(g, [(a, 0) for a in peers]))
        else:
            assert bootstrap_addr is not None
            threading.Thread(target=self._resolve, args=(g, bootstrap_addr), daemon=True,
                             name=f"kvh-route-{room}").start()
        return Receiver(self, g)

    def status(self) -> dict[str, Any]:
        """What this agent is and how it fares (for /ready, metrics and the CLI)."""
        st = self.transport.status()
        with self._lock:
            states: dict[str, int] = {}
            for g in self._groups.values():
                states[g.state.name] = states.get(g.state.name, 0) + 1
            counters = dict(self._counters)
            peers = [{"addr": p.addr, "matched": p.matched,
                      "rejected": p.rejected.reason if p.rejected else None}
                     for p in self._peers.values()]
        return {
            "agent_id": self.agent_id, "role": self.role.value, "address": self.address,
            "generation": self.generation, "layout_hash": self.layout_hash,
            "transport": {"kind": st.kind, "lanes": list(st.lanes), "degraded": st.degraded,
                          "reason": st.reason, "bytes_sent": st.bytes_sent,
                          "bytes_received": st.bytes_received},
            "rooms": states, "peers": peers, "counters": counters,
        }

    def close(self) -> None:
        """Fails open rooms, stops the threads, closes sockets and the transport. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            groups = [g for g in self._groups.values() if not g.done.is_set()]
        for g in groups:
            self._abort(g, "agent closed")
        if self._registration is not None:
            self._registration.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self._wake()
        self._thread.join(timeout=5)
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self.transport.close()
        for s in self._dealers.values():
            s.close(0)
        self._router.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TransferAgent({self.role.value}, {self.agent_id}, {self.address}, "
                f"transport={self.transport.kind})")

    # ------------------------------------------------------------------ rooms

    def _need(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise ConfigError(f"{what}(): only a {role.value} agent opens {what}s; this agent is "
                              f"{self.role.value}")
        if self._closed:
            raise KVHandoffError("agent is closed")

    def _new_group(self, room: int, on_release: Callable[[int], None] | None,
                   expected: int | None) -> _Group:
        if not 0 <= room < 1 << 64:
            raise ConfigError(f"room: expected an unsigned 64-bit id, got {room}")
        layers = tuple(sorted(self._layer_order))
        g = _Group(room=room, role=self.role, layers=layers, expected=expected,
                   on_release=on_release, t_created=time.monotonic())
        g.layer_events = {lid: threading.Event() for lid in layers}
        with self._lock:
            old = self._groups.get(room)
            if old is not None and not old.done.is_set():
                raise ConfigError(f"room {room}: already open on this agent")
            if old is not None:
                for leg in old.legs:
                    self._legs.pop((room, leg.peer or ""), None)
            self._groups[room] = g
        return g

    def _new_leg(self, g: _Group, peer: str) -> _Room:
        """(lock held) A leg of `g` with `peer`."""
        s = self.settings
        now = time.monotonic()
        deadlines = DeadlineConfig(
            bootstrap_s=s.bootstrap_timeout_s, waiting_for_input_s=s.waiting_timeout_s,
            transfer_stall_s=s.stall_timeout_s, lease_s=s.lease_s)
        r = _Room(room=g.room, role=self.role,
                  machine=RoomMachine(self.role, now=now, deadlines=deadlines, layers=g.layers),
                  layers=g.layers, group=g, peer=peer)
        g.legs.append(r)
        self._legs[(g.room, peer)] = r
        return r

    def _page_table(self, pages: Any, seq_len: int, prefix: int, *, side: str
                    ) -> dict[str, np.ndarray]:
        """Per region, the pages that take part, validated against the buffers."""
        ps = self.layout.page_size_tokens
        out: dict[str, np.ndarray] = {}
        for reg in self.layout.regions:
            start_tok = page_aligned(prefix, ps) if reg.send_from is SendFrom.DECODE_PREFIX else 0
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

    def _layer_ready(self, g: _Group, layer: int) -> None:
        if layer not in g.layer_events:
            raise ConfigError(f"layer_ready({layer}): not a layer of the layout")
        with self._lock:
            if layer in g.ready:
                return
            g.ready.append(layer)
            g.t_last_ready = time.monotonic()
            for r in g.legs:
                if r.accepted and not r.machine.is_terminal:
                    self._post_layer(r, layer, 0)
        self._wake()

    def _receiver_init(self, g: _Group, dst_pages: Any, seq_len: int, prefix: int) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        if not 0 <= prefix <= seq_len:
            raise ConfigError(f"decode_prefix_len: expected 0..{seq_len}, got {prefix}")
        table = self._page_table(dst_pages, seq_len, prefix, side="dst_pages")
        with self._lock:
            if g.pages is not None:
                raise ConfigError(f"room {g.room}: init() called twice")
            g.seq_len = seq_len
            g.pages = (table, page_aligned(prefix, self.layout.page_size_tokens))
            for r in g.legs:
                self._init_leg(r)
        self._wake()

    def _init_leg(self, r: _Room) -> None:
        """(lock held) Decode: give a leg the engine's pages once both exist; maybe request."""
        g = r.group
        assert g is not None
        if g.pages is None or r.inited:
            return
        table, prefix = g.pages
        r.seq_len, r.prefix_len, r.pages = g.seq_len, prefix, table
        r.page_size = self.layout.page_size_tokens
        r.inited = True
        self._maybe_request(r)

    def _abort(self, g: _Group, reason: str) -> None:
        with self._lock:
            if g.legs:
                for r in g.legs:
                    self._fail(r, Aborted(reason=reason, by=self.role), notify=Notify.ABORT)
            self._fail_group(g, Failure(FailureKind.ABORTED,
                                        f"aborted by {self.role.value}: {reason}"))
        self._wake()

    # ------------------------------------------------------------------ peers and handshake

    def _resolve(self, g: _Group, bootstrap_addr: str) -> None:
        try:
            from kvhandoff.transfer.registration import lookup_prefill

            sources = lookup_prefill(self, g.room, bootstrap_addr)
        except KVHandoffError as e:
            with self._lock:
                self._fail_group(g, Failure(FailureKind.BOOTSTRAP,
                                            f"bootstrap lookup failed: {e}"))
            self._wake()
            return
        self._call(lambda: self._attach_peers(g, sources))

    def _attach_peers(self, g: _Group, sources: list[tuple[str, int]]) -> None:
        """(lock held) Decode: one leg per prefill rank to read from; starts the handshakes."""
        if g.failure is not None:
            return
        if not sources:
            self._fail_group(g, Failure(FailureKind.BOOTSTRAP,
                                        "no prefill rank to read this room from"))
            return
        g.expected = len(sources)
        for addr, gen in sources:
            r = self._new_leg(g, addr)
            self._attach_peer(r, addr, gen)
            self._init_leg(r)

    def _attach_peer(self, r: _Room, addr: str, gen: int) -> None:
        """(lock held) Ties a decode leg to its prefill peer; starts the handshake."""
        if r.machine.is_terminal:
            return
        p = self._peer(addr)
        if p.rejected:
            self._fail(r, PeerLost(reason=p.rejected.reason), notify=Notify.FAILED,
                       failure=p.rejected)
            return
        if p.matched:
            self._matched(r, p)
            return
        p.waiting.append(r)
        if not p.hello_sent:
            p.hello_sent = True
            p.last_seen = time.monotonic()  # a peer that never answers dies in 2 heartbeats
            self._send(addr, self._hello(P.Hello))

    def _peer(self, addr: str) -> _Peer:
        p = self._peers.get(addr)
        if p is None:
            p = self._peers[addr] = _Peer(addr=addr, last_seen=time.monotonic())
        return p

    def _hello(self, cls: type[P.Hello]) -> P.Hello:
        msg = cls(src=self.address, gen=self.generation, agent_id=self.agent_id,
                  role=self.role.value, transport=self.transport.kind,
                  transport_address=self.transport.address, layout=self.layout.to_dict(),
                  layout_hash=self.layout_hash, buffers=self.buffers.descs())
        secret = self.settings.hmac_secret
        return P.sign_hello(msg, secret.get_secret_value().encode()) if secret else msg

    def _matched(self, r: _Room, p: _Peer) -> None:
        r.peer_gen = p.gen
        if not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), time.monotonic())
        self._maybe_request(r)

    def _maybe_request(self, r: _Room) -> None:
        """(lock held) Decode: send the TransferRequest once matched and initialised."""
        if (r.role is not Role.DECODE or r.request_sent or not r.inited
                or not r.machine.peer_matched or r.machine.is_terminal or r.peer is None):
            return
        p = self._peers.get(r.peer)
        if p is None or p.layout is None:
            return
        # Claim the planes this leg brings: those the source holds that no other leg of the
        # room claimed yet (replicated regions: the first leg takes all; head slices: by name).
        g = r.group
        assert g is not None
        claimed = {name: set() for name in self._region_index}  # type: dict[str, set[str]]
        for other in g.legs:
            if other is not r and other.planes:
                for name, pl in other.planes.items():
                    claimed[name].update(pl)
        planes: dict[str, list[str]] = {}
        for reg in self.layout.regions:
            try:
                theirs = {pl.name for pl in p.layout.region(reg.name).planes}
            except KVHandoffError:
                theirs = set()
            planes[reg.name] = [pl.name for pl in reg.planes
                                if pl.name in theirs and pl.name not in claimed[reg.name]]
        r.planes = planes
        r.request_sent = True
        r.xfer = next(self._xfer)
        self._send(r.peer, P.TransferRequest(
            src=self.address, gen=self.generation, room=r.room, xfer=r.xfer, peer_gen=r.peer_gen,
            seq_len=r.seq_len, decode_prefix_len=r.prefix_len, page_size=r.page_size,
            dst_pages={k: v.tolist() for k, v in r.pages.items()}, lease_s=self.settings.lease_s,
            planes=planes))
        if g.expected is not None and len(g.legs) == g.expected and all(
                leg.request_sent for leg in g.legs):
            for reg in self.layout.regions:
                have = set().union(*(set((leg.planes or {}).get(reg.name, [])) for leg in g.legs))
                missing = [pl.name for pl in reg.planes if pl.name not in have]
                if missing:
                    self._fail(r, RemoteFailed(
                        reason=f"{reg.name}: no prefill rank of this room holds planes "
                               f"{missing}"), notify=Notify.FAILED,
                               kind=FailureKind.INVALID_REQUEST)
                    return

    def _check_hello(self, msg: P.Hello) -> list[str]:
        """Reasons to refuse a Hello (empty: accept)."""
        secret = self.settings.hmac_secret
        if secret and not P.verify_hello(msg, secret.get_secret_value().encode()):
            return ["hello: HMAC does not verify (wrong or missing shared secret)"]
        if msg.transport != self.transport.kind:
            return [f"transport: {self.role.value}={self.transport.kind} peer={msg.transport}"]
        if msg.role == self.role.value:
            return [f"role: both sides are {msg.role}"]
        if msg.layout_hash == self.layout_hash:
            return []
        try:
            theirs = LayoutSpec.from_dict(msg.layout)
        except KVHandoffError as e:
            return [f"layout: peer sent an invalid layout: {e}"]
        names = ("prefill", "decode") if self.role is Role.PREFILL else ("decode", "prefill")
        diff = _layout_compat_diff(self.layout, theirs, names)
        if self.role is Role.DECODE:  # always name prefill first
            diff = _layout_compat_diff(theirs, self.layout, ("prefill", "decode"))
        return diff

    def _on_hello(self, msg: P.Hello) -> None:
        self._forgotten.pop(msg.src, None)
        p = self._peer(msg.src)
        if p.gen and p.gen != msg.gen:
            self._peer_lost(p, f"peer {msg.src} restarted (generation changed)")
            p = self._peer(msg.src)
        problems = self._check_hello(msg)
        p.gen, p.agent_id, p.last_seen = msg.gen, msg.agent_id, time.monotonic()
        secret = self.settings.hmac_secret
        p.authenticated = not secret or P.verify_hello(msg, secret.get_secret_value().encode())
        if not problems:
            try:
                p.layout = LayoutSpec.from_dict(msg.layout)
            except KVHandoffError as e:
                problems = [f"layout: peer sent an invalid layout: {e}"]
        if problems:
            ev = LayoutMismatch(diff=tuple(problems))
            p.rejected = failure_of(ev)
            if not isinstance(msg, P.HelloAck):
                self._send(msg.src, P.HelloReject(src=self.address, gen=self.generation,
                                                  reason=ev.reason, diff=problems))
            self._fail_waiting(p, ev)
            return
        try:
            self.transport.connect(msg.src, msg.transport_address)
        except KVHandoffError as e:
            lost = PeerLost(reason=f"transport connect to {msg.src} failed: {e}")
            p.rejected = failure_of(lost, FailureKind.TRANSPORT)
            self._send(msg.src, P.HelloReject(src=self.address, gen=self.generation,
                                              reason=lost.reason))
            self._fail_waiting(p, lost, kind=FailureKind.TRANSPORT)
            return
        p.matched = True
        p.rejected = None
        if not isinstance(msg, P.HelloAck):
            self._send(msg.src, self._hello(P.HelloAck))
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._matched(r, p)

    def _tell_forgotten(self, addr: str) -> None:
        """(lock held) A peer this agent declared lost still talks to it (it did not see us
        die): tell it once per heartbeat, so it drops the handshake too and says Hello again,
        instead of waiting two heartbeats of silence. Only for peers we knew: never reply to
        an arbitrary sender address."""
        now = time.monotonic()
        since = self._forgotten.get(addr)
        if since is None or now - self._forgotten_told.get(addr, 0.0) < \
                self.settings.heartbeat_interval_s:
            return
        self._forgotten_told[addr] = now
        self._send(addr, P.Reject(src=self.address, gen=self.generation,
                                  reason=f"{_NO_HANDSHAKE}: {self.address} declared this peer "
                                         "lost; say Hello again"))

    def _fail_waiting(self, p: _Peer, ev: FailureEvent, kind: FailureKind | None = None
                      ) -> None:
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._fail(r, ev, notify=Notify.FAILED, kind=kind)

    def _peer_lost(self, p: _Peer, reason: str, *, keep: frozenset[_Room] = frozenset()
                   ) -> None:
        """(lock held) Fails every open room with this peer (but `keep`) and forgets the
        handshake."""
        self._counters["peers_lost"] += 1
        for r in list(self._legs.values()):
            if r.peer == p.addr and not r.machine.is_terminal and r not in keep:
                self._fail(r, PeerLost(reason=reason), notify=Notify.FAILED)
        for r in p.waiting:
            self._fail(r, PeerLost(reason=reason), notify=Notify.NONE)
        p.waiting = []
        self._peers.pop(p.addr, None)
        self._forgotten[p.addr] = time.monotonic()
        try:
            self.transport.disconnect(p.addr)
        except KVHandoffError:
            pass
        sock = self._dealers.pop(p.addr, None)
        if sock is not None:
            self._defer_close(sock)

    # ------------------------------------------------------------------ message handling

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames, max_bytes=self.settings.max_message_bytes)
        except ProtocolError as e:
            self._counters["rejected_messages"] += 1
            log.warning("rejected a control message: %s", e)
            return
        self._counters["messages_in"] += 1
        with self._lock:
            if isinstance(msg, P.Hello):  # Hello and HelloAck
                self._on_hello(msg)
                return
            p = self._peers.get(msg.src)
            if (self.settings.hmac_secret and (p is None or not p.authenticated)
                    and not isinstance(msg, P.HelloReject)):
                # with a shared secret, only a peer whose Hello verified may touch rooms (an
                # unknown process must not fail or abort a room it could not join)
                self._counters["stale_messages"] += 1
                return
            if p is None or (p.gen and msg.gen != p.gen):
                # no handshake with this sender (or an older generation of it)
                self._counters["stale_messages"] += 1
                if isinstance(msg, P.Failed | P.Abort) and p is None:
                    self._room_msg(msg)  # a failure for a room may precede any handshake
                elif p is None and not isinstance(msg, P.Reject | P.AbortAck):
                    self._tell_forgotten(msg.src)
                return
            p.last_seen = time.monotonic()
            if isinstance(msg, P.HelloReject):
                ev = LayoutMismatch(diff=tuple(msg.diff or [msg.reason]))
                p.rejected = failure_of(ev)
                self._fail_waiting(p, ev)
                return
            if isinstance(msg, P.Heartbeat):
                now = time.monotonic()
                for room in msg.rooms:
                    r = self._legs.get((room, p.addr))
                    if r is not None and not r.machine.is_terminal:
                        r.machine.apply(LeaseRenewed(), now)
                return
            if isinstance(msg, P.Reject):
                log.warning("peer %s rejected a message: %s", msg.src, msg.reason)
                if msg.reason.startswith(_NO_HANDSHAKE):
                    # It dropped us (took us for dead): rooms it had accepted are gone on its
                    # side; requests it never accepted are handshaken and sent again.
                    retry = frozenset(r for r in self._legs.values()
                                      if r.peer == p.addr and not r.machine.is_terminal
                                      and not r.accepted and r.role is Role.DECODE)
                    self._peer_lost(p, f"peer {p.addr} dropped its handshake with this agent "
                                       "(it took this agent for dead)", keep=retry)
                    for r in retry:
                        r.request_sent, r.planes = False, None
                        self._attach_peer(r, p.addr, 0)
                return
            self._room_msg(msg)

    def _room_msg(self, msg: Any) -> None:
        """(lock held) Routes a room message to its leg (creating a prefill leg on request)."""
        r = self._legs.get((msg.room, msg.src))
        g = self._groups.get(msg.room)
        if r is None and g is not None and self.role is Role.PREFILL:
            if isinstance(msg, P.TransferRequest):
                if g.failure is not None:
                    self._send(msg.src, P.Failed(src=self.address, gen=self.generation,
                                                 room=g.room, reason=g.failure.reason,
                                                 failure_kind=g.failure.kind.value))
                    return
                if g.expected is not None and len(g.legs) >= g.expected:
                    self._send(msg.src, P.Failed(
                        src=self.address, gen=self.generation, room=g.room,
                        reason=f"room {g.room} already has its {g.expected} decode rank(s) on "
                               "this prefill rank", failure_kind=FailureKind.INVALID_REQUEST.value))
                    return
                r = self._new_leg(g, msg.src)
                r.seq_len, r.pages, r.page_size = g.seq_len, g.pages, self.layout.page_size_tokens
                r.inited = True
            elif isinstance(msg, P.Failed | P.Abort):
                told = msg.failure_kind or ("aborted" if isinstance(msg, P.Abort) else "")
                f = remote_failure(told, f"peer failed the room: {msg.reason}")
                self._fail_group(g, f)
                return
        if r is None:
            if g is None and len(self._early) < _EARLY_LIMIT:
                self._early.setdefault(msg.room, []).append(msg)
                self._early_t.setdefault(msg.room, time.monotonic())
            return
        self._dispatch_room_msg(r, msg)

    def _dispatch_room_msg(self, r: _Room, msg: Any) -> None:
        if isinstance(msg, P.Failed):
            reason = f"peer failed the room: {msg.reason}"
            self._fail(r, RemoteFailed(reason=reason), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind, reason))
        elif isinstance(msg, P.Abort):
            other = Role.DECODE if self.role is Role.PREFILL else Role.PREFILL
            self._fail(r, Aborted(reason=msg.reason, by=other), notify=Notify.NONE,
                       failure=remote_failure(msg.failure_kind or "aborted", msg.reason))
            self._send(msg.src, P.AbortAck(src=self.address, gen=self.generation, room=r.room))
        elif isinstance(msg, P.AbortAck):
            pass
        elif r.machine.is_terminal:
            if isinstance(msg, P.TransferRequest) and r.machine.state is KVPoll.Failed:
                f = r.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
                self._send(msg.src, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                             reason=f.reason, failure_kind=f.kind.value))
        elif isinstance(msg, P.TransferRequest):
            self._on_request(r, msg)
        elif isinstance(msg, P.TransferAccepted):
            self._on_accepted(r, msg)
        elif isinstance(msg, P.LayerDone):
            for info in msg.layers:
                r.sums[(info.layer, info.attempt)] = {x.region: x.checksum for x in info.regions}
                self._try_verify(r, info.layer, info.attempt)
        elif isinstance(msg, P.LayerNack):
            if msg.attempt + 1 < 1 << P.ATTEMPT_BITS and r.posted.get(msg.layer) == msg.attempt:
                self._counters["retransmits"] += 1
                r.retransmits += 1
                self._post_layer(r, msg.layer, msg.attempt + 1)
        elif isinstance(msg, P.RoomAck):
            if r.role is Role.PREFILL:
                r.acked = True
                self._maybe_acked(r)

    def _on_request(self, r: _Room, msg: P.TransferRequest) -> None:
        """Prefill: validate the request, plan, accept, and send the layers already ready."""
        p = self._peers.get(msg.src)
        if msg.peer_gen != self.generation:
            self._send(msg.src, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                         reason="stale request: it names a previous generation "
                                         "of this prefill agent",
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
            r.peer, r.xfer, r.prefix_len = msg.src, msg.xfer, msg.decode_prefix_len
            r.peer_gen = msg.gen
            # suffix-only regions start at the page-aligned decode prefix on this side too
            r.pages = {reg.name: r.pages[reg.name][
                page_aligned(r.prefix_len, r.page_size) // r.page_size
                if reg.send_from is SendFrom.DECODE_PREFIX else 0:]
                for reg in self.layout.regions}
            if p is None or p.layout is None:
                raise ConfigError("transfer request before the decode's Hello")
            r.planes = msg.planes
            r.plans = self._plans(r, src_pages=r.pages, src_ps=r.page_size,
                                  dst_pages={k: np.asarray(v, dtype=np.int64)
                                             for k, v in msg.dst_pages.items()},
                                  dst_ps=msg.page_size, src_layout=self.layout,
                                  dst_layout=p.layout)
        except KVHandoffError as e:
            r.peer = msg.src
            self._fail(r, RemoteFailed(reason=f"invalid transfer request: {e}"),
                       notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        now = time.monotonic()
        if p is not None and not r.machine.peer_matched:
            r.machine.apply(PeerMatched(), now)
        r.machine.apply(TransferAccepted(), now)
        r.machine.apply(LeaseRenewed(), now)
        r.accepted = True
        self._send(msg.src, P.TransferAccepted(
            src=self.address, gen=self.generation, room=r.room, page_size=r.page_size,
            src_pages={k: v.tolist() for k, v in r.pages.items()}))
        g = r.group
        assert g is not None
        for layer in g.ready:
            self._post_layer(r, layer, 0)

    def _plans(self, r: _Room, *, src_pages: Mapping[str, np.ndarray], src_ps: int,
               dst_pages: Mapping[str, np.ndarray], dst_ps: int, src_layout: LayoutSpec,
               dst_layout: LayoutSpec) -> dict[str, Any]:
        """The span plan of each region this leg moves (the same for every layer of the
        region): both sides call this with the same arguments. Regions whose planes this leg
        does not bring (another leg does) are left out."""
        plans = {}
        for reg in self.layout.regions:
            wanted = (r.planes or {}).get(reg.name)
            if r.planes is not None and not wanted:
                continue
            if reg.name not in src_pages or reg.name not in dst_pages:
                raise ConfigError(f"pages: region {reg.name!r} missing")
            first = r.prefix_len if reg.send_from is SendFrom.DECODE_PREFIX else 0
            plans[reg.name] = build_spans(
                src_layout.region(reg.name), token_start=first, token_end=r.seq_len,
                src_pages=src_pages[reg.name], src_page_size=src_ps,
                src_first_token=page_aligned(first, src_ps),
                dst_pages=dst_pages[reg.name], dst_page_size=dst_ps,
                dst_first_token=page_aligned(first, dst_ps),
                dst_region=dst_layout.region(reg.name), planes=wanted)
        return plans

    def _on_accepted(self, r: _Room, msg: P.TransferAccepted) -> None:
        """Decode: plan, post every receive, WaitingForInput."""
        if r.accepted:
            return
        try:
            p = self._peers.get(r.peer or "")
            if p is None or p.layout is None:
                raise ConfigError("TransferAccepted before the prefill's Hello")
            r.plans = self._plans(r, src_pages={k: np.asarray(v, dtype=np.int64)
                                                for k, v in msg.src_pages.items()},
                                  src_ps=msg.page_size, dst_pages=r.pages, dst_ps=r.page_size,
                                  src_layout=p.layout, dst_layout=self.layout)
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid TransferAccepted: {e}"),
                       notify=Notify.FAILED, kind=FailureKind.INVALID_REQUEST)
            return
        r.accepted = True
        self._apply(r, TransferAccepted())
        for layer in r.layers:
            self._post_recv_layer(r, layer, 0)

    # ------------------------------------------------------------------ data path

    def _regions_of(self, r: _Room, layer: int) -> list[str]:
        """The regions of `layer` this leg moves."""
        return [reg.name for reg in self.layout.regions_of_layer(layer) if reg.name in r.plans]

    def _post_layer(self, r: _Room, layer: int, attempt: int) -> None:
        """(lock held) Prefill: send every region of `layer`, then checksum the source spans
        while the bytes are on the wire, and announce the layer (`LayerDone`) at once: the
        receiver verifies when both its bytes and the announcement are in, so the tail after
        the last layer is one transfer plus one check, not a round trip more."""
        s = self.settings
        r.posted[layer] = attempt
        regions = self._regions_of(r, layer)
        want = wants_checksum(s.checksum, self._layer_order[layer], len(self._layer_order))
        sums: dict[str, int | None] = {}
        r.outstanding[(layer, attempt)] = len(regions)
        r.sums[(layer, attempt)] = sums
        if not regions:  # another leg of the room brings this layer's planes
            r.outstanding[(layer, attempt)] = 1
            self._pending_done.setdefault((r.room, r.peer or ""), []).append(
                P.LayerInfo(layer=layer, attempt=attempt, regions=[]))
            self._sent(r, layer, attempt, "", None)
            return
        for name in regions:
            plan = r.plans[name]
            tag = P.data_tag(r.xfer, layer, self._region_index[name], attempt)
            r.inflight_tags[tag] = r.inflight_tags.get(tag, 0) + 1
            self.transport.post_send(
                r.peer or "", tag, self.buffers.name(name, layer), plan.src_offsets, plan.nbytes,
                self._cb(r, tag, functools.partial(self._sent, r, layer, attempt, name)))
        if want:  # read-only, overlaps the send; off the lock, on the hasher thread
            self._hasher.submit(self._announce, r, layer, attempt, regions)
        else:
            self._queue_done(r, layer, attempt, regions, dict.fromkeys(regions))

    def _announce(self, r: _Room, layer: int, attempt: int, regions: list[str]) -> None:
        """(hasher thread) Checksums the source spans of a posted layer, then announces it."""
        try:
            sums: dict[str, int | None] = {
                name: span_checksum(self.buffers.array(name, layer), r.plans[name].src_offsets,
                                    r.plans[name].nbytes)
                for name in regions}
            with self._lock:
                if not r.machine.is_terminal and r.posted.get(layer) == attempt:
                    self._queue_done(r, layer, attempt, regions, sums)
        except Exception as e:  # noqa: BLE001 - fails the room, with the error as its reason
            with self._lock:
                self._fail(r, RemoteFailed(reason=f"checksum of layer {layer} failed: {e!r}"),
                           notify=Notify.FAILED, kind=FailureKind.TRANSPORT)
        self._wake()

    def _queue_done(self, r: _Room, layer: int, attempt: int, regions: list[str],
                    sums: dict[str, int | None]) -> None:
        """(lock held) Queues the LayerDone of a posted layer (sent by the control thread,
        several layers of a room in one message)."""
        r.sums[(layer, attempt)] = sums
        self._pending_done.setdefault((r.room, r.peer or ""), []).append(P.LayerInfo(
            layer=layer, attempt=attempt, regions=[
                P.RegionDone(region=n, nbytes=r.plans[n].total_bytes, checksum=sums[n])
                for n in regions]))

    def _post_recv_layer(self, r: _Room, layer: int, attempt: int) -> None:
        r.posted[layer] = attempt
        r.recv_done[(layer, attempt)] = set()
        if not self._regions_of(r, layer):
            self._try_verify(r, layer, attempt)
        for name in self._regions_of(r, layer):
            plan = r.plans[name]
            tag = P.data_tag(r.xfer, layer, self._region_index[name], attempt)
            r.inflight_tags[tag] = r.inflight_tags.get(tag, 0) + 1
            self.transport.post_recv(
                r.peer or "", tag, self.buffers.name(name, layer), plan.dst_offsets, plan.nbytes,
                self._cb(r, tag, functools.partial(self._received, r, layer, attempt, name)))

    def _cb(self, r: _Room, tag: int, fn: Callable[[BaseException | None], None]
            ) -> Callable[[BaseException | None], None]:
        def done(exc: BaseException | None) -> None:
            with self._lock:
                left = r.inflight_tags.get(tag, 1) - 1
                if left:
                    r.inflight_tags[tag] = left
                else:
                    r.inflight_tags.pop(tag, None)
                if r.machine.is_terminal:
                    self._maybe_release(r)
                else:
                    fn(exc)
            self._wake()
        return done

    def _sent(self, r: _Room, layer: int, attempt: int, region: str,
              exc: BaseException | None) -> None:
        if exc is not None:
            self._fail_after_grace(r, f"send of layer {layer} {region} failed: {exc}")
            return
        nbytes = r.plans[region].total_bytes if region else 0
        r.bytes_moved += nbytes
        self._counters["bytes_sent"] += nbytes
        key = (layer, attempt)
        r.outstanding[key] -= 1
        if r.outstanding[key]:
            return
        del r.outstanding[key]
        if attempt == 0:
            self._apply(r, LayerSent(layer=layer))
            self._maybe_acked(r)

    def _maybe_acked(self, r: _Room) -> None:
        """(lock held) Prefill: Success once the RoomAck came AND every layer's send completed.
        LayerDone goes out when a layer is posted, so the decode can verify and ack before our
        own send completions are reported."""
        if (r.acked and r.machine.state is KVPoll.Transferring
                and r.machine.layers >= set(r.layers)):
            self._apply(r, AllLayersAcked())

    def _fail_after_grace(self, r: _Room, reason: str) -> None:
        """(lock held) A data op failed. When the peer failed or aborted the room, its
        cancelled ops usually reach us on the data lane before its Failed/Abort (with the real
        reason) on the control lane: give that message one heartbeat, then fail with ours. A
        dead peer is still caught within 2 heartbeats."""
        when = time.monotonic() + self.settings.heartbeat_interval_s
        heapq.heappush(self._timers, (when, next(self._timer_seq), lambda: self._fail(
            r, PeerLost(reason=reason), notify=Notify.FAILED, kind=FailureKind.TRANSPORT)))

    def _received(self, r: _Room, layer: int, attempt: int, region: str,
                  exc: BaseException | None) -> None:
        if exc is not None:
            self._fail_after_grace(r, f"receive of layer {layer} {region} failed: {exc}")
            return
        got = r.recv_done.setdefault((layer, attempt), set())
        got.add(region)
        self._try_verify(r, layer, attempt)

    def _try_verify(self, r: _Room, layer: int, attempt: int) -> None:
        """(lock held) Decode: once a layer's bytes and its LayerDone are both here, verify."""
        if r.role is not Role.DECODE or r.machine.is_terminal or r.posted.get(layer) != attempt:
            return
        regions = self._regions_of(r, layer)
        got = r.recv_done.get((layer, attempt), set())
        sums = r.sums.get((layer, attempt))
        if sums is None or len(got) < len(regions):
            return
        key = (layer, attempt)
        if key in r.verifying:
            return
        items = [(name, sums.get(name)) for name in regions]
        if all(want is None for _, want in items):
            self._verified(r, layer, attempt, regions, bad=None, checked=0)
            return
        r.verifying.add(key)
        self._hasher.submit(self._verify, r, layer, attempt, regions, items)

    def _verify(self, r: _Room, layer: int, attempt: int, regions: list[str],
                items: list[tuple[str, int | None]]) -> None:
        """(hasher thread) Checksums the landed spans of a layer off the lock."""
        try:
            bad, checked = None, 0
            for name, want in items:
                if want is None:
                    continue
                plan = r.plans[name]
                got = span_checksum(self.buffers.array(name, layer), plan.dst_offsets,
                                    plan.nbytes)
                if got != want:
                    bad = name
                    break
                checked += 1
            with self._lock:
                r.verifying.discard((layer, attempt))
                if not r.machine.is_terminal and r.posted.get(layer) == attempt:
                    self._verified(r, layer, attempt, regions, bad=bad, checked=checked)
        except Exception as e:  # noqa: BLE001 - fails the room, with the error as its reason
            with self._lock:
                self._fail(r, RemoteFailed(reason=f"verification of layer {layer} failed: "
                                                  f"{e!r}"),
                           notify=Notify.FAILED, kind=FailureKind.TRANSPORT)
        self._wake()

    def _verified(self, r: _Room, layer: int, attempt: int, regions: list[str], *,
                  bad: str | None, checked: int) -> None:
        """(lock held) Acts on a layer's verification: landed, retransmit once, or Failed."""
        if bad is not None:
            self._counters["checksum_failures"] += 1
            if attempt + 1 < 2:  # one retransmit, then fail
                r.retransmits += 1
                self._counters["retransmits"] += 1
                self._send(r.peer or "", P.LayerNack(
                    src=self.address, gen=self.generation, room=r.room, layer=layer,
                    attempt=attempt, reason=f"checksum mismatch in {bad}"))
                self._post_recv_layer(r, layer, attempt + 1)
            else:
                self._fail(r, ChecksumMismatch(layer=layer, region=bad), notify=Notify.FAILED)
            return
        r.checksums_verified += checked
        self._counters["checksums_verified"] += checked
        for name in regions:
            n = r.plans[name].total_bytes
            r.bytes_moved += n
            self._counters["bytes_received"] += n
        self._apply(r, LayerLanded(layer=layer))
        g = r.group
        assert g is not None
        if g.expected is not None and len(g.legs) == g.expected and all(
                layer in leg.machine.layers for leg in g.legs):
            g.layer_events[layer].set()
        if r.machine.layers >= set(r.layers):
            self._apply(r, AllLayersLanded())
            self._send(r.peer or "", P.RoomAck(src=self.address, gen=self.generation,
                                               room=r.room))

    # ------------------------------------------------------------------ failure / release

    def _apply(self, r: _Room, ev: Any) -> None:
        """(lock held) Feeds a progress event; reacts to terminal states."""
        r.machine.apply(ev, time.monotonic())
        if r.machine.is_terminal:
            self._terminal(r)

    def _fail(self, r: _Room, ev: FailureEvent, *, notify: Notify,
              kind: FailureKind | None = None, failure: Failure | None = None) -> None:
        """(lock held) Fails the room (first failure wins) and tells the peer. The room's
        `Failure` is `failure`, else the event's (with `kind` when given)."""
        if r.machine.is_terminal:
            return
        r.machine.apply(ev, time.monotonic())
        r.failure = failure or failure_of(ev, kind)
        log.info("room %d (%s) failed: %s", r.room, self.role.value, r.failure.reason)
        if notify is not Notify.NONE and r.peer:
            f = r.failure
            if notify is Notify.ABORT:
                self._send(r.peer, P.Abort(src=self.address, gen=self.generation, room=r.room,
                                           reason=f.reason, failure_kind=f.kind.value))
            else:
                self._send(r.peer, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                            reason=f.reason, failure_kind=f.kind.value))
        self._terminal(r)

    def _terminal(self, r: _Room) -> None:
        ok = r.machine.state is KVPoll.Success
        self._counters["rooms_success" if ok else "rooms_failed"] += 1
        if not ok:
            for tag in list(r.inflight_tags):
                try:
                    self.transport.cancel(r.peer or "", tag)
                except KVHandoffError:
                    pass
        g = r.group
        assert g is not None
        if not ok and g.failure is None:
            g.failure = r.failure or Failure(FailureKind.REMOTE_FAILED, "failed")
            for other in g.legs:
                if other is not r and not other.machine.is_terminal:
                    why = f"another rank of the room failed: {g.failure.reason}"
                    self._fail(other, RemoteFailed(reason=why), notify=Notify.FAILED,
                               failure=Failure(g.failure.kind, why))
        self._maybe_release(r)

    def _fail_group(self, g: _Group, failure: Failure) -> None:
        """(lock held) Fails a room that may have no legs yet (abort, failed lookup)."""
        if g.failure is None and not g.done.is_set():
            g.failure = failure
            log.info("room %d (%s) failed: %s", g.room, self.role.value, failure.reason)
            for r in g.legs:
                self._fail(r, RemoteFailed(reason=failure.reason), notify=Notify.FAILED,
                           failure=failure)
        self._group_update(g)

    def _group_update(self, g: _Group) -> None:
        """(lock held) Marks the room done / released once its legs allow."""
        if g.state.is_terminal and not g.done.is_set():
            g.t_done = time.monotonic()
            if g.failure is not None:
                for ev in g.layer_events.values():
                    ev.set()  # wake waiters; wait_for_layer reports False for a failed room
            g.done.set()
        if g.done.is_set() and not g.released.is_set() and all(
                leg.released.is_set() for leg in g.legs):
            g.released.set()
            if g.on_release is not None:
                try:
                    g.on_release(g.room)
                except Exception:  # an engine callback must not kill the agent
                    log.exception("on_release callback of room %d raised", g.room)

    def _maybe_release(self, r: _Room) -> None:
        if not r.inflight_tags and not r.released.is_set():
            r.released.set()
        if r.group is not None:
            self._group_update(r.group)

    def _room_stats(self, g: _Group) -> dict[str, Any]:
        with self._lock:
            desc: dict[str, int] = {}
            before: dict[str, int] = {}
            per_region: dict[str, int] = {}
            for r in g.legs:
                for k, p in r.plans.items():
                    layers = len(self.layout.region(k).layer_ids)
                    desc[k] = desc.get(k, 0) + p.count * layers
                    before[k] = before.get(k, 0) + p.descriptors_before * layers
                    per_region[k] = per_region.get(k, 0) + p.total_bytes * layers
            return {
                "room": g.room, "state": g.state.name,
                "failure": g.failure.reason if g.failure else None,
                "failure_kind": g.failure.kind.value if g.failure else None,
                "legs": len(g.legs), "peers": [r.peer for r in g.legs],
                "bytes": sum(r.bytes_moved for r in g.legs),
                "retransmits": sum(r.retransmits for r in g.legs),
                "checksums_verified": sum(r.checksums_verified for r in g.legs),
                "descriptors": desc, "descriptors_before": before,
                "bytes_per_region": per_region,
                "t_created": g.t_created, "t_last_ready": g.t_last_ready, "t_done": g.t_done,
            }

    # ------------------------------------------------------------------ control thread

    def _call(self, fn: Callable[[], None]) -> None:
        with self._lock:
            fn()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _send(self, addr: str, msg: P.Message) -> None:
        """(lock held) Queues a control message for the control thread (through the effect
        filter, when one is installed: tests drop or delay messages with it)."""
        if self._effect_filter is None:
            self._outbox.append((addr, msg))
            return
        for eff in self._effect_filter(Send(addr, msg)):
            if isinstance(eff, Send):
                self._outbox.append((eff.addr, eff.msg))
            elif isinstance(eff, Delayed) and isinstance(eff.effect, Send):
                out: tuple[str, P.Message] = (eff.effect.addr, eff.effect.msg)
                later: Callable[[], None] = functools.partial(self._outbox.append, out)
                heapq.heappush(self._timers, (time.monotonic() + eff.after_s,
                                              next(self._timer_seq), later))

    def _defer_close(self, sock: zmq.Socket[bytes]) -> None:
        heapq.heappush(self._timers, (time.monotonic(), next(self._timer_seq),
                                      lambda: sock.close(0)))

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.connect(f"tcp://{addr}")
            self._dealers[addr] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        hb = self.settings.heartbeat_interval_s
        while not (self._closed and not self._outbox):
            timeout_ms = self._timeout_ms(hb)
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if self._router not in events:
                self._drained_at = time.monotonic()  # polled: nothing waiting to be read
            else:
                # a burst (hundreds of rooms' requests) must not hold back our heartbeats and
                # answers: after a quarter heartbeat, tick (send them), then read on
                batch_end = time.monotonic() + hb / 4
                for _ in range(1000):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        self._drained_at = time.monotonic()
                        break
                    try:
                        self._handle(frames[1:])  # drop the ROUTER identity frame
                    except Exception:  # one message must never stop the control loop
                        log.exception("agent: error handling a control message")
                    if time.monotonic() > batch_end:
                        break
            try:
                self._tick(hb)
            except Exception:  # the control loop must survive anything a room does
                log.exception("agent control loop error")
        self._flush()

    def _timeout_ms(self, hb: float) -> int:
        if self._outbox or self._pending_done:
            return 0
        now = time.monotonic()
        when = self._next_heartbeat
        if self._timers:
            when = min(when, self._timers[0][0])
        return max(0, min(int((when - now) * 1e3) + 1, int(hb * 1e3)))

    def _tick(self, hb: float) -> None:
        now = time.monotonic()
        # Engine threads posting hundreds of rooms can hold the lock back to back (Python locks
        # are not fair). Heartbeats must still leave on time, or the peer takes this busy agent
        # for a dead one: when the lock does not come within a quarter heartbeat, send bare
        # heartbeats (liveness only, no lease renewals) and try the rest on the next pass.
        if not self._lock.acquire(timeout=hb / 4):
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + hb
                for p in list(self._peers.values()):
                    if p.matched or p.hello_sent:
                        # not through _send: its effect filter's timers need the lock
                        hb_msg = P.Heartbeat(src=self.address, gen=self.generation, rooms=[])
                        effs = (self._effect_filter(Send(p.addr, hb_msg))
                                if self._effect_filter else [Send(p.addr, hb_msg)])
                        self._outbox.extend((e.addr, e.msg) for e in effs
                                            if isinstance(e, Send))
            self._flush()
            return
        try:  # other threads push timers (delayed messages) under the lock
            while self._timers and self._timers[0][0] <= now:
                _, _, fn = heapq.heappop(self._timers)
                fn()
            for (room, peer), infos in self._pending_done.items():
                if peer:
                    self._send(peer, P.LayerDone(src=self.address, gen=self.generation,
                                                 room=room, layers=infos))
            self._pending_done.clear()
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + hb
                self._heartbeats(now, hb)
        finally:
            self._lock.release()
        self._flush()

    def _heartbeats(self, now: float, hb: float) -> None:
        """(lock held) Heartbeats out, dead peers and expired deadlines in."""
        by_peer: dict[str, list[int]] = {}
        for r in self._legs.values():
            if not r.machine.is_terminal and r.peer is not None:
                by_peer.setdefault(r.peer, []).append(r.room)
        for g in list(self._groups.values()):
            waited = now - g.t_created
            if (not g.done.is_set() and (g.expected is None or len(g.legs) < g.expected)
                    and waited > self.settings.bootstrap_timeout_s):
                self._fail_group(g, Failure(
                    FailureKind.DEADLINE, f"bootstrap deadline expired: no peer after "
                    f"{waited:.1f}s", deadline="bootstrap"))
        for p in list(self._peers.values()):
            if p.matched or p.hello_sent:
                self._send(p.addr, P.Heartbeat(src=self.address, gen=self.generation,
                                               rooms=by_peer.get(p.addr, [])))
            # silence is measured up to the last moment this agent had read every message it
            # was sent: a busy control loop must not take its own backlog for a dead peer
            silent = min(now, self._drained_at) - p.last_seen
            if (p.matched or p.waiting) and silent > 2 * hb:
                self._peer_lost(p, f"peer {p.addr} silent for {silent:.2f}s "
                                   f"(> 2 heartbeats of {hb:g}s)")
        for r in list(self._legs.values()):
            if not r.machine.is_terminal:
                for which in r.machine.expired(now):
                    self._fail(r, DeadlineExpired(which=which), notify=Notify.FAILED)
                    break
        self._gc(now)

    def _gc(self, now: float) -> None:
        # messages for rooms the engine never opened: kept as long as a room may bootstrap
        for room in [k for k, t in self._early_t.items()
                     if now - t > self.settings.bootstrap_timeout_s]:
            self._early.pop(room, None)
            self._early_t.pop(room, None)
        for addr in [a for a, t in self._forgotten.items() if now - t > _FORGOTTEN_KEEP_S]:
            self._forgotten.pop(addr, None)
            self._forgotten_told.pop(addr, None)
        keep = self.settings.room_retention_s
        for room in [k for k, g in self._groups.items()
                     if g.released.is_set() and g.t_done is not None and now - g.t_done > keep]:
            for r in self._groups.pop(room).legs:
                self._legs.pop((room, r.peer or ""), None)

    def _flush(self) -> None:
        while self._outbox:
            addr, msg = self._outbox.popleft()
            if not addr:
                continue
            try:
                self._dealer(addr).send_multipart(P.encode(msg), zmq.NOBLOCK)
                self._counters["messages_out"] += 1
            except zmq.ZMQError as e:
                log.warning("could not send %s to %s: %s", type(msg).__name__, addr, e)

