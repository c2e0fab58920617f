"""The control protocol between transfer agents: versioned msgpack structs, never pickle.

Rules:
- A message on the wire is two ZMQ frames: a 4-byte header ``b"KVH" + version`` and a msgpack
  body, a msgspec tagged union (field ``kind``). The header is checked before the body is
  decoded, so a peer of another protocol version gets a `Reject` naming both versions instead of
  a confusing decode error.
- `decode` raises `ProtocolError` for anything unexpected (truncated, oversized, unknown kind,
  wrong field types); the agent counts it and keeps serving.
- Every field is typed, so what a frame can make the decoder build is bounded by the types, not
  by the sender: no field takes an arbitrary msgpack value (a Hello's layout is a map of at
  most three levels of scalars and lists, `LayoutMap`), so nesting is bounded (a frame of ten
  thousand nested maps is a `ProtocolError` at the first level the type does not allow), and
  the body's size (``max_message_bytes``, checked before decoding) bounds every string, list
  and map.
- Every message names its sender (`src`, the sender's control address) and the sender's
  `gen` (a nonce per process start), so a restarted peer's stale messages are recognised.
- With a shared secret (``hmac_secret``) every message is authenticated. A Hello / HelloAck
  carries a fresh random `nonce` and an HMAC under the secret over its recipient's address and
  its body (`sign_hello`: said to one agent, it does not verify at another); the HelloAck
  echoes the Hello's nonce (`echo`), so it cannot be replayed to the agent that said Hello, and
  a HelloReject echoes the nonce of the Hello it refuses (it is MAC'd too). Both nonces and both
  (address, generation) pairs derive a per-session key (`session_key`: HKDF-SHA256, RFC 5869).
  Every other message is *sealed* under that key (`seal`): header ``b"KVA" + version``, then
  the msgpack body followed by an 8-byte sequence number and an HMAC-SHA256 over the header,
  the recipient's address, the sequence number and the body. The receiver refuses a seal that
  does not verify, and a sequence number not above the last one it took (replays, reordering).
  Sender and generation are in the body (`src`, `gen`) and must match the session's.
- With a shared secret the handshake messages (Hello, HelloAck, HelloReject) also travel
  *sealed over their bytes* (`seal_hello`): header ``b"KVE" + version``, then a clear envelope
  (the kind, the sender's address and generation, the handshake nonce and echo: what a refusal
  needs to answer, nothing else), a 12-byte random GCM nonce and the message's msgpack body
  encrypted with AES-256-GCM under `hello_key` (HKDF of the secret with its own label), the
  envelope and the recipient's address as associated data. `open_hello` checks the tag before
  anything is decoded, so a stranger's handshake frame costs one GCM pass and never a decode,
  and the body (layout, transport address, buffer descriptors: RDMA remote keys, UCX/NIXL
  worker addresses) is readable by holders of the secret only. The MAC inside (`sign_hello`)
  stays: the session authenticates what it is handed, however it came.
- Rooms are 63-bit ids chosen by the bootstrap server / router; data tags use a small per-decode
  `xfer` id instead (see `data_tag`), because transport tags are limited to 40 bits.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from msgspec import Meta

from kvhandoff.errors import ProtocolError

PROTOCOL_VERSION = 1
HEADER = b"KVH" + bytes([PROTOCOL_VERSION])
SEALED_HEADER = b"KVA" + bytes([PROTOCOL_VERSION])  # body + seq + HMAC (see `seal`)
HELLO_SEALED_HEADER = b"KVE" + bytes([PROTOCOL_VERSION])  # a sealed handshake (`seal_hello`)
NONCE_BYTES = 16
_SEQ = 8
_MAC = 32
SEAL_BYTES = _SEQ + _MAC

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


# A Hello's layout (`LayoutSpec.to_dict`): a map whose values are scalars or lists of scalars
# and maps (regions, rows), whose values are scalars or lists of scalars and maps (planes), whose
# values are scalars. Three levels, few keys, short lists: deeper or larger is not a layout.
_Key = Annotated[str, Meta(max_length=256)]
_Scalar = _Key | int | float | bool | None
_PlaneMap = Annotated[dict[_Key, _Scalar], Meta(max_length=64)]
_RegionMap = Annotated[dict[_Key, _Scalar | Annotated[list[_Scalar | _PlaneMap],
                                                      Meta(max_length=4096)]],
                       Meta(max_length=64)]
LayoutMap = Annotated[dict[_Key, _Scalar | Annotated[list[_Scalar | _RegionMap],
                                                     Meta(max_length=4096)]],
                      Meta(max_length=64)]


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
    layout: LayoutMap  # LayoutSpec.to_dict()
    layout_hash: str
    buffers: list[BufferDesc]
    mac: bytes = b""  # HMAC-SHA256 of the body with mac=b"" when a shared secret is set
    # where the agent's KV buffers live: "host" or "cuda" (`BufferSet.memory`); it decides
    # the room's checksum algorithm (`checksums.checksum_alg`). Absent (an older peer): host.
    memory: str = "host"
    # the sender's checksum mode (`Settings.checksum`: "full", "sampled" or "off"); a decode
    # refuses a prefill that sums fewer layers than it verifies (`checksums.checksum_problem`).
    # Absent (an older peer): unknown, checked per layer as its sums come.
    checksum: str = ""
    # a fresh random value per Hello said (with a shared secret: it keys the session and a
    # HelloAck / HelloReject must echo it); `echo`: in a HelloAck, the nonce of the Hello it
    # answers. Absent (an older peer, or an agent without a secret): b"".
    nonce: bytes = b""
    echo: bytes = b""
    # the sender's heartbeat interval (`Settings.heartbeat_interval_s`): its peers measure its
    # silence against the longer of theirs and this, so two agents set differently do not
    # take each other's quieter beat for death. Absent (an older peer): 0, the receiver's own.
    heartbeat_s: float = 0.0
    # the sender's `stall_timeout_s`: its bound on stopping a cancelled copy, which a decode's
    # write quarantine must outlast (`lifecycle.write_quarantine`). Absent: the receiver's own.
    stall_s: float = 0.0


class HelloAck(Hello, tag="hello_ack", frozen=True):
    pass


class HelloReject(_Msg, tag="hello_reject", frozen=True):
    reason: str
    diff: list[str] = []
    echo: bytes = b""  # the nonce of the Hello (or HelloAck) refused
    mac: bytes = b""  # HMAC-SHA256 of the body with mac=b"", when the sender has a secret


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
    # how many decode ranks read this room from the prefill rank asked (each reader says; a
    # prefill that opened the room without a count takes it from the first; 0: not said)
    readers: int = 0
    # per region, a later token than decode_prefix_len the region's dst_pages start at (a
    # sliding-window region: the decode holds no page before its window; aligned to
    # page_size). None or a region left out: decode_prefix_len. A peer that does not know the
    # field plans those regions from decode_prefix_len and fails the room (too few pages).
    region_starts: dict[str, int] | None = None


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
    # Non-zero: the sender declared the recipient's process of this generation lost (silent,
    # or its recheck unanswered) and dropped its handshake, so every room with it failed
    # there, not this one alone: the news its Reject (`no handshake`) brings once that
    # process talks again, sent ahead with the rooms' own Failed. It names the generation so
    # that a process restarted on the same address, which may read what was sent to the old
    # one, takes it for none of its business. 0: not so (and from older peers).
    dropped_gen: int = 0


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
    # the sender woke from a stall and asks whether the receiver still holds its handshake:
    # answered (`answers` = this) only while it does (0: no question)
    probe: int = 0
    # the `probe` of the receiver's question this heartbeat answers (0: none)
    answers: int = 0


class Hold(_Msg, tag="hold", frozen=True):
    """Decode -> prefill: the decode has requests of these rooms queued and will read them:
    keep each room waiting for it `hold_s` more seconds past its bootstrap bound (renewed at
    every heartbeat while queued; a hold not renewed lapses)."""

    rooms: list[int]
    hold_s: float


class Reject(_Msg, tag="reject", frozen=True):
    reason: str


Message = (
    Hello | HelloAck | HelloReject | TransferRequest | TransferAccepted | Failed | LayerDone
    | LayerNack | RoomAck | Abort | AbortAck | Heartbeat | Reject | ChunkAdded | ChunkAccepted
    | Hold
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    """The two frames of `msg`."""
    return [HEADER, _ENCODER.encode(msg)]


class Seal(msgspec.Struct, frozen=True):
    """What authenticates a sealed message (`seal`): its sequence number, its MAC, and the
    bytes the MAC covers but the recipient's address (`signed`: header, seq, body)."""

    seq: int
    mac: bytes
    signed: bytes


def decode(frames: list[bytes], *, max_bytes: int) -> Message:
    """The message in `frames` (sealed or not); `ProtocolError` for anything else."""
    return decode_sealed(frames, max_bytes=max_bytes)[0]


def decode_sealed(frames: list[bytes], *, max_bytes: int) -> tuple[Message, Seal | None]:
    """The message in `frames` and its `Seal` (None: the message is not sealed; whether it
    verifies is the session's to check, it holds the keys); `ProtocolError` for anything
    else."""
    body, seal = _split(frames, max_bytes=max_bytes)
    return decode_body(body), seal


class Envelope(msgspec.Struct, frozen=True):
    """The clear part of a sealed handshake frame (`seal_hello`): its handshake `nonce` and
    `echo` (what a refusal echoes), the GCM nonce `iv` and the associated data `aad` (header
    and envelope; the recipient's address is appended when it is opened)."""

    nonce: bytes
    echo: bytes
    iv: bytes
    aad: bytes


class Opened(msgspec.Struct, frozen=True):
    """A frame set whose header, size and seal were checked and split (`open_frames`), its
    body not decoded: `kind`, `src` and `gen` are read from the body's first three fields
    (`peek`), which is all a receiver needs to choose the key a seal must verify under. A
    sealed handshake frame (`hello` set) has them from its clear envelope and its `body` is
    the ciphertext: `open_hello` gives the body to decode."""

    body: memoryview
    seal: Seal | None
    kind: str
    src: str
    gen: int
    hello: Envelope | None = None


def open_frames(frames: list[bytes], *, max_bytes: int) -> Opened:
    """`frames` checked (two frames, a kvhandoff header of this version, the body within
    `max_bytes`, a seal where the header says so) and split, without decoding the body: its
    cost does not grow with what the body holds (one copy of the signed bytes of a sealed
    frame, for its MAC). `ProtocolError` for anything else."""
    if len(frames) == 2 and bytes(frames[0]) == HELLO_SEALED_HEADER:
        return _open_envelope(memoryview(frames[1]), max_bytes=max_bytes)
    body, seal = _split(frames, max_bytes=max_bytes)
    kind, src, gen = peek(body)
    if seal is None and kind in UNSEALED_KINDS and len(body) > HELLO_MAX_BYTES:
        # decoded before its MAC is checked (the MAC covers the decoded form): what a
        # stranger makes an agent decode is bounded by an honest Hello's size, not by
        # max_message_bytes
        raise ProtocolError(f"{kind} of {len(body)} bytes exceeds a handshake message's bound "
                            f"of {HELLO_MAX_BYTES}")
    return Opened(body=body, seal=seal, kind=kind, src=src, gen=gen)


def _split(frames: list[bytes], *, max_bytes: int) -> tuple[memoryview, Seal | None]:
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (header, body), got {len(frames)}")
    header, body = bytes(frames[0]), memoryview(frames[1])
    if header == HELLO_SEALED_HEADER:
        raise ProtocolError("a sealed handshake message: `open_frames` then `open_hello` it")
    sealed = header == SEALED_HEADER
    if len(header) != 4 or header[:3] not in (b"KVH", b"KVA"):
        raise ProtocolError(f"not a kvhandoff message (header {header[:8]!r})")
    if header[3] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {header[3]} not supported (this agent speaks {PROTOCOL_VERSION})"
        )
    if len(body) > max_bytes + (SEAL_BYTES if sealed else 0):
        raise ProtocolError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}")
    seal = None
    if sealed:
        if len(body) < SEAL_BYTES:
            raise ProtocolError(f"sealed message of {len(body)} bytes: shorter than its seal")
        tail = bytes(body[len(body) - SEAL_BYTES:])
        body = body[:len(body) - SEAL_BYTES]
        seal = Seal(seq=int.from_bytes(tail[:_SEQ], "big"), mac=tail[_SEQ:],
                    signed=header + tail[:_SEQ] + bytes(body))
    return body, seal


def decode_body(body: memoryview | bytes) -> Message:
    """The message a body (`Opened.body`) holds; `ProtocolError` when it holds none."""
    try:
        msg: Message = _DECODER.decode(body)
        return msg
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message: {e}") from e
    except RecursionError as e:  # the types bound nesting; never let it escape regardless
        raise ProtocolError("malformed message: nested too deep") from e


_PEEK_STR_MAX = 1024  # a kind or an address longer than this is no message of ours


def peek(body: memoryview | bytes) -> tuple[str, str, int]:
    """(kind, src, gen) of a message body, read from its first three fields without decoding
    the rest: every message is a map whose first keys are ``kind``, ``src`` and ``gen`` in that
    order (msgspec writes a tagged struct's tag first, then its fields in order, `_Msg`'s
    first). O(1) in the body's size; `ProtocolError` when the body does not start so."""
    b = bytes(body[:3 * (_PEEK_STR_MAX + 16)])
    i = 0

    def need(n: int) -> None:
        if i + n > len(b):
            raise ProtocolError("malformed message: truncated before its sender")

    def string() -> str:
        nonlocal i
        need(1)
        t = b[i]
        if 0xA0 <= t <= 0xBF:
            n, i = t & 0x1F, i + 1
        elif t == 0xD9:
            need(2)
            n, i = b[i + 1], i + 2
        elif t == 0xDA:
            need(3)
            n, i = int.from_bytes(b[i + 1:i + 3], "big"), i + 3
        else:
            raise ProtocolError("malformed message: a string expected before its sender")
        if n > _PEEK_STR_MAX:
            raise ProtocolError(f"malformed message: a string of {n} bytes in its header")
        need(n)
        try:
            out = b[i:i + n].decode()
        except UnicodeDecodeError as e:
            raise ProtocolError("malformed message: its header is not utf-8") from e
        i += n
        return out

    def key(name: str) -> None:
        if string() != name:
            raise ProtocolError(f"malformed message: {name!r} is not where a message has it")

    need(1)
    t = b[0]
    if 0x83 <= t <= 0x8F:
        i = 1
    elif t == 0xDE:
        i = 3
    elif t == 0xDF:
        i = 5
    else:
        raise ProtocolError("malformed message: not a map of at least three fields")
    key("kind")
    kind = string()
    key("src")
    src = string()
    key("gen")
    need(1)
    t = b[i]
    if t <= 0x7F:
        gen = t
    elif t in _INTS:
        n, signed = _INTS[t]
        need(1 + n)
        gen = int.from_bytes(b[i + 1:i + 1 + n], "big", signed=signed)
    elif t >= 0xE0:
        gen = t - 0x100
    else:
        raise ProtocolError("malformed message: its generation is not an integer")
    return kind, src, gen


_INTS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
         0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}
#: the kinds that come unsealed with a shared secret (each carries a MAC of its own)
UNSEALED_KINDS = frozenset({"hello", "hello_ack", "hello_reject"})
#: the largest unsealed handshake message taken (refused before decoding): an honest Hello is
#: about 7 KB for DeepSeek-V3.2's 122 buffers (layout, buffer list, transport address), so
#: 1 MiB leaves room for any layout and a transport's metadata
HELLO_MAX_BYTES = 1 << 20
#: with a shared secret, the largest unsealed HelloReject decoded (the refusal of a handshake
#: that did not authenticate, `BAD_HMAC`, is about 120 bytes): anything larger is refused
#: undecoded
UNSEALED_REJECT_MAX_BYTES = 4096


def _hello_body(msg: Hello) -> bytes:
    """The bytes a Hello's mac covers: the message with an empty mac, encoded as a map in
    field order. `memory` is left out when it is "host" (its default), so the body of a host
    agent's Hello is byte for byte what a peer that predates the field signs and checks; a
    "cuda" Hello carries it (an older peer's check then fails: it cannot hand off device
    memory anyway). `checksum` is left out when "" or "full" (its default) for the same
    reason, and so are `heartbeat_s` and `stall_s` when 0 (not said)."""
    m = msgspec.to_builtins(msgspec.structs.replace(msg, mac=b""), builtin_types=(bytes,))
    if m.get("memory") == "host":
        del m["memory"]
    if m.get("checksum") in ("", "full"):
        del m["checksum"]
    # likewise when empty: nonce and echo (an agent without a secret), heartbeat_s and
    # stall_s (0: not said)
    for name in ("nonce", "echo", "heartbeat_s", "stall_s"):
        if not m.get(name):
            m.pop(name, None)
    return _ENCODER.encode(m)


def _hello_mac(secret: bytes, recipient: str, msg: Hello) -> bytes:
    # the recipient's control address is covered too: a Hello said to one agent does not
    # verify at another (it cannot be replayed to a third agent of the same secret)
    return hmac.new(secret, recipient.encode() + b"\0" + _hello_body(msg),
                    hashlib.sha256).digest()


def sign_hello(msg: Hello, secret: bytes, *, recipient: str) -> Hello:
    """`msg` with its `mac` set: HMAC-SHA256 over `recipient` (the control address it is
    said to) and the body with an empty mac."""
    return msgspec.structs.replace(msg, mac=_hello_mac(secret, recipient, msg))


def verify_hello(msg: Hello, secret: bytes, *, recipient: str) -> bool:
    """Whether `msg.mac` authenticates it with `secret` for `recipient` (this agent's control
    address); constant-time compare."""
    return hmac.compare_digest(_hello_mac(secret, recipient, msg), msg.mac)


def sign_hello_reject(msg: HelloReject, secret: bytes) -> HelloReject:
    """`msg` with its `mac` set (HMAC-SHA256 over the body with an empty mac)."""
    body = _ENCODER.encode(msgspec.structs.replace(msg, mac=b""))
    return msgspec.structs.replace(msg, mac=hmac.new(secret, body, hashlib.sha256).digest())


def verify_hello_reject(msg: HelloReject, secret: bytes) -> bool:
    """Whether `msg.mac` authenticates it with `secret` (constant-time compare)."""
    body = _ENCODER.encode(msgspec.structs.replace(msg, mac=b""))
    return hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).digest(), msg.mac)


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF with SHA-256 (RFC 5869): extract with `salt`, expand with `info` to `length`
    bytes."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def session_key(secret: bytes, *, initiator: tuple[str, int, bytes],
                responder: tuple[str, int, bytes]) -> bytes:
    """The key of the session between the agent that said Hello (`initiator`: its address,
    generation and Hello nonce) and the one that answered (`responder`: the same of its
    HelloAck): both sides compute it from what the handshake carried."""
    (ia, ig, inonce), (ra, rg, rnonce) = initiator, responder
    info = _ENCODER.encode([b"kvhandoff session", PROTOCOL_VERSION, ia, ig, ra, rg])
    return hkdf_sha256(secret, salt=inonce + rnonce, info=info)


def _seal_mac(key: bytes, recipient: str, signed: bytes) -> bytes:
    return hmac.new(key, recipient.encode() + b"\0" + signed, hashlib.sha256).digest()


def seal(msg: Message, *, key: bytes, recipient: str, seq: int) -> list[bytes]:
    """The two frames of `msg` sealed under the session `key` for `recipient` (its control
    address) with sequence number `seq`."""
    body = _ENCODER.encode(msg)
    seq_b = seq.to_bytes(_SEQ, "big")
    return [SEALED_HEADER, body + seq_b + _seal_mac(key, recipient, SEALED_HEADER + seq_b + body)]


def verify_seal(s: Seal, *, key: bytes, recipient: str) -> bool:
    """Whether seal `s` verifies under `key` for `recipient` (this agent's control address);
    constant-time compare."""
    return hmac.compare_digest(_seal_mac(key, recipient, s.signed), s.mac)


# ---------------------------------------------------------------- sealed handshake messages

_HELLO_KINDS = {"hello": 1, "hello_ack": 2, "hello_reject": 3}
_HELLO_KIND_NAMES = {v: k for k, v in _HELLO_KINDS.items()}
_IV = 12  # the GCM nonce
_TAG = 16  # the GCM tag
_ENVELOPE_NONCE_MAX = 64  # a handshake nonce / echo longer than this is no message of ours
#: what a sealed handshake frame adds to its body at most (envelope, GCM nonce and tag)
HELLO_SEAL_BYTES = 1 + 8 + 2 + _PEEK_STR_MAX + 2 * (1 + _ENVELOPE_NONCE_MAX) + _IV + _TAG
#: what any frame adds to its message's body at most (a sealed message's seq and MAC, a sealed
#: handshake's envelope, GCM nonce and tag): a transport's frame limit is the body's limit
#: (max_message_bytes) plus this, so no honest frame within it is dropped as too large
FRAME_OVERHEAD_MAX = max(SEAL_BYTES, HELLO_SEAL_BYTES)


def frame_limit(max_message_bytes: int) -> int:
    """The largest frame body a control socket takes for messages of `max_message_bytes`."""
    return max_message_bytes + FRAME_OVERHEAD_MAX


def hello_key(secret: bytes) -> bytes:
    """The AES-256-GCM key of sealed handshake messages (`seal_hello`): HKDF-SHA256 of the
    shared secret under a label of its own (no other key of kvhandoff is derived with it)."""
    return hkdf_sha256(secret, salt=b"", info=b"kvhandoff hello aead 1")


def seal_hello(msg: Hello | HelloReject, *, key: bytes, recipient: str,
               iv: bytes) -> list[bytes]:
    """The two frames of handshake message `msg` sealed for `recipient` (its control address)
    under `key` (`hello_key`) with GCM nonce `iv` (12 bytes, fresh random per message): the
    clear envelope (kind, src, gen, nonce, echo), `iv`, then the message's body encrypted, the
    header, envelope and recipient authenticated with it."""
    if len(iv) != _IV:
        raise ValueError(f"iv must be {_IV} bytes, got {len(iv)}")
    src = msg.src.encode()
    nonce = msg.nonce if isinstance(msg, Hello) else b""
    echo = msg.echo
    if len(src) > _PEEK_STR_MAX or max(len(nonce), len(echo)) > _ENVELOPE_NONCE_MAX:
        raise ValueError("a handshake message's address or nonce is too long to seal")
    env = (bytes([_HELLO_KINDS[_kind_of(msg)]])
           + msg.gen.to_bytes(8, "big", signed=True) + len(src).to_bytes(2, "big") + src
           + bytes([len(nonce)]) + nonce + bytes([len(echo)]) + echo + iv)
    aad = HELLO_SEALED_HEADER + env + b"\0" + recipient.encode()
    return [HELLO_SEALED_HEADER, env + AESGCM(key).encrypt(iv, _ENCODER.encode(msg), aad)]


def _kind_of(msg: Hello | HelloReject) -> str:
    return "hello_reject" if isinstance(msg, HelloReject) else (
        "hello_ack" if isinstance(msg, HelloAck) else "hello")


def _open_envelope(body: memoryview, *, max_bytes: int) -> Opened:
    """A sealed handshake frame's clear envelope read (bounded by its own lengths), its
    ciphertext left as it is: at most `max_bytes` (the agent's max_message_bytes) and
    HELLO_MAX_BYTES of body."""
    b = bytes(body[:HELLO_SEAL_BYTES])
    i = 0

    def take(n: int) -> bytes:
        nonlocal i
        if i + n > len(b):
            raise ProtocolError("malformed sealed handshake: truncated envelope")
        out, i = b[i:i + n], i + n
        return out

    kind = _HELLO_KIND_NAMES.get(take(1)[0])
    if kind is None:
        raise ProtocolError("malformed sealed handshake: unknown kind")
    gen = int.from_bytes(take(8), "big", signed=True)
    n = int.from_bytes(take(2), "big")
    if n > _PEEK_STR_MAX:
        raise ProtocolError(f"malformed sealed handshake: a sender of {n} bytes")
    try:
        src = take(n).decode()
    except UnicodeDecodeError as e:
        raise ProtocolError("malformed sealed handshake: its sender is not utf-8") from e
    nonce = take(take(1)[0])
    echo = take(take(1)[0])
    iv = take(_IV)
    ct = body[i:]
    if len(ct) < _TAG:
        raise ProtocolError("malformed sealed handshake: shorter than its tag")
    bound = min(HELLO_MAX_BYTES, max_bytes)
    if len(ct) - _TAG > bound:
        # an honest one is a few KB; what a stranger makes an agent decrypt is bounded too,
        # by the smaller of a handshake's bound and the agent's max_message_bytes
        raise ProtocolError(f"{kind} of {len(ct) - _TAG} bytes exceeds a handshake message's "
                            f"bound of {bound}")
    return Opened(body=ct, seal=None, kind=kind, src=src, gen=gen,
                  hello=Envelope(nonce=nonce, echo=echo, iv=iv,
                                 aad=HELLO_SEALED_HEADER + b[:i] + b"\0"))


def open_hello(opened: Opened, *, key: bytes, recipient: str) -> bytes | None:
    """The body of sealed handshake frame `opened` (`open_frames`) when its GCM tag verifies
    under `key` (`hello_key`) for `recipient` (this agent's control address) and the body's
    own kind, sender and generation are the envelope's; None otherwise. Nothing of the body
    is decoded before the tag is checked (the `peek` after it reads three fields)."""
    env = opened.hello
    if env is None:
        raise ValueError("open_hello: not a sealed handshake frame")
    try:
        body: bytes = AESGCM(key).decrypt(env.iv, opened.body, env.aad + recipient.encode())
    except InvalidTag:
        return None
    try:
        if peek(body) != (opened.kind, opened.src, opened.gen):
            return None
    except ProtocolError:
        return None
    return body


def envelope_matches(msg: Message, env: Envelope) -> bool:
    """Whether a sealed handshake message decoded says the nonce and echo its envelope said
    (a refusal answers the envelope's)."""
    if isinstance(msg, Hello):
        return msg.nonce == env.nonce and msg.echo == env.echo
    return isinstance(msg, HelloReject) and msg.echo == env.echo and not env.nonce
