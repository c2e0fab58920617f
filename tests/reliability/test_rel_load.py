"""Load and soak: hundreds of concurrent rooms between one prefill and one decode agent, 10 %
of them aborted at random moments by a random side.

Both agents live in the test process (real agents, real ZMQ control sockets, real tcp/UCX data
lanes on 127.0.0.1): 500 rooms of two processes' worth of page pools fit CI memory this way.
Each round opens every room on both sides first (all concurrent), then the prefill engine marks
layer after layer ready across all rooms, as an engine computing a batch does. Asserted per
round: every room terminal on both sides (0 lost), every room not aborted Success and
byte-exact, every aborted room Failed (or Success where the ack had won), every page back in
its pool exactly once. Asserted across rounds: RSS after the last round within a small bound of
RSS after the warm-up round(s). Pool buffers are filled at start, so every page is resident
before the first round and RSS shows growth, not the first touch of pool pages. An agent keeps
the record of a finished room for 10 minutes (~20 KB per room over both agents for the 6-layer
layout); between rounds the test ages those records out through the agent's own collection, as
10 minutes would.

Each soak runs in a process of its own (this module run as a script, the parameters as JSON on
its command line), so RSS is the memory of the two agents and their pools alone: inside a full
`make test` the pytest process also holds what hundreds of earlier tests left (vLLM, SGLang,
torch, captured output), which grew 17-29 MiB per round there while a soak alone stays within
a few MiB.
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from relkit import (
    Engine,
    age_out_finished_rooms,
    engine_pair,
    fast_settings,
    layers_of,
    mini_glm,
    rss_bytes,
)

from kvhandoff.state_machine import KVPoll

PHASES = ("before_init", "waiting", "mid", "after_last")

OWN_LANES = True  # each test names its transport (the conftest adds none)


@dataclass
class RoundResult:
    rooms: int
    aborted: int
    success: int
    failed: int
    lost: int
    bad_bytes: int
    seconds: float
    ack_won: int = 0
    problems: list[str] = field(default_factory=list)


def run_round(p: Engine, d: Engine, *, rooms: int, max_seq: int, abort_frac: float,
              rng: random.Random, wait_s: float) -> RoundResult:
    layers = layers_of(p.layout)
    ids = [rng.getrandbits(63) for _ in range(rooms)]
    seq = {r: rng.randint(1, max_seq) for r in ids}
    plan: dict[int, tuple[str, str, int]] = {}  # room -> (side, phase, layer index)
    for r in rng.sample(ids, int(rooms * abort_frac)):
        plan[r] = (rng.choice(["prefill", "decode"]), rng.choice(PHASES),
                   rng.randrange(1, len(layers)))
    t0 = time.monotonic()
    senders: dict[int, Any] = {}
    recvs: dict[int, Any] = {}
    for r in ids:
        senders[r] = p.send(r, seq[r], ready=False)
        side, phase, _ = plan.get(r, ("", "", 0))
        rv = d.recv(r, seq[r], p.address, init=phase != "before_init")
        recvs[r] = rv
        if phase == "before_init":
            (senders[r] if side == "prefill" else rv).abort(f"load abort {side} {phase}")
            if side == "prefill":  # the decode engine offers its pages as usual, afterwards
                rv.init(d.pages[r], seq[r])
    for r, (side, phase, _) in plan.items():
        if phase == "waiting":
            (senders[r] if side == "prefill" else recvs[r]).abort(f"load abort {side} {phase}")
    for i, lid in enumerate(layers):
        for r in ids:
            side, phase, at = plan.get(r, ("", "", 0))
            if phase == "mid" and at == i:
                (senders[r] if side == "prefill" else recvs[r]).abort(f"load abort {side} mid")
            senders[r].layer_ready(lid)
    for r, (side, phase, _) in plan.items():
        if phase == "after_last":
            (senders[r] if side == "prefill" else recvs[r]).abort(f"load abort {side} last")
    res = RoundResult(rooms=rooms, aborted=len(plan), success=0, failed=0, lost=0,
                      bad_bytes=0, seconds=0.0)
    deadline = time.monotonic() + wait_s
    for r in ids:
        left = max(0.0, deadline - time.monotonic())
        ss, rs = senders[r].wait(left), recvs[r].wait(left)
        if not (ss.is_terminal and rs.is_terminal):
            res.lost += 1
            res.problems.append(f"room {r} not terminal: prefill {ss.name}, decode {rs.name}")
            continue
        if r in plan:
            if KVPoll.Success in (ss, rs):
                res.ack_won += 1
                # only an abort after the last layer may lose to the ack
                if plan[r][1] != "after_last":
                    res.problems.append(f"room {r} aborted at {plan[r]} but {ss.name}/{rs.name}")
            res.failed += 1
        else:
            if (ss, rs) != (KVPoll.Success, KVPoll.Success):
                res.problems.append(f"room {r}: {ss.name}/{rs.name} {senders[r].failure} "
                                    f"{recvs[r].failure}")
                res.failed += 1
                continue
            res.success += 1
            res.bad_bytes += d.bad_bytes(r, seq[r])
    released = p.wait_all_released(ids, max(1.0, deadline - time.monotonic())) and \
        d.wait_all_released(ids, max(1.0, deadline - time.monotonic()))
    if not released:
        res.problems.append("pages of some rooms were never released")
    res.seconds = time.monotonic() - t0
    return res


def soak(*, transport: str, rooms: int, rounds: int, max_seq: int, num_layers: int,
         rss_bound_mib: float, wait_s: float, rng: random.Random, warmup_rounds: int = 1,
         steps_forgiven: int = 0, **extra: Any) -> list[RoundResult]:
    """Rounds of `rooms` concurrent rooms; RSS may grow by `rss_bound_mib` over the rounds
    after `warmup_rounds`, less the `steps_forgiven` largest rounds' growth (a pool that grows
    once, in whichever round, is a step; a leak grows every round)."""
    layout = mini_glm(num_layers=num_layers, indexer_layer_ids=(1, num_layers - 1))
    pages = rooms * -(-max_seq // layout.page_size_tokens)
    results: list[RoundResult] = []
    rss: list[int] = []
    # a heartbeat of 2 s (the product's default; said, as relkit's is 0.5 s): this process
    # holds both agents' control loops, and a burst of hundreds of rooms beside a busy loop on
    # every core kept them from running for over 1 s, so each agent rightly gave its rooms up
    # as unresponsive ("this agent was unresponsive for 1.02s (> 2 heartbeats of 0.5s)"). The
    # soak counts lost rooms, pages and memory; a dead peer's detection is test_rel_peer_death's
    st = fast_settings(transport=transport, heartbeat_interval_s=2.0, lease_s=30.0, **extra)
    with engine_pair(layout, num_pages=pages, settings=st) as (p, d):
        for _ in range(rounds):
            res = run_round(p, d, rooms=rooms, max_seq=max_seq, abort_frac=0.10, rng=rng,
                            wait_s=wait_s)
            results.append(res)
            assert res.lost == 0 and not res.problems, (res.problems[:10], res)
            assert res.bad_bytes == 0
            assert res.success + res.failed == rooms
            p.assert_no_leak()
            d.assert_no_leak()
            for e in (p, d):
                age_out_finished_rooms(e)
                e.pages.clear()
                e.releases.clear()
                e.prefix.clear()
            gc.collect()
            rss.append(rss_bytes())
        for e in (p, d):  # nothing left open on either agent
            states = e.agent.status()["rooms"]
            assert set(states) <= {"Success", "Failed"}, states
    after = rss[warmup_rounds - 1:]
    steps = sorted((b - a for a, b in zip(after, after[1:], strict=False)), reverse=True)
    growth_mib = sum(steps[steps_forgiven:]) / (1 << 20)
    print(f"soak {transport}: {rounds} rounds x {rooms} rooms; per round "
          + ", ".join(f"{r.success} ok/{r.failed} failed ({r.ack_won} ack won) "
                      f"in {r.seconds:.1f}s" for r in results)
          + f"; RSS after each round MiB: {[round(x / (1 << 20)) for x in rss]}; "
          f"growth after {warmup_rounds} warm-up round(s) {growth_mib:+.1f} MiB"
          + (f" (the largest {steps_forgiven} round(s) left out)" if steps_forgiven else ""))
    assert growth_mib < rss_bound_mib, (
        f"RSS grew {growth_mib:.1f} MiB after the warm-up round(s)"
        + (f", the largest {steps_forgiven} left out" if steps_forgiven else ""))
    return results


def soak_in_child(rng: random.Random, **kw: Any) -> None:
    """Runs `soak` in a fresh Python process (see the module docstring) with a seed drawn from
    the test's seeded `rng`; its assertions fail the test with the child's output."""
    kw["seed"] = rng.getrandbits(32)
    budget = kw["wait_s"] * kw["rounds"] + 120  # every round may use its wait, plus start-up
    proc = subprocess.run([sys.executable, __file__, json.dumps(kw)], capture_output=True,
                          text=True, timeout=budget)
    print(proc.stdout, end="")
    assert proc.returncode == 0, (f"soak process exited {proc.returncode} (seed {kw['seed']}):\n"
                                  + proc.stderr[-6000:])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_500_concurrent_rooms_with_random_aborts(transport: str, rng: random.Random) -> None:
    soak_in_child(rng, transport=transport, rooms=500, rounds=3, max_seq=48, num_layers=6,
                  rss_bound_mib=32, wait_s=60)


def test_ucx_soak_200_rooms_with_aborts(rng: random.Random) -> None:
    """The short UCX soak of `make test`: 200 concurrent rooms, 10 % aborted, five rounds; 0
    rooms lost, every page back exactly once (the 2,000-room runs are `long`). RSS is
    compared after two warm-up rounds, and the one round that grew most is left out: UCX
    grows its memory pools in steps, not always in the first rounds (+40 MiB after one
    warm-up round late in a full `make test`; alone: +15 MiB in round 2, then within 2 MiB;
    beside busy loops, RSS after each round 407, 408, 451, 453 MiB: one step in round 3)."""
    # UCX peer error handling on (as between hosts): without it a same-host UCX endpoint
    # closing while the other agent's UCX worker still runs can abort the process
    # (docs/TRANSFER.md, the UCX limitation), which is not what this soak measures
    soak_in_child(rng, transport="ucx", rooms=200, rounds=5, max_seq=48, num_layers=6,
                  rss_bound_mib=32, wait_s=60, warmup_rounds=2, steps_forgiven=1,
                  ucx_same_host_error_handling=True)


@pytest.mark.long
@pytest.mark.timeout(900)  # 5 rounds of 2,000 rooms: about 2 minutes here, above the default
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_soak_2000_rooms_longer_contexts(transport: str, rng: random.Random) -> None:
    # allocator arenas and socket buffers settle at this scale over two rounds; then flat
    soak_in_child(rng, transport=transport, rooms=2000, rounds=5, max_seq=160, num_layers=12,
                  rss_bound_mib=64, wait_s=300, warmup_rounds=2)


if __name__ == "__main__":  # the process of one soak: soak_in_child's JSON parameters
    args = json.loads(sys.argv[1])
    soak(rng=random.Random(args.pop("seed")), **args)
