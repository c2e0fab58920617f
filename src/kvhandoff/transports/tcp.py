# TCP transport over pyzmq: explicit and loudly degraded (no RDMA; status says so).
#
# How it works: each transport binds one ROUTER on settings.agent_host, port 0, and opens one
# DEALER per connected peer (routing id = this transport's id). A send cuts its stream into the
# shared chunk grid (_chunks.ChunkPlan) and sends one frame pair per chunk on the DEALER:
# (b"D" + tag, chunk index, chunk count, total bytes) and the payload, zero-copy (copy=False):
# a view of the registered buffer when the chunk lies in one span, else a pooled staging buffer
# it was gathered into. The receiver's ROUTER copies each payload once into the destination
# (direct or scattered) and answers b"C" (chunk arrived: the sender may reuse that staging
# buffer and send one more chunk of that op: the shared per-op window, _threaded.WINDOW) and,
# when every chunk of the op landed, b"F" + status, which completes the send. Chunks that
# arrive before their receive is posted are held (as zmq frames) until it is.
#
# Rules: every socket is used by the one I/O thread only; other threads enqueue commands and
# wake it through a pipe. `_lock` guards the op tables, each op's `finished` flag and every
# write into destination memory, so an op finishes exactly once and, after cancel() returns,
# nothing of that tag is written. Callbacks run on a separate CallbackThread, outside the lock.
from __future__ import annotations

import collections
import itertools
import logging
import struct
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import zmq

from kvhandoff.buffers.devsum import refuse_device_memory
from kvhandoff.errors import TransportError
from kvhandoff.netaddr import split_zmq_endpoint, zmq_endpoint, zmq_ipv6
from kvhandoff.transports.base import OnDone, TransportKind, TransportStatus
from kvhandoff.transports.streams import ChunkPlan, check_tag
from kvhandoff.transports.threaded import IoCommand, ThreadedTransport

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

log = logging.getLogger(__name__)

_DATA = struct.Struct("<cQIIQ")  # b"D", tag, chunk index, chunk count, total bytes
_CREDIT = struct.Struct("<cQI")  # b"C", tag, chunk index
_FINAL = struct.Struct("<cQB")  # b"F", tag, ok (1) / failed (0); then a utf-8 reason
_TOMBSTONES = 4096  # (peer id, tag) of cancelled receives whose late chunks are dropped


class _Op:
    __slots__ = ("peer", "ident", "tag", "is_send", "buf", "plan", "on_done", "finished",
                 "next_chunk", "inflight", "landed", "staging")

    def __init__(self, peer: str, ident: bytes, tag: int, is_send: bool, buf: np.ndarray,
                 plan: ChunkPlan, on_done: OnDone) -> None:
        self.peer = peer
        self.ident = ident
        self.tag = tag
        self.is_send = is_send
        self.buf = buf
        self.plan = plan
        self.on_done = on_done
        self.finished = False
        self.next_chunk = 0
        self.inflight = 0
        self.landed = 0
        self.staging: dict[int, np.ndarray] = {}

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


class TcpTransport(ThreadedTransport):
    """pyzmq data transport (see module comment). Always degraded: no RDMA."""

    kind: ClassVar[TransportKind] = TransportKind.TCP

    def __init__(self, settings: Settings) -> None:
        if settings.require_rdma:
            raise TransportError("tcp transport refused: require_rdma is set and TCP has no RDMA;"
                                 " use transport=ucx on hosts with an RDMA device, or unset "
                                 "KVHANDOFF_REQUIRE_RDMA to accept the degraded TCP path")
        self._ident = uuid.uuid4().hex.encode("ascii")
        self._init_threaded(settings.chunk_bytes, f"kvhandoff-tcp-cb-{self._ident[:8].decode()}")
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.IPV6, zmq_ipv6(settings.agent_host))
        try:
            self._router.bind(zmq_endpoint(settings.agent_host, 0))
        except zmq.ZMQError as e:
            self._router.close()
            self._ctx.term()
            self._abandon_threaded()
            raise TransportError(f"tcp: cannot bind agent_host={settings.agent_host!r}: {e}") from e
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._address = f"{endpoint}/{self._ident.decode()}".encode("ascii")

        self._bytes_sent = 0
        self._bytes_received = 0
        # owned by the I/O thread
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._send_index: dict[tuple[str, int], _Op] = {}
        self._recv_index: dict[tuple[bytes, int], _Op] = {}
        self._unexpected: dict[tuple[bytes, int], list[tuple[int, int, int, zmq.Frame]]] = {}
        # when each held tag's first chunk arrived (a count shared with disconnect()): a
        # disconnect drops only what arrived before it was called, not the chunks of a
        # reconnected peer that the I/O thread read before it got to the disconnect command
        self._seq = itertools.count()
        self._unexpected_seq: dict[tuple[bytes, int], int] = {}
        self._tombstones: collections.OrderedDict[tuple[bytes, int], None] = (
            collections.OrderedDict())
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvhandoff-tcp-io-{self._ident[:8].decode()}")
        self._thread.start()

    # ---- public API (any thread) ----------------------------------------------------------

    def register(self, name: str, buf: np.ndarray) -> None:
        refuse_device_memory("tcp", name, buf)  # CUDA memory: say which transport can
        super().register(name, buf)

    @property
    def address(self) -> bytes:
        return self._address

    def connect(self, peer: str, address: bytes) -> None:
        endpoint, _ = _split_address(address)
        with self._lock:
            self._check_open()
            known = self._peers.get(peer)
            if known == address:
                return
            if known is not None:
                raise TransportError(f"connect {peer!r}: already connected at another address; "
                                     "disconnect first")
            self._peers[peer] = address
        self._command(IoCommand.CONNECT, peer, endpoint)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            ops = [op for op in self._ops.values() if op.peer == peer]
            done = self._finish_locked(ops, f"disconnected from peer {peer!r}")
            known = self._peers.pop(peer, None)
        self._deliver(done)
        if known is not None:
            self._command(IoCommand.DISCONNECT, peer, known, ops, next(self._seq))

    def cancel(self, peer: str, tag: int) -> None:
        tag = check_tag(tag)
        with self._lock:
            ops = [op for k in ((peer, tag, True), (peer, tag, False))
                   if (op := self._ops.get(k)) is not None]
            done = self._finish_locked(ops, f"cancelled: tag {tag} peer {peer!r}")
        self._deliver(done)
        if ops:
            self._command(IoCommand.FORGET, ops, "peer cancelled")

    def status(self) -> TransportStatus:
        return TransportStatus(kind=self.kind, lanes=("tcp",), degraded=True,
                               reason="tcp transport: no RDMA (pyzmq over TCP sockets)",
                               bytes_sent=self._bytes_sent, bytes_received=self._bytes_received)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            done = self._finish_locked(list(self._ops.values()), "tcp transport closed")
        self._deliver(done)
        self._shutdown_io()

    def __repr__(self) -> str:
        return f"<TcpTransport {self._address.decode()} peers={len(self._peers)}>"

    # ---- helpers (any thread) -------------------------------------------------------------

    def _make_op(self, is_send: bool, peer: str, address: bytes, tag: int, buf: np.ndarray,
                 plan: ChunkPlan, on_done: OnDone) -> _Op:
        return _Op(peer, _split_address(address)[1], tag, is_send, buf, plan, on_done)

    # ---- I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        handlers: dict[IoCommand, Callable[..., bool]] = {
            IoCommand.CONNECT: self._on_connect, IoCommand.DISCONNECT: self._on_disconnect,
            IoCommand.SEND: self._on_send, IoCommand.RECV: self._on_recv,
            IoCommand.FORGET: self._on_forget,
        }
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    self._drain_wake()
                while self._commands:
                    cmd = self._commands.popleft()
                    if cmd[0] is IoCommand.STOP:
                        return
                    handlers[cmd[0]](poller, *cmd[1:])
                self._drain_router()
                for peer, sock in list(self._dealers.items()):
                    self._drain_dealer(peer, sock)
                self._pump_sends()
        except Exception:
            log.exception("tcp transport I/O thread failed")
            with self._lock:
                self._closed = True
                done = self._finish_locked(list(self._ops.values()),
                                           "tcp transport I/O thread failed")
            self._deliver(done)
        finally:
            for sock in self._dealers.values():
                sock.close(linger=0)
            self._router.close(linger=0)
            self._ctx.term()

    def _on_connect(self, poller: zmq.Poller, peer: str, endpoint: str) -> bool:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._ident)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, zmq_ipv6(split_zmq_endpoint(endpoint)[0]))
        sock.connect(endpoint)
        self._dealers[peer] = sock
        poller.register(sock, zmq.POLLIN)
        return True

    def _on_disconnect(self, poller: zmq.Poller, peer: str, address: bytes,
                       ops: list[_Op], cut: int) -> bool:
        ident = _split_address(address)[1]
        self._on_forget(poller, ops, "peer disconnected")
        sock = self._dealers.pop(peer, None)
        if sock is not None:
            poller.unregister(sock)
            sock.close(linger=0)
        for key in [k for k in self._unexpected
                    if k[0] == ident and self._unexpected_seq.get(k, -1) < cut]:
            del self._unexpected[key]
            self._unexpected_seq.pop(key, None)
        return True

    def _on_forget(self, poller: zmq.Poller, ops: list[_Op], why: str) -> bool:
        for op in ops:
            if op.is_send:
                if self._send_index.get((op.peer, op.tag)) is op:
                    del self._send_index[(op.peer, op.tag)]
            elif self._recv_index.get((op.ident, op.tag)) is op:
                del self._recv_index[(op.ident, op.tag)]
                self._tombstone(op.ident, op.tag)
                self._router.send_multipart([op.ident, _FINAL.pack(b"F", op.tag, 0),
                                             why.encode()])
        return True

    def _tombstone(self, ident: bytes, tag: int) -> None:
        self._unexpected.pop((ident, tag), None)
        self._unexpected_seq.pop((ident, tag), None)
        self._tombstones[(ident, tag)] = None
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _on_send(self, poller: zmq.Poller, op: _Op) -> bool:
        if op.finished:
            return True
        self._send_index[(op.peer, op.tag)] = op
        self._active_sends.append(op)
        return True

    def _on_recv(self, poller: zmq.Poller, op: _Op) -> bool:
        if op.finished:
            return True
        key = (op.ident, op.tag)
        self._tombstones.pop(key, None)
        self._recv_index[key] = op
        self._unexpected_seq.pop(key, None)
        for k, n, total, frame in self._unexpected.pop(key, []):
            self._land(op, k, n, total, frame)
        return True

    # ---- send window hooks (_threaded._pump_sends) ----------------------------------------

    def _channel(self, op: _Op) -> zmq.Socket[bytes] | None:
        return self._dealers.get(op.peer)

    def _emit(self, channel: zmq.Socket[bytes], op: _Op, k: int, view: np.ndarray,
              stage: np.ndarray | None) -> None:
        if stage is not None:
            op.staging[k] = stage  # back to the pool when the receiver's credit comes
        plan = op.plan
        channel.send_multipart([_DATA.pack(b"D", op.tag, k, plan.nchunks, plan.total),
                                view.data], copy=False)
        self._bytes_sent += view.size

    def _drain_dealer(self, peer: str, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            head = frames[0]
            if head[:1] == b"C" and len(head) == _CREDIT.size:
                _, tag, k = _CREDIT.unpack(head)
                op = self._send_index.get((peer, tag))
                if op is not None:
                    op.inflight -= 1
                    self._unstage(op.staging.pop(k, None))
            elif head[:1] == b"F" and len(head) == _FINAL.size:
                _, tag, ok = _FINAL.unpack(head)
                op = self._send_index.pop((peer, tag), None)
                if op is not None:
                    reason = None if ok else (frames[1].decode("utf-8", "replace")
                                              if len(frames) > 1 else "receiver failed")
                    self._finish(op, reason)
            else:
                log.warning("tcp: dropping a malformed frame from peer %r", peer)

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1].bytes) != _DATA.size:
                log.warning("tcp: dropping a malformed message (%d frames)", len(frames))
                continue
            ident = frames[0].bytes
            kind, tag, k, n, total = _DATA.unpack(frames[1].bytes)
            if kind != b"D":
                continue
            self._router.send_multipart([ident, _CREDIT.pack(b"C", tag, k)])
            key = (ident, tag)
            op = self._recv_index.get(key)
            if op is not None:
                self._land(op, k, n, total, frames[2])
            elif key not in self._tombstones:
                if key not in self._unexpected:
                    self._unexpected_seq[key] = next(self._seq)
                self._unexpected.setdefault(key, []).append((k, n, total, frames[2]))

    def _land(self, op: _Op, k: int, n: int, total: int, frame: zmq.Frame) -> None:
        plan = op.plan
        data = frame.buffer
        if total != plan.total or n != plan.nchunks or k >= n or len(data) != plan.chunk_len(k):
            reason = (f"size mismatch on tag {op.tag}: sender has {total} bytes, receiver "
                      f"expects {plan.total}")
            self._recv_index.pop((op.ident, op.tag), None)
            self._tombstone(op.ident, op.tag)
            self._router.send_multipart([op.ident, _FINAL.pack(b"F", op.tag, 0),
                                         reason.encode()])
            self._finish(op, reason)
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
            self._router.send_multipart([op.ident, _FINAL.pack(b"F", op.tag, 1), b""])
            self._finish(op, None)

