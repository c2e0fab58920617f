"""`TransferAgent`: one per engine rank; moves the KV of its rooms per layer.

How it works:
- State: rooms (`rooms._Room`), peers (`_Peer`), guarded by one lock (`self._lock`). Engine
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvhandoff.errors import ConfigError, KVHandoffError, ProtocolError
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
from kvhandoff.transfer.rooms import Receiver, Sender, _Room
from kvhandoff.transfer.transports.base import Transport, load_transport

log = logging.getLogger("kvhandoff.agent")

_EARLY_LIMIT = 4096  # messages kept for rooms the engine has not opened yet


@dataclass(eq=False)
class _Peer:
    addr: str
    gen: int = 0
    agent_id: str = ""
    matched: bool = False
    hello_sent: bool = False
    rejected: str | None = None
    last_seen: float = 0.0
    waiting: list[_Room] = field(default_factory=list)  # rooms waiting for the handshake


def _layout_compat_diff(mine: LayoutSpec, theirs: LayoutSpec, names: tuple[str, str]) -> list[str]:
    """Differences that make a handoff impossible. Page sizes may differ (the span builder pairs
    pages token by token), so they are compared with the page size set equal."""
    return layout_diff(mine.with_page_size(1), theirs.with_page_size(1), names)


class TransferAgent:
    """Moves KV pages of rooms between a prefill and a decode engine rank.

    Args:
        role: `Role.PREFILL` or `Role.DECODE` (or "prefill" / "decode").
        layout: this rank's KV layout.
        buffers: the KV buffers, one per (region, layer): a dict region -> {layer_id: buffer}
            or region -> sequence aligned with the region's layer ids. Buffers are torch tensors
            or numpy arrays holding whole pages (``pages x page_nbytes`` bytes, contiguous).
        settings: process settings (transport, heartbeat, checksums, faults ...).
        transport: an already built transport (tests); by default `settings.transport`.
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
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[str, _Peer] = {}
        self._early: dict[int, list[Any]] = {}
        self._xfer = itertools.count(1)
        self._outbox: deque[tuple[str, P.Message]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._pending_done: dict[int, list[P.LayerInfo]] = {}
        self._counters: dict[str, int] = {
            "messages_in": 0, "messages_out": 0, "rejected_messages": 0, "stale_messages": 0,
            "retransmits": 0, "checksum_failures": 0, "checksums_verified": 0, "bytes_sent": 0,
            "bytes_received": 0, "rooms_success": 0, "rooms_failed": 0, "peers_lost": 0,
        }
        self._corrupt_left = (self.settings.fault_corrupt_times
                              if self.settings.fault_corrupt_layer is not None else 0)
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
        self._thread = threading.Thread(target=self._run, name=f"kvh-{self.agent_id}",
                                        daemon=True)
        self._thread.start()
        self._registration: Any = None
        if self.role is Role.PREFILL and self.settings.bootstrap_url:
            from kvhandoff.transfer.registration import Registration

            self._registration = Registration(self)
        log.info("agent %s (%s) on %s, transport %s", self.agent_id, self.role.value,
                 self.address, self.transport.status())

    # ------------------------------------------------------------------ public API

    def sender(
        self,
        room: int,
        *,
        pages: np.ndarray | list[int] | Mapping[str, np.ndarray | list[int]],
        seq_len: int,
        on_release: Callable[[int], None] | None = None,
    ) -> Sender:
        """Opens the prefill side of `room`: `pages` is the page table of the sequence (token 0
        on; or a dict per region), `seq_len` its length in tokens."""
        self._need(Role.PREFILL, "sender")
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        r = self._new_room(room, on_release)
        with self._lock:
            r.seq_len = seq_len
            r.page_size = self.layout.page_size_tokens
            r.pages = self._page_table(pages, seq_len, 0, side="pages")
            r.inited = True
            for msg in self._early.pop(room, []):
                self._dispatch_room_msg(r, msg)
        self._wake()
        return Sender(self, r)

    def receiver(
        self,
        room: int,
        bootstrap_addr: str | None = None,
        *,
        peer: str | None = None,
        on_release: Callable[[int], None] | None = None,
    ) -> Receiver:
        """Opens the decode side of `room`. The prefill is found through the bootstrap server
        at `bootstrap_addr` (host:port or URL), or given directly as its agent `peer` address."""
        self._need(Role.DECODE, "receiver")
        if peer is None and bootstrap_addr is None:
            raise ConfigError("receiver: give bootstrap_addr (the prefill's bootstrap server) "
                              "or peer (the prefill agent's control address)")
        r = self._new_room(room, on_release)
        if peer is not None:
            self._call(lambda: self._attach_peer(r, peer, 0))
        else:
            assert bootstrap_addr is not None
            threading.Thread(target=self._resolve, args=(r, bootstrap_addr), daemon=True,
                             name=f"kvh-route-{room}").start()
        return Receiver(self, r)

    def status(self) -> dict[str, Any]:
        """What this agent is and how it fares (for /ready, metrics and the CLI)."""
        st = self.transport.status()
        with self._lock:
            states: dict[str, int] = {}
            for r in self._rooms.values():
                states[r.state.name] = states.get(r.state.name, 0) + 1
            counters = dict(self._counters)
            peers = [{"addr": p.addr, "matched": p.matched, "rejected": p.rejected}
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
            rooms = [r for r in self._rooms.values() if not r.machine.is_terminal]
        for r in rooms:
            self._abort(r, "agent closed")
        if self._registration is not None:
            self._registration.close()
        self._wake()
        self._thread.join(timeout=5)
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

    def _new_room(self, room: int, on_release: Callable[[int], None] | None) -> _Room:
        if not 0 <= room < 1 << 64:
            raise ConfigError(f"room: expected an unsigned 64-bit id, got {room}")
        s = self.settings
        now = time.monotonic()
        deadlines = DeadlineConfig(
            bootstrap_s=s.bootstrap_timeout_s, waiting_for_input_s=s.waiting_timeout_s,
            transfer_stall_s=s.stall_timeout_s, lease_s=s.lease_s)
        layers = tuple(sorted(self._layer_order))
        r = _Room(room=room, role=self.role,
                  machine=RoomMachine(self.role, now=now, deadlines=deadlines, layers=layers),
                  layers=layers, on_release=on_release, t_created=now)
        r.layer_events = {lid: threading.Event() for lid in layers}
        with self._lock:
            old = self._rooms.get(room)
            if old is not None and not old.machine.is_terminal:
                raise ConfigError(f"room {room}: already open on this agent")
            self._rooms[room] = r
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

    def _layer_ready(self, r: _Room, layer: int) -> None:
        if layer not in r.layer_events:
            raise ConfigError(f"layer_ready({layer}): not a layer of the layout")
        s = self.settings
        if s.fault_crash_layer is not None and layer == s.fault_crash_layer:
            log.error("fault injection: crashing at layer %d", layer)
            os._exit(137)
        with self._lock:
            if layer in r.ready:
                return
            r.ready.append(layer)
            r.t_last_ready = time.monotonic()
            if r.accepted and not r.machine.is_terminal:
                self._post_layer(r, layer, 0)
        self._wake()

    def _receiver_init(self, r: _Room, dst_pages: Any, seq_len: int, prefix: int) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len: expected > 0, got {seq_len}")
        if not 0 <= prefix <= seq_len:
            raise ConfigError(f"decode_prefix_len: expected 0..{seq_len}, got {prefix}")
        table = self._page_table(dst_pages, seq_len, prefix, side="dst_pages")
        with self._lock:
            if r.inited:
                raise ConfigError(f"room {r.room}: init() called twice")
            r.seq_len = seq_len
            r.prefix_len = page_aligned(prefix, self.layout.page_size_tokens)
            r.page_size = self.layout.page_size_tokens
            r.pages = table
            r.inited = True
            self._maybe_request(r)
        self._wake()

    def _abort(self, r: _Room, reason: str) -> None:
        with self._lock:
            self._fail(r, Aborted(reason=reason, by=self.role), notify="abort")
        self._wake()

    # ------------------------------------------------------------------ peers and handshake

    def _resolve(self, r: _Room, bootstrap_addr: str) -> None:
        try:
            from kvhandoff.transfer.registration import lookup_prefill

            addr, gen = lookup_prefill(self, r.room, bootstrap_addr)
        except KVHandoffError as e:
            with self._lock:
                self._fail(r, PeerLost(reason=f"bootstrap lookup failed: {e}"), notify=None)
            self._wake()
            return
        self._call(lambda: self._attach_peer(r, addr, gen))

    def _attach_peer(self, r: _Room, addr: str, gen: int) -> None:
        """(lock held) Ties a decode room to its prefill peer; starts the handshake."""
        if r.machine.is_terminal:
            return
        p = self._peer(addr)
        r.peer = addr
        if p.rejected:
            self._fail(r, PeerLost(reason=p.rejected), notify="failed")
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
        r.request_sent = True
        r.xfer = next(self._xfer)
        self._send(r.peer, P.TransferRequest(
            src=self.address, gen=self.generation, room=r.room, xfer=r.xfer, peer_gen=r.peer_gen,
            seq_len=r.seq_len, decode_prefix_len=r.prefix_len, page_size=r.page_size,
            dst_pages={k: v.tolist() for k, v in r.pages.items()}, lease_s=self.settings.lease_s))

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
        p = self._peer(msg.src)
        if p.gen and p.gen != msg.gen:
            self._peer_lost(p, f"peer {msg.src} restarted (generation changed)")
            p = self._peer(msg.src)
        problems = self._check_hello(msg)
        p.gen, p.agent_id, p.last_seen = msg.gen, msg.agent_id, time.monotonic()
        if problems:
            reason = "layout mismatch: " + "; ".join(problems)
            p.rejected = reason
            if not isinstance(msg, P.HelloAck):
                self._send(msg.src, P.HelloReject(src=self.address, gen=self.generation,
                                                  reason=reason, diff=problems))
            self._fail_waiting(p, LayoutMismatch(diff=tuple(problems)))
            return
        try:
            self.transport.connect(msg.src, msg.transport_address)
        except KVHandoffError as e:
            p.rejected = f"transport connect to {msg.src} failed: {e}"
            self._send(msg.src, P.HelloReject(src=self.address, gen=self.generation,
                                              reason=p.rejected))
            self._fail_waiting(p, PeerLost(reason=p.rejected))
            return
        p.matched = True
        p.rejected = None
        if not isinstance(msg, P.HelloAck):
            self._send(msg.src, self._hello(P.HelloAck))
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._matched(r, p)

    def _fail_waiting(self, p: _Peer, ev: FailureEvent) -> None:
        waiting, p.waiting = p.waiting, []
        for r in waiting:
            self._fail(r, ev, notify="failed")

    def _peer_lost(self, p: _Peer, reason: str) -> None:
        """(lock held) Fails every open room with this peer and forgets the handshake."""
        self._counters["peers_lost"] += 1
        for r in list(self._rooms.values()):
            if r.peer == p.addr and not r.machine.is_terminal:
                self._fail(r, PeerLost(reason=reason), notify="failed")
        for r in p.waiting:
            self._fail(r, PeerLost(reason=reason), notify=None)
        p.waiting = []
        self._peers.pop(p.addr, None)
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
            if p is None or (p.gen and msg.gen != p.gen):
                # no handshake with this sender (or an older generation of it)
                self._counters["stale_messages"] += 1
                if isinstance(msg, P.Failed | P.Abort) and p is None:
                    self._room_msg(msg)  # a failure for a room may precede any handshake
                return
            p.last_seen = time.monotonic()
            if isinstance(msg, P.HelloReject):
                p.rejected = msg.reason
                self._fail_waiting(p, LayoutMismatch(diff=tuple(msg.diff or [msg.reason])))
                return
            if isinstance(msg, P.Heartbeat):
                now = time.monotonic()
                for room in msg.rooms:
                    r = self._rooms.get(room)
                    if r is not None and r.peer == p.addr and not r.machine.is_terminal:
                        r.machine.apply(LeaseRenewed(), now)
                return
            if isinstance(msg, P.Reject):
                log.warning("peer %s rejected a message: %s", msg.src, msg.reason)
                return
            self._room_msg(msg)

    def _room_msg(self, msg: Any) -> None:
        r = self._rooms.get(msg.room)
        if r is None or (r.role is Role.PREFILL and not r.inited):
            if len(self._early) < _EARLY_LIMIT:
                self._early.setdefault(msg.room, []).append(msg)
            return
        self._dispatch_room_msg(r, msg)

    def _dispatch_room_msg(self, r: _Room, msg: Any) -> None:
        if r.peer is not None and msg.src != r.peer:
            self._counters["stale_messages"] += 1
            return
        if isinstance(msg, P.Failed):
            self._fail(r, RemoteFailed(reason=f"peer failed the room: {msg.reason}"), notify=None)
        elif isinstance(msg, P.Abort):
            other = Role.DECODE if self.role is Role.PREFILL else Role.PREFILL
            self._fail(r, Aborted(reason=msg.reason, by=other), notify=None)
            self._send(msg.src, P.AbortAck(src=self.address, gen=self.generation, room=r.room))
        elif isinstance(msg, P.AbortAck):
            pass
        elif r.machine.is_terminal:
            if isinstance(msg, P.TransferRequest) and r.machine.state is KVPoll.Failed:
                self._send(msg.src, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                             reason=r.machine.failure or "failed"))
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
            if r.role is Role.PREFILL and r.machine.state is KVPoll.Transferring:
                self._apply(r, AllLayersAcked())

    def _on_request(self, r: _Room, msg: P.TransferRequest) -> None:
        """Prefill: validate the request, plan, accept, and send the layers already ready."""
        p = self._peers.get(msg.src)
        if msg.peer_gen != self.generation:
            self._send(msg.src, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                         reason="stale request: it names a previous generation "
                                         "of this prefill agent"))
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
            r.plans = self._plans(r, src_pages=r.pages, src_ps=r.page_size,
                                  dst_pages={k: np.asarray(v, dtype=np.int64)
                                             for k, v in msg.dst_pages.items()},
                                  dst_ps=msg.page_size)
        except KVHandoffError as e:
            r.peer = msg.src
            self._fail(r, RemoteFailed(reason=f"invalid transfer request: {e}"), notify="failed")
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
        for layer in r.ready:
            self._post_layer(r, layer, 0)

    def _plans(self, r: _Room, *, src_pages: Mapping[str, np.ndarray], src_ps: int,
               dst_pages: Mapping[str, np.ndarray], dst_ps: int) -> dict[str, Any]:
        """The span plan of each region (the same for every layer of the region): both sides
        call this with the same arguments."""
        plans = {}
        for reg in self.layout.regions:
            if reg.name not in src_pages or reg.name not in dst_pages:
                raise ConfigError(f"pages: region {reg.name!r} missing")
            first = r.prefix_len if reg.send_from is SendFrom.DECODE_PREFIX else 0
            plans[reg.name] = build_spans(
                reg, token_start=first, token_end=r.seq_len,
                src_pages=src_pages[reg.name], src_page_size=src_ps,
                src_first_token=page_aligned(first, src_ps),
                dst_pages=dst_pages[reg.name], dst_page_size=dst_ps,
                dst_first_token=page_aligned(first, dst_ps))
        return plans

    def _on_accepted(self, r: _Room, msg: P.TransferAccepted) -> None:
        """Decode: plan, post every receive, WaitingForInput."""
        if r.accepted:
            return
        try:
            r.plans = self._plans(r, src_pages={k: np.asarray(v, dtype=np.int64)
                                                for k, v in msg.src_pages.items()},
                                  src_ps=msg.page_size, dst_pages=r.pages, dst_ps=r.page_size)
        except KVHandoffError as e:
            self._fail(r, RemoteFailed(reason=f"invalid TransferAccepted: {e}"), notify="failed")
            return
        r.accepted = True
        self._apply(r, TransferAccepted())
        for layer in r.layers:
            self._post_recv_layer(r, layer, 0)

    # ------------------------------------------------------------------ data path

    def _regions_of(self, layer: int) -> list[str]:
        return [reg.name for reg in self.layout.regions_of_layer(layer)]

    def _post_layer(self, r: _Room, layer: int, attempt: int) -> None:
        """(lock held) Prefill: checksum and send every region of `layer`."""
        s = self.settings
        if s.fault_stall_layer is not None and layer == s.fault_stall_layer:
            log.warning("fault injection: stalling layer %d", layer)
            return
        r.posted[layer] = attempt
        regions = self._regions_of(layer)
        want = wants_checksum(s.checksum, self._layer_order[layer], len(self._layer_order))
        sums: dict[str, int | None] = {}
        r.outstanding[(layer, attempt)] = len(regions)
        for name in regions:
            plan = r.plans[name]
            buf = self.buffers.array(name, layer)
            sums[name] = span_checksum(buf, plan.src_offsets, plan.nbytes) if want else None
            tag = P.data_tag(r.xfer, layer, self._region_index[name], attempt)
            r.inflight_tags[tag] = r.inflight_tags.get(tag, 0) + 1
            self.transport.post_send(
                r.peer or "", tag, self.buffers.name(name, layer), plan.src_offsets, plan.nbytes,
                self._cb(r, tag, functools.partial(self._sent, r, layer, attempt, name)))
        r.sums[(layer, attempt)] = sums

    def _post_recv_layer(self, r: _Room, layer: int, attempt: int) -> None:
        r.posted[layer] = attempt
        r.recv_done[(layer, attempt)] = set()
        for name in self._regions_of(layer):
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
            self._fail(r, PeerLost(reason=f"send of layer {layer} {region} failed: {exc}"),
                       notify="failed")
            return
        nbytes = r.plans[region].total_bytes
        r.bytes_moved += nbytes
        self._counters["bytes_sent"] += nbytes
        key = (layer, attempt)
        r.outstanding[key] -= 1
        if r.outstanding[key]:
            return
        del r.outstanding[key]
        sums = r.sums.get(key, {})
        info = P.LayerInfo(layer=layer, attempt=attempt, regions=[
            P.RegionDone(region=n, nbytes=r.plans[n].total_bytes, checksum=sums.get(n))
            for n in self._regions_of(layer)])
        self._pending_done.setdefault(r.room, []).append(info)
        if attempt == 0:
            self._apply(r, LayerSent(layer=layer))

    def _received(self, r: _Room, layer: int, attempt: int, region: str,
                  exc: BaseException | None) -> None:
        if exc is not None:
            self._fail(r, PeerLost(reason=f"receive of layer {layer} {region} failed: {exc}"),
                       notify="failed")
            return
        got = r.recv_done.setdefault((layer, attempt), set())
        got.add(region)
        self._try_verify(r, layer, attempt)

    def _try_verify(self, r: _Room, layer: int, attempt: int) -> None:
        """(lock held) Decode: once a layer's bytes and its LayerDone are both here, verify."""
        if r.role is not Role.DECODE or r.machine.is_terminal or r.posted.get(layer) != attempt:
            return
        regions = self._regions_of(layer)
        got = r.recv_done.get((layer, attempt), set())
        sums = r.sums.get((layer, attempt))
        if sums is None or len(got) < len(regions):
            return
        for name in regions:
            plan = r.plans[name]
            buf = self.buffers.array(name, layer)
            if self._corrupt_left and layer == self.settings.fault_corrupt_layer and plan.count:
                self._corrupt_left -= 1
                off = int(plan.dst_offsets[0])
                buf[off] ^= 0xFF
                log.warning("fault injection: corrupted layer %d %s at byte %d", layer, name, off)
            want = sums.get(name)
            if want is None:
                continue
            if span_checksum(buf, plan.dst_offsets, plan.nbytes) != want:
                self._counters["checksum_failures"] += 1
                if attempt + 1 < 2:  # one retransmit, then fail
                    r.retransmits += 1
                    self._counters["retransmits"] += 1
                    self._send(r.peer or "", P.LayerNack(
                        src=self.address, gen=self.generation, room=r.room, layer=layer,
                        attempt=attempt, reason=f"checksum mismatch in {name}"))
                    self._post_recv_layer(r, layer, attempt + 1)
                else:
                    self._fail(r, ChecksumMismatch(layer=layer, region=name), notify="failed")
                return
            r.checksums_verified += 1
            self._counters["checksums_verified"] += 1
        for name in regions:
            n = r.plans[name].total_bytes
            r.bytes_moved += n
            self._counters["bytes_received"] += n
        self._apply(r, LayerLanded(layer=layer))
        r.layer_events[layer].set()
        if all(ev.is_set() for ev in r.layer_events.values()):
            self._apply(r, AllLayersLanded())
            self._send(r.peer or "", P.RoomAck(src=self.address, gen=self.generation,
                                               room=r.room))

    # ------------------------------------------------------------------ failure / release

    def _apply(self, r: _Room, ev: Any) -> None:
        """(lock held) Feeds a progress event; reacts to terminal states."""
        r.machine.apply(ev, time.monotonic())
        if r.machine.is_terminal:
            self._terminal(r)

    def _fail(self, r: _Room, ev: FailureEvent, *, notify: str | None) -> None:
        """(lock held) Fails the room (first failure wins) and tells the peer."""
        if r.machine.is_terminal:
            return
        r.machine.apply(ev, time.monotonic())
        log.info("room %d (%s) failed: %s", r.room, self.role.value, r.machine.failure)
        if notify and r.peer:
            reason = r.machine.failure or "failed"
            if notify == "abort":
                self._send(r.peer, P.Abort(src=self.address, gen=self.generation, room=r.room,
                                           reason=reason))
            else:
                self._send(r.peer, P.Failed(src=self.address, gen=self.generation, room=r.room,
                                            reason=reason))
        self._terminal(r)

    def _terminal(self, r: _Room) -> None:
        now = time.monotonic()
        r.t_done = now
        ok = r.machine.state is KVPoll.Success
        self._counters["rooms_success" if ok else "rooms_failed"] += 1
        if not ok:
            for ev in r.layer_events.values():
                ev.set()  # wake waiters; wait_for_layer reports False for a failed room
            for tag in list(r.inflight_tags):
                try:
                    self.transport.cancel(r.peer or "", tag)
                except KVHandoffError:
                    pass
        r.done.set()
        self._maybe_release(r)

    def _maybe_release(self, r: _Room) -> None:
        if r.inflight_tags or r.released.is_set():
            return
        r.released.set()
        if r.on_release is not None:
            try:
                r.on_release(r.room)
            except Exception:  # an engine callback must not kill the agent
                log.exception("on_release callback of room %d raised", r.room)

    def _room_stats(self, r: _Room) -> dict[str, Any]:
        with self._lock:
            return {
                "room": r.room, "state": r.machine.state.name, "failure": r.machine.failure,
                "bytes": r.bytes_moved, "retransmits": r.retransmits,
                "checksums_verified": r.checksums_verified,
                "descriptors": {k: p.count for k, p in r.plans.items()},
                "descriptors_before": {k: p.descriptors_before for k, p in r.plans.items()},
                "bytes_per_region": {k: p.total_bytes * len(self.layout.region(k).layer_ids)
                                     for k, p in r.plans.items()},
                "t_created": r.t_created, "t_last_ready": r.t_last_ready, "t_done": r.t_done,
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
        """(any thread) Queues a control message for the control thread."""
        s = self.settings
        kind = type(msg).__name__
        if s.fault_drop_message and kind == s.fault_drop_message:
            log.warning("fault injection: dropping %s to %s", kind, addr)
            return
        if isinstance(msg, P.Heartbeat) and s.fault_refuse_heartbeat:
            return
        if s.fault_delay_message_ms:
            when = time.monotonic() + s.fault_delay_message_ms / 1e3
            heapq.heappush(self._timers, (when, next(self._timer_seq),
                                          lambda: self._outbox.append((addr, msg))))
            return
        self._outbox.append((addr, msg))

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
            if self._router in events:
                for _ in range(1000):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames[1:])  # drop the ROUTER identity frame
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
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
        with self._lock:
            for room, infos in self._pending_done.items():
                r = self._rooms.get(room)
                if r is not None and r.peer:
                    self._send(r.peer, P.LayerDone(src=self.address, gen=self.generation,
                                                   room=room, layers=infos))
            self._pending_done.clear()
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + hb
                self._heartbeats(now, hb)
        self._flush()

    def _heartbeats(self, now: float, hb: float) -> None:
        """(lock held) Heartbeats out, dead peers and expired deadlines in."""
        by_peer: dict[str, list[int]] = {}
        for r in self._rooms.values():
            if r.machine.is_terminal:
                continue
            if r.peer is not None:
                by_peer.setdefault(r.peer, []).append(r.room)
            elif r.role is Role.PREFILL:
                # no decode yet: the bootstrap deadline bounds this wait, not the lease
                r.machine.apply(LeaseRenewed(), now)
        for p in list(self._peers.values()):
            if p.matched or p.hello_sent:
                self._send(p.addr, P.Heartbeat(src=self.address, gen=self.generation,
                                               rooms=by_peer.get(p.addr, [])))
            silent = now - p.last_seen
            if (p.matched or p.waiting) and silent > 2 * hb:
                self._peer_lost(p, f"peer {p.addr} silent for {silent:.2f}s "
                                   f"(> 2 heartbeats of {hb:g}s)")
        for r in list(self._rooms.values()):
            if not r.machine.is_terminal:
                for which in r.machine.expired(now):
                    self._fail(r, DeadlineExpired(which=which), notify="failed")
                    break
        self._gc(now)

    def _gc(self, now: float) -> None:
        keep = 600.0
        for room in [k for k, r in self._rooms.items()
                     if r.released.is_set() and r.t_done is not None and now - r.t_done > keep]:
            del self._rooms[room]

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

    def _tick_if_idle(self) -> None:
        """Nothing to do: the control thread runs the timers."""
