# The shm transport's proof of a peer: which process a writer may write into, and which of its
# memory, learnt from the process itself over a Unix socket, never from what a message claims.
#
# How it works: every shm transport listens on an abstract Unix socket named after the random
# ident in its address (``\0kvhandoff-shm/<ident>``). A writer that connects to a peer
# (`prove`) connects to that name and reads the listener's credentials from the kernel
# (SO_PEERCRED: the pid and uid of the process that listens); the listener (`Voucher.serve`)
# reads the connector's the same way, refuses one of another user (root excepted), and answers
# with the descriptors of the buffers it registered and, by SCM_RIGHTS, the memfds of the
# shared segments those buffers lie in. The writer then:
# - refuses the peer unless the pid its address declares is the pid the socket proved, and
#   unless it is another transport than itself (its own ident);
# - installs a target only for a descriptor in that list (one-sided writes and two-sided
#   receives alike), so the address, size and segment it writes come from the process that
#   owns them;
# - maps a segment through the memfd it was handed, never by opening /proc/<pid>/fd/<fd>;
#   process_vm_writev goes only to the proved pid.
# A peer that is not a transport listening on this host (a pid and ident copied into a forged
# address, a process in another network namespace) gets no proof, and the connect is refused.
#
# The message (listener -> writer): header b"KVHVOUC1", the count of descriptors, of fds, and
# the payload's length; then the fd numbers the memfds had in the listener (i32 each, in the
# order of the SCM_RIGHTS array), then each descriptor as a u32 length and its bytes. The
# listener sends it with one sendmsg on a fresh connection (a few KiB) and closes.
#
# Rules: `Voucher` answers on a thread of its own (each accepted connection is answered at once
# and closed), so a transport's I/O thread may call `prove` while its peers prove it. `prove`
# runs on the caller's thread, bounded by `timeout_s`. Linux only (abstract names,
# SO_PEERCRED, SCM_RIGHTS).
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvhandoff.errors import TransportError

log = logging.getLogger("kvhandoff.transports.shm.transport")

_PREFIX = b"\0kvhandoff-shm/"
_HEAD = struct.Struct("<8sIII")  # magic, descriptors, fds, payload bytes after the header
_MAGIC = b"KVHVOUC1"
_LEN = struct.Struct("<I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PAYLOAD = 4 << 20
_MAX_FDS = 250  # SCM_MAX_FD is 253


class PeerNotProven(TransportError):
    """A peer whose address names no process that proved it is that peer (nothing listens
    as its ident on this host, another user's, another pid than it declared, this transport
    itself). The auto transport sends such a peer over its cross-host part instead."""


def listen_name(ident: bytes) -> bytes:
    return _PREFIX + ident


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, from the
    kernel (the listener's at listen(), the connector's at connect())."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def same_user(uid: int) -> bool:
    """Whether a process of `uid` may be handed this process's memory (it could read it
    through /proc anyway): this user, or root."""
    return uid in (os.geteuid(), 0)


@dataclass
class Proof:
    """What a peer's own process told us: its pid and uid (from the kernel), its buffers'
    descriptors, and the memfds of its segments (their fd numbers in the peer -> ours)."""

    pid: int
    uid: int
    descriptors: frozenset[bytes]
    fds: dict[int, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


class Voucher:
    """The listening side: answers every connection of a same-user process with this
    transport's buffer descriptors and segment memfds (see the module comment), on a thread
    of its own, so a transport's I/O thread may prove a peer while its own peers prove it."""

    __slots__ = ("_sock", "_listing", "refused", "_thread", "_closed")

    def __init__(self, ident: bytes,
                 listing: Callable[[], Iterable[tuple[bytes, int]]]) -> None:
        """`listing`: (descriptor, memfd or -1) of every registered host buffer, now."""
        self._listing = listing
        self.refused = 0  # connections of another user, closed unanswered
        self._closed = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(listen_name(ident))
            sock.listen(64)
        except OSError as e:
            sock.close()
            raise TransportError(f"shm: cannot listen for peers' proofs ({e})") from e
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"kvhandoff-shm-proof-{ident[:8].decode()}")
        self._thread.start()

    def close(self) -> None:
        """Stops answering (the thread ends) and closes the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except InterruptedError:
                continue
            except OSError as e:
                if not self._closed:
                    log.warning("shm: accepting a peer's proof connection failed: %s", e)
                return
            try:
                self._answer(conn)
            except Exception as e:  # noqa: BLE001 - the writer went away, a listing failed
                log.debug("shm: answering a proof connection failed: %s", e)
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        pid, uid, _ = peer_cred(conn)
        if not same_user(uid):
            self.refused += 1
            log.warning("shm: refused a peer proof to process %d of uid %d (this process runs "
                        "as uid %d): its memory is handed to the same user only", pid, uid,
                        os.geteuid())
            return
        descs, fds = [], []
        for desc, fd in self._listing():
            descs.append(desc)
            if fd >= 0 and fd not in fds:
                fds.append(fd)
        fds = fds[:_MAX_FDS]
        body = b"".join([struct.pack(f"<{len(fds)}i", *fds),
                         *(_LEN.pack(len(d)) + d for d in descs)])
        head = _HEAD.pack(_MAGIC, len(descs), len(fds), len(body))
        conn.settimeout(5.0)  # a fresh connection's buffer takes a few KiB at once
        socket.send_fds(conn, [head + body], fds)


def prove(ident: bytes, *, timeout_s: float) -> Proof:
    """Connects to the transport listening as `ident` on this host and returns what its
    process proved; `TransportError` if nothing listens there, it is of another user, or its
    answer is malformed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(listen_name(ident))
        except OSError as e:
            raise PeerNotProven(f"no shm transport of this host listens as {ident!r} ({e}): "
                                 "the peer's address names no process that can prove it is "
                                 "the peer") from None
        pid, uid, _ = peer_cred(sock)
        if not same_user(uid):
            raise PeerNotProven(f"the process listening as the peer (pid {pid}) runs as uid "
                                 f"{uid}, this one as uid {os.geteuid()}: shm writes go to "
                                 "processes of the same user only")
        data = bytearray()
        try:
            msg, got, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
            fds.extend(got)
            data += msg
            while len(data) >= _HEAD.size and len(data) < _HEAD.size + _HEAD.unpack_from(
                    data)[3] and len(data) <= _HEAD.size + _MAX_PAYLOAD:
                more = sock.recv(1 << 16)
                if not more:
                    break
                data += more
        except OSError as e:
            raise TransportError(f"the peer's proof (pid {pid}) did not come: {e}") from None
        proof = _parse(bytes(data), fds, pid, uid)
        fds = []  # owned by the proof now
        return proof
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)


def _parse(data: bytes, fds: list[int], pid: int, uid: int) -> Proof:
    bad = TransportError(f"the peer's proof (pid {pid}) is malformed")
    if len(data) < _HEAD.size:
        raise bad
    magic, ndesc, nfds, nbody = _HEAD.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEAD.size + nbody or nfds != len(fds) \
            or nfds > _MAX_FDS:
        raise bad
    at = _HEAD.size
    numbers = struct.unpack_from(f"<{nfds}i", data, at)
    at += 4 * nfds
    descs = []
    for _ in range(ndesc):
        if at + _LEN.size > len(data):
            raise bad
        (n,) = _LEN.unpack_from(data, at)
        at += _LEN.size
        if at + n > len(data):
            raise bad
        descs.append(data[at:at + n])
        at += n
    if at != len(data):
        raise bad
    return Proof(pid, uid, frozenset(descs), dict(zip(numbers, fds, strict=True)))
