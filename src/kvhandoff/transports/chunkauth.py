# The tcp data plane bound to the control session: connection proofs, a MAC per chunk, and a
# bounded store of chunks that came before their receive was posted.
#
# How it works: the control session with a peer derives a session key (protocol.wire's
# `session_key`; fresh for every handshake); the transport is handed it (`bind_session`) and
# derives a data key from it (`data_key`: HKDF, info "kvhandoff tcp data"). A sending
# connection (`Signer`, one per DEALER) draws a random 16-byte connection nonce and, before any
# chunk, sends a proof: b"P", its transport id, the nonce and HMAC-SHA256(data key, "proof" |
# sender id | receiver id | nonce). Each chunk's header frame ends with a sequence number and
# HMAC-SHA256(data key, "chunk" | nonce | seq | header | payload). The receiver (`Gate`) maps a
# ZMQ routing id (assigned by the receiving ROUTER, never the sender's choice) to the peer whose
# proof it verified there, and lands a chunk only from such a connection, with a MAC that
# verifies and a sequence number above the last one it took there.
# - A replayed proof is refused: each nonce is taken once per session key (a proof of an older
#   session does not verify under the new key; one of this session was taken already).
# - A chunk cannot move between connections or sessions (the MAC covers the nonce) nor be
#   replayed on its own (the sequence number).
# - Without a secret the proof is a claim (the MAC is zeros and not checked): chunks still come
#   only from a connection that named its peer, and the bounds below hold.
# The payload is MAC'd, not only the header: the room's checksum (xxh3-64, whose digest travels
# sealed) is no MAC, so an on-path attacker who rewrote the payload could keep its hash; one
# SHA-256 pass per side per byte is the cost (docs/SECURITY.md gives the measured figures).
# What an on-path attacker can still do: read the bytes (nothing is encrypted), drop, delay or
# cut the connection (the room fails or retransmits), and forge the receiver's replies (credits
# and finals are not MAC'd: it can fail a send or stall it, never make a byte land).
#
# Rules: a `Gate` and an `EarlyStore` belong to the transport's I/O thread, except the key
# table, which `bind`/`unbind` change from any thread under the gate's own lock. A proof that
# does not verify under its peer's key is counted and held (checked again once that key
# changes: the sender may be a handshake ahead). What a stranger costs is bounded: proofs
# waiting for their key or held after a refusal (PENDING_MAX, oldest dropped),
# connections taken on a claim without a secret (CLAIMS_MAX, oldest dropped), early chunks per
# peer and in total (bytes; over the bound the tag's held chunks are dropped, counted, and its
# receive fails when posted, its sender is told at once), and nothing at all for a chunk from
# an unproven connection (dropped and counted).
from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct
import threading
from typing import Any

from kvhandoff.protocol.wire import hkdf_sha256

Buffer = Any  # bytes, a memoryview or a numpy array: what hmac's update takes (3.12's Buffer)

NONCE_BYTES = 16
MAC_BYTES = 32
PROOF = struct.Struct("<c32s16s32s")  # b"P", sender's transport id, nonce, MAC
TRAILER = struct.Struct("<Q32s")  # after a chunk's header: sequence number, MAC
PENDING_MAX = 256  # proofs held until their peer's key is bound
CLAIMS_MAX = 1024  # connections taken on a claim (no secret)
NONCES_MAX = 4096  # proofs taken per session key (reconnects): more are refused
OVERFLOWED_MAX = 4096  # tags whose early chunks went over the bound, remembered

#: the counters a `Gate` and an `EarlyStore` keep (the transport's status and the metrics)
COUNTERS = ("data_unproven_chunks", "data_refused_proofs", "data_replayed_proofs",
            "data_forged_chunks", "data_early_dropped")
_NO_MAC = bytes(MAC_BYTES)


def data_key(session_key: bytes) -> bytes:
    """The key of the data connections of one control session (HKDF of its session key)."""
    return hkdf_sha256(session_key, salt=b"", info=b"kvhandoff tcp data 1")


def _proof_mac(key: bytes, sender: bytes, receiver: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"proof\0" + sender + b"\0" + receiver + b"\0" + nonce,
                    hashlib.sha256).digest()


def _chunk_mac(key: bytes, nonce: bytes, seq: int, head: bytes, payload: Buffer) -> bytes:
    h = hmac.new(key, b"chunk\0" + nonce + seq.to_bytes(8, "little") + head, hashlib.sha256)
    h.update(payload)
    return h.digest()


class Signer:
    """The sending end of one data connection: its proof and each chunk's trailer."""

    __slots__ = ("_key", "nonce", "_seq")

    def __init__(self, session_key: bytes) -> None:
        self._key = data_key(session_key) if session_key else b""
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._seq = 0

    def proof(self, sender: bytes, receiver: bytes) -> bytes:
        """The proof frame this connection sends before its first chunk."""
        mac = _proof_mac(self._key, sender, receiver, self.nonce) if self._key else _NO_MAC
        return PROOF.pack(b"P", sender, self.nonce, mac)

    def trailer(self, head: bytes, payload: Buffer) -> bytes:
        """What follows chunk header `head` in its frame: the next sequence number, the MAC."""
        self._seq += 1
        mac = _chunk_mac(self._key, self.nonce, self._seq, head, payload) if self._key \
            else _NO_MAC
        return TRAILER.pack(self._seq, mac)

    def __repr__(self) -> str:
        return f"<Signer keyed={bool(self._key)} seq={self._seq}>"


class _Conn:
    __slots__ = ("ident", "key", "nonce", "seq")

    def __init__(self, ident: bytes, key: bytes, nonce: bytes) -> None:
        self.ident, self.key, self.nonce, self.seq = ident, key, nonce, 0


class Gate:
    """The receiving end: which connection proved which peer (see the module comment).
    `me`: this transport's id; `required`: a secret is set (proofs and MACs are checked)."""

    def __init__(self, me: bytes, *, required: bool, counters: dict[str, int]) -> None:
        self._me = me
        self.required = required
        self.counters = counters
        self._keys_lock = threading.Lock()
        self._keys: dict[bytes, bytes] = {}  # peer id -> data key (any thread, the lock)
        self._nonces: dict[bytes, tuple[bytes, set[bytes]]] = {}  # peer id -> (key, taken)
        self._conns: collections.OrderedDict[bytes, _Conn] = collections.OrderedDict()
        self._route: dict[bytes, bytes] = {}  # peer id -> routing id of its latest proof
        # routing id -> (proof frame, the key it failed under: b"" not checked yet)
        self._pending: collections.OrderedDict[bytes, tuple[bytes, bytes]] = (
            collections.OrderedDict())
        # routing ids that proved a peer once (a sender worth telling its chunk was not taken)
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    # ---- any thread ------------------------------------------------------------------------

    def bind(self, ident: bytes, session_key: bytes) -> None:
        """Peer `ident`'s connections prove themselves under `session_key` from now on; those
        proven under an earlier key are no longer taken."""
        key = data_key(session_key) if session_key else b""
        with self._keys_lock:
            self._keys[ident] = key

    def unbind(self, ident: bytes) -> None:
        with self._keys_lock:
            self._keys.pop(ident, None)

    def _key_of(self, ident: bytes) -> bytes | None:
        with self._keys_lock:
            return self._keys.get(ident)

    # ---- I/O thread ------------------------------------------------------------------------

    def route(self, ident: bytes) -> bytes | None:
        """The routing id of peer `ident`'s proven connection (where replies go), if any."""
        rid = self._route.get(ident)
        conn = self._conns.get(rid) if rid is not None else None
        return rid if conn is not None and conn.ident == ident else None

    def on_proof(self, rid: bytes, frame: bytes) -> None:
        """A proof frame on connection `rid`: taken now, held until its key is bound, or
        refused (counted)."""
        if len(frame) != PROOF.size:
            self.counters["data_refused_proofs"] += 1
            return
        self._conns.pop(rid, None)  # a new proof replaces what the connection proved
        if self.required:
            self._pending.pop(rid, None)
            self._pending[rid] = (frame, b"")
            while len(self._pending) > PENDING_MAX:
                _, (_, tried) = self._pending.popitem(last=False)
                if not tried:
                    self.counters["data_refused_proofs"] += 1
            self._try_pending(rid)
            return
        _, ident, nonce, _ = PROOF.unpack(frame)
        self._take(rid, ident, b"", nonce)

    def _try_pending(self, rid: bytes) -> _Conn | None:
        held = self._pending.get(rid)
        if held is None:
            return None
        frame, tried = held
        _, ident, nonce, mac = PROOF.unpack(frame)
        key = self._key_of(ident)
        if not key or key == tried:
            return None  # not bound yet (the control session is being set up): held
        if not hmac.compare_digest(_proof_mac(key, ident, self._me, nonce), mac):
            # counted, and held: the sender may be a session ahead of this side (its new
            # handshake's key is bound here a moment later); checked again under that key
            self.counters["data_refused_proofs"] += 1
            self._pending[rid] = (frame, key)
            return None
        del self._pending[rid]
        taken = self._nonces.get(ident)
        if taken is None or taken[0] != key:
            taken = self._nonces[ident] = (key, set())
        if nonce in taken[1] or len(taken[1]) >= NONCES_MAX:
            self.counters["data_replayed_proofs"] += 1
            return None
        taken[1].add(nonce)
        return self._take(rid, ident, key, nonce)

    def _take(self, rid: bytes, ident: bytes, key: bytes, nonce: bytes) -> _Conn:
        conn = self._conns[rid] = _Conn(ident, key, nonce)
        self._route[ident] = rid
        self._known[rid] = None
        for table in (self._conns, self._known):
            while len(table) > CLAIMS_MAX:
                table.popitem(last=False)
        return conn

    def check(self, rid: bytes, head: bytes, trailer: bytes, payload: Buffer) -> bytes | None:
        """The peer id a chunk (`head`, its `trailer`, `payload`) on connection `rid` comes
        from, or None (dropped, counted): an unproven connection, a connection proven under a
        key since replaced, a MAC that does not verify, a sequence number already taken."""
        conn = self._conns.get(rid)
        if conn is None and self.required:
            conn = self._try_pending(rid)
        if conn is None:
            self.counters["data_unproven_chunks"] += 1
            return None
        if not self.required:
            return conn.ident
        if self._key_of(conn.ident) != conn.key:
            del self._conns[rid]  # proven under a key of an older session
            self.counters["data_unproven_chunks"] += 1
            return None
        seq, mac = TRAILER.unpack(trailer)
        if seq <= conn.seq or not hmac.compare_digest(
                _chunk_mac(conn.key, conn.nonce, seq, head, payload), mac):
            self.counters["data_forged_chunks"] += 1
            return None
        conn.seq = seq
        return conn.ident

    def was_proven(self, rid: bytes) -> bool:
        """Whether connection `rid` proved (or is waiting to prove) a peer: worth telling that
        its chunk was not taken. A stranger's connection is told nothing."""
        return rid in self._pending or rid in self._known

    def forget(self, ident: bytes) -> None:
        """Peer `ident` was disconnected: with a secret, unless it is bound again already, its
        connections and nonces go (their next chunk is answered: not taken). Without one,
        claims stay (the oldest go past CLAIMS_MAX): a peer that did not disconnect goes on."""
        if not self.required or self._key_of(ident) is not None:
            return
        for rid in [r for r, c in self._conns.items() if c.ident == ident]:
            del self._conns[rid]
        self._route.pop(ident, None)
        self._nonces.pop(ident, None)


class EarlyStore:
    """Chunks that came before their receive was posted, per (peer id, tag), bounded in bytes
    per peer (`peer_bytes`) and in total (`total_bytes`). Each item is held with the order it
    came in (`order`), so a disconnect drops only what came before it."""

    def __init__(self, *, peer_bytes: int, total_bytes: int, counters: dict[str, int]) -> None:
        self.peer_bytes = peer_bytes
        self.total_bytes = total_bytes
        self.counters = counters
        self._items: dict[tuple[bytes, int], list[Any]] = {}
        self._order: dict[tuple[bytes, int], int] = {}
        self._size: dict[tuple[bytes, int], int] = {}
        self._peer: collections.Counter[bytes] = collections.Counter()
        self.total = 0
        self._overflowed: collections.OrderedDict[tuple[bytes, int], None] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())

    def overflowed(self, key: tuple[bytes, int]) -> bool:
        return key in self._overflowed

    def hold(self, key: tuple[bytes, int], item: Any, nbytes: int, order: int) -> bool:
        """Holds `item` (`nbytes` of payload) for `key`; False when that would go over a bound:
        then what was held for `key` is dropped too, and `key` is marked overflowed."""
        if (key in self._overflowed or self._peer[key[0]] + nbytes > self.peer_bytes
                or self.total + nbytes > self.total_bytes):
            self.counters["data_early_dropped"] += 1 + len(self._items.get(key, ()))
            self.discard(key)
            self._overflowed[key] = None
            while len(self._overflowed) > OVERFLOWED_MAX:
                self._overflowed.popitem(last=False)
            return False
        if key not in self._items:
            self._order[key] = order
            self._items[key] = []
            self._size[key] = 0
        self._items[key].append(item)
        self._size[key] += nbytes
        self._peer[key[0]] += nbytes
        self.total += nbytes
        return True

    def take(self, key: tuple[bytes, int]) -> list[Any]:
        """What was held for `key`, now handed over (its receive was posted)."""
        items = self._items.get(key, [])
        self.discard(key)
        return items

    def discard(self, key: tuple[bytes, int]) -> None:
        self._items.pop(key, None)
        self._order.pop(key, None)
        size = self._size.pop(key, 0)
        self._peer[key[0]] -= size
        if self._peer[key[0]] <= 0:
            del self._peer[key[0]]
        self.total -= size

    def unmark(self, key: tuple[bytes, int]) -> None:
        self._overflowed.pop(key, None)

    def drop_peer(self, ident: bytes, before: int) -> None:
        """Drops what peer `ident` sent before order `before` (a disconnect)."""
        for key in [k for k in self._items if k[0] == ident and self._order[k] < before]:
            self.discard(key)
