"""The control protocol: every message round-trips; anything else is a ProtocolError.

Also the Hello HMAC and the bounds of `data_tag` (transport tags are limited to 40 bits).
"""

from __future__ import annotations

import itertools

import msgspec
import pytest

from kvhandoff.errors import ProtocolError
from kvhandoff.kv_layout import layout_hash, preset
from kvhandoff.protocol import wire as P
from kvhandoff.transports.base import TAG_LIMIT

MAX = 1 << 20
ADDR, GEN = "127.0.0.1:5555", (1 << 62) - 1
LAYOUT = preset("glm-5.3")


def _hello(cls: type[P.Hello] = P.Hello) -> P.Hello:
    return cls(src=ADDR, gen=GEN, agent_id="prefill-0a1b", role="prefill", transport="ucx",
               transport_address=bytes(range(256)) * 3, layout=LAYOUT.to_dict(),
               layout_hash=layout_hash(LAYOUT),
               buffers=[P.BufferDesc(region="main_kv", layer=0, nbytes=41_984 * 9),
                        P.BufferDesc(region="indexer_k", layer=77, nbytes=8_448 * 9)])


# One instance of every message kind, with non-default values in every field.
SAMPLES: list[P.Message] = [
    _hello(),
    _hello(P.HelloAck),
    P.HelloReject(src=ADDR, gen=GEN, reason="layout mismatch",
                  diff=["indexer_k.layer_ids: prefill=[0, 4] decode=[0, 2]"]),
    P.TransferRequest(src=ADDR, gen=GEN, room=(1 << 63) - 1, xfer=7, peer_gen=12345, seq_len=4096,
                      decode_prefix_len=1024, page_size=32,
                      dst_pages={"main_kv": [5, 3, 9], "indexer_k": [9]}, lease_s=2.5,
                      planes={"main_kv": ["nope"]}, allocation_policy="early",
                      reserved_pages={"main_kv": 3, "indexer_k": 1}, free_pages=17,
                      prompt=P.Digest(page_size=32, num_tokens=40, pages=b"\x01" * 16,
                                      whole=b"\x02" * 16),
                      cached_prefix=P.Digest(page_size=32, num_tokens=32, pages=b"\x01" * 8,
                                             whole=b"\x03" * 16)),
    P.TransferAccepted(src=ADDR, gen=GEN, room=42, page_size=64,
                       src_pages={"main_kv": [1, 0], "indexer_k": [0]}, xfer=7),
    P.Failed(src=ADDR, gen=GEN, room=42, reason="checksum mismatch on layer 3, region 'main_kv'",
             xfer=7),
    P.LayerDone(src=ADDR, gen=GEN, room=42, layers=[
        P.LayerInfo(layer=0, attempt=0, regions=[
            P.RegionDone(region="main_kv", nbytes=1000, checksum=(1 << 64) - 1),
            P.RegionDone(region="indexer_k", nbytes=200, checksum=None)]),
        P.LayerInfo(layer=1, attempt=1, regions=[
            P.RegionDone(region="main_kv", nbytes=1000, checksum=0)]),
        P.LayerInfo(layer=2, attempt=0, regions=[  # verified by the writer (shm map lane)
            P.RegionDone(region="main_kv", nbytes=1000, checksum=7, landed=7,
                         plan=(1 << 64) - 2)])], xfer=7),
    P.LayerNack(src=ADDR, gen=GEN, room=42, layer=5, attempt=0,
                reason="checksum mismatch in main_kv"),
    P.RoomAck(src=ADDR, gen=GEN, room=42),
    P.Abort(src=ADDR, gen=GEN, room=42, reason="decode aborted the request", xfer=7),
    P.AbortAck(src=ADDR, gen=GEN, room=42, xfer=7),
    P.Heartbeat(src=ADDR, gen=GEN, rooms=[1, 2, (1 << 63) - 1]),
    P.Hold(src=ADDR, gen=GEN, rooms=[7, (1 << 63) - 1], hold_s=2.0),
    P.Reject(src=ADDR, gen=GEN, reason="protocol version 2 not supported"),
    P.ChunkAdded(src=ADDR, gen=GEN, room=42, chunk=2, chunk_end=12_288,
                 src_pages={"main_kv": [7, 8], "indexer_k": []}, xfer=7),
    P.ChunkAccepted(src=ADDR, gen=GEN, room=42, chunk=2, xfer=(1 << 24) + 3),
]


def test_samples_cover_every_message_kind() -> None:
    kinds = set(P.Message.__args__)
    assert {type(m) for m in SAMPLES} == kinds


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    frames = P.encode(msg)
    assert frames[0] == b"KVH\x01" == P.HEADER
    back = P.decode(frames, max_bytes=MAX)
    assert type(back) is type(msg)
    assert back == msg
    # the body is plain msgpack with the kind tag (no pickle, readable by any peer)
    raw = msgspec.msgpack.decode(frames[1])
    assert isinstance(raw, dict) and raw["kind"] == type(msg).__struct_config__.tag


def test_hello_and_hello_ack_stay_distinct() -> None:
    back = P.decode(P.encode(_hello(P.HelloAck)), max_bytes=MAX)
    assert isinstance(back, P.HelloAck)
    back = P.decode(P.encode(_hello()), max_bytes=MAX)
    assert type(back) is P.Hello


def _body(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


GOOD = P.encode(P.RoomAck(src=ADDR, gen=GEN, room=3))


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([GOOD[0], GOOD[1][:-3]], "malformed"),  # truncated body
        ([GOOD[0], b""], "malformed"),  # empty body
        ([b"KV", GOOD[1]], "not a kvhandoff message"),  # truncated header
        ([b"XYZ\x01", GOOD[1]], "not a kvhandoff message"),  # wrong magic
        ([b"KVH\x02", GOOD[1]], "protocol version 2"),  # other version
        ([b"KVH\x00", GOOD[1]], "protocol version 0"),
        ([GOOD[0]], "expected 2 frames"),
        ([GOOD[0], GOOD[1], b"extra"], "expected 2 frames"),
        ([GOOD[0], _body(kind="teleport", src="a", gen=1, room=3)], "malformed"),  # unknown kind
        ([GOOD[0], _body(src="a", gen=1, room=3)], "malformed"),  # no kind at all
        ([GOOD[0], _body(kind="room_ack", src="a", gen=1, room="three")], "malformed"),
        ([GOOD[0], _body(kind="room_ack", src="a", gen=1)], "malformed"),  # missing field
        ([GOOD[0], _body(kind="heartbeat", src="a", gen=1, rooms=["x"])], "malformed"),
        ([GOOD[0], _body(kind="layer_done", src="a", gen=1, room=1,
                         layers=[{"layer": "0", "attempt": 0, "regions": []}])], "malformed"),
        ([GOOD[0], msgspec.msgpack.encode([1, 2, 3])], "malformed"),  # not a map
        ([GOOD[0], b"\x80\x04\x95"], "malformed"),  # a pickle opcode prefix is just garbage
    ],
    ids=["truncated", "empty", "short-header", "wrong-magic", "version-2", "version-0",
         "one-frame", "three-frames", "unknown-kind", "no-kind", "wrong-type", "missing-field",
         "wrong-list-type", "wrong-nested-type", "not-a-map", "pickle-bytes"],
)
def test_rejects_bad_frames(frames: list[bytes], needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        P.decode(frames, max_bytes=MAX)


def test_rejects_oversized_body_before_decoding() -> None:
    msg = P.Heartbeat(src=ADDR, gen=GEN, rooms=list(range(1000)))
    frames = P.encode(msg)
    assert P.decode(frames, max_bytes=len(frames[1])) == msg  # exactly at the limit: fine
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        P.decode(frames, max_bytes=len(frames[1]) - 1)


def test_a_layer_done_without_the_writers_read_back_decodes_as_unverified() -> None:
    # an older prefill sends no landed / plan: the decode then hashes what landed itself
    body = _body(kind="layer_done", src="a", gen=1, room=3, layers=[
        {"layer": 0, "attempt": 0, "regions": [{"region": "main_kv", "nbytes": 8,
                                                "checksum": 5}]}])
    msg = P.decode([P.HEADER, body], max_bytes=MAX)
    assert isinstance(msg, P.LayerDone)
    done = msg.layers[0].regions[0]
    assert (done.checksum, done.landed, done.plan) == (5, None, None)


@pytest.mark.parametrize("kind", ["transfer_accepted", "failed", "layer_done", "abort",
                                  "abort_ack", "chunk_added"])
def test_a_room_message_of_an_older_peer_names_no_request(kind: str) -> None:
    # an older peer sends no `xfer`: 0, which a decode never takes as its request's word
    sample = next(m for m in SAMPLES if type(m).__struct_config__.tag == kind)
    raw = msgspec.msgpack.decode(P.encode(sample)[1])
    del raw["xfer"]
    back = P.decode([P.HEADER, msgspec.msgpack.encode(raw)], max_bytes=MAX)
    assert back == msgspec.structs.replace(sample, xfer=0)


def test_unknown_extra_fields_are_tolerated() -> None:
    # a newer peer of the same protocol version may add optional fields
    body = _body(kind="room_ack", src="a", gen=1, room=3, hint="new")
    assert P.decode([P.HEADER, body], max_bytes=MAX) == P.RoomAck(src="a", gen=1, room=3)


# ---------------------------------------------------------------------------- HMAC


TO = "127.0.0.1:7"  # the Hello's recipient


def test_hmac_sign_and_verify() -> None:
    secret = b"s3cret"
    signed = P.sign_hello(_hello(), secret, recipient=TO)
    assert len(signed.mac) == 32
    assert P.verify_hello(signed, secret, recipient=TO)
    # the MAC survives the wire
    back = P.decode(P.encode(signed), max_bytes=MAX)
    assert isinstance(back, P.Hello) and P.verify_hello(back, secret, recipient=TO)


def test_hmac_rejects_wrong_secret_tampering_unsigned_and_another_recipient() -> None:
    secret = b"s3cret"
    signed = P.sign_hello(_hello(), secret, recipient=TO)
    assert not P.verify_hello(signed, b"other", recipient=TO)
    assert not P.verify_hello(_hello(), secret, recipient=TO)  # no MAC at all
    # said to one agent, it does not verify at another (no replay to a third agent)
    assert not P.verify_hello(signed, secret, recipient="127.0.0.1:8")
    for field, value in [("layout_hash", "0" * 64), ("transport_address", b"elsewhere"),
                         ("gen", 2), ("role", "decode")]:
        tampered = msgspec.structs.replace(signed, **{field: value})
        assert not P.verify_hello(tampered, secret, recipient=TO), field
    # HelloAck is signed over its own kind: a Hello's MAC does not authenticate an ack
    as_ack = P.HelloAck(**{f: getattr(signed, f) for f in signed.__struct_fields__})
    assert not P.verify_hello(as_ack, secret, recipient=TO)


# ---------------------------------------------------------------------------- data_tag

MAX_XFER = (1 << P.XFER_BITS) - 1
MAX_LAYER = (1 << P.LAYER_BITS) - 1
MAX_REGION = (1 << P.REGION_BITS) - 1
MAX_ATTEMPT = (1 << P.ATTEMPT_BITS) - 1


def test_data_tag_fits_the_transport_limit() -> None:
    assert P.XFER_BITS + P.LAYER_BITS + P.REGION_BITS + P.ATTEMPT_BITS == 40
    assert P.data_tag(0, 0, 0, 0) == 0
    top = P.data_tag(MAX_XFER, MAX_LAYER, MAX_REGION, MAX_ATTEMPT)
    assert top == TAG_LIMIT - 1


def test_data_tag_is_injective_within_bounds() -> None:
    xs, layers, regions, attempts = [0, 1, MAX_XFER], [0, 1, 77, MAX_LAYER], [0, 1, MAX_REGION], \
        [0, 1, MAX_ATTEMPT]
    tags = [P.data_tag(*t) for t in itertools.product(xs, layers, regions, attempts)]
    assert len(set(tags)) == len(tags)
    assert all(0 <= t < TAG_LIMIT for t in tags)


def test_data_tag_wraps_the_transfer_id() -> None:
    assert P.data_tag(MAX_XFER + 1, 3, 1, 0) == P.data_tag(0, 3, 1, 0)
    assert P.data_tag(MAX_XFER + 5, 3, 1, 0) == P.data_tag(4, 3, 1, 0)


@pytest.mark.parametrize(
    ("layer", "region", "attempt"),
    [(MAX_LAYER + 1, 0, 0), (-1, 0, 0), (0, MAX_REGION + 1, 0), (0, -1, 0),
     (0, 0, MAX_ATTEMPT + 1), (0, 0, -1)],
)
def test_data_tag_rejects_out_of_range(layer: int, region: int, attempt: int) -> None:
    with pytest.raises(ProtocolError, match="data tag out of range"):
        P.data_tag(1, layer, region, attempt)
