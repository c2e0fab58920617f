"""Bad input on the control socket: truncated, oversized, wrong-version, malformed and random
msgpack frames, sent by a raw ZMQ DEALER to a live agent's control address.

Every bad frame set is rejected (the agent's `rejected_messages` counter counts exactly those
that `protocol.decode` refuses), nothing is executed or stored, and the agent keeps serving: a
`Prober.barrier` is answered, and a real handoff between the fuzzed agents still succeeds.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from relkit import Engine, Prober, engine_pair, fast_settings, handoff

from kvhandoff.errors import ProtocolError
from kvhandoff.protocol import wire as P

MAX_MSG = 64 << 10  # the agents' max_message_bytes in this module
# The frames go to the control socket, which does not depend on the data transport; and the
# module's one pair is made before any test's lane is set (a module fixture comes first), so a
# second lane of the matrix ran every test again on the same tcp pair.
OWN_LANES = True
Pair = tuple[Engine, Engine]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with engine_pair(settings=fast_settings(max_message_bytes=MAX_MSG), num_pages=32) as pr:
        yield pr


def new_room() -> int:
    """A random 63-bit id, as the bootstrap server hands out: a fuzzed frame that happens to be
    a valid Abort for a small id cannot name it (rooms are not guessable)."""
    return secrets.randbits(63)


def rejected(frames: list[bytes]) -> bool:
    try:
        P.decode(frames, max_bytes=MAX_MSG)
    except ProtocolError:
        return True
    return False


def valid_body(src: str) -> bytes:
    return msgspec.msgpack.encode(P.Heartbeat(src=src, gen=7, rooms=[1, 2]))


def crafted_cases(src: str) -> dict[str, list[bytes]]:
    body = valid_body(src)
    return {
        "header only": [P.HEADER],
        "truncated body": [P.HEADER, body[: len(body) // 2]],
        "empty body": [P.HEADER, b""],
        "short header": [b"KV", body],
        "not kvhandoff": [b"HTTP", body],
        "version 2": [b"KVH\x02", body],
        "version 0": [b"KVH\x00", body],
        "extra frame": [P.HEADER, body, b"more"],
        "oversized": [P.HEADER, b"\xc0" * (MAX_MSG + 16)],
        "unknown kind": [P.HEADER, msgspec.msgpack.encode({"kind": "exec", "src": src, "gen": 1})],
        "no kind": [P.HEADER, msgspec.msgpack.encode({"src": src, "gen": 1})],
        "wrong types": [P.HEADER, msgspec.msgpack.encode(
            {"kind": "heartbeat", "src": 5, "gen": "x", "rooms": "all"})],
        "missing fields": [P.HEADER, msgspec.msgpack.encode({"kind": "transfer_request",
                                                             "src": src, "gen": 1})],
        "negative room": [P.HEADER, msgspec.msgpack.encode(
            {"kind": "abort", "src": src, "gen": 1, "room": -1, "reason": 3})],
        "msgpack array": [P.HEADER, msgspec.msgpack.encode([1, 2, 3])],
        "msgpack ext": [P.HEADER, b"\xd4\x01\x00"],
        "garbage": [P.HEADER, bytes(range(256))],
    }


def counters(e: Engine) -> dict[str, int]:
    return e.agent.status()["counters"]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_crafted_bad_frames_are_rejected_and_the_agent_serves_on(pair: Pair, side: str) -> None:
    p, d = pair
    target = p if side == "prefill" else d
    with Prober(target.address) as pr:
        cases = crafted_cases(pr.address)
        assert all(rejected(f) for f in cases.values()), [
            k for k, f in cases.items() if not rejected(f)]
        before = counters(target)["rejected_messages"]
        for frames in cases.values():
            pr.send(frames)
        answer = pr.barrier(side)[-1]
        assert "transport" in answer.reason
        assert counters(target)["rejected_messages"] - before == len(cases)
    room = new_room()
    s, rv = handoff(p, d, room, 40)
    assert d.bad_bytes(room, 40) == 0


def test_frame_over_the_socket_limit_drops_only_that_connection(pair: Pair) -> None:
    """A frame far over max_message_bytes is cut by ZMQ itself (MAXMSGSIZE) before it is
    buffered: the sender's connection is dropped, the agent serves everyone else."""
    p, d = pair
    with Prober(p.address) as big:
        big.send([P.HEADER, b"\x00" * (4 * MAX_MSG)])
    with Prober(p.address) as other:
        other.barrier("prefill")
    room = new_room()
    handoff(p, d, room, 40)
    assert d.bad_bytes(room, 40) == 0


def msgpack_values() -> st.SearchStrategy[object]:
    scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
               | st.floats(allow_nan=True) | st.text(max_size=16) | st.binary(max_size=16))
    return st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                        | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


TAGS = ["hello", "hello_ack", "hello_reject", "transfer_request", "transfer_accepted", "failed",
        "layer_done", "layer_nack", "room_ack", "abort", "abort_ack", "heartbeat", "reject"]
FIELDS = ["room", "xfer", "peer_gen", "seq_len", "decode_prefix_len", "page_size", "dst_pages",
          "src_pages", "lease_s", "layers", "layer", "attempt", "reason", "rooms", "layout",
          "buffers", "mac", "planes", "diff", "agent_id", "role", "transport"]


def frame_sets(src: str) -> st.SearchStrategy[list[bytes]]:
    header = st.sampled_from([P.HEADER, b"KVH\x02", b"KVH", b""]) | st.binary(max_size=6)
    shaped = st.fixed_dictionaries(
        {"kind": st.sampled_from(TAGS), "src": st.sampled_from([src, "127.0.0.1:1"]),
         "gen": st.integers(-5, 2**64 - 1)},
        optional={f: msgpack_values() for f in FIELDS})
    body = (st.binary(max_size=300)
            | msgpack_values().map(msgspec.msgpack.encode)
            | shaped.map(msgspec.msgpack.encode))
    return (st.tuples(header, body).map(list)
            | st.lists(st.binary(max_size=64), min_size=1, max_size=4))


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_fuzzed_frames_are_rejected_and_the_agent_serves_on(pair: Pair, side: str) -> None:
    p, d = pair
    target = p if side == "prefill" else d
    with Prober(target.address) as pr:
        sent: list[list[bytes]] = []

        @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(frame_sets(pr.address))
        def fuzz(frames: list[bytes]) -> None:
            pr.send(frames)
            sent.append(frames)

        before = counters(target)
        fuzz()
        pr.barrier(side)
        after = counters(target)
    want = sum(rejected(f) for f in sent)
    assert want >= len(sent) * 0.9  # the fuzz mostly hits the rejection paths
    assert after["rejected_messages"] - before["rejected_messages"] == want
    room = new_room()
    handoff(p, d, room, 40)
    assert d.bad_bytes(room, 40) == 0
    for e in (p, d):
        assert e.wait_all_released(list(e.pages), 20)
        e.assert_no_leak()
