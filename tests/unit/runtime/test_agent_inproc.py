"""Two TransferAgents in one process over the in-process transport: the handoff semantics of
issue 4 (byte-exact, suffix-only indexer, layout check, abort, checksums, page release, per-layer
readiness). Every wait is bounded by WAIT_S; ordering is proved with the agents' own events.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import zmq

from kvhandoff.errors import (
    Aborted,
    ChecksumMismatch,
    FailureKind,
    LayoutMismatch,
    TransferTimeout,
)
from kvhandoff.kv_layout import layout_hash
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.checksums import SAMPLE_EVERY
from kvhandoff.settings import ChecksumMode
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import Receiver, Sender

from .conftest import WAIT_S, Pair, layers_of, tiny_layout

MakePair = Callable[..., Pair]

SEQ = 200  # 12.5 pages of 16: the last page is partial
PREFIX = 70  # page-aligned down to 64: 4 cached pages


def expected_bytes(pair: Pair, seq_len: int, prefix: int) -> int:
    lay = pair.decode.layout
    ps = lay.page_size_tokens
    total = 0
    for reg in lay.regions:
        first = (prefix // ps * ps) if reg.send_from.value == "decode_prefix" else 0
        total += (seq_len - first) * reg.bytes_per_token * reg.num_layers
    return total


def run_layers(pair: Pair, sender: Sender, receiver: Receiver) -> None:
    """Prefill marks each layer ready in order; decode waits for each before the next one."""
    for lid in layers_of(pair.prefill.layout):
        sender.layer_ready(lid)
        assert receiver.wait_for_layer(lid, WAIT_S), (lid, receiver.poll(), receiver.failure)


def assert_released_once(pair: Pair, room: int) -> None:
    for side in (pair.prefill, pair.decode):
        assert side.releases.calls == {room: 1}, side.agent.role
        assert side.pool.free_count == side.pool.num_pages


def finish(sender: Sender, receiver: Receiver) -> tuple[KVPoll, KVPoll]:
    rs = receiver.wait(WAIT_S)
    ss = sender.wait(WAIT_S)
    assert receiver.wait_released(WAIT_S) and sender.wait_released(WAIT_S)
    return ss, rs


# ---------------------------------------------------------------------------- happy path


def test_handoff_byte_exact_with_suffix_only_indexer(pair: MakePair) -> None:
    pr = pair()
    sender, receiver, _, dst = pr.open(11, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert sender.failure is None and receiver.failure is None
    bad, touched = pr.verify(dst, SEQ, PREFIX)
    assert bad == 0, "landed bytes differ from the prefill's"
    assert touched == 0, "the handoff wrote into decode's cached-prefix indexer pages"
    want = expected_bytes(pr, SEQ, PREFIX)
    assert receiver.stats()["bytes"] == want
    assert sender.stats()["bytes"] == want
    for h in (sender, receiver):  # when the engine could see Success: after the session's
        st = h.stats()            # stamp (taken before it handled the room's last event)
        assert st["t_seen"] is not None and st["t_seen"] >= st["t_done"], st
    # both regions are suffix-only: 13 pages in all, the 4 cached ones stay
    per_region = receiver.stats()["bytes_per_region"]
    assert per_region["indexer_k"] == (SEQ - 64) * 132 * 3
    assert per_region["main_kv"] == (SEQ - 64) * 656 * 6
    assert_released_once(pr, 11)
    # a late abort after Success changes nothing and releases nothing twice
    sender.abort("too late")
    receiver.abort("too late")
    assert sender.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
    assert_released_once(pr, 11)


def test_decode_page_size_may_differ(pair: MakePair) -> None:
    pr = pair(tiny_layout(page_size=16), decode_layout=tiny_layout(page_size=8), num_pages=64)
    sender, receiver, _, dst = pr.open(12, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    assert_released_once(pr, 12)


def test_several_rooms_share_one_peer(pair: MakePair) -> None:
    pr = pair(num_pages=64)
    rooms = [pr.open(100 + i, 40 + 37 * i, 16 * i) for i in range(4)]
    for lid in layers_of(pr.prefill.layout):
        for sender, _, _, _ in reversed(rooms):
            sender.layer_ready(lid)
    for i, (sender, receiver, _, dst) in enumerate(rooms):
        assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
        assert pr.verify(dst, 40 + 37 * i, 16 * i) == (0, 0)
    st = pr.prefill.agent.status()
    assert len(st["peers"]) == 1 and st["peers"][0]["matched"]
    assert pr.prefill.releases.calls == {100 + i: 1 for i in range(4)}
    assert pr.decode.pool.free_count == pr.decode.pool.num_pages


# ---------------------------------------------------------------------------- per layer


def test_wait_for_layer_returns_while_later_layers_are_not_ready(pair: MakePair) -> None:
    pr = pair()
    sender, receiver, _, _ = pr.open(13, SEQ, PREFIX)
    layers = layers_of(pr.prefill.layout)
    sender.layer_ready(layers[0])
    assert receiver.wait_for_layer(layers[0], WAIT_S)
    # layer 1 was never marked ready on the prefill: it cannot have landed
    with pytest.raises(TransferTimeout, match="layer 1 not landed"):
        receiver.wait_for_layer(layers[1], 0)
    assert receiver.poll() is KVPoll.Transferring
    assert sender.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
    # mid-transfer nobody may reuse the pages
    assert not sender.released and not receiver.released
    assert pr.prefill.releases.calls == {} == pr.decode.releases.calls
    # layer 0 holds the right bytes already (main KV of every token, indexer suffix)
    d = pr.decode
    assert d.agent.status()["counters"]["checksums_verified"] == 2  # main_kv + indexer_k
    for lid in layers[1:]:
        with pytest.raises(TransferTimeout):
            receiver.wait_for_layer(lid, 0)
        sender.layer_ready(lid)
        assert receiver.wait_for_layer(lid, WAIT_S)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)


def test_layers_ready_before_decode_arrives_are_sent_on_accept(pair: MakePair) -> None:
    """Prefill may finish every layer before decode asks: the request then sends them all."""
    pr = pair()
    p = pr.prefill
    src = p.pool.alloc(-(-SEQ // 16))
    from kvhandoff.engine_sim.pattern import write_tokens

    from .conftest import SEED

    for ri, reg in enumerate(p.layout.regions):
        for lid in reg.layer_ids:
            write_tokens(p.agent.buffers.array(reg.name, lid), p.layout, ri, lid, src, 0, SEQ,
                         SEED)
    sender = p.agent.sender(14, pages=src, seq_len=SEQ, on_release=p.releases.callback(src))
    for lid in layers_of(p.layout):
        sender.layer_ready(lid)
    assert sender.poll() is KVPoll.Bootstrapping  # no decode yet
    d = pr.decode
    dst = d.pool.alloc(-(-SEQ // 16))
    receiver = d.agent.receiver(14, peer=p.agent.address, on_release=d.releases.callback(dst))
    receiver.init(dst, SEQ, 0)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, 0) == (0, 0)
    assert_released_once(pr, 14)


# ---------------------------------------------------------------------------- layout check


def test_layout_mismatch_fails_both_sides_with_the_diff(pair: MakePair) -> None:
    pr = pair(tiny_layout(indexer=(0, 3, 5)), decode_layout=tiny_layout(indexer=(0, 2, 5)))
    sender, receiver, _, _ = pr.open(15, SEQ, PREFIX)
    sender.layer_ready(0)
    ss, rs = finish(sender, receiver)
    assert (ss, rs) == (KVPoll.Failed, KVPoll.Failed)
    diff = "indexer_k.layer_ids: prefill=[0, 3, 5] decode=[0, 2, 5]"
    assert receiver.failure is not None and diff in receiver.failure
    assert sender.failure is not None and diff in sender.failure
    with pytest.raises(LayoutMismatch) as err:  # a failed room raises its typed error
        receiver.wait_for_layer(0, WAIT_S)
    assert diff in err.value.diff and err.value.kind is FailureKind.LAYOUT_MISMATCH
    assert receiver.failure_kind is FailureKind.LAYOUT_MISMATCH
    assert sender.failure_kind is FailureKind.LAYOUT_MISMATCH
    assert_released_once(pr, 15)


def test_hmac_secret_mismatch_fails_the_handshake(pair: MakePair) -> None:
    """The decode learns at once why it cannot join; the prefill's room is NOT failed by a
    process that could not authenticate (that would let anyone fail rooms by id): it keeps
    waiting for a genuine decode, bounded by its bootstrap deadline, here ended by an abort."""
    pr = pair(prefill_settings={"hmac_secret": "alpha"}, decode_settings={"hmac_secret": "beta"})
    sender, receiver, _, _ = pr.open(16, SEQ)
    assert receiver.wait(WAIT_S) is KVPoll.Failed
    assert receiver.failure is not None and "HMAC" in receiver.failure
    assert sender.poll() is KVPoll.Bootstrapping
    sender.abort("test over")
    ss, rs = finish(sender, receiver)
    assert (ss, rs) == (KVPoll.Failed, KVPoll.Failed)
    assert sender.failure is not None and "test over" in sender.failure


def test_hmac_shared_secret_handoff_succeeds(pair: MakePair) -> None:
    pr = pair(hmac_secret="shared")
    sender, receiver, _, dst = pr.open(17, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)


# ---------------------------------------------------------------------------- abort


def test_abort_from_prefill_fails_decode_with_the_reason(pair: MakePair) -> None:
    pr = pair()
    sender, receiver, _, _ = pr.open(18, SEQ, PREFIX)
    sender.layer_ready(0)
    assert receiver.wait_for_layer(0, WAIT_S)
    sender.abort("engine evicted the request")
    assert finish(sender, receiver) == (KVPoll.Failed, KVPoll.Failed)
    assert sender.failure is not None and "engine evicted the request" in sender.failure
    assert receiver.failure is not None and "engine evicted the request" in receiver.failure
    with pytest.raises(Aborted, match="engine evicted the request"):
        receiver.wait_for_layer(1, WAIT_S)
    assert receiver.failure_kind is FailureKind.ABORTED
    assert sender.failure_kind is FailureKind.ABORTED
    assert_released_once(pr, 18)
    sender.abort("again")  # safe twice; the first reason stays
    assert "engine evicted the request" in (sender.failure or "")
    assert_released_once(pr, 18)


def test_abort_from_decode_fails_prefill_and_releases_its_pages(pair: MakePair) -> None:
    pr = pair()
    sender, receiver, _, _ = pr.open(19, SEQ, PREFIX)
    sender.layer_ready(0)
    assert receiver.wait_for_layer(0, WAIT_S)
    receiver.abort("decode gave up")
    assert finish(sender, receiver) == (KVPoll.Failed, KVPoll.Failed)
    assert sender.failure is not None and "decode gave up" in sender.failure
    # the engine may still call layer_ready for later layers: nothing moves, nothing breaks
    sender.layer_ready(1)
    assert sender.poll() is KVPoll.Failed
    assert_released_once(pr, 19)


def test_decode_abort_before_the_transfer_starts(pair: MakePair) -> None:
    pr = pair()
    sender, receiver, _, _ = pr.open(20, SEQ)
    receiver.abort("client disconnected")
    assert finish(sender, receiver) == (KVPoll.Failed, KVPoll.Failed)
    assert "client disconnected" in (sender.failure or "")
    assert_released_once(pr, 20)


# ---------------------------------------------------------------------------- checksums


def test_corruption_once_is_retransmitted(pair: MakePair) -> None:
    pr = pair(decode_faults={"corrupt": [{"layer": 3}]})
    sender, receiver, _, dst = pr.open(21, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)  # the retransmit overwrote the flipped byte
    assert receiver.stats()["retransmits"] == 1
    assert sender.stats()["retransmits"] == 1
    assert pr.decode.agent.status()["counters"]["checksum_failures"] == 1
    assert_released_once(pr, 21)


def test_corruption_twice_fails_naming_layer_and_region(pair: MakePair) -> None:
    pr = pair(decode_faults={"corrupt": [{"layer": 3, "times": 2}]})
    sender, receiver, _, _ = pr.open(22, SEQ, PREFIX)
    for lid in layers_of(pr.prefill.layout):
        sender.layer_ready(lid)
    assert finish(sender, receiver) == (KVPoll.Failed, KVPoll.Failed)
    want = "checksum mismatch on layer 3, region 'main_kv'"
    assert receiver.failure is not None and want in receiver.failure
    assert sender.failure is not None and want in sender.failure
    with pytest.raises(ChecksumMismatch) as err:  # a failed room raises for every layer
        receiver.wait_for_layer(3, 0)
    assert (err.value.layer, err.value.region) == (3, "main_kv")
    with pytest.raises(ChecksumMismatch):
        receiver.wait_for_layer(0, 0)
    assert sender.failure_kind is FailureKind.CHECKSUM
    assert pr.decode.agent.status()["counters"]["checksum_failures"] == 2
    assert_released_once(pr, 22)


@pytest.mark.parametrize(
    ("mode", "verified"),
    [(ChecksumMode.FULL, 6 + 3),  # every (layer, region)
     (ChecksumMode.SAMPLED, 2 + 2),  # layers 0 and 5 (the last), each with main + indexer
     (ChecksumMode.OFF, 0)],
)
def test_checksum_modes(pair: MakePair, mode: ChecksumMode, verified: int) -> None:
    assert SAMPLE_EVERY > 5  # in 6 layers, sampled mode hashes the first and the last only
    pr = pair(checksum=mode)
    sender, receiver, _, dst = pr.open(23, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    assert receiver.stats()["checksums_verified"] == verified


# ---------------------------------------------------------------------------- bad peers


def test_bad_messages_are_rejected_and_the_agent_keeps_serving(pair: MakePair) -> None:
    pr = pair()
    agent = pr.prefill.agent
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox = ctx.socket(zmq.ROUTER)
    out = ctx.socket(zmq.DEALER)
    try:
        inbox.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.LINGER, 0)
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        me = f"127.0.0.1:{port}"
        out.connect(f"tcp://{agent.address}")
        garbage = [
            [b"KVH\x02", P.encode(P.RoomAck(src=me, gen=1, room=1))[1]],
            [b"junk", b"\x80\x04\x95"],
            [P.HEADER, msgspec.msgpack.encode({"kind": "teleport", "src": me, "gen": 1})],
            [P.HEADER, msgspec.msgpack.encode({"kind": "room_ack", "src": me, "gen": 1,
                                               "room": "x"})],
            [P.HEADER],
        ]
        for frames in garbage:
            out.send_multipart(frames)
        # then a well-formed Hello of another layout on the same connection (ordered after the
        # garbage): the agent must answer it with a HelloReject carrying the diff
        other = tiny_layout(indexer=(1,))
        out.send_multipart(P.encode(P.Hello(
            src=me, gen=7, agent_id="decode-test", role="decode", transport="inproc",
            transport_address=b"nowhere", layout=other.to_dict(),
            layout_hash=layout_hash(other), buffers=[])))
        assert inbox.poll(int(WAIT_S * 1000)), "no answer to the Hello"
        frames = inbox.recv_multipart()
        reply = P.decode(frames[1:], max_bytes=1 << 20)
        assert isinstance(reply, P.HelloReject)
        assert "indexer_k.layer_ids: prefill=[0, 3, 5] decode=[1]" in reply.diff
        assert agent.status()["counters"]["rejected_messages"] == len(garbage)
    finally:
        out.close(0)
        inbox.close(0)
    # still serving: a real handoff on the same agent
    sender, receiver, _, dst = pr.open(24, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)


def test_abort_then_reopen_the_same_room_id(pair: MakePair) -> None:
    """abort() returns with the room terminal, so an engine may open the same room id again at
    once (vLLM reopens a preempted request's room on its new blocks)."""
    pr = pair()
    p = pr.prefill
    src = p.pool.alloc(-(-SEQ // 16))
    s1 = p.agent.sender(31, pages=src, seq_len=SEQ, on_release=p.releases.callback(src))
    s1.abort("preempted")
    assert s1.poll() is KVPoll.Failed and "preempted" in (s1.failure or "")
    assert s1.wait_released(WAIT_S)
    sender, receiver, _, dst = pr.open(31, SEQ)  # the same id, new pages
    run_layers(pr, sender, receiver)
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, 0) == (0, 0)
