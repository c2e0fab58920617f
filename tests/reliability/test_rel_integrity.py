"""Integrity: corruption of landed bytes is caught every time, retransmitted once, and then
fails the room naming the layer and region; a prefill its engine aborted never lets the decode
reach Success.

Corruption is injected by wrapping the decode agent's transport
(`kvhandoff.testing.faults.FaultyTransport`: one byte of the first landed span of a region of
that layer flipped before the agent verifies it), not by patching internals; main KV and the
indexer are both corrupted. With one-sided writes the decode posts nothing to wrap, so the
prefill's transport corrupts instead: a byte of the decode's pages flipped inside shm's copy
job, right after its piece was copied and before the writer hashes what landed, on both
one-sided lanes: plain decode memory (the decode verifies what landed) and a shared pool the
writer maps (the writer's copy hashes each piece it wrote right after writing it; the decode
checks that sum).
"""

from __future__ import annotations

import random

import pytest
from relkit import WAIT_S, Engine, engine_pair, fast_settings, layers_of

from kvhandoff.errors import ChecksumMismatch, FailureKind
from kvhandoff.state_machine import KVPoll

SEQ = 40  # 2.5 pages of 16 tokens: a partial last page too
TRIALS = 25


def test_corruption_once_is_caught_retransmitted_and_lands_byte_exact(rng: random.Random
                                                                      ) -> None:
    """N trials, each a fresh decode agent whose fault corrupts one landed byte of a random
    region (main KV or indexer) of a random layer once: every corruption is caught (the
    checksum fails), retransmitted once, and the room ends byte-exact."""
    with engine_pair(num_pages=TRIALS * 3 + 4) as (p, _):
        for room in range(1, TRIALS + 1):
            region = rng.choice([reg.name for reg in p.layout.regions])
            layer = rng.choice(list(p.layout.region(region).layer_ids))
            d = Engine("decode", p.layout, 4, fast_settings(),
                       faults={"corrupt": [{"layer": layer, "region": region}]})
            try:
                s = p.send(room, SEQ)
                rv = d.recv(room, SEQ, p.address)
                assert rv.wait(WAIT_S) is KVPoll.Success, (layer, region, rv.failure)
                assert s.wait(WAIT_S) is KVPoll.Success, (layer, s.failure)
                c = d.agent.status()["counters"]
                assert c["checksum_failures"] == 1 and c["retransmits"] == 1, (layer, c)
                assert rv.stats()["retransmits"] == 1
                assert d.bad_bytes(room, SEQ) == 0
                assert d.wait_all_released([room], WAIT_S)
                d.assert_no_leak()
            finally:
                d.close()
        assert p.agent.status()["counters"]["retransmits"] == TRIALS
        assert p.wait_all_released(list(p.pages), WAIT_S)
        p.assert_no_leak()


@pytest.mark.parametrize("region", ["main_kv", "indexer_k"])
def test_corruption_twice_fails_naming_layer_and_region(region: str) -> None:
    """Corrupted again after the retransmit: Failed on both sides, the reason names the layer
    and the region; nothing reaches Success; all pages come back."""
    layer = 5  # an indexer layer of the mini layout, not the first one
    faults = {"corrupt": [{"layer": layer, "region": region, "times": 2 * TRIALS}]}
    with engine_pair(num_pages=TRIALS * 3 + 4, decode_faults=faults) as (p, d):
        rooms = list(range(1, TRIALS + 1))
        handles = [(p.send(room, SEQ), d.recv(room, SEQ, p.address)) for room in rooms]
        for s, rv in handles:
            assert rv.wait(WAIT_S) is KVPoll.Failed
            assert s.wait(WAIT_S) is KVPoll.Failed
            want = f"checksum mismatch on layer {layer}, region '{region}'"
            assert want in (rv.failure or ""), rv.failure
            assert want in (s.failure or ""), s.failure  # the prefill is told why
            with pytest.raises(ChecksumMismatch) as err:
                rv.wait_for_layer(layer, 0)
            assert (err.value.layer, err.value.region) == (layer, region)
            assert s.failure_kind is FailureKind.CHECKSUM  # told the kind, too
        c = d.agent.status()["counters"]
        assert c["checksum_failures"] == 2 * TRIALS
        assert c["rooms_success"] == 0 and c["rooms_failed"] == TRIALS
        assert p.wait_all_released(rooms, WAIT_S) and d.wait_all_released(rooms, WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


def test_engine_aborted_prefill_never_lets_decode_succeed(rng: random.Random) -> None:
    """The prefill engine aborts its request at a random layer (including the last one) after
    marking the layers before it ready: in every trial the decode ends Failed with the abort's
    reason, never Success, and every page comes back."""
    with engine_pair(num_pages=TRIALS * 3 + 4) as (p, d):
        layers = layers_of(p.layout)
        rooms = list(range(1, TRIALS + 1))
        cut = {room: rng.randrange(len(layers)) for room in rooms}
        cut[rooms[0]], cut[rooms[1]] = 0, len(layers) - 1
        handles = []
        for room in rooms:
            s = p.send(room, SEQ, ready=cut[room])
            rv = d.recv(room, SEQ, p.address)
            handles.append((room, s, rv))
        for room, s, rv in handles:
            if cut[room]:  # let the layers before the abort land first (the worst case)
                assert rv.wait_for_layer(layers[cut[room] - 1], WAIT_S), rv.failure
            s.abort(f"engine aborted request {room}")
            for lid in layers[cut[room]:]:  # a careless engine keeps marking layers ready
                s.layer_ready(lid)
        for room, s, rv in handles:
            assert rv.wait(WAIT_S) is KVPoll.Failed, (room, cut[room], rv)
            assert f"engine aborted request {room}" in (rv.failure or "")
            assert s.poll() is KVPoll.Failed
        assert d.agent.status()["counters"]["rooms_success"] == 0
        assert p.wait_all_released(rooms, WAIT_S) and d.wait_all_released(rooms, WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


# The one-sided lanes: "shm" writes into plain decode memory (process_vm_writev; the decode
# verifies what landed), "shm-map" into a decode pool in a shared segment, which the writer
# maps: its copy hashes each destination piece right after copying it and the decode checks
# that sum and the plan's digest instead of reading the bytes again
# (checksums_writer_verified counts those).
ONE_SIDED = ["shm", "shm-map"]


def _writer_verifies(lane: str, counters: dict[str, int]) -> bool:
    return (counters["checksums_writer_verified"] > 0) == (lane == "shm-map")


@pytest.mark.parametrize("lane", ONE_SIDED)
def test_one_sided_corruption_is_caught_and_rewritten(lane: str) -> None:
    """One-sided writes: the prefill's faulty transport flips a byte in the decode's pages
    inside the copy (after its piece's copy, before the landed hash), so the checksum it sends
    is of the true bytes. Caught (by the decode's pass, or on the map lane by the writer's
    fused hash of what landed), rewritten once, byte-exact; every page comes back."""
    for room, (layer, region) in enumerate([(5, "indexer_k"), (0, "main_kv"), (3, "main_kv")]):
        faults = {"corrupt": [{"layer": layer, "region": region}]}
        with engine_pair(num_pages=8, settings=fast_settings(transport="shm"),
                         prefill_faults=faults,
                         decode_shared_pool=lane == "shm-map") as (p, d):
            s, rv = p.send(room, SEQ), d.recv(room, SEQ, p.address)
            assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
            assert s.wait(WAIT_S) is KVPoll.Success, s.failure
            assert rv.stats()["retransmits"] == 1 and rv.stats()["one_sided"] is True
            assert d.agent.status()["counters"]["checksum_failures"] == 1
            assert _writer_verifies(lane, d.agent.status()["counters"])
            assert d.bad_bytes(room, SEQ) == 0
            assert p.wait_all_released([room], WAIT_S) and d.wait_all_released([room], WAIT_S)
            p.assert_no_leak()
            d.assert_no_leak()


@pytest.mark.parametrize("region", ["main_kv", "indexer_k"])
@pytest.mark.parametrize("lane", ONE_SIDED)
def test_one_sided_corruption_twice_fails_naming_layer_and_region(lane: str, region: str
                                                                  ) -> None:
    """Every write of the layer corrupted (the rewrite too): Failed on both sides naming the
    layer and region, over one-sided writes; every page comes back. Layer 5's regions are one
    write job: the other region lands intact in the same jobs and is not the one named."""
    layer = 5
    faults = {"corrupt": [{"layer": layer, "region": region, "times": 2 * TRIALS}]}
    with engine_pair(num_pages=TRIALS * 3 + 4, settings=fast_settings(transport="shm"),
                     prefill_faults=faults, decode_shared_pool=lane == "shm-map") as (p, d):
        rooms = list(range(1, TRIALS + 1))
        handles = [(p.send(room, SEQ), d.recv(room, SEQ, p.address)) for room in rooms]
        want = f"checksum mismatch on layer {layer}, region '{region}'"
        for s, rv in handles:
            assert rv.wait(WAIT_S) is KVPoll.Failed
            assert want in (rv.failure or ""), rv.failure
            assert s.wait(WAIT_S) is KVPoll.Failed and want in (s.failure or "")
            assert rv.stats()["one_sided"] is True
        c = d.agent.status()["counters"]
        assert c["checksum_failures"] == 2 * TRIALS and c["rooms_one_sided"] == TRIALS
        assert _writer_verifies(lane, c)
        # each caught corruption was injected once: a byte flipped inside a copy job
        assert len(p.agent.transport.log.corrupted) == 2 * TRIALS  # type: ignore[attr-defined]
        assert p.wait_all_released(rooms, WAIT_S) and d.wait_all_released(rooms, WAIT_S)
        p.assert_no_leak()
        d.assert_no_leak()


@pytest.mark.parametrize("lane", ONE_SIDED)
def test_one_sided_corruption_of_both_regions_of_a_layer_job_is_rewritten_once(lane: str
                                                                               ) -> None:
    """A layer's regions are one write job: both of layer 5's (main KV and indexer) corrupted
    in the same job are caught together, the layer is rewritten once, byte-exact."""
    faults = {"corrupt": [{"layer": 5, "region": "main_kv"}, {"layer": 5, "region": "indexer_k"}]}
    with engine_pair(num_pages=8, settings=fast_settings(transport="shm"),
                     prefill_faults=faults, decode_shared_pool=lane == "shm-map") as (p, d):
        s, rv = p.send(1, SEQ), d.recv(1, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
        assert s.wait(WAIT_S) is KVPoll.Success, s.failure
        assert rv.stats()["retransmits"] == 1 and rv.stats()["one_sided"] is True
        assert d.agent.status()["counters"]["checksum_failures"] == 1
        assert _writer_verifies(lane, d.agent.status()["counters"])
        assert d.bad_bytes(1, SEQ) == 0
        assert p.wait_all_released([1], WAIT_S) and d.wait_all_released([1], WAIT_S)

