"""The control loop's batch of one-sided writes (runtime.batching.WRITE_BATCH_BYTES), with real
agents over shm: the layers of a room that the prefill has when the decode's request comes
leave as one transport job (a short prompt: one copy call, one completion), while each layer
still completes, is announced and is verified on its own; a write over the batch's bytes leaves
alone. A stall of one layer inside such a batch (the fault kit holds that layer's writes only)
holds the batch's one completion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvhandoff.protocol.wire import split_tag
from kvhandoff.runtime import batching
from kvhandoff.state_machine import KVPoll

from .conftest import WAIT_S, Pair, layers_of
from .test_agent_driver import wait_until
from .test_agent_inproc import PREFIX, SEQ, finish

MakePair = Callable[..., Pair]


def record_jobs(pr: Pair, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The layers of each write job the prefill's transport is given from now on."""
    jobs: list[list[int]] = []
    tr = pr.prefill.agent.transport
    post = tr.post_writes  # type: ignore[attr-defined]

    def recorded(peer: str, writes: Any, on_done: Any, *, checksum: bool = False) -> None:
        jobs.append([split_tag(w[0])[1] for w in writes])
        post(peer, writes, on_done, checksum=checksum)

    monkeypatch.setattr(tr, "post_writes", recorded)
    return jobs


@pytest.mark.parametrize("batch", [batching.WRITE_BATCH_BYTES, 1], ids=["batched", "one-per-layer"])
def test_layers_ready_at_the_request_leave_as_one_job(
        pair: MakePair, monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """Every layer is ready before the decode asks: one job holding every layer's regions
    (each layer's writes under its own tag); with a batch of 1 byte one job per layer. Either
    way both sides end Success, every layer verified (a checksum per region), byte-exact."""
    monkeypatch.setattr(batching, "WRITE_BATCH_BYTES", batch)
    pr = pair(transport="shm")
    jobs = record_jobs(pr, monkeypatch)
    lids = layers_of(pr.prefill.layout)
    sender, receiver, _, dst = pr.open(3, SEQ, PREFIX, ready=tuple(lids))
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    if batch == 1:
        assert sorted(jobs) == [[lid] * len(job) for lid, job in zip(lids, sorted(jobs),
                                                                    strict=True)]
    else:
        assert len(jobs) == 1 and sorted(set(jobs[0])) == lids
    regions = sum(1 for reg in pr.decode.layout.regions for _ in reg.layer_ids)
    assert receiver.stats()["checksums_verified"] == regions


def test_layers_ready_leaves_as_one_job_and_one_announcement(
        pair: MakePair, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that marks a room's layers at once (`layers_ready`, as SGLang hands a room
    over after its forward) once the transfer is accepted: one write job of every layer, and
    every layer announced in the same `LayerDone` (the prefill's room timeline stamps each
    layer when its LayerDone leaves: one stamp for all); a layer given twice counts once."""
    pr = pair(transport="shm")
    jobs = record_jobs(pr, monkeypatch)
    lids = layers_of(pr.prefill.layout)
    sender, receiver, _, dst = pr.open(5, SEQ, PREFIX)
    assert wait_until(lambda: receiver.poll() is KVPoll.WaitingForInput)  # accepted
    sender.layers_ready([*lids, lids[0]])
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    assert len(jobs) == 1 and sorted(set(jobs[0])) == lids
    t = pr.prefill.agent.room_timings(5)
    assert t is not None and t["layers"] == len(lids) and t["layers_ms"] == 0.0, t
    regions = sum(1 for reg in pr.decode.layout.regions for _ in reg.layer_ids)
    assert receiver.stats()["checksums_verified"] == regions


def test_a_stalled_layer_holds_back_its_batch_until_the_engine_aborts(
        pair: MakePair) -> None:
    """Layer 3's write stalls (fault kit) inside the batch of every layer: the other layers'
    writes are copied, but the job has one completion, so no layer of it is announced (the
    decode lands none); the engine's abort then fails the room on both sides and both give
    their pages back."""
    lids = layers_of(pair().prefill.layout)
    pr = pair(transport="shm", prefill_faults={"stall_layers": [lids[3]]})
    sender, receiver, _, _ = pr.open(4, SEQ, PREFIX, ready=tuple(lids))
    tr = pr.prefill.agent.transport
    assert wait_until(lambda: tr.log.stalled == 1)  # type: ignore[attr-defined]
    assert wait_until(lambda: receiver.poll() is KVPoll.WaitingForInput)  # accepted
    assert receiver.stats()["bytes"] == 0  # and nothing of the batch announced
    sender.abort("engine gave up")
    assert receiver.wait(WAIT_S) is KVPoll.Failed and sender.wait(WAIT_S) is KVPoll.Failed
    assert receiver.wait_released(WAIT_S) and sender.wait_released(WAIT_S)


def test_a_room_over_one_job_leaves_as_full_jobs_in_order(
        pair: MakePair, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a job's worth of about two layers, the layers ready at the request leave as jobs of
    at most that many bytes, in layer order, each as full as the next layer allows (the batch
    sends what it holds before a write would take it over the limit: a held remainder is never
    cut into smaller jobs)."""
    pr = pair(transport="shm")
    lids = layers_of(pr.prefill.layout)
    tr = pr.prefill.agent.transport
    post = tr.post_writes  # type: ignore[attr-defined]
    jobs: list[list[tuple[int, int]]] = []  # per job: (layer, bytes) of each part

    def recorded(peer: str, writes: Any, on_done: Any, *, checksum: bool = False) -> None:
        jobs.append([(split_tag(w[0])[1], w[3].total_bytes) for w in writes])
        post(peer, writes, on_done, checksum=checksum)

    monkeypatch.setattr(tr, "post_writes", recorded)
    sender, receiver, _, _ = pr.open(6, SEQ, PREFIX, ready=tuple(lids))  # layer sizes
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    sizes: dict[int, int] = {}
    for job in jobs:
        for lid, n in job:
            sizes[lid] = sizes.get(lid, 0) + n
    limit = max(sizes.values()) * 2
    monkeypatch.setattr(batching, "WRITE_BATCH_BYTES", limit)
    jobs.clear()
    sender, receiver, _, dst = pr.open(7, SEQ, PREFIX, ready=tuple(lids))
    assert finish(sender, receiver) == (KVPoll.Success, KVPoll.Success)
    assert pr.verify(dst, SEQ, PREFIX) == (0, 0)
    layers = [sorted({lid for lid, _ in job}) for job in jobs]
    assert [lid for job in layers for lid in job] == lids
    totals = [sum(n for _, n in job) for job in jobs]
    assert len(jobs) > 1 and all(t <= limit for t in totals), totals
    for i in range(len(jobs) - 1):  # the next job's first layer did not fit in this one
        assert totals[i] + sizes[layers[i + 1][0]] > limit, (totals, sizes)
