# TCP transport over pyzmq: explicit and loudly degraded (no RDMA; status says so).
#
# How it works: each transport binds one ROUTER on settings.agent_host, port 0, and opens one
# DEALER per connected peer (routing id = this transport's id). A send cuts its stream into the
# shared chunk grid (streams.ChunkPlan) and sends one frame pair per chunk on the DEALER:
# (b"D" + tag, chunk index, chunk count, total bytes) and the payload, zero-copy (copy=False):
# a view of the registered buffer when the chunk lies in one span, else a pooled staging buffer
# it was gathered into. The receiver's ROUTER copies each payload once into the destination
# (direct or scattered) and answers b"C" (chunk landed: the sender may reuse that staging
# buffer and send one more chunk of that op: the per-op window, window.SendWindow) and,
# when every chunk of the op landed, b"F" + status, which completes the send. With a secret
# each reply is MAC'd under its connection's key with a sequence number of its own
# (chunkauth.ReplyMac): the sender takes none that does not verify or comes out of order.
# Chunks that arrive before their receive is posted are held (as zmq frames, bounded per
# peer and in total: early.EarlyStore) until it is, and answered b"C" only then.
# Each data connection is bound to the control session with its peer (chunkauth: the DEALER
# sends a proof under the session's key before its first chunk, and again after every
# reconnect or rekey; each header frame ends with a sequence number and a MAC of header and
# payload; the receiver's replies carry a sequence number and a MAC); the ROUTER assigns
# routing ids itself
# (no ROUTER_HANDOVER: a sender cannot pick, reuse or take over another's) and lands a chunk
# only from a connection that proved its peer. High-water marks and the largest message are
# bounded.
#
# The transport composes owned parts: its op table (optable.OpTable: buffers, peers, pending
# ops, completion delivery), its I/O thread (iothread.IoThread: the commands it runs are
# this transport's own `_on_*` methods), and the send window (window.SendWindow).
#
# Rules: every socket is used by the one I/O thread only; other threads enqueue commands and
# wake it through a pipe. The op table's lock (`_lock`) guards the op tables, each op's
# `finished` flag and every write into destination memory, so an op finishes exactly once
# and, after cancel() returns, nothing of that tag is written. Callbacks run on the op
# table's CallbackThread, outside the lock.
from __future__ import annotations

import collections
import functools
import itertools
import logging
import struct
import time
import uuid
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import zmq

from kvhandoff.errors import TransportError
from kvhandoff.netaddr import split_zmq_endpoint
from kvhandoff.transports.base import OnDone, TransportKind, TransportStatus
from kvhandoff.transports.chunkauth import (
    COUNTERS,
    GMAC,
    MAC_NAMES,
    REPLY_KEYS,
    REPLY_TRAILER,
    TRAILER,
    Gate,
    Signer,
    default_mac,
    mac_note,
)
from kvhandoff.transports.early import EarlyStore
from kvhandoff.transports.iothread import IoThread
from kvhandoff.transports.optable import OpTable, TableTransport
from kvhandoff.transports.sockets import bind_router, connect_dealer
from kvhandoff.transports.streams import ChunkPlan
from kvhandoff.transports.window import ChunkOp, SendWindow

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

log = logging.getLogger(__name__)

_DATA = struct.Struct("<cQIIQ")  # b"D", tag, chunk index, chunk count, total bytes
_HEAD_BYTES = _DATA.size + TRAILER.size  # a chunk's header frame: _DATA, then its trailer
_CREDIT = struct.Struct("<cQI")  # b"C", tag, chunk index
_FINAL = struct.Struct("<cQB")  # b"F", tag, ok (1) / failed (0); then a utf-8 reason
_TOMBSTONES = 4096  # (peer id, tag) of cancelled receives whose late chunks are dropped
_HWM = 65536  # messages queued per connection and direction (credits are 17 bytes each)
PROOF_KINDS = frozenset(MAC_NAMES)  # a proof frame's first byte (chunkauth)
_NOT_TAKEN = "tcp: chunk not taken: its connection has not proven this session (say Hello)"
_NOT_TAKEN_B = _NOT_TAKEN.encode()


class _Op(ChunkOp):
    __slots__ = ("ident", "staging", "rid")

    def __init__(self, peer: str, ident: bytes, tag: int, is_send: bool, buf: np.ndarray,
                 plan: ChunkPlan, on_done: OnDone) -> None:
        super().__init__(peer, tag, is_send, buf, plan, on_done)
        self.ident = ident
        self.staging: dict[int, np.ndarray] = {}  # send: chunk -> its staging buffer
        self.rid: bytes | None = None  # (receive) the connection its last chunk came on

    @staticmethod
    def posted(is_send: bool, peer: str, address: bytes, tag: int, buf: np.ndarray,
               plan: ChunkPlan, on_done: OnDone) -> _Op:
        """The op of a post_send / post_recv (the op table's `make_op`)."""
        return _Op(peer, _split_address(address)[1], tag, is_send, buf, plan, on_done)

    def __repr__(self) -> str:
        kind = "send" if self.is_send else "recv"
        return f"<tcp {kind} peer={self.peer!r} tag={self.tag} {self.plan!r}>"


def _split_address(address: bytes) -> tuple[str, bytes]:
    try:
        text = address.decode("ascii")
        endpoint, ident = text.rsplit("/", 1)
    except (UnicodeDecodeError, ValueError):
        endpoint, ident = "", ""
    try:
        split_zmq_endpoint(endpoint)
    except ValueError:
        ident = ""
    if len(ident) != 32:
        raise TransportError(f"tcp: address {address!r} is not a tcp transport address "
                             "(tcp://host:port/<id>, tcp://[v6]:port/<id>); both agents must use "
                             "the same transport")
    return endpoint, ident.encode("ascii")


class TcpTransport(TableTransport):
    """pyzmq data transport (see module comment). Always degraded: no RDMA."""

    kind: ClassVar[TransportKind] = TransportKind.TCP

    def __init__(self, settings: Settings) -> None:
        if settings.require_rdma:
            raise TransportError("tcp transport refused: require_rdma is set and TCP has no RDMA;"
                                 " use transport=ucx on hosts with an RDMA device, or unset "
                                 "KVHANDOFF_REQUIRE_RDMA to accept the degraded TCP path")
        self._ident = uuid.uuid4().hex.encode("ascii")
        self._io = IoThread(f"kvhandoff-tcp-io-{self._ident[:8].decode()}")
        self._table = OpTable(self.kind, chunk_bytes=settings.chunk_bytes,
                              callback_thread=f"kvhandoff-tcp-cb-{self._ident[:8].decode()}",
                              make_op=_Op.posted,
                              start_send=functools.partial(self._io.put, self._on_send),
                              start_recv=functools.partial(self._io.put, self._on_recv))
        self._lock = self._table.lock
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._router, endpoint = bind_router(self._ctx, settings.agent_host, what="tcp",
                                                 handover=False, hwm=_HWM,
                                                 max_message=settings.chunk_bytes + _HEAD_BYTES)
        except TransportError:
            self._ctx.term()
            self._table.stop()
            self._io.close()
            raise
        self._address = f"{endpoint}/{self._ident.decode()}".encode("ascii")

        self._bytes_sent = 0
        self._bytes_received = 0
        # owned by the I/O thread
        self._window = SendWindow(settings.chunk_bytes, channel=self._dealer_of,
                                  emit=self._emit, fail=self._table.finish)
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._send_index: dict[tuple[str, int], _Op] = {}
        self._recv_index: dict[tuple[bytes, int], _Op] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._gate = Gate(self._ident, required=settings.hmac_secret is not None,
                          counters=self._counters)
        if self._gate.required and default_mac() != GMAC:
            log.warning("tcp: %s", mac_note())
        self._early = EarlyStore(peer_bytes=settings.tcp_early_bytes,
                                 total_bytes=4 * settings.tcp_early_bytes,
                                 counters=self._counters, keep_s=settings.stall_timeout_s)
        self._session_keys: dict[str, bytes] = {}  # (the lock) peer -> bind_session's key
        self._bound: dict[str, bytes] = {}  # (the lock) peer -> the key its connect used
        self._signers: dict[str, Signer] = {}
        # peer -> its connection's last REPLY_KEYS proofs sent (their replies are taken)
        self._proofs_sent: dict[str, collections.deque[Signer]] = {}
        self._unproved: set[str] = set()  # peers whose next chunk goes after a fresh proof
        # peer -> (its DEALER's monitor, its transport id, the session key); connections made
        self._monitors: dict[str, tuple[zmq.Socket[bytes], bytes, bytes]] = {}
        self._connects: dict[str, int] = {}
        # the order each held tag's first chunk arrived in (a count shared with disconnect()):
        # a disconnect drops only what arrived before it was called, not the chunks of a
        # reconnected peer that the I/O thread read before it got to the disconnect command
        self._seq = itertools.count()
        self._tombstones: collections.OrderedDict[tuple[bytes, int], None] = (
            collections.OrderedDict())
        self._io.start(self._run)

    # ---- public API (any thread) ----------------------------------------------------------

    def bind_session(self, peer: str, key: bytes) -> None:
        with self._lock:
            self._session_keys[peer] = bytes(key)

    def connect(self, peer: str, address: bytes) -> None:
        endpoint, ident = _split_address(address)
        with self._lock:
            key = self._session_keys.get(peer, b"")
            if self._table.known_peer(peer, address) and self._bound.get(peer) == key:
                return
            self._table.peers[peer] = address
            self._bound[peer] = key
        self._gate.bind(ident, key)  # (a known peer with a new key: the data plane follows)
        self._io.put(self._on_connect, peer, endpoint, ident, key)

    def disconnect(self, peer: str) -> None:
        ops, known = self._table.end_peer(peer, f"disconnected from peer {peer!r}")
        with self._lock:
            self._session_keys.pop(peer, None)
            self._bound.pop(peer, None)
        if known is not None:
            self._gate.unbind(_split_address(known)[1])
            self._io.put(self._on_disconnect, peer, known, ops, next(self._seq))

    def cancel(self, peer: str, tag: int) -> None:
        ops = self._table.end_tag(peer, tag)
        if ops:
            self._io.put(self._on_forget, ops, "peer cancelled")

    def status(self) -> TransportStatus:
        return TransportStatus(kind=self.kind, lanes=("tcp",), degraded=True,
                               reason="tcp transport: no RDMA (pyzmq over TCP sockets)"
                               + (f"; {mac_note()}" if self._gate.required else ""),
                               bytes_sent=self._bytes_sent, bytes_received=self._bytes_received,
                               counters=dict(self._counters))

    def __repr__(self) -> str:
        return f"<TcpTransport {self._address.decode()} peers={len(self._table.peers)}>"

    # ---- I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        io = self._io
        poller.register(io.wake_fd, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if io.wake_fd in events:
                    io.drain_wake()
                io.handle(poller)
                if io.stopped:
                    return
                self._drain_router()
                for peer, sock in list(self._dealers.items()):
                    self._drain_dealer(peer, sock)
                for peer in [p for p, m in self._monitors.items() if m[0] in events]:
                    self._drain_monitor(peer)
                self._window.pump()
        except Exception:
            log.exception("tcp transport I/O thread failed")
            self._table.close("tcp transport I/O thread failed")
        finally:
            for sock in self._dealers.values():
                sock.close(linger=0)
            for mon, _, _ in self._monitors.values():
                mon.close(linger=0)
            self._router.close(linger=0)
            self._ctx.term()

    def _on_connect(self, poller: zmq.Poller, peer: str, endpoint: str, ident: bytes,
                    key: bytes) -> bool:
        sock = self._dealers.get(peer)
        if sock is None:
            # no routing id of ours: the peer's ROUTER names this connection itself; the send
            # side unbounded (the per-op window bounds what is queued)
            sock, mon = connect_dealer(self._ctx, None, endpoint, hwm=0, rcvhwm=_HWM,
                                       monitor=zmq.EVENT_CONNECTED)
            assert mon is not None
            self._dealers[peer] = sock
            self._monitors[peer] = (mon, ident, key)
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        else:  # a new session with the same peer: prove it on the same connection
            mon = self._monitors[peer][0]
            self._monitors[peer] = (mon, ident, key)
        self._prove(peer)
        return True

    def _prove(self, peer: str) -> None:
        """A fresh proof (new nonce), sent ahead of the next chunk to this peer (`_emit`): by
        then the peer asked for chunks under the session, so it holds the key and checks the
        proof at once (it holds none for later)."""
        key = self._monitors[peer][2]
        self._signers[peer] = Signer(key)
        self._unproved.add(peer)

    def _drain_monitor(self, peer: str) -> None:
        """A reconnected connection is a new one to the peer's ROUTER: prove it again (the
        first connect's proof went out with connect)."""
        mon = self._monitors[peer][0]
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames[0]) >= 2 and struct.unpack_from("<H", frames[0])[0] == \
                    zmq.EVENT_CONNECTED:
                self._connects[peer] = self._connects.get(peer, 0) + 1
                if self._connects[peer] > 1:
                    self._prove(peer)

    def _on_disconnect(self, poller: zmq.Poller, peer: str, address: bytes,
                       ops: list[_Op], cut: int) -> bool:
        ident = _split_address(address)[1]
        self._on_forget(poller, ops, "peer disconnected")
        sock = self._dealers.pop(peer, None)
        if sock is not None:
            poller.unregister(sock)
            sock.disable_monitor()
            sock.close(linger=0)
        mon = self._monitors.pop(peer, None)
        if mon is not None:
            poller.unregister(mon[0])
            mon[0].close(linger=0)
        self._signers.pop(peer, None)
        self._proofs_sent.pop(peer, None)
        self._unproved.discard(peer)
        self._connects.pop(peer, None)
        self._gate.forget(ident)
        self._early.drop_peer(ident, cut)
        return True

    def _on_forget(self, poller: zmq.Poller, ops: list[_Op], why: str) -> bool:
        for op in ops:
            if op.is_send:
                if self._send_index.get((op.peer, op.tag)) is op:
                    del self._send_index[(op.peer, op.tag)]
            elif self._recv_index.get((op.ident, op.tag)) is op:
                del self._recv_index[(op.ident, op.tag)]
                self._tombstone(op.ident, op.tag)
                self._reply(op, _FINAL.pack(b"F", op.tag, 0), why.encode())
        return True

    def _reply(self, op: _Op, head: bytes, reason: bytes) -> None:
        """To the connection the receive's chunks came on, else its peer's proven connection
        (none: the peer has sent nothing to tell)."""
        rid = op.rid or self._gate.route(op.ident)
        if rid is not None:
            self._answer(rid, head, reason)

    def _answer(self, rid: bytes, head: bytes, reason: bytes | None = None) -> None:
        """A reply (a credit: no `reason`; a final) to connection `rid`; with a secret MAC'd
        under what that connection proved (chunkauth.Gate.seal)."""
        if self._gate.required:
            head = self._gate.seal(rid, head, reason or b"")
        self._router.send_multipart([rid, head] if reason is None else [rid, head, reason])

    def _tombstone(self, ident: bytes, tag: int) -> None:
        self._early.discard((ident, tag))
        self._tombstones[(ident, tag)] = None
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _on_send(self, poller: zmq.Poller, op: _Op) -> bool:
        if op.finished:
            return True
        self._send_index[(op.peer, op.tag)] = op
        self._window.add(op)
        return True

    def _on_recv(self, poller: zmq.Poller, op: _Op) -> bool:
        if op.finished:
            return True
        key = (op.ident, op.tag)
        if self._early.overflowed(key):  # its sender was told when its chunks were dropped
            self._early.unmark(key)
            self._tombstone(op.ident, op.tag)
            self._table.finish(op, f"tcp: tag {op.tag}: chunks that came before this receive "
                                   "was posted went over the bound of held chunks "
                                   "(tcp_early_bytes) and were dropped")
            return True
        self._tombstones.pop(key, None)
        self._recv_index[key] = op
        for k, n, total, frame, rid in self._early.take(key):
            self._answer(rid, _CREDIT.pack(b"C", op.tag, k))
            self._land(op, k, n, total, frame, rid)
        return True

    # ---- send window hooks (window.SendWindow) --------------------------------------------

    def _dealer_of(self, op: _Op) -> zmq.Socket[bytes] | None:
        return self._dealers.get(op.peer)

    def _emit(self, channel: zmq.Socket[bytes], op: _Op, k: int, view: np.ndarray,
              stage: np.ndarray | None) -> None:
        if stage is not None:
            op.staging[k] = stage  # back to the pool when the receiver's credit comes
        plan = op.plan
        head = _DATA.pack(b"D", op.tag, k, plan.nchunks, plan.total)
        if op.peer in self._unproved:
            self._unproved.discard(op.peer)
            signer = self._signers[op.peer]
            channel.send(signer.proof(self._ident, self._monitors[op.peer][1]))
            self._proofs_sent.setdefault(
                op.peer, collections.deque(maxlen=REPLY_KEYS)).append(signer)
        channel.send_multipart([head + self._signers[op.peer].trailer(head, view), view.data],
                               copy=False)
        self._bytes_sent += view.size

    def _drain_dealer(self, peer: str, sock: zmq.Socket[bytes]) -> None:
        required = self._gate.required
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if required:
                verified = self._verified(peer, frames)
                if verified is None:
                    continue
                head = verified
            else:
                head = frames[0]
            if head[:1] == b"C" and len(head) == _CREDIT.size:
                _, tag, k = _CREDIT.unpack(head)
                op = self._send_index.get((peer, tag))
                if op is not None:
                    self._window.credit(op, op.staging.pop(k, None))
            elif head[:1] == b"F" and len(head) == _FINAL.size:
                _, tag, ok = _FINAL.unpack(head)
                op = self._send_index.pop((peer, tag), None)
                reason = None if ok else (frames[1].decode("utf-8", "replace")
                                          if len(frames) > 1 else "receiver failed")
                if reason == _NOT_TAKEN:  # the peer did not take our proof: a fresh one
                    self._prove(peer)
                if op is not None:
                    self._table.finish(op, reason)
            else:
                log.warning("tcp: dropping a malformed frame from peer %r", peer)

    def _verified(self, peer: str, frames: list[bytes]) -> bytes | None:
        """A reply's header without its trailer, if its MAC verifies under one of this
        connection's recent proofs with a sequence number above the last taken there; else
        None, counted: a forged, replayed or reordered reply (`data_forged_replies`), or a
        "not taken" the receiver could not MAC (`data_unverified_replies`: taken as a hint to
        prove the connection again, once per proof sent, never to fail a send)."""
        raw = frames[0]
        reason = frames[1] if len(frames) > 1 else b""
        if len(frames) <= 2 and len(raw) > REPLY_TRAILER.size:
            head = raw[:-REPLY_TRAILER.size]
            seq, mac = REPLY_TRAILER.unpack_from(raw, len(head))
            for signer in reversed(self._proofs_sent.get(peer, ())):
                if signer.reply is not None and signer.reply.take(seq, head, reason, mac):
                    return head
            if head[:1] == b"F" and len(head) == _FINAL.size and reason == _NOT_TAKEN_B:
                self._counters["data_unverified_replies"] += 1
                if peer not in self._unproved and peer in self._monitors:
                    self._prove(peer)
                return None
        self._counters["data_forged_replies"] += 1
        return None

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid = frames[0].bytes
            if len(frames) == 2 and frames[1].bytes[:1] in PROOF_KINDS:
                self._gate.on_proof(rid, frames[1].bytes)
                continue
            if len(frames) != 3 or len(frames[1].bytes) != _HEAD_BYTES:
                log.debug("tcp: dropping a malformed message (%d frames)", len(frames))
                continue
            head = frames[1].bytes
            kind, tag, k, n, total = _DATA.unpack_from(head)
            if kind != b"D":
                continue
            ident = self._gate.check(rid, head[:_DATA.size], head[_DATA.size:],
                                     frames[2].buffer)
            if ident is None:  # dropped (counted); told once per proof it sent
                if self._gate.tell(rid):
                    self._answer(rid, _FINAL.pack(b"F", tag, 0), _NOT_TAKEN_B)
                continue
            key = (ident, tag)
            op = self._recv_index.get(key)
            if op is not None:
                self._answer(rid, _CREDIT.pack(b"C", tag, k))
                self._land(op, k, n, total, frames[2], rid)
            elif key in self._tombstones:
                self._answer(rid, _CREDIT.pack(b"C", tag, k))
            elif not self._hold_early(key, (k, n, total, frames[2], rid), len(frames[2])):
                self._answer(rid, _FINAL.pack(b"F", tag, 0), (
                    f"tcp: tag {tag}: chunks sent before the receiver posted its receive went "
                    "over its bound (tcp_early_bytes); dropped").encode())

    def _hold_early(self, key: tuple[bytes, int], item: tuple[int, int, int, zmq.Frame, bytes],
                    nbytes: int) -> bool:
        """Holds an early chunk; first drops the tags held longer than the store keeps them
        (their receive was never posted: each sender is told, as over the bound)."""
        now = time.monotonic()
        for (_, tag), items in self._early.expire(now):
            for rid in {it[4] for it in items}:
                self._answer(rid, _FINAL.pack(b"F", tag, 0), (
                    f"tcp: tag {tag}: chunks held {self._early.keep_s:.0f} s without a "
                    "receive posted (stall_timeout_s); dropped").encode())
        return self._early.hold(key, item, nbytes, next(self._seq), now=now)

    def _land(self, op: _Op, k: int, n: int, total: int, frame: zmq.Frame, rid: bytes) -> None:
        op.rid = rid
        plan = op.plan
        data = frame.buffer
        if total != plan.total or n != plan.nchunks or k >= n or len(data) != plan.chunk_len(k):
            reason = (f"size mismatch on tag {op.tag}: sender has {total} bytes, receiver "
                      f"expects {plan.total}")
            self._recv_index.pop((op.ident, op.tag), None)
            self._tombstone(op.ident, op.tag)
            self._reply(op, _FINAL.pack(b"F", op.tag, 0), reason.encode())
            self._table.finish(op, reason)
            return
        start = plan.direct(k)
        src = np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            if op.finished:
                return
            if start is not None:
                op.buf[start:start + src.size] = src
            else:
                plan.scatter(op.buf, k, src)
            op.landed += 1
            self._bytes_received += src.size
            complete = op.landed == plan.nchunks
        if complete:
            self._recv_index.pop((op.ident, op.tag), None)
            self._reply(op, _FINAL.pack(b"F", op.tag, 1), b"")
            self._table.finish(op, None)

