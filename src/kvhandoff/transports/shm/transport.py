# Same-host transport: the writer copies straight into the receiver's memory.
#
# How it works: each transport binds one ZMQ ROUTER (control only, on settings.agent_host) and
# opens a DEALER per connected peer; its address names the host (peers on another host are
# refused: use ucx or tcp there), its pid and the ROUTER endpoint. No byte of KV crosses a
# socket:
# - Two-sided (post_send / post_recv, what the agent uses): a posted receive EXPOSES its spans:
#   the receiver sends b"R" (tag, total, its buffer's descriptor, the span list) to the writer.
#   When the writer has both the send and the R of a tag it copies its spans into the
#   receiver's spans (copy.py: a mapped kvhandoff shared segment, else process_vm_writev),
#   then answers b"F" (tag, ok/reason), which completes the receive; the send completes when
#   its copy ended. The receiver posts one message per receive, nothing per span or chunk.
# - One-sided (OneSidedTransport): describe(name) gives a buffer's descriptor, the writer installs
#   it with register_remote(peer, name, descriptor) and post_writes() span plans into it; the
#   receiver posts nothing at all. The writes and their copy jobs are an owned part,
#   `OneSidedWriter` (writer.py, which says how they run): post_writes of host memory copies
#   several plans (a layer's regions) as ONE job (one op under the first write's tag, one
#   completion, one digest per write); with checksum=True the source is hashed while copying
#   and, on the map lane, each destination piece right after its copy, so the job's
#   WriteResult carries `landed` (the writer's verification) without a second call. The
#   transport keeps describe / register_remote (installing a peer's buffer: targets.py) and
#   two private seams for testing.faults: `_post_writes_tampered` (a destination byte flipped
#   inside the copy, before its landed hash) and `_landed_digest` (the read-back of a mapped
#   target, for a byte flipped after a write landed).
# - Peer death: the I/O thread polls a pidfd of every peer process; when it exits, every op
#   with that peer fails ("peer process N exited"). On the map lane the mapping stays valid, on
#   the cma lane the syscall returns ESRCH: a dying peer is an error, never a signal or abort.
# - CUDA buffers (cuda.py): registered device memory is written one-sided only, through
#   CUDA IPC (describe gives a CUDA descriptor, register_remote opens the peer's block once,
#   a write copies on the lane's worker and completes once the copy's event did; digest =
#   devsum of the source). Host <-> device writes and two-sided device ops are refused.
#
# Completion contract (what cancel / disconnect / close promise; the agent relies on it):
# - cancel(peer, tag) and disconnect(peer) never wait on the peer. They end the ops at once
#   (later messages of the peer cannot complete them any more), tell the writer to stop (b"X")
#   and return. The only wait is for this process's own copy jobs (sends and one-sided writes
#   into the peer): they stop within one batch of pieces (memcpy into a mapping, or
#   process_vm_writev, neither of which waits on the peer, stopped or not); bounded by
#   stall_timeout_s, past which TransportError is raised. So after cancel() of a write
#   returns, nothing of that write is written into the peer any more.
# - An op's on_done is called once nothing of it writes into memory any more: a send or write
#   once its copy job stopped; a receive the peer was told about (exposed) once the writer
#   confirmed it stopped (its b"F" or b"A"), or its process is gone (pidfd), or stall_timeout_s
#   passed since the op ended (a warning is logged: a frozen writer that wakes up may still
#   write). Until then the caller must keep the receive's memory (the agent keeps a room's
#   pages until every op's on_done came). A receive never exposed completes at once.
# - close() calls every pending op's on_done before it returns (held receives too, with a
#   warning when their writer never confirmed).
#
# Rules: one I/O thread owns the sockets; copy threads copy two-sided sends and report back
# through the command queue (one-sided host writes complete on their copy thread: writer.py).
# `_lock` (the op table's lock) guards the op table, the peer table, the running send jobs,
# `finished` / `result` / `delivered` of ops and the `exposed` / `acked` state of receives. The
# transport composes owned parts, each with its own state: the op table (optable.OpTable:
# buffers, peers, pending ops, the checks of post_*), the I/O thread (iothread.IoThread: its
# commands are this class's and the writer's `_on_*` methods), `HeldReceives` (hold.py:
# completions held until nothing writes, and the drains of disconnected peers; the op table
# delivers through it and it shares `_lock`, which guards those op fields), `ExposedWriter`
# (expose.py: the two-sided writer's tables, I/O thread only), `OneSidedWriter` (writer.py:
# post_writes and its host and CUDA jobs; it reads the op table, the peer table and the CUDA
# buffers under `_lock` and owns its running jobs), and the opening of write targets
# (targets.py, stateless). What stays here is the transport's own: connect (the peer proves
# its process, proof.py) / disconnect / cancel / close / status, registration, the two-sided
# wire (R out, F / A in, the sends' copy jobs) and the I/O loop with the peers' pidfds.
from __future__ import annotations

import functools
import logging
import os
import select
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import zmq

from kvhandoff.errors import ConfigError, TransportError
from kvhandoff.kv_layout.spans import SpanPlan, pair_spans
from kvhandoff.transports.base import (
    OnDone,
    OneSidedTransport,
    OnWritten,
    TransportKind,
    TransportStatus,
    WriteSpec,
)
from kvhandoff.transports.hostid import host_id
from kvhandoff.transports.iothread import IoThread
from kvhandoff.transports.optable import OpTable, TableTransport
from kvhandoff.transports.shm.copy import CopyJob, CopyPool, Target
from kvhandoff.transports.shm.cuda import (
    DeviceJob,
    DeviceLane,
    encode_device_descriptor,
    is_device_descriptor,
)
from kvhandoff.transports.shm.expose import ExposedWriter, Key
from kvhandoff.transports.shm.hold import HeldReceives
from kvhandoff.transports.shm.native import native
from kvhandoff.transports.shm.proof import PeerNotProven, Proof, Voucher, prove
from kvhandoff.transports.shm.targets import check_vouched, open_host, open_remote
from kvhandoff.transports.shm.wire import (
    EXPOSE,
    MAGIC,
    PID,
    TAGMSG,
    ShmOp,
    ShmPeer,
    describe_buffer,
    parse_descriptor,
    parse_writer_frame,
    split_address,
)
from kvhandoff.transports.shm.writer import OneSidedWriter
from kvhandoff.transports.sockets import bind_router, connect_dealer

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

log = logging.getLogger(__name__)

_DEFAULT_THREADS = 3


class ShmTransport(TableTransport, OneSidedTransport):
    """Same-host transport: writes into the peer's memory (see module comment)."""

    kind: ClassVar[TransportKind] = TransportKind.SHM

    def __init__(self, settings: Settings, *, lane: str = "auto",
                 copy_threads: int | None = None,
                 device_lane: DeviceLane | None = None) -> None:
        if settings.require_rdma:
            raise TransportError("shm transport refused: require_rdma is set (shm is same-host "
                                 "memory, no RDMA); unset KVHANDOFF_REQUIRE_RDMA or use ucx")
        if lane not in ("auto", "cma"):
            raise TransportError(f"shm: lane must be 'auto' or 'cma', got {lane!r}")
        self._allow_map = lane == "auto"
        self._bound_s = float(settings.stall_timeout_s)
        self._ident = uuid.uuid4().hex.encode("ascii")
        # peers prove themselves to us, we to them, over this socket (proof.py)
        self._voucher = Voucher(self._ident, self._vouched)
        self._io = IoThread(f"kvhandoff-shm-io-{self._ident[:8].decode()}")
        # on_done of an op waits until nothing of it writes (hold.py): delivery is _held's
        self._table = OpTable(self.kind, chunk_bytes=settings.chunk_bytes,
                              callback_thread=f"kvhandoff-shm-cb-{self._ident[:8].decode()}",
                              make_op=ShmOp.posted,
                              start_send=functools.partial(self._io.put, self._on_send),
                              start_recv=functools.partial(self._io.put, self._on_recv),
                              deliver=lambda done: self._held.deliver(done))
        self._lock = self._table.lock
        threads = copy_threads or min(_DEFAULT_THREADS, os.cpu_count() or 1)
        self._copier = CopyPool(threads, f"kvhandoff-shm-copy-{self._ident[:8].decode()}")
        self._ctx = zmq.Context(io_threads=1)
        try:  # control messages only: ZMQ's default high-water marks
            self._router, endpoint = bind_router(self._ctx, settings.agent_host, what="shm",
                                                 handover=True, hwm=None)
        except TransportError:
            self._ctx.term()
            self._voucher.close()
            self._copier.stop()
            self._table.stop()
            self._io.close()
            raise
        self._address = (MAGIC + host_id() + PID.pack(os.getpid())
                         + f"{endpoint}/{self._ident.decode()}".encode("ascii"))
        self._bytes_sent = 0
        self._bytes_received = 0
        self._peers_refused = 0  # connects refused: the peer's process proved nothing
        self._peer_info: dict[str, ShmPeer] = {}  # guarded by _lock
        self._lanes: dict[str, set[str]] = {}  # peer -> lanes used ("map", "cma")
        self._held = HeldReceives(lock=self._lock, submit=self._table.callbacks.submit,
                                  bound_s=self._bound_s,
                                  wake=functools.partial(self._io.put, self._on_hold))
        self._exposed = ExposedWriter(router=self._router, finish=self._table.finish,
                                     resolve=self._receive_target, start_job=self._start_copy)
        # owned by the I/O thread
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._dealer_info: dict[str, ShmPeer] = {}  # the peer each dealer is connected to
        # two-sided sends' copy jobs started, end not yet reported (I/O thread; guarded by
        # _lock, which close() reads them under)
        self._running: set[CopyJob] = set()
        # CUDA buffers (one-sided only): name -> (1-D uint8 view, size in bytes)
        self._dev_lane = device_lane or DeviceLane(self._ident[:8].decode())
        self._dev: dict[str, tuple[Any, int]] = {}
        self._one_sided = OneSidedWriter(table=self._table, peers=self._peer_info,
                                         devices=self._dev, held=self._held, io=self._io,
                                         copier=self._copier, device_lane=self._dev_lane,
                                         dead=self._dead, exited=self.peer_exited)
        self._io.start(self._run)

    # ---- public API (any thread) ----------------------------------------------------------

    def register(self, name: str, buf: Any) -> None:
        """Host buffers as every transport takes them; CUDA buffers (torch CUDA tensors,
        ``__cuda_array_interface__`` objects) for one-sided writes only. One memory kind per
        transport."""
        device = not isinstance(buf, np.ndarray) and self._dev_lane.claims(buf)
        with self._lock:
            self._table.check_open()
            if name in self._table.buffers or name in self._dev:
                raise TransportError(f"register: a buffer named {name!r} is already registered")
            other = next(iter(self._table.buffers if device else self._dev), None)
        if other is not None:
            kinds = ("device", "host") if device else ("host", "device")
            raise TransportError(f"register {name!r}: the buffer is {kinds[0]} memory but "
                                 f"{other!r} is {kinds[1]} memory; one shm transport moves one "
                                 "kind of memory (all host or all CUDA)")
        if not device:
            self._table.register(name, buf)
            return
        if not isinstance(name, str) or not name:
            raise TransportError(f"register: name must be a non-empty string, got {name!r}")
        flat = self._dev_lane.flat(buf)
        with self._lock:
            self._table.check_open()
            self._dev[name] = flat

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._two_sided("post_send", name)
        super().post_send(peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._two_sided("post_recv", name)
        super().post_recv(peer, tag, name, offsets, nbytes, on_done)

    def _two_sided(self, what: str, name: str) -> None:
        if name in self._dev:
            raise TransportError(f"{what} {name!r}: the buffer is CUDA memory; over shm device "
                                 "memory moves by one-sided writes only (describe / "
                                 "register_remote / post_writes, which the agent uses when the "
                                 "decode offers its buffers: one_sided_writes on)")

    # ---- one-sided writes (OneSidedTransport) ---------------------------------------------

    def describe(self, name: str) -> bytes:
        dev = self._dev.get(name)
        if dev is not None:  # a CUDA buffer: its IPC export
            return encode_device_descriptor(os.getpid(), dev[1], self._dev_lane.export(dev[0]))
        buf = self._table.buffers.get(name)
        if buf is None:
            raise TransportError(f"describe: no buffer registered as {name!r}")
        return describe_buffer(buf)

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        with self._lock:
            self._table.check_open()
            info = self._peer_info.get(peer)
            local = bool(self._dev) if (self._dev or self._table.buffers) else None
        if info is None:
            raise TransportError(f"register_remote: peer {peer!r} is not connected")
        if not is_device_descriptor(descriptor):  # host memory: the peer must vouch for it
            self._vouched_by(info, descriptor, f"register_remote {name!r}")
        target = open_remote(info, name, descriptor, local_device=local,
                             allow_map=self._allow_map, dev_lane=self._dev_lane)
        with self._lock:
            info.remotes[name] = target
            self._lanes.setdefault(peer, set()).add(target.lane)

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """Host memory: the writes as ONE copy job (one completion, on its copy thread, or on
        this one for a small job), a digest per write, and on the map lane with `checksum` a
        landed sum per write (the writer's verification); CUDA memory: a job per write on the
        device lane (writer.py)."""
        self._one_sided.post_writes(peer, writes, on_done, checksum=checksum)

    def write_digest_alg(self, name: str) -> str | None:
        """The algorithm of post_writes(checksum=True)'s digest for local buffer `name`:
        "xxh3" (host buffers, hashed while copying), "devsum" (CUDA buffers); None when no
        such buffer is registered."""
        return self._one_sided.digest_alg(name)

    def _post_writes_tampered(self, peer: str, writes: Sequence[WriteSpec],
                              on_done: OnWritten, flips: dict[int, int], *,
                              checksum: bool = False) -> bool:
        """The fault-injection seam, private (testing.faults.post_writes_tampered calls it):
        `post_writes` of host memory as one copy job that flips the first destination byte
        of write i's piece `flips[i]` inside the copy, before its landed hash
        (`OneSidedWriter.post_tampered`); False, nothing posted, where it is not one job."""
        return self._one_sided.post_tampered(peer, writes, on_done, flips, checksum=checksum)

    def _landed_digest(self, peer: str, remote: str, plan: SpanPlan) -> int | None:
        """Private read-back (testing.faults calls it after it flipped a byte behind a write's
        back): xxh3-64 of the peer's mapped buffer `remote` at `plan`'s destination pieces
        as they are now; None where the writer does not map it (cma, CUDA)."""
        return self._one_sided.read_back(peer, remote, plan)

    def _vouched(self) -> list[tuple[bytes, int]]:
        """(I/O thread) What a proving peer is handed: the descriptor of every registered host
        buffer, with the memfd of its segment (-1: none)."""
        with self._lock:
            bufs = list(self._table.buffers.values())
        out = []
        for buf in bufs:
            desc = describe_buffer(buf)
            out.append((desc, parse_descriptor(desc)[1]))
        return out

    def connect(self, peer: str, address: bytes) -> None:
        if not isinstance(address, bytes) or not address:
            raise TransportError(f"connect {peer!r}: address must be non-empty bytes")
        host, pid, endpoint, ident = split_address(address)
        if host != host_id():
            raise TransportError(f"connect {peer!r}: the peer is on another host; the shm "
                                 "transport connects agents of one host only (use ucx or tcp)")
        with self._lock:
            if self._table.known_peer(peer, address):
                return
        proof = self._prove(peer, ident, pid)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            proof.close()
            raise TransportError(f"connect {peer!r}: peer process {pid} is not reachable: "
                                 f"{e}") from e
        info = ShmPeer(peer, address, pid, ident, pidfd, proof)
        with self._lock:
            self._table.peers[peer] = address
            self._peer_info[peer] = info
        self._io.put(self._on_connect, peer, endpoint, info)

    def _prove(self, peer: str, ident: bytes, pid: int) -> Proof:
        """What the process listening as `ident` proves (proof.py); `PeerNotProven` unless it
        is another transport than this one, in the process whose pid the address declares."""
        if ident == self._ident:
            self._count_refused()
            raise PeerNotProven(f"connect {peer!r}: the address is this transport's own; a "
                                "transport never writes into itself")
        try:
            proof = prove(ident, timeout_s=self._bound_s)
        except PeerNotProven as e:
            self._count_refused()
            raise PeerNotProven(f"connect {peer!r}: {e}") from None
        if proof.pid != pid:
            proof.close()
            self._count_refused()
            raise PeerNotProven(f"connect {peer!r}: the address declares process {pid}, but "
                                f"the process listening as the peer is {proof.pid}; refused "
                                "(shm writes go only to the process that proved it is the "
                                "peer)")
        return proof

    def _vouched_by(self, info: ShmPeer, descriptor: bytes, what: str) -> None:
        """Makes sure `info`'s process vouched for host buffer `descriptor`: one it registered
        after we connected is asked for again (its process proves itself anew; any thread:
        the peer answers on its proof thread)."""
        with self._lock:
            proof = info.proof
        if proof is None or descriptor in proof.descriptors:
            return
        fresh = prove(info.ident, timeout_s=self._bound_s)
        if fresh.pid != info.pid:
            fresh.close()
            self._count_refused()
            raise PeerNotProven(f"{what}: the process listening as peer {info.name!r} is now "
                                f"{fresh.pid}, not {info.pid}")
        with self._lock:
            stale, info.proof = info.proof, fresh
        # the stale memfds: what was mapped through them stays mapped; the fresh ones cover
        # the same segments
        if stale is not None:
            stale.close()

    def _count_refused(self) -> None:
        with self._lock:
            self._peers_refused += 1
        log.warning("shm: a peer that could not prove its process was refused")

    def disconnect(self, peer: str) -> None:
        with self._lock:
            info = self._peer_info.get(peer)
        ops, _ = self._table.end_peer(peer, f"disconnected from peer {peer!r}")
        if info is None:
            return
        try:
            self._stop_ops(ops, "disconnect", info)
        finally:
            with self._lock:
                self._peer_info.pop(peer, None)
                self._lanes.pop(peer, None)
                for name in [k for k, t in info.remotes.items() if t.lane == "cuda-ipc"]:
                    del info.remotes[name]
            self._dev_lane.close_peer(peer)  # its IPC-opened blocks
            if info.proof is not None:  # its memfds (what was mapped stays mapped)
                info.proof.close()
            # what arrived before this call is dropped, not what a reconnected peer sends after
            self._io.put(self._on_disconnect, peer, info, self._exposed.cut())

    def cancel(self, peer: str, tag: int) -> None:
        ops = self._table.end_tag(peer, tag)
        with self._lock:
            info = self._peer_info.get(peer)
        if ops and info is not None:
            self._stop_ops(ops, "cancel", info)

    def peer_exited(self, peer: str) -> bool:
        """Whether `peer`'s process has ended (its pidfd is readable; a stopped process has
        not), so nothing of it writes into this process any more."""
        with self._lock:  # (pidfds of peers in _peer_info are closed under it only)
            info = self._peer_info.get(peer)
            if info is None or self._table.closed:
                return False
            if info.dead is not None:
                return info.dead.startswith("process")
            return _pidfd_ready(info.pidfd)

    def status(self) -> TransportStatus:
        with self._lock:
            lanes = sorted({lane for ls in self._lanes.values() for lane in ls})
            npeers = len(self._peer_info)
            # a process gone shows at once (its pidfd), before the I/O thread handled the event
            dead = sorted(p.name for p in self._peer_info.values()
                          if p.dead or (not self._table.closed and _pidfd_ready(p.pidfd)))
        held = len(self._held)
        names = {"map": "shm/map", "cma": "shm/cma", "cuda-ipc": "shm/cuda-ipc"}
        reason = (f"shm: same-host writes into the peer's memory ({npeers} peer(s); lanes: "
                  f"{', '.join(names[x] for x in lanes) or 'none used yet'}; "
                  f"{self._copier.threads} copy threads; map = the peer's pool is a kvhandoff "
                  "shared segment, cma = process_vm_writev, cuda-ipc = CUDA buffers written "
                  "through CUDA IPC; a dying peer is an error, never an "
                  f"abort; map lane: {native()[1]})")
        if dead:
            reason += f"; peer process(es) gone: {', '.join(dead)}"
        refused = self._peers_refused + self._voucher.refused
        if refused:
            reason += (f"; {refused} peer connection(s) refused: the process could not prove "
                       "it is the peer it claimed (or was of another user)")
        if held:
            reason += (f"; {held} ended receive(s) held until their writer confirms it stopped "
                       f"(at most {self._bound_s} s)")
        return TransportStatus(kind=self.kind,
                               lanes=tuple(names[x] for x in lanes) or ("shm",),
                               degraded=False, reason=reason,
                               bytes_sent=self._bytes_sent + self._one_sided.bytes_written,
                               bytes_received=self._bytes_received)

    def close(self) -> None:
        ops = self._table.close("shm transport closed")
        if ops is None:
            return
        for op in ops:  # local copies stop; held receives: see _shutdown
            if op.job is not None:
                op.job.cancel()
        self._io.stop(self._copier, self._dev_lane, self._table)

    def __repr__(self) -> str:
        return f"<ShmTransport pid={os.getpid()} peers={len(self._table.peers)}>"

    # ---- helpers (any thread) -------------------------------------------------------------

    def _stop_ops(self, ops: list[ShmOp], what: str, info: ShmPeer) -> None:
        """After `ops` were finished: stop local copies of sends/writes and wait until they
        stopped (bounded), tell the writer of exposed receives to stop. Never waits on the
        peer: the held receives complete later (module comment)."""
        local = [op.job for op in ops if op.job is not None]
        for job in local:
            job.cancel()
        self._io.put(self._on_forget, ops)
        if self._io.is_current():  # it reports the jobs' ends
            return
        deadline = time.monotonic() + self._bound_s
        for job in local:
            if not job.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError(f"{what}: a copy into peer {info.name!r} did not stop "
                                     f"within {self._bound_s} s")

    # ---- I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        io = self._io
        poller.register(io.wake_fd, zmq.POLLIN)
        pidfds: dict[int, ShmPeer] = {}
        try:
            while True:
                io.asleep = True  # before the look at the queue (iothread: `asleep`)
                events = dict(poller.poll(0 if io.pending() else self._held.timeout_ms()))
                io.asleep = False
                if io.wake_fd in events:
                    io.drain_wake()
                io.handle(poller, pidfds)
                if io.stopped:
                    return
                for fd, info in list(pidfds.items()):
                    if fd in events:
                        poller.unregister(fd)
                        del pidfds[fd]
                        self._peer_exited(info)
                self._exposed.drain_router()
                for peer, sock in list(self._dealers.items()):
                    self._drain_dealer(self._dealer_info[peer], sock, live=True)
                for info, sock in self._held.drains:
                    self._drain_dealer(info, sock, live=False)
                self._held.release_due()
                self._held.end_drains(poller, pidfds, closing=False)
        except Exception:
            log.exception("shm transport I/O thread failed")
            self._table.close("shm transport I/O thread failed")
        finally:
            self._shutdown(pidfds)

    def _shutdown(self, pidfds: dict[int, ShmPeer]) -> None:
        with self._lock:
            sends: list[CopyJob | DeviceJob] = list(self._running)
        running = sends + self._one_sided.running()
        for job in running:
            job.cancel()
        for job in running:
            if not job.wait(self._bound_s):
                log.warning("shm: closing while a copy job did not stop within %s s",
                            self._bound_s)
        # the receivers whose memory we were allowed to write: nothing writes it any more
        self._exposed.confirm_all()
        # every op's on_done comes before close() returns (ops of jobs whose end was not
        # reported yet, receives still held: module comment)
        with self._lock:
            owners = [job.owner[0] for job in self._running]
        owners += [job.owner[0] for job in self._one_sided.running()]
        with self._lock:
            for op in owners:
                if op.job is not None and not op.job.ended_event.is_set():
                    op.job = None  # (it did not stop: warned above)
            for info in self._peer_info.values():
                info.dead = info.dead or "transport closed"
        self._held.settle(owners)
        self._held.release(lambda op: True, "the transport closed")
        self._held.end_drains(None, pidfds, closing=True)
        with self._lock:
            for info in self._peer_info.values():
                try:
                    os.close(info.pidfd)
                except OSError:
                    pass
                if info.proof is not None:
                    info.proof.close()
        self._voucher.close()
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    def _on_hold(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer]) -> None:
        """Nothing: the I/O thread was woken to re-read the bound of held receives."""

    def _on_connect(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], peer: str,
                    endpoint: str, info: ShmPeer) -> None:
        sock, _ = connect_dealer(self._ctx, self._ident, endpoint, hwm=None)
        old = self._dealers.pop(peer, None)
        if old is not None:
            poller.unregister(old)
            old.close(linger=0)
        self._dealers[peer] = sock
        self._dealer_info[peer] = info
        poller.register(sock, zmq.POLLIN)
        pidfds[info.pidfd] = info
        poller.register(info.pidfd, zmq.POLLIN)

    def _on_disconnect(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], peer: str,
                       info: ShmPeer, cut: int) -> None:
        sock = self._dealers.pop(peer, None)  # (commands run in order: `info`'s socket)
        self._dealer_info.pop(peer, None)
        if sock is not None:
            # while receives of this peer are held, its socket and pidfd stay open (a drain)
            self._held.drain(info, sock)
            self._held.end_drains(poller, pidfds, closing=False)
        else:
            if pidfds.pop(info.pidfd, None) is not None:
                poller.unregister(info.pidfd)
            os.close(info.pidfd)
        # what this peer exposed to us: forget it, and confirm nothing of it is written
        self._exposed.drop_peer(info, cut)

    def _peer_exited(self, info: ShmPeer) -> None:
        """`info`'s process exited: its ops fail, and nothing of it writes into our memory
        any more (its held receives complete)."""
        peer, pid = info.name, info.pid
        with self._lock:
            live = self._peer_info.get(peer) is info  # else disconnected (a drain)
            ops = [op for op in self._table.ops.values() if op.peer == peer] if live else []
            info.dead = f"process {pid} exited"
            done = self._table.finish_locked(ops, f"peer {peer!r} (process {pid}) exited")
        log.log(logging.WARNING if done else logging.INFO,
                "shm: peer %r (process %d) exited; %d op(s) failed", peer, pid, len(done))
        for op in ops:
            if op.job is not None:
                op.job.cancel()
        self._table.deliver(done)
        self._held.release(lambda op: op.ident == info.ident, None)

    def _dead(self, op: ShmOp) -> bool:
        """Fails `op` if its peer's process is gone (ops to a dead peer end with an error
        through on_done, like any failure on the wire); whether it did."""
        with self._lock:
            info = self._peer_info.get(op.peer)
            dead = info.dead if info is not None else None
        if dead is None:
            return False
        self._table.finish(op, f"peer {op.peer!r}: {dead}")
        return True

    def _on_send(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], op: ShmOp) -> None:
        if op.finished or self._dead(op):
            return
        self._exposed.add_send(op)

    def _on_recv(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], op: ShmOp) -> None:
        if self._dead(op):
            return
        sock = self._dealers.get(op.peer)
        with self._lock:
            if op.finished:
                return
            if sock is not None:
                op.exposed = True
                op.info = self._peer_info.get(op.peer)
        if sock is None:
            self._table.finish(op, f"peer {op.peer!r} is not connected")
            return
        assert op.plan is not None  # a receive has its chunk grid
        off, nb = op.plan.spans()
        desc = describe_buffer(op.buf)
        with self._lock:  # the lane this receive offers (the writer may still fall back to cma)
            self._lanes.setdefault(op.peer, set()).add("map" if parse_descriptor(desc)[1] >= 0
                                                       else "cma")
        sock.send_multipart([EXPOSE.pack(b"R", op.tag, op.total), desc,
                             off.astype("<i8").tobytes(), nb.astype("<i8").tobytes()])

    def _on_forget(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], ops: list[ShmOp]) -> None:
        for op in ops:
            if op.is_send:
                self._exposed.forget_send(op)
            elif op.exposed:
                sock = self._dealers.get(op.peer)
                if sock is not None:
                    sock.send_multipart([TAGMSG.pack(b"X", op.tag)])

    def _drain_dealer(self, info: ShmPeer, sock: zmq.Socket[bytes], live: bool) -> None:
        """Messages of writers (to us as receiver): F (landed / failed), A (stopped). A
        socket kept after disconnect (not `live`) only releases held receives."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            parsed = parse_writer_frame(frames)
            if parsed is None:
                log.warning("shm: dropping a malformed frame from peer %r", info.name)
                continue
            kind, tag, ok, reason = parsed
            # the writer is done with that tag either way: a held receive of it (one that
            # ended before) is released first; the F is then not for a live receive
            if self._held.release_one(info.ident, tag) or kind != b"F" or not live:
                continue
            with self._lock:
                op = self._table.ops.get((info.name, tag, False))
                if op is not None:
                    op.acked = True
                    if ok:
                        self._bytes_received += op.total
            if op is not None:
                self._table.finish(op, None if ok else reason)

    def _receive_target(self, op: ShmOp, desc: bytes) -> Target:
        """(I/O thread) The receive buffer `desc` of `op`'s peer, opened once per peer."""
        with self._lock:
            info = self._peer_info.get(op.peer)
        if info is None:
            raise TransportError(f"peer {op.peer!r} is not connected")
        target = info.targets.get(desc)
        if target is None:
            pid = parse_descriptor(desc)[0]
            if pid != info.pid:
                raise TransportError(f"the receive's buffer is of process {pid}, peer "
                                     f"{op.peer!r} is process {info.pid}")
            self._vouched_by(info, desc, "receive")
            check_vouched(info, desc, "receive")
            target = info.targets[desc] = open_host(info, desc, self._allow_map)
            with self._lock:
                self._lanes.setdefault(op.peer, set()).add(target.lane)
        return target

    def _start_copy(self, op: ShmOp, target: Target, doff: np.ndarray, dnb: np.ndarray,
                    key: Key) -> None:
        """(I/O thread) A two-sided send meets its exposed receive: the two sides' span lists
        (each cut by its own process) are paired here, then copied."""
        assert op.plan is not None
        try:
            plan = pair_spans(*op.plan.spans(), doff, dnb)
        except ConfigError as e:  # a malformed receive (negative spans)
            self._exposed.refuse(key, str(e))
            self._table.finish(op, str(e))
            return
        src = plan.src_offsets + int(op.buf.ctypes.data)
        dst = plan.dst_offsets + target.base
        self._run_job(op, CopyJob(src, dst, plan.nbytes, target, False,
                                  lambda j: self._io.put(self._on_written, j), owner=(op, key)),
                      key)

    def _run_job(self, op: ShmOp, job: CopyJob, key: Key) -> None:
        """(I/O thread) Starts a two-sided send's copy job into its exposed receive (`key`)
        unless the op ended meanwhile; it ends on the I/O thread (`_on_written`)."""
        with self._lock:
            cancelled = op.finished
            if not cancelled:
                op.job = job
                self._running.add(job)
        if cancelled:  # cancelled meanwhile
            self._exposed.refuse(key, "sender cancelled")
            return
        self._exposed.started(key, job)
        self._copier.submit(job)

    def _on_written(self, poller: zmq.Poller, pidfds: dict[int, ShmPeer], job: CopyJob) -> None:
        """A two-sided send's copy ended: its exposed receive learns it (F), the op ends."""
        op, key = job.owner
        with self._lock:
            self._running.discard(job)
        self._exposed.ended(key, job)
        if job.error is None and not job.cancelled:
            with self._lock:
                self._bytes_sent += job.total
            self._table.finish(op, None)
        else:
            self._table.finish(op, job.error or "cancelled")
        self._held.settle([op])  # ended earlier (cancel, disconnect): on_done waited for this


def _pidfd_ready(pidfd: int) -> bool:
    """Whether the process of `pidfd` has ended (a stopped one has not)."""
    ready = select.poll()
    ready.register(pidfd, select.POLLIN)
    return bool(ready.poll(0))
