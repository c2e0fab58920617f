# NIXL transport: one-sided writes through a NIXL agent (its bundled UCX: RDMA where the host
# has a usable device, else TCP), two-sided ops over a tcp transport it holds.
#
# How it works:
# - Two-sided ops (post_send / post_recv / cancel of them) go to the tcp transport it holds
#   (`_tcp`, its own object: its lock, peers and threads are not this transport's).
#   The address is a versioned msgpack struct (_nixl_wire.NixlAddress): the tcp address and
#   this transport's NIXL agent (name, metadata). connect() loads the peer's agent metadata.
# - register() also registers the buffer with the agent (DRAM for a numpy array, VRAM for a
#   CUDA buffer); describe() gives (agent, memory kind, address, length, device) and
#   register_remote() keeps the peer's region (checking it is of that peer's agent).
# - post_writes() (a job of writes, e.g. a layer's regions, as ONE WRITE: one request, one
#   completion, a digest per write) checks each span plan against both buffers, makes one (local,
#   remote) descriptor pair per piece of the plan (vectorised) and queues the op; the transport's
#   own NIXL thread creates and posts one NIXL WRITE per op and polls its state (backing off to 1 ms
#   while writes are in flight, asleep when none are). With checksum=True a hash worker computes the
#   xxh3-64 of the source stream while the write is in flight. on_done(its WriteResult) comes from
#   the callback thread once the write is DONE and the digest is ready.
# - cancel(peer, tag) / disconnect / close release each write's NIXL handle before they return:
#   NIXL aborts an active transfer on release, or refuses (then we wait for it to end, bounded
#   by stall_timeout_s, and release it): after that nothing of it writes into the peer.
# - The UCX backend is created with peer error handling (also NIXL's default): a dead peer
#   fails the write (an error at post or state ERR), it never hangs the transport.
#
# Rules: `_lock` guards the write table, the peer and buffer tables of this transport and each
# write's `finished` flag (an op finishes once; its callback is queued under the lock).
# `_nx_lock` guards every call into the NIXL agent and each write's handle (released once).
from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvhandoff.buffers.checksum import span_checksum
from kvhandoff.errors import TransportError
from kvhandoff.transports.base import (
    OnDone,
    OneSidedTransport,
    OnWritten,
    TransportKind,
    TransportStatus,
    WriteResult,
    WriteSpec,
    _split_writes,
)
from kvhandoff.transports.callbacks import CallbackThread
from kvhandoff.transports.nixl.lib import UcxOffer, nixl_api, nixl_version, ucx_offer
from kvhandoff.transports.nixl.wire import (
    VERSION,
    Memory,
    NixlAddress,
    NixlRegion,
    decode_address,
    decode_region,
    encode,
    memory_of,
    write_descs,
)
from kvhandoff.transports.streams import check_tag, write_plans
from kvhandoff.transports.tcp import TcpTransport

if TYPE_CHECKING:
    from kvhandoff.kv_layout.spans import SpanPlan
    from kvhandoff.settings import Settings

log = logging.getLogger(__name__)

_POLL_MAX_S = 0.001


class _Write:
    __slots__ = ("peer", "tag", "total", "mem", "ldesc", "rdesc", "agent", "on_done", "handle",
                 "finished", "landed", "want_digest", "digest", "err", "seq", "parts")

    def __init__(self, peer: str, tag: int, total: int, mem: str, ldesc: np.ndarray,
                 rdesc: np.ndarray, agent: str, on_done: OnWritten, want_digest: bool,
                 seq: int, parts: int = 1) -> None:
        self.peer, self.tag, self.total, self.mem = peer, tag, total, mem
        self.ldesc, self.rdesc, self.agent, self.on_done = ldesc, rdesc, agent, on_done
        self.handle: Any = None
        self.finished = False
        self.landed = False
        self.want_digest = want_digest
        self.digest: tuple[int | None, ...] | None = None  # one per write of the job
        self.err: str | None = None
        self.seq = seq
        self.parts = parts  # the writes of the job (one digest each)


class NixlTransport(OneSidedTransport):
    """One-sided writes through NIXL, two-sided ops over TCP (see module comment)."""

    kind: ClassVar[TransportKind] = TransportKind.NIXL

    def __init__(self, settings: Settings) -> None:
        api = nixl_api()  # TransportError with the install hint when missing
        self._lock = threading.Lock()
        self._closed = False
        self._stall_s = float(settings.stall_timeout_s)
        self._agent_name = f"kvh-nixl-{uuid.uuid4().hex}"
        self._nx_lock = threading.Lock()
        try:
            self._agent = api.nixl_agent(self._agent_name, api.nixl_agent_config(backends=[]))
            if "UCX" not in self._agent.get_plugin_list():
                raise TransportError("nixl: NIXL has no UCX plugin (nixl-cu12 ships one); "
                                     "reinstall 'kvhandoff[nixl]'")
            # peer error handling, explicitly (NIXL's default too): a dead peer fails writes
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        except TransportError:
            raise
        except Exception as e:  # NIXL raises what its bindings raise
            raise TransportError(f"nixl: cannot create a NIXL agent with the UCX backend "
                                 f"({type(e).__name__}: {e})") from e
        offer = ucx_offer()  # NIXL's UCX is loaded now
        if settings.require_rdma and not offer.rdma_tls:
            raise TransportError("nixl transport refused: require_rdma is set and NIXL's UCX "
                                 f"{offer.version} sees no RDMA device ({_offer_text(offer)}); "
                                 "unset KVHANDOFF_REQUIRE_RDMA to accept UCX over TCP")
        self._offer = offer
        # nothing is registered yet: connection info only (each buffer's keys travel in its
        # describe() blob)
        self._metadata: bytes = self._agent.get_agent_metadata()
        self._tcp = TcpTransport(settings.model_copy(update={"require_rdma": False}))
        self._nixl_address = encode(NixlAddress(VERSION, self._tcp.address, self._agent_name,
                                                self._metadata))
        self._callbacks = CallbackThread(f"kvhandoff-nixl-cb-{self._agent_name[9:17]}")
        self._mems: dict[str, Memory] = {}
        self._regs: dict[str, Any] = {}  # name -> NIXL registration (_nx_lock)
        self._peer_agents: dict[str, tuple[str, bytes]] = {}  # peer -> (agent, metadata)
        self._loaded_agents: set[str] = set()  # remote agents loaded into ours (_nx_lock)
        self._remotes: dict[str, dict[str, NixlRegion]] = {}
        self._writes: dict[tuple[str, int], _Write] = {}
        self._written = 0
        self._seq = itertools.count()
        # the NIXL thread's queue and list of writes in flight
        self._cv = threading.Condition(threading.Lock())
        self._queued: list[_Write] = []
        self._active: list[_Write] = []
        self._stop = False
        self._hasher = CallbackThread(f"kvhandoff-nixl-hash-{self._agent_name[9:17]}")
        self._nx_thread = threading.Thread(target=self._nx_run, daemon=True,
                                           name=f"kvhandoff-nixl-io-{self._agent_name[9:17]}")
        self._nx_thread.start()

    # ---- addresses, buffers, peers -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.kind} transport is closed")

    @property
    def address(self) -> bytes:
        return self._nixl_address

    def register(self, name: str, buf: Any) -> None:
        """Host buffers (also the tcp part's, for two-sided ops) and CUDA buffers (one-sided
        writes only), each registered with the NIXL agent."""
        mem = memory_of(name, buf)
        with self._lock:
            self._check_open()
            if name in self._mems:
                raise TransportError(f"register: a buffer named {name!r} is already "
                                     "registered")
        with self._nx_lock:
            try:
                reg = self._agent.register_memory(
                    np.asarray([[mem.addr, mem.length, mem.device]], np.int64), mem.mem)
            except Exception as e:
                raise TransportError(f"register {name!r}: NIXL refused the {mem.mem} region "
                                     f"({type(e).__name__}: {e})") from e
        try:
            if mem.host is not None:
                self._tcp.register(name, mem.host)
        except TransportError:
            with self._nx_lock:
                self._agent.deregister_memory(reg)
            raise
        with self._nx_lock:
            self._regs[name] = reg
        with self._lock:
            self._mems[name] = mem

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._tcp.post_send(peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._tcp.post_recv(peer, tag, name, offsets, nbytes, on_done)

    def bind_session(self, peer: str, key: bytes) -> None:
        self._tcp.bind_session(peer, key)  # its two-sided part is bound like tcp's

    def connect(self, peer: str, address: bytes) -> None:
        addr = decode_address(address)
        with self._lock:
            self._check_open()
        self._tcp.connect(peer, addr.tcp)
        with self._nx_lock:
            if addr.agent not in self._loaded_agents:
                try:
                    self._agent.add_remote_agent(addr.metadata)
                except Exception as e:
                    self._tcp.disconnect(peer)
                    raise TransportError(f"connect {peer!r}: NIXL cannot load the peer's agent "
                                         f"metadata ({type(e).__name__}: {e})") from e
                self._loaded_agents.add(addr.agent)
        with self._lock:
            self._peer_agents[peer] = (addr.agent, addr.metadata)

    def disconnect(self, peer: str) -> None:
        self._tcp.disconnect(peer)
        with self._lock:
            ops = [op for op in self._writes.values() if op.peer == peer]
            known = self._peer_agents.pop(peer, None)
            self._remotes.pop(peer, None)
            still_used = known is not None and any(a == known[0]
                                                   for a, _ in self._peer_agents.values())
        self._end_writes(ops, f"disconnected from peer {peer!r}")
        if known is not None and not still_used:
            with self._nx_lock:
                if known[0] in self._loaded_agents:
                    self._loaded_agents.discard(known[0])
                    try:
                        self._agent.remove_remote_agent(known[0])
                    except Exception as e:  # nothing of it is in flight any more
                        log.warning("nixl: removing the agent of peer %r failed: %s", peer, e)

    # ---- one-sided writes ------------------------------------------------------------------

    def describe(self, name: str) -> bytes:
        mem = self._mems.get(name)
        if mem is None:
            raise TransportError(f"describe: no buffer registered as {name!r}")
        with self._nx_lock:
            md = self._agent.get_partial_agent_metadata(self._regs[name], False)
        return encode(NixlRegion(VERSION, self._agent_name, mem.mem, mem.addr, mem.length,
                                 mem.device, md))

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        with self._lock:
            self._check_open()
            known = self._peer_agents.get(peer)
        if known is None:
            raise TransportError(f"register_remote: peer {peer!r} is not connected")
        region = decode_region(descriptor)
        if region.agent != known[0]:
            raise TransportError(f"register_remote {name!r}: the descriptor is of NIXL agent "
                                 f"{region.agent!r}, peer {peer!r} is agent {known[0]!r}")
        with self._nx_lock:
            try:
                self._agent.add_remote_agent(region.metadata)  # the region's remote keys
            except Exception as e:
                raise TransportError(f"register_remote {name!r}: NIXL refused the descriptor's "
                                     f"metadata ({type(e).__name__}: {e})") from e
        with self._lock:
            self._remotes.setdefault(peer, {})[name] = region

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """The writes' pieces as ONE NIXL WRITE (one request, one completion) under the first
        write's tag, each write's source hashed on its own; writes of both memory kinds (DRAM
        and VRAM) in one job: one WRITE each (_split_writes)."""
        with self._lock:
            known = self._peer_agents.get(peer)
            regions = [self._remotes.get(peer, {}).get(w[2]) for w in writes]
        mems = [self._mems.get(w[1]) for w in writes]
        plans = write_plans(peer, writes, on_done, [None if m is None else m.length for m in mems],
                            [None if r is None else r.length for r in regions],
                            connected=known is not None)
        parts: list[tuple[Memory, SpanPlan, NixlRegion]] = []
        for (_, name, _, _), mem, plan, region in zip(writes, mems, plans, regions, strict=True):
            assert mem is not None and region is not None  # write_plans checked both
            if checksum and mem.host is None:
                raise TransportError(f"post_writes {name!r}: checksum=True needs a host (DRAM) "
                                     "buffer; hash VRAM on the device")
            parts.append((mem, plan, region))
        assert known is not None  # write_plans checked it
        if len({m.mem for m, _, _ in parts}) > 1:  # one NIXL request moves one memory kind
            _split_writes(self, peer, writes, on_done, checksum=checksum)
            return
        descs = [write_descs(m, plan, region) for m, plan, region in parts]
        ldesc = descs[0][0] if len(descs) == 1 else np.concatenate([d[0] for d in descs])
        rdesc = descs[0][1] if len(descs) == 1 else np.concatenate([d[1] for d in descs])
        tag = check_tag(writes[0][0])
        total = sum(plan.total_bytes for _, plan, _ in parts)
        op = _Write(peer, tag, total, parts[0][0].mem, ldesc, rdesc, known[0], on_done, checksum,
                    next(self._seq), len(parts))
        with self._lock:
            self._check_open()
            if peer not in self._peer_agents:
                raise TransportError(f"post_writes: peer {peer!r} is not connected")
            if (peer, tag) in self._writes:
                raise TransportError(f"post_writes: tag {tag} with peer {peer!r} is already "
                                     "pending")
            self._writes[(peer, tag)] = op
            if total == 0:
                op.landed = True
        if checksum:
            self._hasher.submit(functools.partial(
                self._hash, op, [(m.host, plan.src_offsets, plan.nbytes) for m, plan, _ in parts]))
        if total == 0:
            self._complete(op)
            return
        with self._cv:
            self._queued.append(op)
            self._cv.notify()

    def cancel(self, peer: str, tag: int) -> None:
        self._tcp.cancel(peer, tag)
        with self._lock:
            op = self._writes.get((peer, check_tag(tag)))
        if op is not None:
            self._end_writes([op], f"cancelled: tag {tag} peer {peer!r}")

    # ---- status, close ---------------------------------------------------------------------

    def status(self) -> TransportStatus:
        offer = self._offer
        lanes = tuple(f"nixl/ucx:{tl}" for tl in offer.network_tls) or ("nixl/ucx",)
        degraded = not offer.rdma_tls
        reason = (f"nixl transport (NIXL {nixl_version()}, writes over UCX "
                  f"{offer.version}: {', '.join(offer.rdma_tls) or 'tcp'}); two-sided ops over "
                  f"tcp; {_offer_text(offer)}")
        if degraded:
            reason = "no RDMA lane: " + reason
        tcp = self._tcp.status()
        return TransportStatus(kind=self.kind, lanes=lanes, degraded=degraded, reason=reason,
                               bytes_sent=tcp.bytes_sent + self._written,
                               bytes_received=tcp.bytes_received, counters=tcp.counters)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ops = list(self._writes.values())
        self._end_writes(ops, "nixl transport closed")
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._nx_thread:
            self._nx_thread.join()
        with self._lock:
            ops = list(self._writes.values())  # posted while closing: never started
        self._end_writes(ops, "nixl transport closed")
        self._tcp.close()
        self._hasher.stop()
        self._callbacks.stop()
        with self._nx_lock:
            for agent in list(self._loaded_agents):
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception as e:
                    log.warning("nixl: removing remote agent %s failed: %s", agent, e)
            self._loaded_agents.clear()
            for reg in self._regs.values():
                try:
                    self._agent.deregister_memory(reg)
                except Exception as e:
                    log.warning("nixl: deregistering memory failed: %s", e)
            self._regs.clear()

    def __repr__(self) -> str:
        return f"<NixlTransport agent={self._agent_name} peers={len(self._peer_agents)}>"

    # ---- completion (any thread) -----------------------------------------------------------

    def _hash(self, op: _Write, spans: list[tuple[Any, np.ndarray, np.ndarray]]) -> None:
        """(hash worker) The digest of each write's source stream, while the WRITE flies."""
        if op.finished:
            return
        op.digest = tuple(span_checksum(host, off, nb) for host, off, nb in spans)
        self._complete(op)

    def _complete(self, op: _Write, err: str | None = None) -> None:
        """Finishes `op` with `err`, or successfully once it landed and its digest (if asked)
        is ready; no-op when already finished or not ready."""
        with self._lock:
            if op.finished:
                return
            if err is None and (not op.landed or (op.want_digest and op.digest is None)):
                return
            op.finished = True
            self._writes.pop((op.peer, op.tag), None)
            if err is None:
                self._written += op.total
                result = WriteResult(None, op.digest if op.want_digest and op.digest is not None
                                     else (None,) * op.parts)
            else:
                result = WriteResult(TransportError(err))
            self._callbacks.submit(functools.partial(op.on_done, result))

    def _end_writes(self, ops: list[_Write], reason: str) -> None:
        """Aborts the NIXL transfer of each op (nothing of it writes afterwards), then finishes
        it with `reason` (unless it completed first)."""
        for op in ops:
            op.err = reason  # the NIXL thread starts no transfer of it any more
            with self._nx_lock:
                self._release(op, wait=True)
            self._complete(op, reason)

    def _release(self, op: _Write, wait: bool) -> bool:
        """(_nx_lock held) Releases op's handle: aborts it if active; when NIXL cannot abort
        it and `wait`, waits for it to end (bounded by stall_timeout_s). Whether released."""
        if op.handle is None:
            return True
        try:
            op.handle.release()
        except Exception as e:
            if not wait:
                raise
            deadline = time.monotonic() + self._stall_s
            while self._agent.check_xfer_state(op.handle) == "PROC":
                if time.monotonic() > deadline:
                    log.error("nixl: write tag %d to peer %r could not be aborted (%s) and did "
                              "not end in %.0f s; it may still land", op.tag, op.peer, e,
                              self._stall_s)
                    return False
                time.sleep(0.0005)
            op.handle.release()
        op.handle = None
        return True

    # ---- the NIXL thread -------------------------------------------------------------------

    def _nx_run(self) -> None:
        delay = 0.0
        try:
            while True:
                with self._cv:
                    if not self._queued and not self._active and not self._stop:
                        self._cv.wait()
                    elif not self._queued and not self._stop and delay:
                        self._cv.wait(delay)
                    if self._stop:
                        return
                    new, self._queued = self._queued, []
                ended: list[tuple[_Write, str | None]] = []
                with self._nx_lock:
                    for op in new:
                        self._start(op, ended)
                    self._poll(ended)
                for op, err in ended:
                    if err is None:
                        op.landed = True
                    self._complete(op, err)
                delay = 0.0 if ended or new else min(max(delay * 2, 5e-5), _POLL_MAX_S)
        except Exception:
            log.exception("nixl transport thread failed")
            with self._lock:
                ops = list(self._writes.values())
            for op in ops:
                self._complete(op, "nixl transport thread failed")

    def _start(self, op: _Write, ended: list[tuple[_Write, str | None]]) -> None:
        """(_nx_lock held) Creates and posts op's WRITE."""
        if op.err is not None or op.finished:
            return
        agent = self._agent
        try:
            local = agent.get_xfer_descs(op.ldesc, op.mem)
            remote = agent.get_xfer_descs(op.rdesc, op.mem)
            op.handle = agent.initialize_xfer("WRITE", local, remote, op.agent)
            state = agent.transfer(op.handle)
        except Exception as e:
            if op.handle is not None:
                self._release(op, wait=True)
            ended.append((op, f"nixl: WRITE of tag {op.tag} to peer {op.peer!r} could not be "
                              f"posted ({type(e).__name__}: {e})"))
            return
        self._settle(op, state, ended)

    def _poll(self, ended: list[tuple[_Write, str | None]]) -> None:
        still = []
        for op in self._active:
            if op.handle is None:  # aborted by cancel/disconnect/close
                continue
            try:
                state = self._agent.check_xfer_state(op.handle)
            except Exception as e:
                state = f"ERR ({type(e).__name__}: {e})"
            if self._settle(op, state, ended, track=False):
                still.append(op)
        self._active = still

    def _settle(self, op: _Write, state: str, ended: list[tuple[_Write, str | None]],
                track: bool = True) -> bool:
        """(_nx_lock held) Acts on op's NIXL state; whether it is still in flight."""
        if state == "PROC":
            if track:
                self._active.append(op)
            return True
        released = self._release(op, wait=True)
        if state == "DONE":
            ended.append((op, None))
        else:
            what = "the peer is gone or unreachable" if released else "and could not be released"
            ended.append((op, f"nixl: WRITE of tag {op.tag} to peer {op.peer!r} failed "
                              f"(state {state}: {what})"))
        return False


def _offer_text(offer: UcxOffer) -> str:
    verbs = (f"built with verbs modules {', '.join(offer.verbs_modules)}"
             if offer.verbs_modules else "built without verbs")
    rdma = (f"RDMA transports {', '.join(offer.rdma_tls)}" if offer.rdma_tls
            else "no RDMA device usable")
    res = ", ".join(offer.resources) or "none"
    err = f"; probe error: {offer.error}" if offer.error else ""
    return (f"NIXL's bundled UCX {offer.version} at {offer.libdir} is {verbs}; {rdma} "
            f"(resources: {res}); {offer.modules_note}{err}")
