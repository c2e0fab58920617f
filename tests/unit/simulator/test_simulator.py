"""The deterministic simulator (`kvhandoff.testing.simulator`) over a range of seeds, its
replay, its command line, and that its invariants do fire on a transport that breaks them.

`test_every_seed_holds_every_invariant` runs SEEDS seeds in `make test` (about half a minute
on two cores): seeds 0-1999, the range the mutation run of the release rules
(tests/unit/simulator/test_mutants.py) shows to kill every mutant that is not explained, and that
met every defect class seeds 0-3999 ever met; the `long` test runs LONG_SEEDS more (from
2000 on, so `make test-long` still covers 0-43999). A failing seed prints the command that
replays it with its trace."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from kvhandoff.testing.simulator import (
    SimConfig,
    Simulation,
    Violation,
    replay_command,
    run_seed,
    run_seeds,
)
from kvhandoff.testing.simulator.core import Agent

from .test_defects import DECODE, PREFILL, open_until_accepted, scripted

SEEDS = 2000
LONG_SEEDS = 42000


def report(found: list[Violation], ran: int) -> str:
    """What failed, the replay command of each, and the trace of the first."""
    kinds = Counter(v.invariant for v in found)
    lines = [f"{len(found)} of {ran} seeds broke an invariant: {dict(kinds)}"]
    lines += [f"  seed {v.seed}: {v.invariant}: {v.detail[:160]}"
              + (f"\n    likely cause: {v.cause}" if v.cause else "")
              + f"\n    replay: {replay_command(v.seed)}" for v in found[:12]]
    try:
        run_seed(found[0].seed, trace=True)
    except Violation as first:
        lines += [f"trace of seed {first.seed} (last 80 steps):"] + first.trace[-80:]
    return "\n".join(lines)


def check(seeds: range) -> None:
    ran, found = run_seeds(seeds)
    assert ran == len(seeds)
    assert not found, report(found, ran)


@pytest.mark.timeout(900)  # ~25 s of CPU; more on a shared host
def test_every_seed_holds_every_invariant() -> None:
    """No page goes back while a write can land, Success means every byte is the prefill's,
    both sides end and agree, nothing grows: over SEEDS schedules with faults."""
    check(range(SEEDS))


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_many_more_seeds_hold_every_invariant() -> None:
    check(range(SEEDS, SEEDS + LONG_SEEDS))


@pytest.mark.parametrize("seed", [0, 7, 117, 1170])
def test_a_seed_replays_exactly(seed: int) -> None:
    def once() -> tuple[str, list[str]]:
        sim = Simulation(seed, trace=True)
        try:
            out = sim.play()
        except Violation as v:
            return f"violation {v.invariant} at step {v.step}", sim.trace
        return f"ok {out.steps} steps {out.states}", sim.trace

    first, again = once(), once()
    assert first == again
    assert len(first[1]) > 20  # the trace holds the steps


def test_the_seeds_cover_what_the_faults_and_shapes_promise() -> None:
    """The seed range of `make test` does open fan-in and fan-out rooms, reuse room ids, and
    hit every kind of fault, with one- and two-sided rooms."""
    faults: Counter[str] = Counter()
    shapes: Counter[str] = Counter()
    for seed in range(200):
        sim = Simulation(seed)
        for inst in sim.instances:
            shapes["fan-in" if len(inst.prefills) > 1 else
                   "fan-out" if len(inst.decodes) > 1 else "1:1"] += 1
        rooms = [inst.room for inst in sim.instances]
        shapes["reused id"] += len(rooms) - len(set(rooms))
        shapes["two-sided agent"] += sum(not a.writes for a in sim.agents.values())
        try:
            out = sim.play()
        except Violation:
            continue
        for f in out.faults:
            faults[f.split(" of ")[0].split()[1] if f.startswith(("prefill", "decode"))
                   else f.split()[0] + " " + f.split()[1]] += 1
    assert {"fan-in", "fan-out", "1:1", "reused id", "two-sided agent"} <= set(shapes)
    assert {"paused", "died", "engine abort", "engine timeout", "clock jumps",
            "the next"} <= set(faults), faults


def test_the_command_line_replays_a_seed_with_its_trace() -> None:
    cmd = [sys.executable, "-m", "kvhandoff.testing.simulator"]
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--seed" in helped.stdout and "--trace" in helped.stdout
    done = subprocess.run([*cmd, "--seed", "3", "--trace"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode in (0, 1), done.stderr
    assert "agents: prefill:0" in done.stdout
    assert ("ok seed 3:" in done.stdout) == (done.returncode == 0)
    if done.returncode:
        assert replay_command(3) in done.stdout


class LyingTransport(Simulation):
    """A transport that ends every cancelled write and confirms the cancel at once, while
    the write goes on landing."""

    def _stop_ops(self, a: Agent, peer: str, tag: int | None) -> None:
        for fl in list(self.flights.values()):
            if fl.writer is a and fl.dest.name == peer and (tag is None or tag in fl.tags):
                self._spend(fl, a, "cancelled")  # its completion is spent; the bytes land later


def test_a_transport_that_confirms_a_cancel_it_did_not_do_is_caught() -> None:
    sim = scripted(LyingTransport)
    inst = open_until_accepted(sim)
    sim.deliver(PREFILL, DECODE, len(sim.queued(PREFILL, DECODE)))  # the decode accepted
    sim.abort(inst, DECODE)  # the decode holds its pages until the prefill says it stopped
    assert sim.views[inst.tokens[DECODE]].releases == 0
    with pytest.raises(Violation) as caught:  # the prefill cancels, "confirmed": AbortAck
        sim.drain(land=False)
    # the prefill hands its source pages back first (its ops "ended"), then the decode
    assert caught.value.invariant in ("source-released-in-flight", "released-while-in-flight")


class StraySpans(Simulation):
    """A transport that lands every write one page further than its plan says."""

    def _pages(self, dest: Agent, region: str, offsets: object, nbytes: object
               ) -> tuple[int, ...]:
        pages = super()._pages(dest, region, offsets, nbytes)  # type: ignore[arg-type]
        return tuple(p + 1 for p in pages)


def test_a_write_outside_the_offered_pages_is_caught() -> None:
    with pytest.raises(Violation) as caught:
        StraySpans(5, SimConfig(force=(("writes", True), ("faults", 0)))).play()
    assert caught.value.invariant == "landed-outside-room"
