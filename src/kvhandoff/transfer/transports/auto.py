# The `auto` transport: shm with peers on this host, a cross-host transport with the others.
#
# How it works: it holds a ShmTransport and the transport named by settings.auto_cross_host
# (ucx, tcp or nixl). Its address is a versioned msgpack struct carrying this host's identity
# (_hostid.host_id) and the address of each part. connect(peer, address) compares the peer's
# host identity with this one: equal -> the peer's route is shm, else the cross-host part; the
# route is remembered per peer until disconnect. Every per-peer call (post_send, post_recv,
# cancel, register_remote, post_write, fence, peer_exited) goes to that peer's route only, so
# the two parts never see the same peer and their tag spaces never meet. Both sides of a pair
# run auto (the Hello refuses a different kind) and agree on the route: host identity is
# symmetric.
#
# One-sided writes: supports_write is True. describe(name) gives both parts' descriptors (the
# cross-host part's only when it can take writes); register_remote installs the part of the
# peer's route and raises TransportError when that route has no one-sided writes (tcp, ucx):
# the agent then sends that peer's rooms two-sided, which is intended, not an error.
#
# Status: lanes are the union of both parts' lanes, the cross-host ones prefixed with its kind
# ("shm/cma", "ucx:tcp/lo", "tcp:tcp"); counters are summed; degraded only when the cross-host
# part is degraded AND a connected peer uses it (shm is never degraded), the reason says which
# peers and how many use each part.
#
# require_rdma applies to the cross-host part (tcp refuses it, ucx refuses a peer without an
# RDMA lane); the shm part ignores it, as UCX accepts its shared-memory lanes for same-host peers.
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ClassVar, TypeVar

import msgspec
import numpy as np

from kvhandoff.errors import TransportError

from ._hostid import host_id
from .base import OnDone, OnWritten, Transport, TransportKind, TransportStatus, load_transport

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

VERSION = 1
_T = TypeVar("_T")
#: The cross-host transports auto can hold (settings.auto_cross_host).
CROSS_HOST_KINDS = (TransportKind.UCX, TransportKind.TCP, TransportKind.NIXL)


class _Versioned(msgspec.Struct):
    v: int


class AutoAddress(msgspec.Struct, frozen=True):
    """What peers pass to connect: host identity and the address of each part."""

    v: int
    host: bytes
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


def encode_address(host: bytes, shm: bytes, cross_kind: str, cross: bytes) -> bytes:
    """An auto address (tests build one with another host identity by hand)."""
    return msgspec.msgpack.encode(AutoAddress(VERSION, host, shm, str(cross_kind), cross))


def decode_address(blob: bytes) -> AutoAddress:
    return _decode(blob, AutoAddress, "auto address")


class AutoTransport(Transport):
    """shm for peers on this host, the auto_cross_host transport for the others."""

    kind: ClassVar[TransportKind] = TransportKind.AUTO
    supports_write: ClassVar[bool] = True

    def __init__(self, settings: Settings) -> None:
        cross_kind = TransportKind(settings.auto_cross_host)
        if cross_kind not in CROSS_HOST_KINDS:  # settings validates too; a hand-built object
            raise TransportError(f"auto_cross_host must be one of "
                                 f"{', '.join(map(str, CROSS_HOST_KINDS))}, got {cross_kind}")
        from .shm import ShmTransport

        self._shm: Transport = ShmTransport(settings.model_copy(update={"require_rdma": False}))
        try:
            self._cross: Transport = load_transport(cross_kind, settings)
        except BaseException:
            self._shm.close()
            raise
        self._cross_kind = cross_kind
        self._host = host_id()
        self._address = encode_address(self._host, self._shm.address, cross_kind,
                                       self._cross.address)
        self._lock = threading.Lock()
        self._routes: dict[str, Transport] = {}  # peer -> the part that carries it
        self._addresses: dict[str, bytes] = {}
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
        if known == address:
            return
        if known is not None:
            raise TransportError(f"connect {peer!r}: already connected at another address; "
                                 "disconnect first")
        if addr.host == self._host:
            part, inner = self._shm, addr.shm
        else:
            if addr.cross_kind != self._cross_kind:
                raise TransportError(
                    f"connect {peer!r}: the peer is on another host and its auto_cross_host "
                    f"is {addr.cross_kind}, this side's is {self._cross_kind}; set "
                    "KVHANDOFF_AUTO_CROSS_HOST alike on both sides")
            part, inner = self._cross, addr.cross
        part.connect(peer, inner)
        with self._lock:
            self._routes[peer] = part
            self._addresses[peer] = address

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
        cross = self._cross.describe(name) if self._cross.supports_write else b""
        return msgspec.msgpack.encode(AutoDescriptor(VERSION, shm, str(self._cross_kind), cross))

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        part = self._route(peer, "register_remote")
        desc = _decode(descriptor, AutoDescriptor, f"register_remote {name!r}: descriptor")
        if part is self._shm:
            part.register_remote(peer, name, desc.shm)
            return
        if not self._cross.supports_write or not desc.cross:
            side = ("this side's" if not self._cross.supports_write
                    else f"the peer's ({desc.cross_kind})")
            raise TransportError(f"register_remote {name!r}: the {self._cross_kind} lane to peer "
                                 f"{peer!r} has no one-sided writes ({side} cross-host "
                                 "transport cannot take them); use post_send / post_recv")
        part.register_remote(peer, name, desc.cross)

    def post_write(self, peer: str, tag: int, name: str, offsets: np.ndarray,
                   nbytes: np.ndarray, remote: str, remote_offsets: np.ndarray,
                   remote_nbytes: np.ndarray, on_done: OnWritten, *,
                   checksum: bool = False) -> None:
        self._route(peer, "post_write").post_write(peer, tag, name, offsets, nbytes, remote,
                                                   remote_offsets, remote_nbytes, on_done,
                                                   checksum=checksum)

    def fence(self, peer: str, on_done: OnDone) -> None:
        self._route(peer, "fence").fence(peer, on_done)

    def peer_exited(self, peer: str) -> bool:
        with self._lock:
            part = self._routes.get(peer)
        return part is not None and part.peer_exited(peer)

    # ---- status / lifecycle ---------------------------------------------------------------

    def status(self) -> TransportStatus:
        shm, cross = self._shm.status(), self._cross.status()
        with self._lock:
            routes = dict(self._routes)
        shm_peers = sorted(p for p, part in routes.items() if part is self._shm)
        cross_peers = sorted(p for p, part in routes.items() if part is self._cross)
        k = str(self._cross_kind)
        lanes = tuple(shm.lanes) + tuple(f"{k}:{lane}" for lane in cross.lanes)
        degraded = cross.degraded and bool(cross_peers)
        head = (f"auto: shm for {len(shm_peers)} same-host peer(s), {k} for "
                f"{len(cross_peers)} peer(s) on other hosts")
        if degraded:
            head += f"; degraded: the {k} lane to peer(s) {', '.join(cross_peers)} is degraded"
        elif cross.degraded:
            head += f" ({k} would be degraded, but no connected peer uses it)"
        reason = f"{head}. [shm] {shm.reason}. [{k}] {cross.reason}"
        return TransportStatus(kind=self.kind, lanes=lanes, degraded=degraded,
                               reason=reason,
                               bytes_sent=shm.bytes_sent + cross.bytes_sent,
                               bytes_received=shm.bytes_received + cross.bytes_received)

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
