# The shm transport's wire: its address, buffer descriptors, control messages, and the records
# of ops and peers (shared by shm.py's two-sided and one-sided paths).
from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan
from kvhandoff.netaddr import split_zmq_endpoint
from kvhandoff.transports.base import OnDone
from kvhandoff.transports.hostid import HOST_ID_BYTES
from kvhandoff.transports.shm.copy import CopyJob, Target
from kvhandoff.transports.streams import ChunkPlan

MAGIC = b"KVHSHM1"
PID = struct.Struct("<I")
_DESC = struct.Struct("<8sIiQQQQ")  # magic, pid, fd, segment bytes, offset, address, nbytes
_DESC_MAGIC = b"KVHSHMD1"
EXPOSE = struct.Struct("<cQQ")  # b"R", tag, total bytes; then descriptor, offsets, nbytes
FINAL = struct.Struct("<cQB")  # b"F", tag, ok; then a utf-8 reason
TAGMSG = struct.Struct("<cQ")  # b"X" (stop writing tag) / b"A" (nothing writes it any more)


def split_address(address: bytes) -> tuple[bytes, int, str, bytes]:
    """(host id, pid, control endpoint, ident) of an shm transport address."""
    head = len(MAGIC) + HOST_ID_BYTES + PID.size
    try:
        if not address.startswith(MAGIC) or len(address) <= head:
            raise ValueError
        host = address[len(MAGIC):len(MAGIC) + HOST_ID_BYTES]
        (pid,) = PID.unpack(address[head - PID.size:head])
        endpoint, ident = address[head:].decode("ascii").rsplit("/", 1)
        split_zmq_endpoint(endpoint)  # tcp://host:port or tcp://[v6]:port
        if len(ident) != 32:
            raise ValueError
    except (ValueError, UnicodeDecodeError, struct.error):
        raise TransportError(f"shm: address {address[:48]!r}… is not an shm transport address; "
                             "both agents must use the same transport") from None
    return host, pid, endpoint, ident.encode("ascii")


def describe_buffer(buf: np.ndarray) -> bytes:
    """The descriptor of a registered buffer of this process (see kvhandoff.buffers.shared)."""
    from kvhandoff.buffers.shared import find_segment

    addr, n = int(buf.ctypes.data), int(buf.size)
    seg = find_segment(addr, n)
    fd, seg_n, off = (seg.fd, seg.segment_nbytes, seg.offset) if seg else (-1, 0, 0)
    return _DESC.pack(_DESC_MAGIC, os.getpid(), fd, seg_n, off, addr, n)


def parse_descriptor(desc: bytes) -> tuple[int, int, int, int, int, int]:
    """(pid, fd, segment bytes, offset, address, nbytes) of a buffer descriptor."""
    if not isinstance(desc, bytes) or len(desc) != _DESC.size:
        raise TransportError(f"shm: a buffer descriptor has {_DESC.size} bytes, got "
                             f"{len(desc) if isinstance(desc, bytes) else type(desc).__name__}")
    magic, pid, fd, seg_n, off, addr, n = _DESC.unpack(desc)
    if magic != _DESC_MAGIC:
        raise TransportError("shm: not a buffer descriptor (bad magic)")
    return pid, fd, seg_n, off, addr, n


def parse_writer_frame(frames: list[bytes]) -> tuple[bytes, int, bool, str] | None:
    """(kind b"F" or b"A", tag, ok, reason) of a writer's message to a receiver; None when
    malformed. b"A" (nothing writes the tag any more) is always ok."""
    head = frames[0] if frames else b""
    if head[:1] == b"F" and len(head) == FINAL.size:
        _, tag, ok = FINAL.unpack(head)
        reason = (frames[1].decode("utf-8", "replace") if len(frames) > 1 and frames[1]
                  else "writer failed")
        return b"F", tag, bool(ok), reason
    if head[:1] == b"A" and len(head) == TAGMSG.size:
        return b"A", TAGMSG.unpack(head)[1], True, ""
    return None


class ShmOp:
    __slots__ = ("peer", "ident", "tag", "is_send", "buf", "plan", "total", "on_done", "finished",
                 "exposed", "acked", "job", "is_write", "remote", "digest", "digests", "landed",
                 "info", "result", "delivered", "hold_until")

    def __init__(self, peer: str, ident: bytes, tag: int, is_send: bool, buf: np.ndarray | Any,
                 plan: ChunkPlan | None, on_done: OnDone, *, total: int | None = None) -> None:
        self.peer = peer
        self.ident = ident
        self.tag = tag
        self.is_send = is_send
        self.buf = buf
        self.plan = plan  # send / receive: its chunk grid (a write has its SpanPlan in remote)
        self.total = plan.total if plan is not None else int(total or 0)
        self.on_done = on_done
        self.finished = False
        self.exposed = False  # receive: its R went out (the writer may write into it)
        # receive: nothing of the writer writes into it any more (it confirmed with F or A, its
        # process is gone, or the bound passed)
        self.acked = False
        self.info: ShmPeer | None = None  # receive: the peer it was exposed to
        self.job: CopyJob | Any = None  # send / write: its copy (a DeviceJob on the CUDA lane)
        self.is_write = False
        # write: where to (a Target, or a cuda.DeviceTarget on the CUDA lane) and its plan
        self.remote: tuple[Target | Any, SpanPlan] | None = None
        # write with checksum: xxh3-64 of the source stream (devsum on the CUDA lane)
        self.digest: int | None = None
        # host write job with checksum: the xxh3-64 of each write's source stream, in order
        self.digests: tuple[int | None, ...] = ()
        # host write job on the map lane with checksum: each write's landed sum (the copy's)
        self.landed: tuple[int | None, ...] = ()
        # completion: the outcome once the op finished; on_done is handed on (`delivered`) only
        # once nothing of the op writes into memory any more (shm.py's module comment)
        self.result: BaseException | None = None
        self.delivered = False
        self.hold_until = 0.0  # receive held after it finished: when the wait gives up

    @staticmethod
    def posted(is_send: bool, peer: str, address: bytes, tag: int, buf: np.ndarray,
               plan: ChunkPlan, on_done: OnDone) -> ShmOp:
        """The op of a post_send / post_recv (the op table's `make_op`)."""
        return ShmOp(peer, split_address(address)[3], tag, is_send, buf, plan, on_done)

    def __repr__(self) -> str:
        kind = "write" if self.is_write else "send" if self.is_send else "recv"
        return f"<shm {kind} peer={self.peer!r} tag={self.tag} bytes={self.total}>"


class ShmPeer:
    __slots__ = ("name", "address", "pid", "ident", "pidfd", "dead", "remotes", "targets",
                 "maps", "proof")

    def __init__(self, name: str, address: bytes, pid: int, ident: bytes, pidfd: int,
                 proof: Any = None) -> None:
        self.name = name
        self.address = address
        self.pid = pid
        self.ident = ident
        self.pidfd = pidfd
        self.dead: str | None = None
        self.remotes: dict[str, Target | Any] = {}  # register_remote name -> target
        self.targets: dict[bytes, Target] = {}  # descriptor -> target (two-sided receives)
        self.maps: dict[tuple[int, int], Any] = {}  # (fd, size) -> the peer segment's mmap
        # proof.Proof: the pid the peer's socket proved, its buffers' descriptors and memfds
        self.proof = proof


