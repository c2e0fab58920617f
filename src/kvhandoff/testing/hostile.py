"""A hostile peer: frames an outsider may send an agent, and functions that send them.

An agent's surfaces take bytes from anyone who can reach them: its control socket (ZMQ, the
agent's ``host:port``), its same-host control lane (an abstract Unix socket named after that
address, Linux), its data transport's port (tcp) and the bootstrap server's HTTP API. This module
builds what a hostile or broken sender would put there and throws it at a surface, so a test (or
a user rehearsing a deployment) can check that the agent stays up, counts what it refused, and
still completes real handoffs beside the attack, byte-exact.

- `corpus(seed, count, ...)`: frame sets for the control surfaces, by category (`KINDS`): deep
  nesting, huge array/map/string headers, wrong types, truncated and random frames, valid
  messages with forged fields (another agent's address, a made-up generation, a known room),
  replays of frames seen on the wire, and a flood of small garbage. Seeded: the same seed gives
  the same frames.
- `send_control(address, frame_sets)`: sends them to an agent's control socket from a raw ZMQ
  DEALER (no agent code on this side). `send_lane(address, frame_sets)`: the same over the
  agent's same-host lane. `send_tcp(host, port, chunks)`: raw bytes to a data port.
  `send_http(base_url, requests)`: raw HTTP requests to a bootstrap server.
- The tcp data plane's own cases (`TCP_KINDS`; `tcp_session_cases`, `send_tcp_frames`): a
  forged connection proof in a peer's name, a replayed proof (captured bytes, given), a
  connection that reuses a peer's ZMQ identity, chunks with forged MACs for the tags a peer
  uses, and a flood of chunks for tags no one posted (the early-chunk store's bound).
- The replies a tcp sender takes (`REPLY_KINDS`; `forged_replies`, `OnPath`): credits and
  finals with made-up MACs or none (the format before they were MAC'd), a "not taken" that
  cannot be MAC'd, and an on-path relay between a sender and its receiver that records the
  receiver's replies and injects forged or replayed ones into the sender's connection.
- `nested_maps(depth)`: the one frame that used to end an agent's control thread (a Hello whose
  layout nests `depth` maps).
- `attack_control`, `attack_lane`, `attack_tcp_data`, `attack_http`: a seeded corpus thrown
  at one surface; `beside(attack, work)` runs an attack on a thread while `work` (a real
  handoff) runs on the caller's, and re-raises what either raised. `beside_process` runs it as
  a process of its own (`attack_argv`; ``python -m kvhandoff.testing.hostile``), as a real
  attacker is: one in the agents' process would share their interpreter lock.

Example (two agents of one host, `p` the prefill; the handoff must still end byte-exact)::

    from kvhandoff.testing import hostile

    sent = hostile.beside(
        lambda: hostile.attack_control(p.address, seed=1, count=5000,
                                       known_peers=[(d.address, d.generation)]),
        lambda: run_one_handoff())

Nothing here is used by kvhandoff itself (it is under `kvhandoff.testing`).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvhandoff.protocol import wire as P

#: the categories `corpus` draws from
KINDS = ("nested", "huge_header", "wrong_types", "truncated", "random", "forged", "replay",
         "flood")

_LANE_PREFIX = b"\0kvhandoff-control/"  # runtime.locallane's abstract names
# how long a closed sender's queued frames are still delivered (zmq's LINGER: close returns at
# once, and what is still queued then is dropped after this long). Longer than any caller
# waits for them to be read: 5 s dropped frames of a flood on a loaded host, and the test
# counting them waited in vain.
LINGER_MS = 120_000
_LENGTHS = struct.Struct("<II")


@dataclass(frozen=True, slots=True)
class Case:
    """One frame set of the corpus and the category it was drawn from."""

    kind: str
    frames: list[bytes]


def nested_maps(depth: int = 10_000) -> list[bytes]:
    """A Hello frame set whose layout is `depth` maps nested in one another (about 3 bytes a
    level: 10,000 levels are a 30 KB frame)."""
    head = msgspec.msgpack.encode({"kind": "hello", "src": "127.0.0.1:1", "gen": 1,
                                   "agent_id": "x", "role": "decode", "transport": "tcp",
                                   "transport_address": b"", "layout_hash": "",
                                   "buffers": []})
    # the map header of `head` counts its keys: one more for "layout"
    n = head[0] & 0x0F
    body = bytes([0x80 | (n + 1)]) + head[1:] + b"\xa6layout" + b"\x81\xa1a" * depth + b"\xc0"
    return [P.HEADER, body]


def _nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def corpus(seed: int, count: int, *, src: str = "127.0.0.1:1", known_rooms: Sequence[int] = (),
           known_peers: Sequence[tuple[str, int]] = (), seen: Sequence[list[bytes]] = (),
           kinds: Sequence[str] = KINDS) -> Iterator[Case]:
    """`count` frame sets drawn from `kinds` with a PRNG seeded by `seed`.

    Args:
        seed: the PRNG seed (the same seed, the same frames).
        count: how many frame sets.
        src: the control address the forged messages name as their own when they do not
            impersonate a known peer.
        known_rooms: room ids an outsider may have learnt (the bootstrap server shows them).
        known_peers: (control address, generation) of agents an outsider may impersonate
            (the bootstrap server shows both).
        seen: frame sets captured on the wire, replayed as they are ("replay").
        kinds: the categories to draw from (`KINDS`).
    """
    rng = random.Random(seed)
    makers = {"nested": _nested, "huge_header": _huge_header, "wrong_types": _wrong_types,
              "truncated": _truncated, "random": _random, "forged": _forged,
              "replay": _replay, "flood": _flood}
    kinds = [k for k in kinds if k != "replay" or seen]
    ctx = _Ctx(rng, src, list(known_rooms) or [rng.getrandbits(63)],
               list(known_peers) or [(src, rng.getrandbits(62))], list(seen))
    for _ in range(count):
        kind = rng.choice(kinds)
        yield Case(kind, makers[kind](ctx))


@dataclass(slots=True)
class _Ctx:
    rng: random.Random
    src: str
    rooms: list[int]
    peers: list[tuple[str, int]]
    seen: list[list[bytes]]


def _nested(c: _Ctx) -> list[bytes]:
    depth = c.rng.choice([100, 1_000, 10_000, 50_000])
    if c.rng.random() < 0.5:
        return nested_maps(depth)
    body = msgspec.msgpack.encode({"kind": "transfer_request", "src": c.src, "gen": 1})
    n = body[0] & 0x0F
    return [P.HEADER, bytes([0x80 | (n + 1)]) + body[1:] + b"\xaadst_pages\x81\xa1a"
            + _nested_arrays(depth)]


def _huge_header(c: _Ctx) -> list[bytes]:
    # a container or string header that claims far more than the frame holds
    marker = c.rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6"])  # array32 map32 str32 bin32
    claim = c.rng.choice([0xFFFFFFFF, 1 << 30, 1 << 24])
    field = c.rng.choice(["rooms", "dst_pages", "reason", "layout", "buffers", "src"])
    body = msgspec.msgpack.encode({"kind": "heartbeat", "src": c.src, "gen": 1})
    n = body[0] & 0x0F
    name = msgspec.msgpack.encode(field)
    return [P.HEADER, bytes([0x80 | (n + 1)]) + body[1:] + name + marker
            + claim.to_bytes(4, "big") + os.urandom(c.rng.randrange(0, 64))]


_TAGS = ("hello", "hello_ack", "hello_reject", "transfer_request", "transfer_accepted",
         "failed", "layer_done", "layer_nack", "room_ack", "abort", "abort_ack", "heartbeat",
         "reject", "chunk_added", "chunk_accepted")
_FIELDS = ("room", "xfer", "peer_gen", "seq_len", "decode_prefix_len", "page_size",
           "dst_pages", "src_pages", "lease_s", "layers", "layer", "attempt", "reason", "rooms",
           "layout", "buffers", "mac", "nonce", "echo", "planes", "diff", "agent_id", "role",
           "transport", "chunk", "chunk_end", "writes_stopped", "failure_kind")


def _value(rng: random.Random, depth: int = 0) -> object:
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice([-1, 0, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])
    if pick == 3:
        return rng.choice([float("nan"), float("inf"), -0.0, 1e308])
    if pick == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 40)))
    if pick == 5:
        return os.urandom(rng.randrange(0, 40))
    if pick == 6:
        return rng.getrandbits(63)
    if pick == 7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if pick == 8:
        return {str(_value(rng, 3)): _value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    return {rng.choice(_FIELDS): _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _wrong_types(c: _Ctx) -> list[bytes]:
    msg: dict[str, object] = {"kind": c.rng.choice(_TAGS), "src": c.src,
                              "gen": c.rng.getrandbits(62)}
    for f in c.rng.sample(_FIELDS, c.rng.randrange(1, 8)):
        msg[f] = _value(c.rng)
    return [P.HEADER, msgspec.msgpack.encode(msg)]


def _valid(c: _Ctx) -> P.Message:
    """A well-formed message with forged fields: another agent's address and generation (as
    the bootstrap server shows them), a known room."""
    addr, gen = c.rng.choice(c.peers)
    room = c.rng.choice(c.rooms)
    pick = c.rng.randrange(9)
    if pick == 0:
        return P.Failed(src=addr, gen=gen, room=room, reason="forged",
                        failure_kind="remote_failed")
    if pick == 1:
        return P.AbortAck(src=addr, gen=gen, room=room)
    if pick == 2:
        # a question of a woken agent, or an answer to one (the answer a rechecked peer's
        # held room messages wait for), with made-up probes
        probe, answers = c.rng.choice([(0, 0), (c.rng.getrandbits(63), 0),
                                       (0, c.rng.getrandbits(63)), (0, 1)])
        return P.Heartbeat(src=addr, gen=gen, rooms=list(c.rooms), probe=probe, answers=answers)
    if pick == 3:
        return P.Abort(src=addr, gen=gen, room=room, reason="forged")
    if pick == 4:
        return P.HelloReject(src=addr, gen=gen, reason="forged", diff=["forged"])
    if pick == 5:
        return P.Reject(src=addr, gen=gen, reason="no handshake: forged")
    if pick == 6:
        return P.RoomAck(src=addr, gen=gen, room=room)
    if pick == 7:
        return P.LayerNack(src=addr, gen=gen, room=room, layer=0, attempt=0, reason="forged")
    return P.Hello(src=addr, gen=c.rng.getrandbits(62), agent_id="forged", role="decode",
                   transport="tcp", transport_address=b"127.0.0.1:1", layout={},
                   layout_hash="", buffers=[], mac=os.urandom(32))


def _forged(c: _Ctx) -> list[bytes]:
    frames = P.encode(_valid(c))
    if c.rng.random() < 0.3:  # with a made-up seal (as if sent within a session)
        frames = [P.SEALED_HEADER, frames[1] + os.urandom(P.SEAL_BYTES)]
    return frames


def _truncated(c: _Ctx) -> list[bytes]:
    body = P.encode(_valid(c))[1]
    return [P.HEADER, body[:c.rng.randrange(0, max(1, len(body)))]]


def _random(c: _Ctx) -> list[bytes]:
    n = c.rng.randrange(1, 4)
    return [os.urandom(c.rng.randrange(0, 200)) for _ in range(n)]


def _replay(c: _Ctx) -> list[bytes]:
    return list(c.rng.choice(c.seen))


def _flood(c: _Ctx) -> list[bytes]:
    return [P.HEADER, os.urandom(c.rng.randrange(1, 16))]


def heavy_heartbeat(src: str, gen: int, rooms: int, *, sealed: bool, seed: int = 0
                    ) -> list[bytes]:
    """A well-typed Heartbeat in the name of (`src`, `gen`) naming `rooms` made-up rooms (5
    bytes each: a million is a 4.9 MB frame that takes tens of ms to decode); `sealed`: with a
    made-up seal (as if sent within a session with the agent)."""
    rng = random.Random(seed)
    body = P.encode(P.Heartbeat(src=src, gen=gen,
                                rooms=[rng.randrange(1 << 16, 1 << 32) for _ in range(rooms)]))[1]
    return [P.SEALED_HEADER, body + os.urandom(P.SEAL_BYTES)] if sealed else [P.HEADER, body]


def sealed_garbage(src: str, gen: int, nbytes: int = 64) -> list[bytes]:
    """A sealed frame in the name of (`src`, `gen`) whose body starts as a message does (kind,
    src, gen) and goes on with `nbytes` bytes that are no msgpack, under a made-up seal: an
    agent that checks the seal before it decodes refuses it as unauthenticated; one that
    decodes first refuses it as malformed."""
    head = msgspec.msgpack.encode({"kind": "heartbeat", "src": src, "gen": gen})
    body = bytes([0x84]) + head[1:] + b"\xc1" * nbytes
    return [P.SEALED_HEADER, body + os.urandom(P.SEAL_BYTES)]


def junk_claims(count: int, *, seed: int = 0) -> list[TcpCase]:
    """`count` connections to a tcp data port, each with a proof-shaped frame naming a made-up
    transport id (without a secret such a frame is a claim; with one, a proof whose MAC is
    made up), then one chunk: what used to push the real connections' claims and proofs out of
    the receiver's tables."""
    from kvhandoff.transports.chunkauth import PROOF

    rng = random.Random(seed)
    return [TcpCase("junk_claim", None, [
        [PROOF.pack(b"P", rng.randbytes(16).hex().encode(), rng.randbytes(16),
                    rng.randbytes(32))],
        tcp_chunk(rng.getrandbits(40), 0, 1, 64, rng.randbytes(64))]) for _ in range(count)]


# ---------------------------------------------------------------------------- senders


def send_control(address: str, frame_sets: Iterable[list[bytes]], *,
                 linger_ms: int = 5000) -> int:
    """Sends each frame set to the agent whose control address is `address` (``host:port``)
    from a fresh ZMQ DEALER; returns how many were sent. The sends are queued by ZMQ: to know
    the agent read them, follow with something it answers (see the reliability tests'
    ``Prober.barrier``). `linger_ms`: how long closing waits for the queue to go out (-1:
    until it did)."""
    import zmq

    from kvhandoff.netaddr import split_host_port, zmq_endpoint, zmq_ipv6

    host, port = split_host_port(address)
    # a context of its own when closing waits for the queue: its term() is that wait
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if linger_ms < 0 \
        else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger_ms)  # the frames leave before close returns
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.IPV6, zmq_ipv6(host))
    sock.connect(zmq_endpoint(host, port))
    n = 0
    try:
        for frames in frame_sets:
            sock.send_multipart(frames)
            n += 1
    finally:
        sock.close()
        if linger_ms < 0:
            ctx.term()
    return n


def send_lane(address: str, frame_sets: Iterable[list[bytes]]) -> int:
    """Sends each frame set (its first two frames; a lane message has two) over the same-host
    control lane of the agent at `address`; returns how many were written. Raises
    `ConnectionRefusedError` when the agent has no lane (another host, or the lane is off).
    Stops early when the agent closes the connection (a frame over its limits)."""
    n = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(_LANE_PREFIX + address.encode())
        try:
            for frames in frame_sets:
                head, body = (list(frames) + [b"", b""])[:2]
                sock.sendall(_LENGTHS.pack(len(head), len(body)) + head + body)
                n += 1
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):  # the agent closed it: a frame over
            return n  # its limits ends a lane connection
        try:  # until the agent closed its side: it read everything
            while sock.recv(4096):
                pass
        except OSError:
            pass
    return n


def send_tcp(host: str, port: int, chunks: Iterable[bytes]) -> int:
    """Writes `chunks` to a TCP port (a tcp transport's data port) and closes; returns the
    bytes written (a peer that closes early ends the write: what it took is counted)."""
    sent = 0
    with socket.create_connection((host, port), timeout=10) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass
        except OSError:
            pass
    return sent


def tcp_chunks(seed: int, count: int) -> Iterator[bytes]:
    """Garbage for a data port: random bytes, length prefixes that claim gigabytes, zeros."""
    rng = random.Random(seed)
    for _ in range(count):
        pick = rng.randrange(4)
        if pick == 0:
            yield os.urandom(rng.randrange(1, 512))
        elif pick == 1:
            yield struct.pack("<QQ", rng.getrandbits(64), rng.getrandbits(64))
        elif pick == 2:
            yield b"\xff" * rng.randrange(1, 64)
        else:
            yield bytes(rng.randrange(1, 256))


#: the categories of `tcp_session_cases` (the tcp data plane's connection proofs and chunks)
TCP_KINDS = ("forged_proof", "replayed_proof", "identity_reuse", "forged_chunks",
             "early_flood")


@dataclass(frozen=True, slots=True)
class TcpCase:
    """One connection of the tcp data-plane corpus: the ZMQ identity it claims (None: the
    socket's own), the frame sets it sends in order, and the category."""

    kind: str
    identity: bytes | None
    frame_sets: list[list[bytes]]


def tcp_chunk(tag: int, k: int, n: int, total: int, payload: bytes, *,
              trailer: bytes | None = None) -> list[bytes]:
    """The frames of one data chunk as a tcp transport's DEALER sends them; `trailer`: its
    sequence number and MAC (`chunkauth.Signer.trailer`), else a made-up one."""
    from kvhandoff.transports.chunkauth import TRAILER

    head = b"D" + struct.pack("<QIIQ", tag, k, n, total)
    if trailer is None:
        trailer = TRAILER.pack(1 + k, os.urandom(32))
    return [head + trailer, payload]


def tcp_session_cases(seed: int, count: int, *, claims: Sequence[bytes] = (),
                      proofs: Sequence[bytes] = (), tags: Sequence[int] = (),
                      flood_bytes: int = 4096) -> list[TcpCase]:
    """`count` chunks' worth of connections that try to get bytes into a tcp receiver without
    its peers' session key: a proof in the name of a peer (`claims`: transport ids, the last
    32 characters of a transport address) with a made-up MAC, then chunks; each captured proof
    in `proofs` replayed on a connection of its own, then chunks; a connection whose ZMQ
    identity is a peer's id (what ROUTER_HANDOVER let take a connection over), chunks only;
    chunks with made-up MACs for `tags`; and a flood of `flood_bytes`-byte chunks for random
    tags after a proof-shaped claim in the name of `claims`' first (without a secret that
    claim is taken: the flood then
    measures the store's bound, when the claim names a peer the receiver is bound to). Seeded.
    """
    from kvhandoff.transports.chunkauth import PROOF

    rng = random.Random(seed)
    claim = list(claims) or [os.urandom(16).hex().encode()]
    tag_pool = list(tags) or [rng.getrandbits(40)]
    per = max(1, count // len(TCP_KINDS))

    def chunks(n: int, size: int = 256) -> list[list[bytes]]:
        out = []
        for _ in range(n):
            tag = rng.choice(tag_pool)
            out.append(tcp_chunk(tag, 0, 1, size, rng.randbytes(size)))
        return out

    def proof(ident: bytes) -> bytes:
        return PROOF.pack(b"P", ident, rng.randbytes(16), rng.randbytes(32))

    cases = [TcpCase("forged_proof", None, [[proof(c)] for c in claim] + chunks(per))]
    for captured in proofs:
        cases.append(TcpCase("replayed_proof", None, [[captured], *chunks(per)]))
    cases.append(TcpCase("identity_reuse", claim[0], chunks(per)))
    cases.append(TcpCase("forged_chunks", None, chunks(per)))
    flood = []
    for _ in range(per):
        size = max(1, flood_bytes)
        flood.append(tcp_chunk(rng.getrandbits(40), 0, 1, size, rng.randbytes(size)))
    cases.append(TcpCase("early_flood", None, [[proof(claim[0])], *flood]))
    return cases


#: the categories of `forged_replies` (what an on-path attacker would answer a tcp sender)
REPLY_KINDS = ("forged_credit", "forged_final_ok", "forged_final_failed", "bare_final_ok",
               "bare_final_failed", "unverified_not_taken")


def forged_replies(seed: int, tags: Sequence[int], *, chunks: int = 4) -> list[list[bytes]]:
    """Replies a tcp receiver did not send, for `tags` (the sender's own, which an on-path
    attacker reads off the wire): each chunk's credit and a final ok and failed with made-up
    MACs and sequence numbers (REPLY_TRAILER), the same finals without a trailer (the format
    of replies before they were MAC'd), and a "not taken" with the all-zero trailer of a reply
    the receiver could not MAC. Seeded."""
    from kvhandoff.transports.chunkauth import NO_REPLY_TRAILER, REPLY_TRAILER
    from kvhandoff.transports.tcp import _NOT_TAKEN

    rng = random.Random(seed)

    def made_up() -> bytes:
        return REPLY_TRAILER.pack(rng.randrange(1, 1 << 32), rng.randbytes(16))

    out: list[list[bytes]] = []
    for tag in tags:
        out += [[b"C" + struct.pack("<QI", tag, k) + made_up()] for k in range(chunks)]
        out.append([b"F" + struct.pack("<QB", tag, 1) + made_up(), b""])
        out.append([b"F" + struct.pack("<QB", tag, 0) + made_up(), b"forged"])
        out.append([b"F" + struct.pack("<QB", tag, 1), b""])
        out.append([b"F" + struct.pack("<QB", tag, 0), b"forged"])
        out.append([b"F" + struct.pack("<QB", tag, 0) + NO_REPLY_TRAILER, _NOT_TAKEN.encode()])
    return out


class OnPath:
    """An on-path attacker between a tcp sender and its receiver: a relay (a ZMQ ROUTER the
    sender connects to, a DEALER to the receiver's data port) that forwards both ways on a
    thread of its own, records what the receiver answered (`replies`) and puts frame sets of
    its own into the sender's connection (`inject`). `address`: what the sender connects to
    in place of the receiver's transport address. A context manager; `close()` stops it."""

    def __init__(self, receiver_address: bytes) -> None:
        import queue

        import zmq

        endpoint, ident = receiver_address.decode().rsplit("/", 1)
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._back = self._ctx.socket(zmq.DEALER)
        self._back.setsockopt(zmq.LINGER, 0)
        self._back.connect(endpoint)
        self.address = f"tcp://127.0.0.1:{port}/{ident}".encode()
        self.replies: list[list[bytes]] = []  # what the receiver sent, in order
        self.forwarded = 0  # frame sets the sender sent, forwarded
        self._inbox: queue.Queue[list[bytes]] = queue.Queue()
        self._rid: bytes | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hostile-on-path", daemon=True)
        self._thread.start()

    def inject(self, frame_sets: Iterable[list[bytes]]) -> None:
        """Puts `frame_sets` into the sender's connection (once it has connected), in order,
        after what the receiver sent before."""
        for frames in frame_sets:
            self._inbox.put(list(frames))

    def recorded(self) -> list[list[bytes]]:
        with self._lock:
            return list(self.replies)

    def _run(self) -> None:
        import queue

        import zmq

        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(10))
            if self._front in events:
                while True:
                    try:
                        rid, *frames = self._front.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._rid = rid
                    self._back.send_multipart(frames)
                    self.forwarded += 1
            if self._back in events:
                while True:
                    try:
                        frames = self._back.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._lock:
                        self.replies.append(frames)
                    if self._rid is not None:
                        self._front.send_multipart([self._rid, *frames])
            while self._rid is not None:
                try:
                    frames = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._front.send_multipart([self._rid, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._front.close()
        self._back.close()
        self._ctx.term()

    def __enter__(self) -> OnPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_tcp_frames(transport_address: bytes, cases: Iterable[TcpCase]) -> int:
    """Sends each case on a ZMQ DEALER connection of its own to a tcp transport's data port
    (its `Transport.address`), closing each once its frames are queued; returns the frame sets
    sent. What the receiver had not read when a connection closed is dropped by ZMQ there: a
    test that counts every frame the receiver took keeps them open (`tcp_connections`)."""
    with _tcp_cases(transport_address, cases, keep_open=False) as n:
        return n


def tcp_connections(transport_address: bytes,
                    cases: Iterable[TcpCase]) -> contextlib.AbstractContextManager[int]:
    """`send_tcp_frames` with the connections kept open until the block ends: yields the
    frame sets sent. A ZMQ ROUTER discards the messages of a connection that closed before it
    read them, so on a busy host a flood sent and closed at once arrives only in part."""
    return _tcp_cases(transport_address, cases, keep_open=True)


@contextlib.contextmanager
def _tcp_cases(transport_address: bytes, cases: Iterable[TcpCase], *,
               keep_open: bool) -> Iterator[int]:
    import zmq

    endpoint = transport_address.decode().rsplit("/", 1)[0]
    # a context of its own per 256 connections (a context holds at most 1,023 sockets,
    # closed ones included until they are reaped); term() returns once their frames went out
    ctxs: list[zmq.Context[zmq.Socket[bytes]]] = []
    socks: list[zmq.Socket[bytes]] = []
    n = 0
    try:
        for i, case in enumerate(cases):
            if i % 256 == 0:
                if ctxs and not keep_open:
                    ctxs.pop().term()
                ctxs.append(zmq.Context())
            sock = ctxs[-1].socket(zmq.DEALER)
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 5000)
            if case.identity is not None:
                sock.setsockopt(zmq.IDENTITY, case.identity)
            sock.connect(endpoint)
            for frames in case.frame_sets:
                sock.send_multipart(frames)
                n += 1
            if not keep_open:
                socks.pop().close()
        yield n
    finally:
        for sock in socks:
            sock.close()
        for ctx in ctxs:
            ctx.term()


def http_requests(seed: int, count: int, *, paths: Sequence[str] = ("/",)) -> Iterator[bytes]:
    """Raw HTTP/1.1 requests a hostile client may send a bootstrap server: bodies that are not
    JSON, JSON of the wrong shape, deep nesting, huge numbers, oversized headers."""
    rng = random.Random(seed)
    for _ in range(count):
        path = rng.choice(list(paths))
        pick = rng.randrange(5)
        if pick == 0:
            body = os.urandom(rng.randrange(0, 256))
        elif pick == 1:
            body = b"[" * 5000 + b"]" * 5000
        elif pick == 2:
            body = msgspec.json.encode(_value(rng))
        elif pick == 3:
            body = b'{"rank": 1e999999, "room": -1, "port": 99999999999999999999}'
        else:
            body = b'{"a":' * 3000 + b"1" + b"}" * 3000
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        yield head + body


def send_http(host: str, port: int, requests: Iterable[bytes]) -> list[int]:
    """Sends each raw request on its own connection; returns the HTTP status of each answer
    (0: the server closed without one)."""
    statuses = []
    for req in requests:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(req)
            got = b""
            try:
                while b"\r\n" not in got:
                    part = sock.recv(4096)
                    if not part:
                        break
                    got += part
            except OSError:
                pass
            try:
                statuses.append(int(got.split(b" ", 2)[1]))
            except (IndexError, ValueError):
                statuses.append(0)
    return statuses


# ---------------------------------------------------------------------------- attacks

_T = TypeVar("_T")


def attack_control(address: str, *, seed: int, count: int, **corpus_kw: Any) -> int:
    """`count` frame sets of `corpus(seed, ...)` sent to the control socket at `address`;
    returns how many were sent."""
    return send_control(address, (c.frames for c in corpus(seed, count, **corpus_kw)))


def attack_lane(address: str, *, seed: int, count: int, **corpus_kw: Any) -> int:
    """The same over the same-host control lane of the agent at `address`. The agent closes a
    lane connection at a frame over its limits (the stream cannot be resynchronised), so each
    frame set goes over a connection of its own when it must; returns how many were sent."""
    n = 0
    batch: list[list[bytes]] = []
    for c in corpus(seed, count, **corpus_kw):
        batch.append(c.frames)
        if len(batch) == 64:
            n += _lane_batch(address, batch)
            batch = []
    if batch:
        n += _lane_batch(address, batch)
    return n


def _lane_batch(address: str, batch: list[list[bytes]]) -> int:
    n = 0
    while n < len(batch):  # after a closed connection, on with the next frame set
        took = send_lane(address, batch[n:])
        n += max(took, 1)
    return n


def attack_tcp_data(transport_address: bytes, *, seed: int, count: int,
                    claims: Sequence[bytes] = ()) -> int:
    """Garbage at a tcp transport's data port (its `Transport.address`,
    ``tcp://host:port/<id>``): raw bytes on plain TCP connections (not ZMTP), chunk frames
    with random tags from a ZMQ DEALER that claims an identity of its own, then the
    data-plane session cases (`tcp_session_cases`, in the name of the transport ids
    `claims`). Returns the frames and chunks sent."""
    import zmq

    from kvhandoff.netaddr import split_zmq_endpoint

    endpoint = transport_address.decode().rsplit("/", 1)[0]
    host, port = split_zmq_endpoint(endpoint)
    rng = random.Random(seed)
    n = 0
    for i in range(max(1, count // 100)):
        n += 1 if send_tcp(host, port, tcp_chunks(seed + i, 20)) else 0
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.IDENTITY, os.urandom(8).hex().encode())
    sock.connect(endpoint)
    try:
        for _ in range(count):
            head = b"D" + struct.pack("<QIIQ", rng.getrandbits(40), rng.randrange(4),
                                      rng.randrange(1, 4), rng.randrange(1, 1 << 20))
            frames = [head, os.urandom(rng.randrange(0, 256))]
            if rng.random() < 0.2:
                frames = [os.urandom(rng.randrange(0, 32)) for _ in range(rng.randrange(1, 4))]
            sock.send_multipart(frames)
            n += 1
    finally:
        sock.close()
    return n + send_tcp_frames(transport_address, tcp_session_cases(seed, count // 4,
                                                                   claims=claims))


#: the bootstrap server's write endpoints `attack_http` posts to
HTTP_PATHS = ("/v1/ranks", "/v1/ranks/heartbeat", "/v1/ranks/deregister", "/v1/rooms",
              "/v1/rooms/1/bind", "/v1/rooms/1/abort", "/register_dp_rank", "/query_dp_ranks")


def attack_http(base_url: str, *, seed: int, count: int,
                paths: Sequence[str] = HTTP_PATHS) -> list[int]:
    """`count` raw hostile requests to the bootstrap server at `base_url`
    (``http://host:port``); returns the HTTP status of each (0: no answer)."""
    rest = base_url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return send_http(host.strip("[]"), int(port), http_requests(seed, count, paths=paths))


def attack_argv(surface: str, target: str, *, seed: int, count: int,
                known_peers: Sequence[tuple[str, int]] = (),
                known_rooms: Sequence[int] = (), claims: Sequence[bytes] = (),
                rooms: int = 0, uid: int | None = None) -> list[str]:
    """The command line that runs an attack in a process of its own (`main`): an attacker in
    the agents' process would share its interpreter lock with them and starve them, which a
    real attacker cannot. `target`: the control address (control, lane, heavy_control,
    sealed_garbage), the transport address (tcp_data, junk_claims) or the base URL (http);
    `claims`: transport ids to impersonate (tcp_data); `rooms`: rooms per heavy_control
    Heartbeat; `uid`: the user the attack runs as (it starts as this one, imports what it
    needs, then drops to `uid`: an unprivileged process of another user; needs root)."""
    import json
    import sys

    return [sys.executable, "-m", "kvhandoff.testing.hostile", surface, target,
            "--seed", str(seed), "--count", str(count),
            "--known-peers", json.dumps([list(x) for x in known_peers]),
            "--known-rooms", json.dumps(list(known_rooms)),
            "--claims", json.dumps([c.decode("ascii") for c in claims]),
            "--rooms", str(rooms), *(["--uid", str(uid)] if uid is not None else [])]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvhandoff.testing.hostile SURFACE TARGET [--seed N] [--count N]
    [--known-peers JSON] [--known-rooms JSON]``: runs one attack, prints what it sent as one
    JSON line."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvhandoff.testing.hostile",
                                 description="Throws a seeded hostile corpus at one surface "
                                             "of a kvhandoff agent or bootstrap server.")
    ap.add_argument("surface", choices=["control", "lane", "tcp_data", "http",
                                        "heavy_control", "sealed_garbage", "junk_claims"])
    ap.add_argument("target", help="control address host:port (control, lane), transport "
                                   "address (tcp_data) or base URL (http)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--known-peers", default="[]",
                    help='JSON list of ["host:port", generation] to impersonate')
    ap.add_argument("--known-rooms", default="[]", help="JSON list of room ids")
    ap.add_argument("--claims", default="[]",
                    help="JSON list of tcp transport ids to impersonate (tcp_data)")
    ap.add_argument("--rooms", type=int, default=1_000_000,
                    help="rooms per Heartbeat (heavy_control)")
    ap.add_argument("--uid", type=int, default=None,
                    help="run as this user (drops to it after the imports; needs root)")
    a = ap.parse_args(argv)
    if a.uid is not None:
        import zmq  # noqa: F401 - loaded before the user changes (it may not read the venv)

        import kvhandoff.netaddr  # noqa: F401 - likewise
        import kvhandoff.transports.chunkauth  # noqa: F401 - likewise

        os.setgid(a.uid)
        os.setuid(a.uid)
    peers = [(str(x), int(g)) for x, g in json.loads(a.known_peers)]
    kw: dict[str, Any] = {"known_peers": [(str(x), int(g)) for x, g in
                                          json.loads(a.known_peers)],
                          "known_rooms": [int(r) for r in json.loads(a.known_rooms)]}
    if a.surface in ("heavy_control", "sealed_garbage"):
        # in the name of the first known peer; sealed when it is one (a session is assumed)
        src, gen = peers[0] if peers else ("127.0.0.1:1", 1)
        if a.surface == "heavy_control":
            one = heavy_heartbeat(src, gen, a.rooms, sealed=bool(peers), seed=a.seed)
        else:
            one = sealed_garbage(src, gen)
        out: Any = send_control(a.target, [one] * a.count, linger_ms=-1)  # one connection
    elif a.surface == "junk_claims":
        out = send_tcp_frames(a.target.encode(), junk_claims(a.count, seed=a.seed))
    elif a.surface == "control":
        out = attack_control(a.target, seed=a.seed, count=a.count, **kw)
    elif a.surface == "lane":
        out = attack_lane(a.target, seed=a.seed, count=a.count, **kw)
    elif a.surface == "tcp_data":
        out = attack_tcp_data(a.target.encode(), seed=a.seed, count=a.count,
                              claims=[str(c).encode("ascii") for c in json.loads(a.claims)])
    else:
        statuses = attack_http(a.target, seed=a.seed, count=a.count)
        out = {"statuses": statuses}
    print(json.dumps({"surface": a.surface, "sent": out}))
    return 0


def beside_process(argv: Sequence[str], work: Callable[[], None], *,
                   timeout_s: float = 300.0) -> Any:
    """Runs the attack `argv` (`attack_argv`) as a process while `work` runs here; returns
    what it printed (parsed), once both ended; raises if it failed."""
    import json
    import subprocess

    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        work()
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the attack exited {proc.returncode}: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def beside(attack: Callable[[], _T], work: Callable[[], None], *,
           timeout_s: float = 120.0) -> _T:
    """Runs `attack` on a thread while `work` runs on this one; returns what `attack`
    returned once both ended; re-raises an exception of either (`work`'s first)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = attack()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="kvhandoff-hostile", daemon=True)
    t.start()
    try:
        work()
    finally:
        t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"the attack did not end within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    result: _T = box["value"]
    return result


if __name__ == "__main__":
    raise SystemExit(main())
