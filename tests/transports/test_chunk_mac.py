"""The tcp data plane's chunk MAC (transports/chunkauth.py, docs/SECURITY.md "The tcp data
plane"): AES-256-GMAC where `cryptography` imports, HMAC-SHA256 from the standard library
where it does not. Each kind against a frozen reference vector and against its definition
computed another way; a flipped payload bit refused by the receiver's `Gate`; the fallback
(`cryptography` made unimportable) taken by the sender, named in the status, and still
accepted by a receiver that has `cryptography`. `cryptography` is a dependency (pyproject), so
the GMAC tests need it and fail without it; the fallback's run in every environment."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvhandoff.protocol.wire import hkdf_sha256
from kvhandoff.transports import chunkauth
from kvhandoff.transports.chunkauth import (
    COUNTERS,
    GMAC,
    HMAC_SHA256,
    PROOF,
    TRAILER,
    ChunkMac,
    Gate,
    Signer,
    data_key,
)

KEY = bytes(range(32))
NONCE = bytes(range(100, 116))
HEAD = b"D" + bytes(24)
PAYLOAD = bytes(range(256)) * 5
SEQ = 7
# computed once with this module's construction; a change of the wire format must change these
REFERENCE = {
    GMAC: "25d9817b59371263d7cdffd2b29e13d7" + "00" * 16,
    HMAC_SHA256: "d7eb8b1a6ce00e26bc857852f2c59da29d9a1588de83445ec86a599e902c083c",
}
SENDER, RECEIVER = b"a" * 32, b"b" * 32

@pytest.fixture
def no_cryptography(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as if `cryptography` did not import (the stdlib fallback)."""
    monkeypatch.setattr(chunkauth, "_AESGCM", None)
    yield


def test_hmac_matches_its_reference_and_its_definition() -> None:
    got = ChunkMac(HMAC_SHA256, KEY, NONCE)(SEQ, HEAD, PAYLOAD)
    want = hmac.new(KEY, b"chunk\0" + NONCE + SEQ.to_bytes(8, "little") + HEAD + PAYLOAD,
                    hashlib.sha256).digest()
    assert got == want
    assert got.hex() == REFERENCE[HMAC_SHA256]


def test_gmac_matches_its_reference_and_its_definition() -> None:
    """The same tag through the library's streaming GCM interface: the connection's key from
    HKDF of the data key and the nonce, the sequence number as the GCM nonce, the payload as
    associated data, "chunk" and the header as the plaintext."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    got = ChunkMac(GMAC, KEY, NONCE)(SEQ, HEAD, PAYLOAD)
    conn_key = hkdf_sha256(KEY, salt=NONCE, info=b"kvhandoff tcp chunk gmac 1")
    enc = Cipher(algorithms.AES(conn_key), modes.GCM(SEQ.to_bytes(12, "little"))).encryptor()
    enc.authenticate_additional_data(PAYLOAD)
    enc.update(b"chunk\0" + HEAD)
    enc.finalize()
    assert got == enc.tag + bytes(16)
    assert got.hex() == REFERENCE[GMAC]
    # a numpy view of the payload (what the transport passes) gives the same tag
    assert ChunkMac(GMAC, KEY, NONCE)(SEQ, HEAD, np.frombuffer(PAYLOAD, np.uint8)) == got


@pytest.mark.parametrize("kind", [GMAC, HMAC_SHA256])
def test_each_input_changes_the_mac(kind: bytes) -> None:
    mac = ChunkMac(kind, KEY, NONCE)(SEQ, HEAD, PAYLOAD)
    flipped = bytearray(PAYLOAD)
    flipped[300] ^= 0x10
    assert ChunkMac(kind, KEY, NONCE)(SEQ, HEAD, bytes(flipped)) != mac
    assert ChunkMac(kind, KEY, NONCE)(SEQ + 1, HEAD, PAYLOAD) != mac
    assert ChunkMac(kind, KEY, NONCE)(SEQ, b"D" + bytes(23) + b"\1", PAYLOAD) != mac
    assert ChunkMac(kind, KEY, bytes(16))(SEQ, HEAD, PAYLOAD) != mac
    assert ChunkMac(kind, bytes(32), NONCE)(SEQ, HEAD, PAYLOAD) != mac


def gate() -> Gate:
    g = Gate(RECEIVER, required=True, counters=dict.fromkeys(COUNTERS, 0))
    g.bind(SENDER, KEY)
    return g


def chunk(signer: Signer, payload: bytes) -> tuple[bytes, bytes]:
    head = b"D" + os.urandom(24)
    return head, signer.trailer(head, payload)


@pytest.mark.parametrize("kind", [GMAC, HMAC_SHA256])
def test_a_flipped_payload_bit_is_refused(kind: bytes) -> None:
    """Through the receiver's Gate, as the tcp transport calls it: the chunk as sent lands,
    the same chunk with one payload bit flipped is dropped and counted as forged, and so is
    the untouched chunk replayed (its sequence number was taken)."""
    g = gate()
    signer = Signer(KEY, mac=kind)
    g.on_proof(b"rid", signer.proof(SENDER, RECEIVER))
    payload = os.urandom(64 << 10)
    head, trailer = chunk(signer, payload)
    bad = bytearray(payload)
    bad[12345] ^= 0x01
    assert g.check(b"rid", head, trailer, np.frombuffer(bytes(bad), np.uint8)) is None
    assert g.counters["data_forged_chunks"] == 1
    assert g.check(b"rid", head, trailer, memoryview(payload)) == SENDER
    assert g.check(b"rid", head, trailer, memoryview(payload)) is None  # replayed
    assert g.counters["data_forged_chunks"] == 2
    head2, trailer2 = chunk(signer, payload)
    assert g.check(b"rid", head2, trailer2, payload) == SENDER


def test_a_proofs_mac_kind_cannot_be_switched() -> None:
    """The proof's MAC covers its kind byte: an on-path attacker who turns a GMAC proof into
    an HMAC one (or back) gets it refused."""
    g = gate()
    proof = bytearray(Signer(KEY, mac=GMAC).proof(SENDER, RECEIVER))
    proof[0:1] = HMAC_SHA256
    g.on_proof(b"rid", bytes(proof))
    assert g.counters["data_refused_proofs"] == 1
    proof = bytearray(Signer(KEY, mac=HMAC_SHA256).proof(SENDER, RECEIVER))
    proof[0:1] = GMAC
    g.on_proof(b"rid2", bytes(proof))
    assert g.counters["data_refused_proofs"] == 2
    assert g.route(SENDER) is None


@pytest.mark.usefixtures("no_cryptography")
def test_without_cryptography_the_fallback_is_taken_and_named() -> None:
    """The sender signs with HMAC-SHA256 and says so in its proof; a receiver in the same
    state refuses a GMAC proof (counted) and takes the HMAC one; the status note names the
    fallback."""
    assert chunkauth.default_mac() == HMAC_SHA256
    assert "fallback" in chunkauth.mac_note() and "cryptography" in chunkauth.mac_note()
    signer = Signer(KEY)
    proof = signer.proof(SENDER, RECEIVER)
    assert PROOF.unpack(proof)[0] == HMAC_SHA256
    with pytest.raises(ValueError, match="cryptography"):
        ChunkMac(GMAC, KEY, NONCE)
    g = gate()
    # a GMAC proof that verifies (forged here with the proof's own MAC) is refused: no GMAC
    kind_g = GMAC + proof[1:49] + chunkauth._proof_mac(data_key(KEY), GMAC, SENDER, RECEIVER,
                                                       proof[33:49])
    g.on_proof(b"rid", kind_g)
    assert g.counters["data_refused_proofs"] == 1
    g.on_proof(b"rid", proof)
    payload = os.urandom(4096)
    head, trailer = chunk(signer, payload)
    assert g.check(b"rid", head, trailer, payload) == SENDER
    assert TRAILER.unpack(trailer)[1] == hmac.new(
        data_key(KEY), b"chunk\0" + signer.nonce + (1).to_bytes(8, "little") + head + payload,
        hashlib.sha256).digest()


def test_a_receiver_with_cryptography_takes_a_fallback_sender() -> None:
    """A sender without `cryptography` (HMAC proof and chunks) to a receiver with it: taken."""
    g = gate()
    signer = Signer(KEY, mac=HMAC_SHA256)
    g.on_proof(b"rid", signer.proof(SENDER, RECEIVER))
    payload = os.urandom(4096)
    head, trailer = chunk(signer, payload)
    assert g.check(b"rid", head, trailer, payload) == SENDER
    assert Signer(KEY).kind == GMAC  # and its own sender uses GMAC


def test_replies_verify_in_order_only_and_under_their_own_connection() -> None:
    """The receiver's Gate seals replies under what the connection proved; the sender's
    Signer takes each once and in order: a replayed or reordered reply, one whose reason was
    changed, one sealed for another connection, and a chunk-MAC-shaped one are refused. A
    connection that proved nothing gets the all-zero trailer, which verifies under no key."""
    g = gate()
    signer, other = Signer(KEY), Signer(KEY)
    g.on_proof(b"rid", signer.proof(SENDER, RECEIVER))
    g.on_proof(b"rid2", other.proof(SENDER, RECEIVER))
    assert signer.reply is not None and other.reply is not None
    n = chunkauth.REPLY_TRAILER.size

    def split(frame: bytes) -> tuple[bytes, int, bytes]:
        seq, mac = chunkauth.REPLY_TRAILER.unpack(frame[-n:])
        return frame[:-n], seq, mac

    credits = [split(g.seal(b"rid", b"C" + bytes([k]) * 12)) for k in range(3)]
    final = split(g.seal(b"rid", b"F" + bytes(9), b"why"))
    head, seq, mac = credits[1]
    assert signer.reply.take(seq, head, b"", mac)
    assert not signer.reply.take(seq, head, b"", mac)  # replayed
    head0, seq0, mac0 = credits[0]
    assert not signer.reply.take(seq0, head0, b"", mac0)  # reordered: came after seq 2
    head2, seq2, mac2 = credits[2]
    assert not other.reply.take(seq2, head2, b"", mac2)  # another connection's key
    assert signer.reply.take(seq2, head2, b"", mac2)
    fhead, fseq, fmac = final
    assert not signer.reply.take(fseq, fhead, b"other", fmac)  # the reason is covered
    assert signer.reply.take(fseq, fhead, b"why", fmac)
    zhead, zseq, zmac = split(g.seal(b"stranger", b"F" + bytes(9), b"x"))
    assert (zseq, zmac) == (0, bytes(chunkauth.REPLY_MAC_BYTES))
    assert not other.reply.take(zseq, zhead, b"x", zmac)
