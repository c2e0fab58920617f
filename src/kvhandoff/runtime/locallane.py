"""`LocalLane`: control messages between two agents of one host over a Unix stream socket.

ZMQ hands every message to an I/O thread on the sending side and takes it from one on the
receiving side, so a message costs four thread wake-ups before the peer's control thread sees
it. Between two processes of the project's 2-core test host a ZMQ round trip over tcp (or ipc)
took 130-140 µs, one over a Unix stream socket 7-10 µs. Agents of one host therefore talk over
Unix sockets, written and read by their control threads themselves.

Each agent listens on an abstract Unix socket named after its control address (``host:port``,
the address its peers send to). Abstract names live in the network namespace, as TCP ports
do: an agent in another namespace (another host, a container with its own network) never finds
it. The first message to an address chooses that address's lane: connect to its name; nobody
listening there (the peer is elsewhere, or runs with the lane off) -> ZMQ. The choice holds
until the session drops that peer (`drop`), so a peer reads our messages as one ordered
stream, as over one ZMQ connection. A connection the peer closed (it exited) is noticed at the
next send, and that message chooses again.

A message on the wire: two little-endian u32 (the lengths of its two frames, `wire.encode`'s
header and body), then the frames. A frame longer than the limits (64 bytes of header, the
body's ``max_message_bytes``) ends that connection: the stream cannot be resynchronised; the
messages before it were taken.

Abstract names have no permissions and this one is predictable, so both ends ask the kernel who
is at the other end (SO_PEERCRED) and talk only to a process of this user (or root):
- a connection to a peer's name whose listener is of another user (a process that took the
  name first: a squatter) is closed before a byte is written, counted (``lane_refused``),
  logged, and that address is reached over ZMQ until the session drops the peer: the
  squatter reads nothing;
- a connection accepted from a process of another user is closed unread, and counted the
  same way;
- an agent whose own name is taken says so at start (``lane_squatted``, a warning naming the
  holder's pid and uid) and takes its peers' messages over ZMQ (they refuse the squatter as
  above when it is of another user).
A process of the same user could read this one's memory anyway (ptrace), so the lane trusts
it as it trusts the TCP port: the messages are checked the same way (`wire.decode`,
generations, and ``hmac_secret`` on Hellos where it is set).

Only the control thread calls this class (no locks). Linux only (abstract names); elsewhere,
or with ``Settings.local_control_lane`` off, the agent has no lane and every message goes over
ZMQ.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import sys
from collections import deque

import zmq

log = logging.getLogger("kvhandoff.agent")

_LENGTHS = struct.Struct("<II")
_MAX_HEADER = 64  # wire.HEADER is 4 bytes; anything longer is not a kvhandoff message
# read per readable connection per pass, into one buffer kept for it: a fresh `recv(n)` of this
# size allocates (and maps) n bytes per call, which took ~0.1 ms of a small message's hop here
_RECV_BYTES = 1 << 20
_NAME_PREFIX = b"\0kvhandoff-control/"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_REFUSED = (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN, errno.EADDRNOTAVAIL)


def lane_name(address: str) -> bytes | None:
    """The abstract socket name of the agent whose control address is `address` (None where
    the name would not fit a Unix socket address)."""
    name = _NAME_PREFIX + address.encode()
    return name if len(name) <= 107 else None


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (the kernel's:
    a listener's as of its listen(), a connector's as of its connect())."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               _CRED.size))
    return pid, uid


def trusted_uid(uid: int) -> bool:
    """A process of this user, or root: one that could read this process's memory anyway."""
    return uid in (os.geteuid(), 0)


def available() -> bool:
    """Whether this platform has abstract Unix socket names (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def _holder(name: bytes) -> str:
    """Who holds the abstract name `name` (", held by process P of uid U"), "" if unknown."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.setblocking(False)
            probe.connect(name)
            pid, uid = peer_cred(probe)
    except OSError:
        return ""
    return f", held by process {pid} of uid {uid}"


class _Out:
    """One connection to a peer's lane, and what did not fit in its socket yet."""

    __slots__ = ("sock", "pending")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()


class _In:
    """One connection a peer opened to our lane, and the bytes read that are not yet a whole
    message."""

    __slots__ = ("sock", "buf")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()


class LocalLane:
    """The listener of this agent's lane, the connections peers opened to it, and ours to
    theirs. Register it with the control loop's poller (`attach`), call `service` with what
    each poll returned, take messages from `inbox`."""

    def __init__(self, address: str, *, max_message_bytes: int,
                 counters: dict[str, int]) -> None:
        self._max_body = max_message_bytes
        self.inbox: deque[list[bytes]] = deque()  # whole messages, oldest first
        self._counters = counters  # the loop's: messages_out_local, rejected_messages
        counters.setdefault("lane_refused", 0)  # and these two, ours
        counters.setdefault("lane_squatted", 0)
        self._poller: zmq.Poller | None = None
        self._out: dict[str, _Out | None] = {}  # address -> connection (None: over ZMQ)
        self._in: dict[int, _In] = {}  # fd -> connection
        self._writing: set[int] = set()  # fds registered for POLLOUT (something waits)
        self._listener: socket.socket | None = None
        self._scratch = memoryview(bytearray(_RECV_BYTES))
        name = lane_name(address)
        if name is None:
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:  # out of file descriptors, ...
            log.warning("control lane %r: no socket (%s); same-host peers reach this agent "
                        "over ZMQ", address, e)
            return
        try:
            sock.bind(name)
            sock.listen(64)
        except OSError as e:  # another process of this namespace holds the name
            sock.close()
            holder = _holder(name) if e.errno == errno.EADDRINUSE else ""
            if holder:
                self._count("lane_squatted")
            log.warning("control lane %r: cannot listen (%s)%s; same-host peers reach this "
                        "agent over ZMQ", address, e, holder)
            return
        sock.setblocking(False)
        self._listener = sock

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def attach(self, poller: zmq.Poller) -> None:
        self._poller = poller
        if self._listener is not None:
            poller.register(self._listener.fileno(), zmq.POLLIN)

    # ------------------------------------------------------------------ sending

    def send(self, address: str, frames: list[bytes], *, again: bool = True) -> bool:
        """Sends one message to `address` over its lane: True; False where that address is
        reached over ZMQ (the caller sends it there)."""
        if address in self._out:
            out = self._out[address]
        else:
            out = self._out[address] = self._connect(address)
        if out is None:
            return False
        header, body = frames
        data = b"".join((_LENGTHS.pack(len(header), len(body)), header, body))
        if out.pending:  # behind what is waiting: never reorder
            out.pending += data
            self._counters["messages_out_local"] += 1
            return True
        try:
            n = out.sock.send(data, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:  # the peer closed it (exited): choose again for this message
            self._forget(address, e)
            if again:
                return self.send(address, frames, again=False)
            self._out[address] = None  # closed at once twice: ZMQ until the peer is dropped
            return False
        self._counters["messages_out_local"] += 1
        if n < len(data):
            out.pending += memoryview(data)[n:]
            self._want_write(out, True)
        return True

    def drop(self, address: str) -> None:
        """A peer the session dropped: what waits for it gets one more try, then its
        connection closes (what the kernel took stays queued for the peer to read: a stopped
        peer reads its rooms' Failed when it wakes); its next message chooses a lane again."""
        out = self._out.pop(address, None)
        if out is not None:
            self._flush(out)
            self._close_out(out)

    def _connect(self, address: str) -> _Out | None:
        name = lane_name(address)
        if name is None:
            return None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:  # out of file descriptors, ...: ZMQ for this peer
            log.warning("control lane to %s: no socket (%s); using ZMQ", address, e)
            return None
        sock.setblocking(False)
        try:
            sock.connect(name)
        except OSError as e:
            sock.close()
            if e.errno not in _REFUSED:
                log.warning("control lane to %s: %s; using ZMQ", address, e)
            return None
        try:
            pid, uid = peer_cred(sock)
        except OSError as e:
            sock.close()
            log.warning("control lane to %s: no credentials of the listener (%s); using ZMQ",
                        address, e)
            return None
        if not trusted_uid(uid):  # the name was taken by a process of another user
            sock.close()
            self._count("lane_refused")
            log.warning("control lane to %s REFUSED: its name is held by process %d of uid %d "
                        "(this agent runs as uid %d), not by a kvhandoff agent of this user; "
                        "that peer is reached over ZMQ", address, pid, uid, os.geteuid())
            return None
        return _Out(sock)

    def _count(self, name: str) -> None:
        self._counters[name] = self._counters.get(name, 0) + 1

    def _forget(self, address: str, why: OSError) -> None:
        out = self._out.pop(address, None)
        if out is not None:
            log.debug("control lane to %s closed (%s)", address, why)
            self._close_out(out)

    def _flush(self, out: _Out) -> bool:
        """Writes what waits on `out`; False if the peer closed it."""
        while out.pending:
            try:
                n = out.sock.send(out.pending, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                out.pending.clear()
                return False
            del out.pending[:n]
        self._want_write(out, False)
        return True

    def _want_write(self, out: _Out, want: bool) -> None:
        fd = out.sock.fileno()
        if self._poller is None or want == (fd in self._writing):
            return
        if want:
            self._writing.add(fd)
            self._poller.register(fd, zmq.POLLOUT)
        else:
            self._writing.discard(fd)
            self._poller.unregister(fd)

    def _close_out(self, out: _Out) -> None:
        self._want_write(out, False)
        out.sock.close()

    # ------------------------------------------------------------------ receiving

    def service(self, events: dict[object, int]) -> None:
        """Acts on one poll's events: accepts connections, writes what waits, reads whole
        messages into `inbox`."""
        listener = self._listener
        if listener is not None and listener.fileno() in events:
            self._accept(listener)
        if self._writing:
            for address, out in list(self._out.items()):
                if out is not None and out.sock.fileno() in events and not self._flush(out):
                    self._forget(address, BrokenPipeError("the peer closed the control lane"))
        for fd in [fd for fd in self._in if fd in events]:
            self._read(self._in[fd])

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, ...: the peer's connect stands
                log.warning("control lane: accept failed: %s", e)
                return
            try:
                pid, uid = peer_cred(sock)
            except OSError:
                pid, uid = -1, -1
            if not trusted_uid(uid):
                sock.close()
                self._count("lane_refused")
                log.warning("control lane: refused a connection of process %d of uid %d (this "
                            "agent runs as uid %d)", pid, uid, os.geteuid())
                continue
            sock.setblocking(False)
            self._in[sock.fileno()] = _In(sock)
            if self._poller is not None:
                self._poller.register(sock.fileno(), zmq.POLLIN)

    def _read(self, conn: _In) -> None:
        try:
            got = conn.sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:  # the peer closed it
            self._close_in(conn)
            return
        buf = conn.buf
        buf += self._scratch[:got]
        at, end = 0, len(buf)
        with memoryview(buf) as view:  # frames copied once, out of the view
            while end - at >= _LENGTHS.size:
                hlen, blen = _LENGTHS.unpack_from(view, at)
                if hlen > _MAX_HEADER or blen > self._max_body:
                    self._counters["rejected_messages"] += 1
                    log.warning("control lane: a message of %d + %d bytes exceeds the limits "
                                "(%d, max_message_bytes=%d); closing that connection", hlen,
                                blen, _MAX_HEADER, self._max_body)
                    at = -1
                    break
                start = at + _LENGTHS.size
                stop = start + hlen + blen
                if stop > end:
                    break
                self.inbox.append([bytes(view[start:start + hlen]),
                                   bytes(view[start + hlen:stop])])
                at = stop
        if at < 0:  # the view is released: the connection may go
            self._close_in(conn)
            return
        del buf[:at]

    def _close_in(self, conn: _In) -> None:
        fd = conn.sock.fileno()
        if self._in.pop(fd, None) is not None and self._poller is not None:
            self._poller.unregister(fd)
        conn.sock.close()

    def close(self) -> None:
        for out in self._out.values():
            if out is not None:
                out.sock.close()
        self._out.clear()
        for conn in list(self._in.values()):
            conn.sock.close()
        self._in.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
