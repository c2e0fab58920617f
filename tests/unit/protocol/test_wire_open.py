"""`wire.open_frames` / `wire.peek`: a frame's sender and seal read without decoding its body
(issue 48: the seal is checked over the raw bytes before anything is decoded)."""

from __future__ import annotations

import msgspec
import pytest

from kvhandoff.errors import ProtocolError
from kvhandoff.protocol import wire as P
from kvhandoff.testing import hostile

MSGS: list[P.Message] = [
    P.Heartbeat(src="127.0.0.1:5", gen=0, rooms=[]),
    P.Heartbeat(src="[::1]:5", gen=2**62 - 1, rooms=[1, 2**40]),
    P.Failed(src="h" * 300, gen=200, room=1, reason="r"),
    P.TransferRequest(src="a:1", gen=70000, room=3, xfer=1, peer_gen=2, seq_len=4,
                      decode_prefix_len=0, page_size=16, dst_pages={"kv": [1]}, lease_s=1.0),
    P.HelloReject(src="a:1", gen=1, reason="x"),
]


@pytest.mark.parametrize("msg", MSGS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("sealed", [False, True])
def test_open_reads_kind_sender_and_generation_of_every_message(msg: P.Message,
                                                                sealed: bool) -> None:
    frames = P.seal(msg, key=b"k" * 32, recipient="r:1", seq=3) if sealed else P.encode(msg)
    o = P.open_frames(frames, max_bytes=1 << 20)
    assert (o.kind, o.src, o.gen) == (msg.__struct_config__.tag, msg.src, msg.gen)
    assert P.decode_body(o.body) == msg
    assert (o.seal is not None) == sealed
    if sealed:
        assert o.seal is not None and P.verify_seal(o.seal, key=b"k" * 32, recipient="r:1")


def test_a_body_that_does_not_start_as_a_message_is_refused_unread() -> None:
    for body in (b"", b"\x80", b"\x91\xa4kind", b"\x83\xa3src\xa1a", b"\x83\xa4kind\xc1",
                 b"\x83\xa4kind\xa1x\xa3src\xa1a\xa3gen\xc0",
                 b"\x83\xa4kind\xdb\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            P.open_frames([P.HEADER, body], max_bytes=1 << 20)


def test_a_sealed_garbage_body_opens_and_fails_only_when_decoded() -> None:
    """What the agent's check relies on: a frame whose body is garbage after its sender opens
    (the seal can be checked); only decoding it raises."""
    frames = hostile.sealed_garbage("127.0.0.1:9", 77)
    o = P.open_frames(frames, max_bytes=1 << 20)
    assert (o.kind, o.src, o.gen) == ("heartbeat", "127.0.0.1:9", 77)
    assert o.seal is not None and not P.verify_seal(o.seal, key=b"k" * 32, recipient="x")
    with pytest.raises(ProtocolError):
        P.decode_body(o.body)


HELLOS: list[P.Hello | P.HelloReject] = [
    P.Hello(src="127.0.0.1:5", gen=-3, agent_id="a", role="decode", transport="ucx",
            transport_address=b"worker-address", layout={}, layout_hash="h",
            buffers=[P.BufferDesc(region="kv", layer=0, nbytes=8, descriptor=b"rkey")],
            nonce=b"n" * 16),
    P.HelloAck(src="[::1]:9", gen=2**62 - 1, agent_id="b", role="prefill", transport="ucx",
               transport_address=b"w", layout={}, layout_hash="h", buffers=[],
               nonce=b"m" * 16, echo=b"n" * 16),
    P.HelloReject(src="a:1", gen=1, reason="layout", diff=["x"], echo=b"e" * 16),
]
KEY = P.hello_key(b"secret")


@pytest.mark.parametrize("msg", HELLOS, ids=lambda m: type(m).__name__)
def test_a_sealed_handshake_opens_for_its_recipient_only(msg: P.Hello | P.HelloReject) -> None:
    """`seal_hello` / `open_hello`: the envelope says kind, sender, generation and nonces;
    the body opens under the handshake key for the recipient it was sealed for, to the
    message; under another key or for another recipient it does not open."""
    frames = P.seal_hello(msg, key=KEY, recipient="r:1", iv=bytes(12))
    assert frames[0] == P.HELLO_SEALED_HEADER
    o = P.open_frames(frames, max_bytes=1 << 20)
    assert (o.kind, o.src, o.gen) == P.peek(P.encode(msg)[1]) and o.hello is not None
    body = P.open_hello(o, key=KEY, recipient="r:1")
    assert body is not None
    back = P.decode_body(body)
    assert back == msg and P.envelope_matches(back, o.hello)
    assert P.open_hello(o, key=KEY, recipient="r:2") is None
    assert P.open_hello(o, key=P.hello_key(b"other"), recipient="r:1") is None
    assert P.hello_key(b"secret") != P.session_key(b"secret", initiator=("a", 1, b""),
                                                   responder=("b", 2, b""))
    with pytest.raises(ProtocolError, match="sealed handshake"):
        P.decode(frames, max_bytes=1 << 20)  # never decoded without being opened


def test_a_sealed_handshakes_envelope_is_authenticated_and_bounded() -> None:
    """A changed envelope byte (its generation, its nonce) fails the tag; a truncated
    envelope, an unknown kind or a body over HELLO_MAX_BYTES is a ProtocolError before any
    cryptography."""
    head, body = P.seal_hello(HELLOS[0], key=KEY, recipient="r:1", iv=bytes(12))
    flipped = bytearray(body)
    flipped[5] ^= 1  # inside the generation
    o = P.open_frames([head, bytes(flipped)], max_bytes=1 << 20)
    assert P.open_hello(o, key=KEY, recipient="r:1") is None
    for bad in (body[:10], bytes([9]) + body[1:]):
        with pytest.raises(ProtocolError):
            P.open_frames([head, bad], max_bytes=1 << 20)
    big = body[:len(body) - len(P.encode(HELLOS[0])[1]) - 16] + bytes(P.HELLO_MAX_BYTES + 17)
    with pytest.raises(ProtocolError, match="exceeds"):
        P.open_frames([head, big], max_bytes=1 << 24)


def test_a_sealed_handshake_is_bounded_by_max_message_bytes_when_that_is_smaller() -> None:
    """An agent configured with a max_message_bytes below HELLO_MAX_BYTES decrypts no sealed
    handshake larger than it: the same bound as an unsealed message's body."""
    head, body = P.seal_hello(HELLOS[0], key=KEY, recipient="r:1", iv=bytes(12))
    size = len(P.encode(HELLOS[0])[1])
    assert P.open_hello(P.open_frames([head, body], max_bytes=size), key=KEY,
                        recipient="r:1") is not None  # at the edge: opens
    with pytest.raises(ProtocolError, match=f"exceeds a handshake message's bound of {size - 1}"):
        P.open_frames([head, body], max_bytes=size - 1)


def test_the_frame_limit_takes_the_largest_sealed_handshake_at_the_edge() -> None:
    """A Hello whose body is exactly `max_message_bytes`, sealed with the longest sender and
    nonces an envelope carries, makes a frame that fits `frame_limit` (the control sockets'
    MAXMSGSIZE and the local lane's bound) to the byte, and opens there; the limit is the
    wire's own largest overhead, above a sealed message's seq and MAC (40 bytes, the old
    allowance, which dropped this frame)."""
    base = P.HelloAck(src="a" * 1024, gen=1, agent_id="x", role="prefill", transport="tcp",
                      transport_address=b"", layout={}, layout_hash="h", buffers=[],
                      nonce=b"m" * 64, echo=b"n" * 64)
    limit = 4096
    pad = limit - len(P.encode(base)[1])
    msg = msgspec.structs.replace(base, transport_address=b"w" * pad)
    msg = msgspec.structs.replace(
        base, transport_address=b"w" * (pad - (len(P.encode(msg)[1]) - limit)))
    assert len(P.encode(msg)[1]) == limit
    head, body = P.seal_hello(msg, key=KEY, recipient="r:1", iv=bytes(12))
    assert len(body) == limit + P.HELLO_SEAL_BYTES == P.frame_limit(limit)
    assert len(body) > limit + P.SEAL_BYTES
    assert P.FRAME_OVERHEAD_MAX >= P.SEAL_BYTES
    o = P.open_frames([head, body], max_bytes=limit)
    opened = P.open_hello(o, key=KEY, recipient="r:1")
    assert opened is not None and P.decode_body(opened) == msg
