"""`wire.open_frames` / `wire.peek`: a frame's sender and seal read without decoding its body
(issue 48: the seal is checked over the raw bytes before anything is decoded)."""

from __future__ import annotations

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
