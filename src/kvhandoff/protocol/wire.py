"""The control protocol between transfer agents: versioned msgpack structs, never pickle.

Rules:
- A message on the wire is two ZMQ frames: a 4-byte header ``b"KVH" + version`` and a msgpack
  body, a msgspec tagged union (field ``kind``). The header is checked before the body is
  decoded, so a peer of another protocol version gets a `Reject` naming both versions instead of
  a confusing decode error.
- `decode` raises `ProtocolError` for anything unexpected (truncated, oversized, unknown kind,
  wrong field types); the agent answers with `Reject` and keeps serving.
- Every message names its sender (`src`, the sender's control address) and the sender's
  `gen` (a nonce per process start), so a restarted peer's stale messages are recognised.
- Rooms are 63-bit ids chosen by the bootstrap server / router; data tags use a small per-decode
  `xfer` id instead (see `data_tag`), because transport tags are limited to 40 bits.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvhandoff.errors import ProtocolError

PROTOCOL_VERSION = 1
HEADER = b"KVH" + bytes([PROTOCOL_VERSION])

XFER_BITS = 24
LAYER_BITS = 10
REGION_BITS = 4
ATTEMPT_BITS = 2


def data_tag(xfer: int, layer: int, region: int, attempt: int) -> int:
    """The transport tag of one (transfer, layer, region, attempt); < 2**40."""
    if not (0 <= layer < 1 << LAYER_BITS and 0 <= region < 1 << REGION_BITS
            and 0 <= attempt < 1 << ATTEMPT_BITS):
        raise ProtocolError(f"data tag out of range: layer={layer} region={region} "
                            f"attempt={attempt}")
    x = xfer % (1 << XFER_BITS)
    return (((x << LAYER_BITS | layer) << REGION_BITS | region) << ATTEMPT_BITS) | attempt


def split_tag(tag: int) -> tuple[int, int, int, int]:
    """(xfer mod 2**24, layer, region index, attempt) of a `data_tag`."""
    attempt = tag & ((1 << ATTEMPT_BITS) - 1)
    tag >>= ATTEMPT_BITS
    region = tag & ((1 << REGION_BITS) - 1)
    tag >>= REGION_BITS
    layer = tag & ((1 << LAYER_BITS) - 1)
    return tag >> LAYER_BITS, layer, region, attempt


class _Msg(msgspec.Struct, tag_field="kind", forbid_unknown_fields=False, frozen=True):
    src: str  # the sender's control address (host:port)
    gen: int  # the sender's generation (a nonce per process start)


class BufferDesc(msgspec.Struct, frozen=True):
    region: str
    layer: int
    nbytes: int
    # one-sided writes: the decode's transport descriptor of this buffer (Transport.describe),
    # b"" when it offers none (the prefill then sends two-sided)
    descriptor: bytes = b""


class Hello(_Msg, tag="hello", frozen=True):
    agent_id: str
    role: str
    transport: str
    transport_address: bytes
    layout: dict[str, object]
    layout_hash: str
    buffers: list[BufferDesc]
    mac: bytes = b""  # HMAC-SHA256 of the body with mac=b"" when a shared secret is set
    # where the agent's KV buffers live: "host" or "cuda" (`BufferSet.memory`); it decides
    # the room's checksum algorithm (`handshake.checksum_alg`). Absent (an older peer): host.
    memory: str = "host"
    # the sender's checksum mode (`Settings.checksum`: "full", "sampled" or "off"); a decode
    # refuses a prefill that sums fewer layers than it verifies (`handshake.checksum_problem`).
    # Absent (an older peer): unknown, checked per layer as its sums come.
    checksum: str = ""


class HelloAck(Hello, tag="hello_ack", frozen=True):
    pass


class HelloReject(_Msg, tag="hello_reject", frozen=True):
    reason: str
    diff: list[str] = []


class Digest(msgspec.Struct, frozen=True):
    """Hashes of prompt token ids (`kv_layout.PromptDigest` on the wire): one chained 8-byte
    hash per page of `page_size` tokens, concatenated in `pages`, and one of the whole
    sequence."""

    page_size: int
    num_tokens: int
    pages: bytes
    whole: bytes


class TransferRequest(_Msg, tag="transfer_request", frozen=True):
    room: int
    xfer: int
    peer_gen: int  # the prefill generation this request is for
    seq_len: int
    decode_prefix_len: int  # page-aligned down by the sender of the request
    page_size: int
    dst_pages: dict[str, list[int]]  # per region; suffix-only regions list suffix pages only
    lease_s: float
    planes: dict[str, list[str]] | None = None  # per region, the planes wanted from this peer
    # admission (issue 17), checked by the prefill before any byte moves:
    allocation_policy: str = ""  # the decode's policy: early | prefill_complete ("": none)
    reserved_pages: dict[str, int] | None = None  # early: pages reserved per region (new ones)
    free_pages: int | None = None  # prefill_complete: the decode's free pages when it asks
    prompt: Digest | None = None  # the decode's digest of the prompt token ids
    cached_prefix: Digest | None = None  # ... and of its page-aligned cached prefix


class TraceContext(msgspec.Struct, frozen=True):
    """The prefill room span's trace context (W3C Trace Context: ``traceparent``, whose own
    first field is its format version, and ``tracestate``), so the decode's spans of the room
    join the prefill's trace (`runtime.tracing`)."""

    v: int  # 1
    traceparent: str
    tracestate: str = ""


class TransferAccepted(_Msg, tag="transfer_accepted", frozen=True):
    room: int
    page_size: int
    src_pages: dict[str, list[int]]  # per region, same convention as dst_pages
    chunk_end: int = -1  # chunked prefill: the tokens src_pages cover so far (-1: seq_len)
    # the prefill writes straight into the decode's pages (the descriptors of its Hello): the
    # decode posts no receives; a layer's bytes have landed when its LayerDone comes
    one_sided: bool = False
    # set by a prefill that traces the room (the otel extra); an older peer sends none and
    # ignores it (unknown fields are skipped)
    trace: TraceContext | None = None
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class Failed(_Msg, tag="failed", frozen=True):
    room: int
    reason: str
    failure_kind: str = ""  # the sender's FailureKind value ("" from older peers)
    # False: a one-sided writer whose writes into this room are not known to have stopped
    # (its cancel has not confirmed, or failed): the decode keeps the pages until an AbortAck
    # says they stopped, or write_quarantine_s
    writes_stopped: bool = True
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class RegionDone(msgspec.Struct, frozen=True):
    region: str
    nbytes: int
    checksum: int | None  # xxh3-64; None when checksums are off or the layer is not sampled
    # One-sided writes the writer verified (same host, shm's mapped lane): `landed` is the
    # xxh3-64 of the destination pieces it read back right after writing them and `plan` the
    # digest of the span plan it wrote by (`SpanPlan.digest`). The decode then checks
    # landed == checksum and plan == its own plan's digest instead of reading the bytes again.
    # None (absent: an older peer, or a write the writer could not read back): the decode
    # hashes what landed.
    landed: int | None = None
    plan: int | None = None


class LayerInfo(msgspec.Struct, frozen=True):
    layer: int
    attempt: int
    regions: list[RegionDone]
    chunk: int = 0  # chunked prefill: the chunk of the room (0: the first / the only one)


class LayerDone(_Msg, tag="layer_done", frozen=True):
    room: int
    layers: list[LayerInfo]  # several layers in one message when they finish together
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class LayerNack(_Msg, tag="layer_nack", frozen=True):
    room: int
    layer: int
    attempt: int  # the attempt that failed verification
    reason: str
    chunk: int = 0  # chunked prefill: the chunk of the room


class RoomAck(_Msg, tag="room_ack", frozen=True):
    room: int


class Abort(_Msg, tag="abort", frozen=True):
    room: int
    reason: str
    failure_kind: str = ""  # "aborted", or why the sender's agent gave the room up
    writes_stopped: bool = True  # as in `Failed`
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    room: int
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class ChunkAdded(_Msg, tag="chunk_added", frozen=True):
    """Prefill -> decode: the next chunk of a chunked prefill (its source pages, appended to
    the ones sent so far, same convention as `TransferAccepted.src_pages`)."""

    room: int
    chunk: int  # 1, 2, ... (chunk 0 is the TransferAccepted)
    chunk_end: int  # the tokens covered after this chunk (the room's seq_len: the last one)
    src_pages: dict[str, list[int]]
    # which use of the room this answers (issue 35): the `xfer` of the TransferRequest it is
    # about; 0: none known (an older peer, or a prefill that never saw a request)
    xfer: int = 0


class ChunkAccepted(_Msg, tag="chunk_accepted", frozen=True):
    """Decode -> prefill: the receives of `chunk` are posted under the transfer id `xfer`."""

    room: int
    chunk: int
    xfer: int


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    rooms: list[int]  # rooms with the receiver of this heartbeat: renews their leases


class Reject(_Msg, tag="reject", frozen=True):
    reason: str


Message = (
    Hello | HelloAck | HelloReject | TransferRequest | TransferAccepted | Failed | LayerDone
    | LayerNack | RoomAck | Abort | AbortAck | Heartbeat | Reject | ChunkAdded | ChunkAccepted
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    """The two frames of `msg`."""
    return [HEADER, _ENCODER.encode(msg)]


def decode(frames: list[bytes], *, max_bytes: int) -> Message:
    """The message in `frames`; `ProtocolError` for anything else."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (header, body), got {len(frames)}")
    header, body = bytes(frames[0]), frames[1]
    if len(header) != 4 or header[:3] != b"KVH":
        raise ProtocolError(f"not a kvhandoff message (header {header[:8]!r})")
    if header[3] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {header[3]} not supported (this agent speaks {PROTOCOL_VERSION})"
        )
    if len(body) > max_bytes:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}")
    try:
        msg: Message = _DECODER.decode(body)
        return msg
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message: {e}") from e


def _hello_body(msg: Hello) -> bytes:
    """The bytes a Hello's mac covers: the message with an empty mac, encoded as a map in
    field order. `memory` is left out when it is "host" (its default), so the body of a host
    agent's Hello is byte for byte what a peer that predates the field signs and checks; a
    "cuda" Hello carries it (an older peer's check then fails: it cannot hand off device
    memory anyway). `checksum` is left out when "" or "full" (its default) for the same
    reason."""
    m = msgspec.to_builtins(msgspec.structs.replace(msg, mac=b""), builtin_types=(bytes,))
    if m.get("memory") == "host":
        del m["memory"]
    if m.get("checksum") in ("", "full"):
        del m["checksum"]
    return _ENCODER.encode(m)


def sign_hello(msg: Hello, secret: bytes) -> Hello:
    """`msg` with its `mac` set (HMAC-SHA256 over the body with an empty mac)."""
    body = _hello_body(msg)
    return msgspec.structs.replace(msg, mac=hmac.new(secret, body, hashlib.sha256).digest())


def verify_hello(msg: Hello, secret: bytes) -> bool:
    """Whether `msg.mac` authenticates it with `secret` (constant-time compare)."""
    body = _hello_body(msg)
    want = hmac.new(secret, body, hashlib.sha256).digest()
    return hmac.compare_digest(want, msg.mac)
