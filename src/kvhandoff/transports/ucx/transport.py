# UCX transport through ucxx's low-level API (ucxx._lib.libucxx), driven by one I/O thread.
#
# How it works:
# - One UCP context + worker per transport, in blocking-progress mode. This transport's address
#   is the worker address behind a small envelope naming the host (a hash of boot id and host
#   name). Endpoints to peers on ANOTHER host use UCX peer error handling (RDMA and TCP lanes
#   support it: a dead peer fails the requests). Endpoints to peers on THIS host are created
#   with error handling OFF, because that is what enables the shared-memory lanes (sysv/posix +
#   cma; with it on, UCX picks TCP only: 3 GB/s instead of 10 here); the agent's heartbeats
#   detect dead peers. The price, a UCX limitation: if a same-host peer dies while this side is
#   writing into its memory (cma), UCX aborts this process. `ucx_same_host_error_handling`
#   trades the speed for safety; status() says which peers run unprotected.
# - A send cuts its stream into the shared chunk grid (_chunks.ChunkPlan); chunk k goes as one
#   tagged message with UCX tag = H(sender address, tag) ^ k, so tags never collide across peers
#   or directions. With a shared secret H is HMAC-SHA256 under a key of the control session
#   (`bind_session`, `tag_key`): a sender without that session's key cannot make a tag a
#   posted receive matches (without one, xxh3 of what both sides know). A chunk inside one
#   span is sent straight from the registered buffer; other chunks are gathered into pooled
#   staging buffers; the send window is the shared one (window.SendWindow: WINDOW chunks per
#   op in flight).
# - The receiver never pre-posts: it probes the worker for any arrived message (tag_probe with an
#   empty mask, remove=True) and matches it against posted receives (_ucx_matcher), receiving
#   it with its handle straight into destination memory (or a staging buffer + scatter).
#   Messages for receives not posted yet are held, bounded per stream and in total by
#   tcp_early_bytes and aged by stall_timeout_s (the matcher; drops counted in
#   data_early_dropped); a dropped message is received truncated into a small scratch.
# - Endpoints outlive disconnect() (_ucx_endpoints: why, and when they are closed instead).
#   While UCX may still touch the peer's memory for us (a rendezvous send in flight, or a
#   receive in flight unless UCX_RNDV_SCHEME=put_zcopy), disconnect() closes the endpoint,
#   since closing is what stops that (the peer may be dead: a cma write to a dead same-host
#   peer aborts this process). Our endpoint made after that is paired with one UCX made on the
#   peer's side, so what the peer sends us still works; what it sends on its old endpoint does
#   not (the limitation left: a peer both receiving and sending).
# - status() names the UCX build (version, library, verbs / rdmacm: _ucx_lanes.ucx_build).
# - The Python API is not thread-safe, so only the I/O thread touches UCX; other threads enqueue
#   commands and wake it with a pipe polled together with the worker's epoll fd.
# - The transport composes owned parts: its op table (optable.OpTable: buffers, peers, pending
#   ops, completion delivery), its I/O thread (iothread.IoThread: the commands it runs are
#   this transport's own `_on_*` methods), and the send window (window.SendWindow).
#
# Rules: the op table's lock (`_lock`) guards the op tables, each op's `finished` flag and
# every scatter into user memory. cancel() of a receive waits (bounded by
# settings.stall_timeout_s) for direct receives already in flight into its memory, so after it
# returns nothing of that tag writes there.
# A receive's on_done comes only once none of its direct receives is in flight: one that ends
# while some are (a chunk's error or size mismatch, a cancel, a disconnect) is held (`held`)
# and delivered when the last of them completes (or UCX gave up the peer's endpoint, or the
# transport closed and cancelled what was left), so the caller never reuses memory UCX may
# still be writing.
# Callbacks run on a separate CallbackThread, outside the lock.
from __future__ import annotations

import functools
import hmac
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xxhash

from kvhandoff.errors import TransportError
from kvhandoff.protocol.wire import hkdf_sha256
from kvhandoff.transports.base import OnDone, TransportKind, TransportStatus
from kvhandoff.transports.hostid import host_id
from kvhandoff.transports.iothread import IoThread
from kvhandoff.transports.optable import Done, OpTable, TableTransport
from kvhandoff.transports.streams import ChunkPlan
from kvhandoff.transports.window import ChunkOp, SendWindow

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

_ENV_BEFORE = dict(os.environ)
# Tuning measured on this machine (docs/PERFORMANCE.md); the user's own values win.
os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")
# ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer reads; do not warn about it on stdout
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # noqa: E402  (loads libucx and sets ucxx's env defaults)
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

# What importing this module (and ucxx under it) put into this process's environment: each name
# with the value it had before (None: unset). Child processes inherit it; one that must run with
# the user's own UCX settings (the bench's NIXL baseline: NIXL as its users run it) takes it out.
ENV_ADDED: dict[str, str | None] = {k: _ENV_BEFORE.get(k) for k, v in os.environ.items()
                                    if _ENV_BEFORE.get(k) != v}
del _ENV_BEFORE

from kvhandoff.transports.ucx.endpoints import EndpointCache  # noqa: E402
from kvhandoff.transports.ucx.lanes import (  # noqa: E402
    ADDR_MAGIC,
    LOCAL_TLS,
    UcxBuild,
    ep_lanes,
    resources,
    split_address,
    tcp_only,
    ucx_build,
)
from kvhandoff.transports.ucx.matcher import ReceiveMatcher  # noqa: E402

log = logging.getLogger(__name__)

UCXX_VERSION = ucxx.__version__
_DISCARD_MAX = 1 << 16  # streams of cancelled receives whose late messages are dropped
_IDLE_EPS_MAX = 64  # endpoints of disconnected peers kept for a reconnect to the same address
_CHUNK_BITS = 24  # chunk index bits XORed into the UCX tag
# a dropped message is received into one shared scratch of this size, truncated when longer
# (UCX completes a truncated tag receive with UCS_ERR_MESSAGE_TRUNCATED, and the sender's send
# still completes), so dropping what a stranger sent costs no memory of its size
_SCRATCH_BYTES = 4096


def tag_key(session_key: bytes) -> bytes:
    """The key of the UCX tags of one control session (HKDF of its session key, a label of
    its own)."""
    return hkdf_sha256(session_key, salt=b"", info=b"kvhandoff ucx tags 1")


def _tag_base(sender: bytes, tag: int, key: bytes = b"") -> int:
    """The UCX tag of chunk 0 of (`sender`'s address, `tag`): keyed by the session's tag key
    (`tag_key`) when the session has one, so only a holder of that session key can make a
    chunk the receiver matches; without one (no shared secret) xxh3 of what both sides know."""
    msg = sender + tag.to_bytes(8, "little")
    h = (int.from_bytes(hmac.digest(key, msg, "sha256")[:8], "little") if key
         else xxhash.xxh3_64_intdigest(msg))
    return h & ~((1 << _CHUNK_BITS) - 1)


class _Op(ChunkOp):
    __slots__ = ("base", "direct_inflight", "held")

    def __init__(self, peer: str, tag: int, is_send: bool, buf: np.ndarray, plan: ChunkPlan,
                 on_done: OnDone, base: int) -> None:
        super().__init__(peer, tag, is_send, buf, plan, on_done)
        self.base = base  # the UCX tag of chunk 0 (chunk k: base ^ k)
        self.direct_inflight = 0  # receives in flight straight into user memory
        # finished while direct receives were in flight: its on_done result, delivered once
        # the last of them ended (a 1-tuple; None: nothing held)
        self.held: tuple[BaseException | None] | None = None

    def __repr__(self) -> str:
        kind = "send" if self.is_send else "recv"
        return f"<ucx {kind} peer={self.peer!r} tag={self.tag} {self.plan!r}>"


class _Inflight:
    __slots__ = ("req", "op", "k", "stage", "direct")

    def __init__(self, req: Any, op: _Op | None, k: int, stage: np.ndarray | None,
                 direct: bool) -> None:
        self.req = req
        self.op = op
        self.k = k
        self.stage = stage
        self.direct = direct


class UcxTransport(TableTransport):
    """UCX data transport over ucxx's low-level API (see module comment)."""

    kind: ClassVar[TransportKind] = TransportKind.UCX

    def __init__(self, settings: Settings) -> None:
        if int(settings.chunk_bytes) >= (1 << 31):
            raise TransportError("ucx: chunk_bytes must be < 2 GiB")
        self._require_rdma = bool(settings.require_rdma)
        self._same_host_err = bool(settings.ucx_same_host_error_handling)
        self._cancel_bound_s = float(settings.stall_timeout_s)
        try:
            self._ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,
                                                          ucx_api.Feature.WAKEUP))
            self._worker = ucx_api.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()
            self._host = host_id()
            self._address = ADDR_MAGIC + self._host + bytes(self._worker.address.tobytes())
            self._epoll_fd = int(self._worker.epoll_file_descriptor)
        except ucx_api.UCXError as e:
            raise TransportError(f"ucx: cannot create a UCP context/worker: {e}") from e
        self._resources = resources(self._ctx.info)
        self._rdma = [r for r in self._resources
                      if r.split("/")[0] not in LOCAL_TLS and not r.startswith("tcp/")]
        self._tls_config = os.environ.get("UCX_TLS", "all")
        self.build: UcxBuild = ucx_build()
        # rendezvous: the sender writes into the receiver's memory; a receiver never reads
        self._peer_puts = os.environ.get("UCX_RNDV_SCHEME") == "put_zcopy"

        self._io = IoThread("kvhandoff-ucx-io")
        self._table = OpTable(self.kind, chunk_bytes=settings.chunk_bytes,
                              callback_thread="kvhandoff-ucx-cb", make_op=self._make_op,
                              start_send=functools.partial(self._io.put, self._on_send),
                              start_recv=functools.partial(self._io.put, self._on_recv),
                              check_plan=self._check_plan, hold=self._hold_locked)
        self._lock = self._table.lock
        self._cond = threading.Condition(self._lock)
        self._window = SendWindow(settings.chunk_bytes, channel=self._eps_of,
                                  emit=self._emit, fail=self._table.finish)
        self._peer_lanes: dict[str, tuple[str, ...]] = {}
        self._unprotected: set[str] = set()  # same-host peers without UCX error handling
        self._tag_keys: dict[str, bytes] = {}  # (the lock) peer -> its session's tag key
        self._bytes_sent = 0
        self._bytes_received = 0
        self._counters = {"data_early_dropped": 0}  # written by the I/O thread
        # owned by the I/O thread
        self._eps = EndpointCache(_IDLE_EPS_MAX)
        self._matcher: ReceiveMatcher[_Op] = ReceiveMatcher(
            _DISCARD_MAX, chunk_bits=_CHUNK_BITS, early_bytes=int(settings.tcp_early_bytes),
            keep_s=float(settings.stall_timeout_s), counters=self._counters)
        self._scratch = np.empty(_SCRATCH_BYTES, np.uint8)  # dropped messages land here
        self._inflight: list[_Inflight] = []
        self._io.start(self._run)

    # ---- public API (any thread) ----------------------------------------------------------

    def bind_session(self, peer: str, key: bytes) -> None:
        """The chunks of ops posted with `peer` from now on carry tags keyed by `key` (the
        control session's key; b"": none, tags of the addresses alone): an off-path sender
        without the session key makes no tag a receive of ours matches."""
        with self._lock:
            if key:
                self._tag_keys[peer] = tag_key(key)
            else:
                self._tag_keys.pop(peer, None)

    def connect(self, peer: str, address: bytes) -> None:
        if not isinstance(address, bytes) or not address:
            raise TransportError(f"connect {peer!r}: address must be non-empty bytes")
        with self._lock:
            if self._table.known_peer(peer, address):
                return
        result: list[BaseException | tuple[tuple[str, ...], bool]] = []
        done = threading.Event()
        self._io.put(self._on_connect, peer, address, result, done)
        if not done.wait(self._cancel_bound_s):
            raise TransportError(f"connect {peer!r}: the UCX I/O thread did not answer within "
                                 f"{self._cancel_bound_s} s")
        if isinstance(result[0], BaseException):
            raise result[0]
        lanes, unprotected = result[0]
        if self._require_rdma and (tcp_only(lanes) or not self._rdma):
            self._io.put(self._on_disconnect, peer, [])
            raise TransportError(f"connect {peer!r}: require_rdma is set but UCX found no RDMA "
                                 f"lane (lanes: {', '.join(lanes) or 'unknown'}; resources: "
                                 f"{', '.join(self._resources)}; {self.build.describe()}); fix "
                                 "the fabric or the UCX build (docs/TRANSFER.md, RDMA), or "
                                 "unset KVHANDOFF_REQUIRE_RDMA")
        with self._lock:
            self._table.peers[peer] = address
            self._peer_lanes[peer] = lanes
            if unprotected:
                self._unprotected.add(peer)
        if unprotected:
            log.warning("ucx: peer %r is on this host: shared-memory lanes without UCX error "
                        "handling (if it dies mid-write UCX aborts this process; set "
                        "KVHANDOFF_UCX_SAME_HOST_ERROR_HANDLING=true for safety over speed, or "
                        "use transport=shm for same-host pairs)", peer)

    def disconnect(self, peer: str) -> None:
        ops, _ = self._table.end_peer(peer, f"disconnected from peer {peer!r}")
        with self._lock:
            self._peer_lanes.pop(peer, None)
            self._unprotected.discard(peer)
        self._io.put(self._on_disconnect, peer, ops)
        self._wait_direct(ops, "disconnect")

    def cancel(self, peer: str, tag: int) -> None:
        ops = self._table.end_tag(peer, tag)
        if ops:
            self._io.put(self._on_forget, ops)
            self._wait_direct(ops, "cancel")

    def status(self) -> TransportStatus:
        with self._lock:
            per_peer = dict(self._peer_lanes)
        lanes = tuple(sorted({lane for ls in per_peer.values() for lane in ls}))
        tcp_peers = sorted(p for p, ls in per_peer.items() if tcp_only(ls))
        if tcp_peers:
            degraded = True
            why = f"ucx: only TCP lanes to peer(s) {', '.join(tcp_peers)}"
        elif not per_peer:
            degraded = not any(not r.startswith(("tcp/", "self/")) for r in self._resources)
            why = "ucx: no peer connected yet"
        else:
            degraded = False
            why = "ucx: shared-memory/RDMA lanes to every peer"
        rdma = (f"RDMA devices: {', '.join(self._rdma)}" if self._rdma else
                "no RDMA device found: peers on other hosts would use TCP")
        if not self.build.verbs:
            rdma += " (this UCX build has no verbs: no RDMA lane can appear, docs/TRANSFER.md)"
        with self._lock:
            unprotected = sorted(self._unprotected)
        if unprotected:
            why += (f"; same-host peer(s) {', '.join(unprotected)} without UCX error handling "
                    "(shared-memory speed; a peer dying mid-write aborts this process)")
        reason = (f"{why}; {rdma}; {self.build.describe()}; UCX_TLS={self._tls_config}; "
                  "resources: "
                  f"{', '.join(self._resources)}")
        return TransportStatus(kind=self.kind, lanes=lanes or tuple(self._resources),
                               degraded=degraded, reason=reason, bytes_sent=self._bytes_sent,
                               bytes_received=self._bytes_received,
                               counters=dict(self._counters))

    def __repr__(self) -> str:
        return f"<UcxTransport peers={len(self._table.peers)} lanes={self.status().lanes}>"

    # ---- helpers (any thread) -------------------------------------------------------------

    def _check_plan(self, what: str, plan: ChunkPlan) -> None:
        if plan.nchunks >= (1 << _CHUNK_BITS):
            raise TransportError(f"{what}: {plan.total} bytes make {plan.nchunks} chunks, more "
                                 f"than 2**{_CHUNK_BITS}; raise chunk_bytes")

    def _make_op(self, is_send: bool, peer: str, address: bytes, tag: int, buf: np.ndarray,
                 plan: ChunkPlan, on_done: OnDone) -> _Op:
        # (under the op table's lock) the key of the session with `peer` when it has one
        base = _tag_base(self._address if is_send else address, tag,
                         self._tag_keys.get(peer, b""))
        return _Op(peer, tag, is_send, buf, plan, on_done, base)

    @staticmethod
    def _hold_locked(op: _Op, exc: BaseException | None) -> bool:
        """(op table hook) A receive with direct receives still in flight into its memory
        is only marked finished: its on_done is held until they ended."""
        if op.is_send or not op.direct_inflight:
            return False
        op.held = (exc,)
        return True

    @staticmethod
    def _held_ready_locked(ops: list[_Op]) -> Done:
        """The held on_done results of `ops` whose direct receives all ended (taken)."""
        out: Done = []
        for op in ops:
            if op.held is not None and not op.direct_inflight:
                out.append((op, op.held[0]))
                op.held = None
        return out

    def _wait_direct(self, ops: list[_Op], what: str) -> None:
        """Waits until no receive of `ops` is in flight straight into user memory."""
        if self._io.is_current():
            return
        deadline = time.monotonic() + self._cancel_bound_s
        with self._cond:
            while any(op.direct_inflight for op in ops):
                left = deadline - time.monotonic()
                if left <= 0 or self._table.closed and not self._io.is_alive():
                    busy = sum(op.direct_inflight for op in ops)
                    raise TransportError(f"{what}: {busy} UCX receive(s) still in flight into "
                                         f"user memory after {self._cancel_bound_s} s (peer "
                                         "stalled?); that memory may still be written")
                self._cond.wait(left)

    # ---- I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        worker, io = self._worker, self._io
        waiter = select.poll()
        waiter.register(self._epoll_fd, select.POLLIN)
        waiter.register(io.wake_fd, select.POLLIN)
        try:
            while True:
                busy = io.handle() > 0
                if io.stopped:
                    return
                worker.progress()
                busy |= self._probe()
                busy |= self._age()
                busy |= self._reap()
                busy |= self._window.pump()
                if busy or io.pending():
                    continue
                if worker.arm():
                    # poll, not select: a process with over 1,024 descriptors open (an
                    # engine's sockets and pools) gives these numbers past select()'s range
                    # (held messages: wake up when the oldest is to be aged)
                    left = self._matcher.next_expiry()
                    fds = {fd for fd, _ in waiter.poll(
                        None if left is None else int(left * 1000) + 1)}
                    if io.wake_fd in fds:
                        io.drain_wake()
        except Exception:
            log.exception("ucx transport I/O thread failed")
            self._table.close("ucx transport I/O thread failed")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        # consume held message handles (into scratch) so UCX is left with nothing dangling
        try:
            for probe in self._matcher.take_held():
                self._drop(probe)
            for _ in range(3):
                self._worker.progress()
                self._probe()  # every arrived message is now held
            for probe in self._matcher.take_held():
                self._drop(probe)
            for _ in range(1000):
                if all(item.req.completed for item in self._inflight if item.op is None):
                    break
                self._worker.progress()
        except ucx_api.UCXError:
            pass
        try:
            self._worker.cancel_inflight_requests()
        except ucx_api.UCXError:
            pass
        with self._cond:
            held = []
            for item in self._inflight:
                if item.op is not None and item.direct:
                    item.op.direct_inflight = 0
                    held.append(item.op)
            ready = self._held_ready_locked(held)
            self._cond.notify_all()
        self._table.deliver(ready)
        self._eps.close_all()
        self._inflight.clear()

    def _on_connect(self, peer: str, address: bytes, result: list[object],
                    done: threading.Event) -> None:
        try:
            host, worker_address = split_address(address)
            unprotected = host == self._host and not self._same_host_err

            def create() -> Any:
                return ucx_api.UCXEndpoint.create_from_worker_address(
                    self._worker, ucx_api.UCXAddress.create_from_buffer(worker_address),
                    not unprotected)

            ep = self._eps.attach(peer, address, create, self._touching)
            result.append((ep_lanes(ep), unprotected))
        except Exception as e:
            result.append(TransportError(f"connect {peer!r}: UCX cannot create an endpoint "
                                         f"from that address: {e}"))
        done.set()

    def _on_disconnect(self, peer: str, ops: list[_Op]) -> None:
        self._on_forget(ops)
        ep = self._eps.get(peer)
        if ep is not None and not ep.alive:
            self._abandon_direct(ops)
        self._eps.park(peer, self._touching(peer))

    def _abandon_direct(self, ops: list[_Op]) -> None:
        """UCX failed the peer's endpoint (error handling: the peer is gone), so nothing
        writes into the memory of `ops`' receives any more, but their requests may never
        complete (ucxx has no per-request cancel, and closing a failed endpoint crashes):
        stop counting them, so disconnect()'s wait ends."""
        with self._cond:
            for item in self._inflight:
                if item.direct and item.op is not None and item.op in ops:
                    item.direct = False
                    item.op.direct_inflight -= 1
            ready = self._held_ready_locked(ops)
            self._cond.notify_all()
        self._table.deliver(ready)

    def _touching(self, peer: str) -> bool:
        """Whether a UCX request in flight for an op with `peer` may access its memory: a
        send (rendezvous put or its RTS), or a receive unless the peer puts (put_zcopy)."""
        return any(item.op is not None and item.op.peer == peer
                   and (item.op.is_send or not self._peer_puts) for item in self._inflight)

    def _on_forget(self, ops: list[_Op]) -> None:
        for op in ops:
            if not op.is_send:
                for probe in self._matcher.forget(op):
                    self._drop(probe)

    def _on_send(self, op: _Op) -> None:
        if not op.finished:
            self._window.add(op)

    def _on_recv(self, op: _Op) -> None:
        if op.finished:
            return
        try:
            ready, drop = self._matcher.post(op)
        except TransportError as e:  # its early messages were dropped: it would never end
            self._table.finish(op, str(e))
            return
        for probe in drop:
            self._drop(probe)
        for k, probe in ready:
            self._start_recv(op, k, probe)

    def _drop(self, probe: Any) -> None:
        """Receives an unwanted message into the shared scratch, truncated when longer
        (the receive then ends with UCS_ERR_MESSAGE_TRUNCATED, which a drop ignores)."""
        n = min(max(int(probe.length), 1), _SCRATCH_BYTES)
        req = self._worker.tag_recv_with_handle(Array(self._scratch[:n]), probe)
        self._inflight.append(_Inflight(req, None, 0, None, False))

    def _age(self) -> bool:
        """Drops the held messages of streams held longer than stall_timeout_s."""
        expired = self._matcher.expire()
        for probe in expired:
            self._drop(probe)
        return bool(expired)

    def _probe(self) -> bool:
        found = False
        worker = self._worker
        while True:
            probe = worker.tag_probe(ucx_api.UCXXTag(0), ucx_api.UCXXTagMask(0), True)
            if not probe.matched:
                return found
            found = True
            match = self._matcher.arrived(int(probe.sender_tag.value), probe,
                                          int(probe.length))
            if isinstance(match, list):
                for dropped in match:
                    self._drop(dropped)
            else:
                self._start_recv(match[0], match[1], probe)

    def _start_recv(self, op: _Op, k: int, probe: Any) -> None:
        plan = op.plan
        n = plan.chunk_len(k)
        if int(probe.length) != n:
            self._drop(probe)
            self._on_forget([op])
            self._table.finish(op, f"size mismatch on tag {op.tag} chunk {k}: sender's message has "
                             f"{int(probe.length)} bytes, the receive expects {n} (send and "
                             "receive totals must agree)")
            return
        start = plan.direct(k)
        if start is not None:
            with self._lock:
                if op.finished:  # cancelled since the probe: receive into scratch instead
                    self._drop(probe)
                    return
                op.direct_inflight += 1
            view = op.buf[start:start + n]
            req = self._worker.tag_recv_with_handle(Array(view), probe)
            self._inflight.append(_Inflight(req, op, k, None, True))
        else:
            stage = self._window.stage()
            req = self._worker.tag_recv_with_handle(Array(stage[:n]), probe)
            self._inflight.append(_Inflight(req, op, k, stage, False))

    def _reap(self) -> bool:
        if not self._inflight:
            return False
        still: list[_Inflight] = []
        done_any = False
        items, self._inflight = self._inflight, []
        for item in items:
            if not item.req.completed:
                still.append(item)
                continue
            done_any = True
            self._complete(item)  # may start receives (drops): they land in self._inflight
        still.extend(self._inflight)
        self._inflight = still
        return done_any

    def _complete(self, item: _Inflight) -> None:
        op = item.op
        err: str | None = None
        try:
            item.req.check_error()
        except Exception as e:
            err = f"UCX {'send' if op is not None and op.is_send else 'receive'} failed: {e}"
        if op is None:  # a dropped message
            return
        n = op.plan.chunk_len(item.k)
        finished_now = False
        ready: list[tuple[Any, BaseException | None]] = []
        if op.is_send:
            self._window.credit(op, item.stage)
            if err is None and not op.finished:
                self._bytes_sent += n
                op.landed += 1
                finished_now = op.landed == op.plan.nchunks
        else:
            with self._cond:
                if item.direct:
                    op.direct_inflight -= 1
                    if op.finished:
                        ready = self._held_ready_locked([op])
                        self._cond.notify_all()
                if err is None and not op.finished:
                    if item.stage is not None:
                        op.plan.scatter(op.buf, item.k, item.stage)
                    self._bytes_received += n
                    op.landed += 1
                    finished_now = op.landed == op.plan.nchunks
            self._window.unstage(item.stage)
        self._table.deliver(ready)  # a receive that ended earlier: its last direct chunk landed
        if err is not None:
            if not op.is_send:
                self._on_forget([op])
            self._table.finish(op, err)
        elif finished_now:
            self._table.finish(op, None)

    # ---- send window hooks (window.SendWindow) --------------------------------------------

    def _eps_of(self, op: _Op) -> Any:
        return self._eps.get(op.peer)

    def _emit(self, channel: Any, op: _Op, k: int, view: np.ndarray,
              stage: np.ndarray | None) -> None:
        req = channel.tag_send(Array(view), ucx_api.UCXXTag(op.base ^ k))
        self._inflight.append(_Inflight(req, op, k, stage, False))


__all__ = ["UCXX_VERSION", "UcxTransport"]
