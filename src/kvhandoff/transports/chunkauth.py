# The tcp data plane bound to the control session: connection proofs, a MAC per chunk, and a
# bounded store of chunks that came before their receive was posted.
#
# How it works: the control session with a peer derives a session key (protocol.wire's
# `session_key`; fresh for every handshake); the transport is handed it (`bind_session`) and
# derives a data key from it (`data_key`: HKDF, info "kvhandoff tcp data"). A sending
# connection (`Signer`, one per DEALER) draws a random 16-byte connection nonce and, before any
# chunk, sends a proof: a kind byte that names the chunk MAC (b"G": AES-256-GMAC, b"P":
# HMAC-SHA256), its transport id, the nonce and HMAC-SHA256(data key, "proof" | kind | sender
# id | receiver id | nonce). Each chunk's header frame ends with a sequence number and the
# chunk's MAC (`ChunkMac`) of "chunk" | nonce | seq | header | payload:
# - b"G" (`cryptography` installed: the default): the tag of AES-256-GCM under a key of this
#   connection alone (HKDF of the data key and the connection nonce), with the sequence number
#   as the GCM nonce, the header as plaintext (its ciphertext is not sent: the receiver
#   computes the same from the header it got) and the payload as associated data. A GCM tag
#   is a secure MAC as long as no nonce repeats under a key: the key is the connection's own
#   and the sequence number only grows, so none does. About 5x cheaper than HMAC-SHA256 here
#   (AES-NI and carry-less multiply; docs/SECURITY.md gives the figures);
# - b"P" (the pure-stdlib fallback, when `cryptography` cannot be imported): HMAC-SHA256(data
#   key, "chunk" | nonce | seq | header | payload). A receiver takes either; a receiver
#   without `cryptography` refuses b"G" proofs (counted, logged, named in the status).
# The receiver (`Gate`) maps a
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
# MAC pass per side per byte is the cost (docs/SECURITY.md gives the measured figures).
# The receiver's replies on a proven connection (b"C" credits, b"F" finals) are MAC'd too
# (`ReplyMac`): HMAC-SHA256, truncated to 16 bytes, under a key of that connection alone (HKDF
# of the data key and the connection nonce, info "kvhandoff tcp reply 1": never the chunk
# MAC's key) of "reply" | seq | header | reason, with a sequence number of its own that only
# grows; the header frame ends with REPLY_TRAILER (seq, MAC). The sender (`Signer.reply`)
# takes a reply only when its MAC verifies under one of its recent connections' keys and its
# sequence number is above the last one taken there: a forged, replayed or reordered reply is
# refused and counted (`data_forged_replies`), so it neither completes, fails nor advances a
# send. One reply cannot be MAC'd: "chunk not taken" to a connection that proved nothing the
# receiver holds (its proof was refused, or it was dropped); with a secret the sender takes
# such a reply only as a hint to prove the connection again, once per proof
# (`data_unverified_replies`), never as a reason to fail a send. Without a secret nothing
# changes on the wire (no trailer, replies taken as they come).
# What an on-path attacker can still do: read the bytes (nothing is encrypted), drop, delay or
# cut the connection (the room stalls, fails on its stall bound, or retransmits); it cannot
# make a byte land, nor complete, fail or advance a send by a reply it made up or replayed.
#
# Rules: a `Gate` and an early.EarlyStore belong to the transport's I/O thread, except the key
# table, which `bind`/`unbind` change from any thread under the gate's own lock. A sender
# proves a connection with its first chunk after each (re)key or reconnect, so the receiver,
# which binds the key before it asks for any chunk, checks a proof at once: a proof or claim
# for a peer this transport is not bound to, or that does not verify, is refused and counted,
# never held (no table a stranger can fill holds an honest proof). What a stranger costs is
# bounded: proven or claimed connections per bound peer (CONNS_PER_PEER, that peer's oldest
# dropped), one "not taken" reply per proof-shaped frame (`Gate.tell`), early chunks per peer
# and in total (bytes; over the bound the tag's held chunks are dropped, counted, and its
# receive fails when posted, its sender is told at once) and in age (EARLY_KEEP_S: a tag whose
# receive is never posted is dropped likewise), and nothing at all for a chunk from an
# unproven connection (dropped and counted).
from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import struct
import threading
from typing import Any

from kvhandoff.protocol.wire import hkdf_sha256

_AESGCM: Any  # the fast chunk MAC (AES-256-GMAC); None: HMAC-SHA256, the stdlib fallback
try:
    from cryptography.hazmat.primitives.ciphers import aead as _aead

    _AESGCM = _aead.AESGCM
except ImportError:  # pragma: no cover - exercised by forcing `_AESGCM = None` in the tests
    _AESGCM = None

log = logging.getLogger(__name__)

Buffer = Any  # bytes, a memoryview or a numpy array: what hmac's update takes (3.12's Buffer)

NONCE_BYTES = 16
MAC_BYTES = 32
PROOF = struct.Struct("<c32s16s32s")  # kind (GMAC or HMAC), sender's transport id, nonce, MAC
TRAILER = struct.Struct("<Q32s")  # after a chunk's header: sequence number, MAC
REPLY_TRAILER = struct.Struct("<Q16s")  # after a reply's header (with a secret): seq, MAC
REPLY_MAC_BYTES = 16
REPLY_KEYS = 4  # a sender's recent connections (proofs) whose replies it still takes
CONNS_PER_PEER = 16  # proven (or, without a secret, claimed) connections kept per peer
TOLD_MAX = 4096  # connections told their chunk was not taken, remembered (told once)
NONCES_MAX = 4096  # proofs taken per session key (reconnects): more are refused
STALE_MAX = 64  # dropped proven connections whose replies are still sealed (`Gate.seal`)

#: the counters a `Gate` and an early.EarlyStore keep (the transport's status and the metrics)
COUNTERS = ("data_unproven_chunks", "data_refused_proofs", "data_replayed_proofs",
            "data_forged_chunks", "data_early_dropped", "data_forged_replies",
            "data_unverified_replies")
_NO_MAC = bytes(MAC_BYTES)
NO_REPLY_TRAILER = REPLY_TRAILER.pack(0, bytes(REPLY_MAC_BYTES))  # a reply that cannot be MAC'd

#: a proof's kind byte, naming the MAC of the chunks that follow it on that connection
GMAC = b"G"  # AES-256-GCM's tag (`cryptography`): the default where it imports
HMAC_SHA256 = b"P"  # HMAC-SHA256 (the standard library): the fallback
MAC_NAMES = {GMAC: "AES-256-GMAC", HMAC_SHA256: "HMAC-SHA256"}
_TAG_BYTES = 16  # a GCM tag; the trailer's other 16 bytes are zeros


def default_mac() -> bytes:
    """The chunk MAC this process sends: GMAC where `cryptography` imports, else HMAC-SHA256."""
    return GMAC if _AESGCM is not None else HMAC_SHA256


def mac_note() -> str:
    """The chunk MAC in words, for the transport's status (a fallback is named as one)."""
    if _AESGCM is not None:
        return "chunk MAC AES-256-GMAC"
    return ("chunk MAC HMAC-SHA256 (fallback: the 'cryptography' package is not installed, "
            "about 5x the CPU per byte with a secret)")


def data_key(session_key: bytes) -> bytes:
    """The key of the data connections of one control session (HKDF of its session key)."""
    return hkdf_sha256(session_key, salt=b"", info=b"kvhandoff tcp data 1")


def _proof_mac(key: bytes, kind: bytes, sender: bytes, receiver: bytes, nonce: bytes) -> bytes:
    # the kind is covered: an on-path attacker cannot switch a connection's chunk MAC
    return hmac.new(key, b"proof\0" + kind + sender + b"\0" + receiver + b"\0" + nonce,
                    hashlib.sha256).digest()


class ChunkMac:
    """The MAC of one connection's chunks (see the module comment), computed alike by its
    `Signer` and by the receiver's `Gate`: `kind` GMAC or HMAC_SHA256, `key` the data key,
    `nonce` the connection's. `__call__(seq, head, payload)` gives the trailer's 32-byte MAC.
    Both kinds release the GIL over the payload."""

    __slots__ = ("kind", "_key", "_nonce", "_aead")

    def __init__(self, kind: bytes, key: bytes, nonce: bytes) -> None:
        if kind not in MAC_NAMES:
            raise ValueError(f"chunk MAC kind {kind!r} is not one of {sorted(MAC_NAMES)}")
        self.kind, self._key, self._nonce = kind, key, nonce
        self._aead = None
        if kind == GMAC:
            if _AESGCM is None:
                raise ValueError("chunk MAC AES-256-GMAC needs the 'cryptography' package, "
                                 "which is not installed here")
            # a key of this connection alone: its GCM nonces (the sequence numbers) never
            # repeat under it
            self._aead = _AESGCM(hkdf_sha256(key, salt=nonce, info=b"kvhandoff tcp chunk gmac 1"))

    def __call__(self, seq: int, head: bytes, payload: Buffer) -> bytes:
        if self._aead is not None:
            # GCM(plaintext = the header, associated data = the payload): the tag (the last 16
            # bytes) covers both; the header's ciphertext is not sent
            out: bytes = self._aead.encrypt(seq.to_bytes(12, "little"), b"chunk\0" + head, payload)
            return out[-_TAG_BYTES:] + bytes(MAC_BYTES - _TAG_BYTES)
        h = hmac.new(self._key, b"chunk\0" + self._nonce + seq.to_bytes(8, "little") + head,
                     hashlib.sha256)
        h.update(payload)
        return h.digest()


class ReplyMac:
    """The MAC of the receiver's replies on one connection (see the module comment): made by
    the receiver's `Gate` (`seal`) and checked by the connection's `Signer` (`take`). Each
    side keeps its own sequence number: the receiver's last sent, the sender's last taken."""

    __slots__ = ("_key", "seq")

    def __init__(self, data_key: bytes, nonce: bytes) -> None:
        self._key = hkdf_sha256(data_key, salt=nonce, info=b"kvhandoff tcp reply 1")
        self.seq = 0

    def mac(self, seq: int, head: bytes, reason: bytes) -> bytes:
        return hmac.digest(self._key, b"reply\0" + seq.to_bytes(8, "little") + head + reason,
                           "sha256")[:REPLY_MAC_BYTES]

    def seal(self, head: bytes, reason: bytes = b"") -> bytes:
        """`head` with its trailer: the next sequence number and the MAC."""
        self.seq += 1
        return head + REPLY_TRAILER.pack(self.seq, self.mac(self.seq, head, reason))

    def take(self, seq: int, head: bytes, reason: bytes, mac: bytes) -> bool:
        """Whether a reply verifies and comes after the last one taken (then it is taken)."""
        if seq <= self.seq or not hmac.compare_digest(self.mac(seq, head, reason), mac):
            return False
        self.seq = seq
        return True


class Signer:
    """The sending end of one data connection: its proof and each chunk's trailer. `mac`: the
    chunk MAC's kind (default: `default_mac()`); `nonce`: the connection's (default: drawn)."""

    __slots__ = ("_key", "nonce", "_seq", "kind", "_mac", "reply")

    def __init__(self, session_key: bytes, *, mac: bytes | None = None,
                 nonce: bytes | None = None) -> None:
        self._key = data_key(session_key) if session_key else b""
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._seq = 0
        self.kind = mac if mac is not None else default_mac()
        self._mac = ChunkMac(self.kind, self._key, self.nonce) if self._key else None
        #: the receiver's replies on this connection (None: no secret, replies are not MAC'd)
        self.reply = ReplyMac(self._key, self.nonce) if self._key else None

    def proof(self, sender: bytes, receiver: bytes) -> bytes:
        """The proof frame this connection sends before its first chunk."""
        mac = (_proof_mac(self._key, self.kind, sender, receiver, self.nonce) if self._key
               else _NO_MAC)
        return PROOF.pack(self.kind, sender, self.nonce, mac)

    def trailer(self, head: bytes, payload: Buffer) -> bytes:
        """What follows chunk header `head` in its frame: the next sequence number, the MAC."""
        self._seq += 1
        mac = self._mac(self._seq, head, payload) if self._mac is not None else _NO_MAC
        return TRAILER.pack(self._seq, mac)

    def __repr__(self) -> str:
        return (f"<Signer keyed={bool(self._key)} mac={MAC_NAMES[self.kind]} "
                f"seq={self._seq}>")


class _Conn:
    __slots__ = ("ident", "key", "nonce", "seq", "mac", "reply")

    def __init__(self, ident: bytes, key: bytes, nonce: bytes,
                 mac: ChunkMac | None = None) -> None:
        self.ident, self.key, self.nonce, self.seq, self.mac = ident, key, nonce, 0, mac
        self.reply = ReplyMac(key, nonce) if mac is not None else None


class Gate:
    """The receiving end: which connection proved which peer (see the module comment).
    `me`: this transport's id; `required`: a secret is set (proofs and MACs are checked).

    Every table is keyed by what its entries proved, so nothing a stranger sends pushes an
    honest entry out: a proof or claim is taken only for a peer this transport is bound to
    (`bind`: it connected to that peer, so the peer's control session came first), checked at
    once (a sender proves a connection with its first chunk, after the receiver asked for it
    under the session: the key is bound by then), and otherwise refused and counted, never
    held. Proven connections are kept per peer (CONNS_PER_PEER, that peer's oldest go). A
    connection whose chunk is not taken is told so once per proof it sent (`tell`), so an
    honest sender proves itself again; `_told` is the one table a stranger can fill, and
    what it pushes out is only a reply not sent twice."""

    def __init__(self, me: bytes, *, required: bool, counters: dict[str, int]) -> None:
        self._me = me
        self.required = required
        self.counters = counters
        self._keys_lock = threading.Lock()
        self._keys: dict[bytes, bytes] = {}  # peer id -> data key (any thread, the lock)
        self._nonces: dict[bytes, tuple[bytes, set[bytes]]] = {}  # peer id -> (key, taken)
        self._conns: dict[bytes, _Conn] = {}  # routing id -> what it proved
        # peer id -> its proven routing ids, oldest first (at most CONNS_PER_PEER)
        self._by_peer: dict[bytes, collections.OrderedDict[bytes, None]] = {}
        self._route: dict[bytes, bytes] = {}  # peer id -> routing id of its latest proof
        # routing ids told their chunk was not taken since their last proof
        self._told: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # routing id -> the proven connection it last dropped (a new key, a new proof, a
        # disconnect): its replies to that connection are still sealed under it (`seal`);
        # only connections that proved themselves get here, at most STALE_MAX
        self._stale: collections.OrderedDict[bytes, _Conn] = collections.OrderedDict()

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
        """A proof frame on connection `rid`: taken now, or refused (counted)."""
        self._drop_conn(rid)  # a new proof replaces what the connection proved
        self._told.pop(rid, None)
        if len(frame) != PROOF.size:
            self.counters["data_refused_proofs"] += 1
            return
        kind, ident, nonce, mac = PROOF.unpack(frame)
        key = self._key_of(ident)
        if key is None or (self.required and not key):
            self.counters["data_refused_proofs"] += 1  # no peer of ours (or no session yet)
            return
        if not self.required:
            self._take(rid, ident, b"", nonce)
            return
        if kind not in MAC_NAMES or not hmac.compare_digest(
                _proof_mac(key, kind, ident, self._me, nonce), mac):
            self.counters["data_refused_proofs"] += 1
            return
        try:
            chunk_mac = ChunkMac(kind, key, nonce)
        except ValueError as e:  # a GMAC proof where `cryptography` is missing
            self.counters["data_refused_proofs"] += 1
            log.warning("tcp: refusing a proof of peer %r: %s", ident, e)
            return
        taken = self._nonces.get(ident)
        if taken is None or taken[0] != key:
            taken = self._nonces[ident] = (key, set())
        if nonce in taken[1] or len(taken[1]) >= NONCES_MAX:
            self.counters["data_replayed_proofs"] += 1
            return
        taken[1].add(nonce)
        self._take(rid, ident, key, nonce, chunk_mac)

    def _take(self, rid: bytes, ident: bytes, key: bytes, nonce: bytes,
              mac: ChunkMac | None = None) -> _Conn:
        conn = self._conns[rid] = _Conn(ident, key, nonce, mac)
        self._stale.pop(rid, None)
        self._route[ident] = rid
        mine = self._by_peer.setdefault(ident, collections.OrderedDict())
        mine[rid] = None
        while len(mine) > CONNS_PER_PEER:
            old, _ = mine.popitem(last=False)
            self._conns.pop(old, None)
        return conn

    def seal(self, rid: bytes, head: bytes, reason: bytes = b"") -> bytes:
        """A reply's header frame to connection `rid` (with a secret): `head`, then its
        trailer, MAC'd under what the connection proved (or last proved, if dropped since);
        a connection that proved nothing gets an all-zero trailer, which its sender takes only
        as a hint (see the module comment)."""
        conn = self._conns.get(rid) or self._stale.get(rid)
        if conn is None or conn.reply is None:
            return head + NO_REPLY_TRAILER
        return conn.reply.seal(head, reason)

    def _drop_conn(self, rid: bytes) -> None:
        conn = self._conns.pop(rid, None)
        if conn is not None and conn.reply is not None:
            self._stale[rid] = conn
            self._stale.move_to_end(rid)
            while len(self._stale) > STALE_MAX:
                self._stale.popitem(last=False)
        if conn is not None:
            mine = self._by_peer.get(conn.ident)
            if mine is not None:
                mine.pop(rid, None)
                if not mine:
                    del self._by_peer[conn.ident]

    def check(self, rid: bytes, head: bytes, trailer: bytes, payload: Buffer) -> bytes | None:
        """The peer id a chunk (`head`, its `trailer`, `payload`) on connection `rid` comes
        from, or None (dropped, counted): an unproven connection, a connection proven under a
        key since replaced, a MAC that does not verify, a sequence number already taken."""
        conn = self._conns.get(rid)
        if conn is None:
            self.counters["data_unproven_chunks"] += 1
            return None
        if not self.required:
            return conn.ident
        if self._key_of(conn.ident) != conn.key:
            self._drop_conn(rid)  # proven under a key of an older session
            self.counters["data_unproven_chunks"] += 1
            return None
        seq, mac = TRAILER.unpack(trailer)
        if seq <= conn.seq or conn.mac is None or not hmac.compare_digest(
                conn.mac(seq, head, payload), mac):
            self.counters["data_forged_chunks"] += 1
            return None
        conn.seq = seq
        return conn.ident

    def tell(self, rid: bytes) -> bool:
        """Whether to tell connection `rid` that its chunk was not taken: once per proof it
        sent (an honest sender then proves itself again; a stranger gets one reply per
        proof-shaped frame it sent, never one per chunk)."""
        if rid in self._told:
            return False
        self._told[rid] = None
        while len(self._told) > TOLD_MAX:
            self._told.popitem(last=False)
        return True

    def forget(self, ident: bytes) -> None:
        """Peer `ident` was disconnected: with a secret, unless it is bound again already, its
        connections and nonces go (their next chunk is answered: not taken). Without one,
        claims stay (at most CONNS_PER_PEER of it): a peer that did not disconnect goes on."""
        if not self.required or self._key_of(ident) is not None:
            return
        for rid in list(self._by_peer.get(ident, ())):
            self._drop_conn(rid)
        self._route.pop(ident, None)
        self._nonces.pop(ident, None)
