# The `auto` transport: shm with peers on this host, a cross-host transport with the others.
#
# How it works: it holds a ShmTransport and the transport named by settings.auto_cross_host
# (ucx, tcp or nixl). Its address is a versioned msgpack struct carrying this host's identity
# (_hostid.host_id), this process's PID namespace, whether this process may write into a
# sibling process's memory (Yama ptrace_scope, CAP_SYS_PTRACE) and the address of each part.
# connect(peer, address): same host identity and PID namespace, and both sides able to write
# into each other -> the peer's route is shm, else the cross-host part (a same-host peer sent
# cross-host is logged and named in status with the reason); the route is remembered per peer
# until disconnect. (A PID namespace of its own, e.g. a container sharing the host's network
# and name, would make the shm part's pid point at another process; a Yama ptrace_scope of 1
# or more refuses process_vm_writev between siblings.) A same-host peer whose process does not
# prove over the shm part's Unix socket that it is the process its address names
# (shm/proof.py: a forged address, or a process in another network namespace, where the
# socket's abstract name is not seen, which is so both ways) goes cross-host too, with that
# reason.
# Every per-peer call (post_send, post_recv, cancel, register_remote, post_writes,
# peer_exited) goes to that peer's route only, so the two parts never see the same peer and
# their tag spaces never meet. Both sides of a pair run auto (the Hello refuses a different
# kind) and agree on the route: every input of the decision is symmetric.
#
# One-sided writes: an OneSidedTransport. describe(name) gives both parts' descriptors (the
# cross-host part's only when it can take writes); can_write(peer) says whether the peer's
# route has one-sided writes (shm, nixl: yes; tcp, ucx: no, and the agent then sends that
# peer's rooms two-sided, which is intended, not an error); register_remote installs the
# part of the peer's route (TransportError for a route without writes).
#
# Status: lanes are the union of both parts' lanes, the cross-host ones prefixed with its kind
# ("shm/cma", "ucx:tcp/lo", "tcp:tcp"; just "ucx" while no peer uses it); counters are
# summed; degraded only when the cross-host part is degraded AND a connected peer uses it
# (shm is never degraded); the reason says how many peers use each part, which same-host
# peers go cross-host and why.
#
# require_rdma applies to the cross-host part (tcp refuses it, ucx refuses a peer without an
# RDMA lane); the shm part ignores it, as UCX accepts its shared-memory lanes for same-host peers.
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

import msgspec
import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.transports.base import (
    OnDone,
    OneSidedTransport,
    OnWritten,
    Transport,
    TransportKind,
    TransportStatus,
    WriteSpec,
    load_transport,
)
from kvhandoff.transports.hostid import host_id
from kvhandoff.transports.shm.proof import PeerNotProven

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

log = logging.getLogger(__name__)

VERSION = 1
_T = TypeVar("_T")
_CAP_SYS_PTRACE = 19
_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
#: The cross-host transports auto can hold (settings.auto_cross_host).
CROSS_HOST_KINDS = (TransportKind.UCX, TransportKind.TCP, TransportKind.NIXL)


class _Versioned(msgspec.Struct):
    v: int


class AutoAddress(msgspec.Struct, frozen=True):
    """What peers pass to connect: host identity, PID namespace, whether the shm lane can
    work from this process (and why not), and the address of each part."""

    v: int
    host: bytes
    pidns: str
    shm_ok: bool
    shm_why: str
    shm: bytes
    cross_kind: str
    cross: bytes


class AutoDescriptor(msgspec.Struct, frozen=True):
    """describe(name): the shm part's descriptor and the cross-host part's (b"" when it has
    no one-sided writes)."""

    v: int
    shm: bytes
    cross_kind: str
    cross: bytes


def _decode(blob: bytes, typ: type[_T], what: str) -> _T:
    if not isinstance(blob, bytes) or not blob:
        raise TransportError(f"{what} must be non-empty bytes")
    try:
        v = msgspec.msgpack.decode(blob, type=_Versioned).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TransportError(f"{what} is not an auto transport {typ.__name__} ({e}); both "
                             "sides must use transport=auto") from e
    if v != VERSION:
        raise TransportError(f"{what}: version {v}, this side reads version {VERSION}; "
                             "upgrade both sides")
    try:
        return msgspec.msgpack.decode(blob, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TransportError(f"{what}: malformed {typ.__name__}: {e}") from e


def pid_namespace() -> str:
    """This process's PID namespace ("dev:inode" of /proc/self/ns/pid; "" if unreadable)."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def shm_usable(scope: str | None, cap_eff: int) -> tuple[bool, str]:
    """Whether processes of this host may write into each other's memory (the shm lane's
    process_vm_writev): `scope` is Yama's ptrace_scope (None: no Yama),
    `cap_eff` this process's effective capabilities. (ok, why not)."""
    if scope is None or scope.strip() == "0":
        return True, ""
    ptrace_cap = bool(cap_eff >> _CAP_SYS_PTRACE & 1)
    if scope.strip() in ("1", "2") and ptrace_cap:
        return True, ""
    return False, (f"Yama ptrace_scope={scope.strip()} forbids writing into a sibling "
                   "process's memory (set kernel.yama.ptrace_scope=0 or give the engines "
                   "CAP_SYS_PTRACE; kvhandoff doctor checks it)")


def _local_shm_usable() -> tuple[bool, str]:
    try:
        with open(_PTRACE_SCOPE) as f:
            scope: str | None = f.read()
    except FileNotFoundError:
        scope = None
    except OSError as e:
        return False, f"cannot read {_PTRACE_SCOPE}: {e}"
    cap = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    cap = int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return shm_usable(scope, cap)


def encode_address(host: bytes, shm: bytes, cross_kind: str, cross: bytes, *,
                   pidns: str, shm_ok: bool = True, shm_why: str = "") -> bytes:
    """An auto address (tests build one with another host identity by hand)."""
    return msgspec.msgpack.encode(AutoAddress(VERSION, host, pidns, shm_ok, shm_why, shm,
                                              str(cross_kind), cross))


def decode_address(blob: bytes) -> AutoAddress:
    return _decode(blob, AutoAddress, "auto address")


class AutoTransport(OneSidedTransport):
    """shm for peers on this host, the auto_cross_host transport for the others."""

    kind: ClassVar[TransportKind] = TransportKind.AUTO

    def __init__(self, settings: Settings) -> None:
        cross_kind = TransportKind(settings.auto_cross_host)
        if cross_kind not in CROSS_HOST_KINDS:  # settings validates too; a hand-built object
            raise TransportError(f"auto_cross_host must be one of "
                                 f"{', '.join(map(str, CROSS_HOST_KINDS))}, got {cross_kind}")
        from kvhandoff.transports.shm.transport import ShmTransport

        self._shm: OneSidedTransport = ShmTransport(
            settings.model_copy(update={"require_rdma": False}))
        try:
            self._cross: Transport = load_transport(cross_kind, settings)
        except BaseException:
            self._shm.close()
            raise
        if settings.require_rdma:  # fail at start, as ucx alone does (the agent's check)
            st = self._cross.status()
            if st.degraded:
                self._cross.close()
                self._shm.close()
                raise TransportError(f"auto transport refused: require_rdma is set but its "
                                     f"cross-host {cross_kind} part is degraded: {st.reason}")
        self._cross_kind = cross_kind
        self._host = host_id()
        self._pidns = pid_namespace()
        self._shm_ok, self._shm_why = _local_shm_usable()
        self._address = encode_address(self._host, self._shm.address, cross_kind,
                                       self._cross.address, pidns=self._pidns,
                                       shm_ok=self._shm_ok, shm_why=self._shm_why)
        self._lock = threading.Lock()
        self._routes: dict[str, Transport] = {}  # peer -> the part that carries it
        self._addresses: dict[str, bytes] = {}
        self._not_shm: dict[str, str] = {}  # same-host peers sent cross-host -> why
        self._closed = False

    # ---- routing --------------------------------------------------------------------------

    def _lane(self, part: Transport) -> str:
        return "shm" if part is self._shm else str(self._cross_kind)

    def _route(self, peer: str, what: str) -> Transport:
        with self._lock:
            if self._closed:
                raise TransportError("auto transport is closed")
            part = self._routes.get(peer)
        if part is None:
            raise TransportError(f"{what}: peer {peer!r} is not connected; call connect first")
        return part

    def route(self, peer: str) -> str | None:
        """The lane of a connected peer ("shm" or the cross-host kind), None if not connected."""
        with self._lock:
            part = self._routes.get(peer)
        return None if part is None else self._lane(part)

    def routes(self) -> dict[str, str]:
        """The lane of every connected peer ("shm" or the cross-host kind)."""
        with self._lock:
            return {p: self._lane(part) for p, part in self._routes.items()}

    # ---- Transport ------------------------------------------------------------------------

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, name: str, buf: np.ndarray) -> None:
        self._shm.register(name, buf)
        self._cross.register(name, buf)

    def connect(self, peer: str, address: bytes) -> None:
        addr = decode_address(address)
        with self._lock:
            if self._closed:
                raise TransportError("auto transport is closed")
            known = self._addresses.get(peer)
            route = self._routes.get(peer)
        if known == address:
            if route is self._cross:  # a new session with the peer: its key (bind_session)
                route.connect(peer, addr.cross)
            return
        if known is not None:
            raise TransportError(f"connect {peer!r}: already connected at another address; "
                                 "disconnect first")
        why = self._why_not_shm(addr)
        part: Transport
        if addr.host == self._host and not why:
            part, inner = self._shm, addr.shm
        else:
            if addr.cross_kind != self._cross_kind:
                raise TransportError(
                    f"connect {peer!r}: the peer is on another host and its auto_cross_host "
                    f"is {addr.cross_kind}, this side's is {self._cross_kind}; set "
                    "KVHANDOFF_AUTO_CROSS_HOST alike on both sides")
            part, inner = self._cross, addr.cross
        if part is self._shm:
            try:
                part.connect(peer, inner)
            except PeerNotProven as e:  # forged, or a process shm cannot reach: never shm
                if addr.cross_kind != self._cross_kind:
                    raise
                why = f"its process did not prove it is the peer ({e})"
                part, inner = self._cross, addr.cross
                part.connect(peer, inner)
        else:
            part.connect(peer, inner)
        same_host_cross = addr.host == self._host and bool(why)
        if same_host_cross:
            log.warning("auto: peer %r is on this host but goes over %s, not shm: %s", peer,
                        self._cross_kind, why)
        with self._lock:
            self._routes[peer] = part
            self._addresses[peer] = address
            if same_host_cross:
                self._not_shm[peer] = why

    def _why_not_shm(self, addr: AutoAddress) -> str:
        """Why a peer of this host cannot use shm ("" when it can)."""
        if addr.pidns != self._pidns or not self._pidns:
            return (f"another PID namespace (peer {addr.pidns or 'unknown'}, this process "
                    f"{self._pidns or 'unknown'}): its pid would name another process here")
        if not self._shm_ok:
            return f"this side: {self._shm_why}"
        if not addr.shm_ok:
            return f"the peer's side: {addr.shm_why}"
        return ""

    def bind_session(self, peer: str, key: bytes) -> None:
        self._cross.bind_session(peer, key)  # (shm proves its peers by SO_PEERCRED)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            part = self._routes.get(peer)
        if part is None:
            return
        try:
            part.disconnect(peer)
        finally:
            with self._lock:
                if self._routes.get(peer) is part:
                    del self._routes[peer]
                    self._addresses.pop(peer, None)
                    self._not_shm.pop(peer, None)

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._route(peer, "post_send").post_send(peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._route(peer, "post_recv").post_recv(peer, tag, name, offsets, nbytes, on_done)

    def cancel(self, peer: str, tag: int) -> None:
        with self._lock:
            part = self._routes.get(peer)
        if part is not None:  # an unknown peer has no ops to cancel
            part.cancel(peer, tag)

    # ---- one-sided writes -----------------------------------------------------------------

    def describe(self, name: str) -> bytes:
        shm = self._shm.describe(name)
        cross = (self._cross.describe(name) if isinstance(self._cross, OneSidedTransport)
                 else b"")
        return msgspec.msgpack.encode(AutoDescriptor(VERSION, shm, str(self._cross_kind), cross))

    def can_write(self, peer: str) -> bool:
        """Whether connected `peer`'s route (shm, or the cross-host part) has one-sided
        writes. Raises TransportError when the peer is not connected."""
        return isinstance(self._route(peer, "can_write"), OneSidedTransport)

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        part = self._route(peer, "register_remote")
        desc = _decode(descriptor, AutoDescriptor, f"register_remote {name!r}: descriptor")
        if part is self._shm:
            self._shm.register_remote(peer, name, desc.shm)
            return
        cross = self._cross
        if not isinstance(cross, OneSidedTransport) or not desc.cross:
            side = ("this side's" if not isinstance(cross, OneSidedTransport)
                    else f"the peer's ({desc.cross_kind})")
            raise TransportError(f"register_remote {name!r}: the {self._cross_kind} lane to peer "
                                 f"{peer!r} has no one-sided writes ({side} cross-host "
                                 "transport cannot take them); use post_send / post_recv")
        cross.register_remote(peer, name, desc.cross)

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """To the peer's part as one job (shm copies it as one; a part that cannot splits
        it, base._split_writes); its WriteResult, landed sums included, is the part's."""
        part = self._route(peer, "post_writes")
        if not isinstance(part, OneSidedTransport):
            raise TransportError(f"post_writes: the {self._lane(part)} lane to peer {peer!r} "
                                 "has no one-sided writes; use post_send / post_recv")
        part.post_writes(peer, writes, on_done, checksum=checksum)

    def peer_exited(self, peer: str) -> bool:
        with self._lock:
            part = self._routes.get(peer)
        return part is not None and part.peer_exited(peer)

    # ---- status / lifecycle ---------------------------------------------------------------

    def status(self) -> TransportStatus:
        shm, cross = self._shm.status(), self._cross.status()
        with self._lock:
            routes = dict(self._routes)
            not_shm = dict(self._not_shm)
        shm_peers = sorted(p for p, part in routes.items() if part is self._shm)
        cross_peers = sorted(p for p, part in routes.items() if part is self._cross)
        k = str(self._cross_kind)
        # the cross-host part's lanes once a peer uses it; until then only its name (a UCX
        # with no peer lists every resource it could use, which would read as lanes in use)
        lanes = tuple(shm.lanes) + (tuple(f"{k}:{lane}" for lane in cross.lanes)
                                    if cross_peers else (k,))
        degraded = cross.degraded and bool(cross_peers)
        head = (f"auto: shm for {len(shm_peers)} same-host peer(s), {k} for "
                f"{len(cross_peers)} peer(s)")
        if not_shm:
            head += "; same-host peer(s) over " + k + ": " + "; ".join(
                f"{p} ({why})" for p, why in sorted(not_shm.items()))
        if degraded:
            head += f"; degraded: the {k} lane to peer(s) {', '.join(cross_peers)} is degraded"
        elif cross.degraded:
            head += f" ({k} would be degraded, but no connected peer uses it)"
        if not self._shm_ok:
            head += f"; no shm lane from this process: {self._shm_why}"
        reason = f"{head}. [shm] {shm.reason}. [{k}] {cross.reason}"
        return TransportStatus(kind=self.kind, lanes=lanes, degraded=degraded,
                               reason=reason,
                               bytes_sent=shm.bytes_sent + cross.bytes_sent,
                               bytes_received=shm.bytes_received + cross.bytes_received,
                               counters={n: shm.counters.get(n, 0) + cross.counters.get(n, 0)
                                         for n in {*shm.counters, *cross.counters}})

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._routes.clear()
            self._addresses.clear()
        try:
            self._shm.close()
        finally:
            self._cross.close()

    def __repr__(self) -> str:
        with self._lock:
            n = len(self._routes)
        return f"<AutoTransport shm+{self._cross_kind} peers={n}>"
