"""Mutation run of the protocol's release rules against the simulator's seeds.

Each mutant changes one rule in `protocol/roomstate.py`, `protocol/rooms.py` or
`protocol/inflight.py` (what holds a leg's pages, what releases them, what counts an op in
flight), or of the recheck a woken agent makes before it reads on (`protocol/peers.py`,
`peerstate.py`, `receive.py`, `session.py`: what keeps a room its peer gave up from ending
Success). The
script applies the mutants one at a time to a copy of `src/`, runs the simulator's seeds on
it (`python -m kvhandoff.testing.simulator --seeds N --stop`) and reports each as killed (a
seed broke an invariant, or the run failed) or survived. A survivor is either a gap of the
simulator or a mutant that cannot change behaviour (equivalent): docs/RELIABILITY.md
says which, with the reason. Pure Python, no dependencies beyond the project's.

    python scripts/mutate_release_rules.py                 # every mutant, seeds 0..1999
    python scripts/mutate_release_rules.py --seeds 200 --only cancel-never-holds

A mutant the seeds miss is run against the unit tests of the protocol (UNIT_TESTS): it must be
killed there and listed in SIM_GAPS (why the simulator misses it), or survive there too and be
listed in EQUIVALENT (why it cannot change behaviour). Exit status 0 when every mutant is
accounted for so, 1 otherwise; 2 when the unmutated tree fails, or a mutant no longer applies
(its text moved).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "kvhandoff/protocol/"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/kvhandoff/protocol/
    old: str  # the text replaced (must occur exactly once)
    new: str
    what: str


MUTANTS: tuple[Mutant, ...] = (
    # --- roomstate.Fence: what holds a leg's pages
    Mutant("one-completion-clears-the-tag", "roomstate.py",
           """            left = self.tags.get(tag, 1) - 1
            if left:""",
           """            left = 0
            if left:""",
           "one completion clears every op of a tag"),
    Mutant("cancel-never-holds", "roomstate.py",
           "        self.cancelling.add(tag)\n",
           "        pass\n",
           "a cancel never holds (an unanswered cancel does not fence the pages)"),
    Mutant("failed-stop-does-not-hold", "roomstate.py",
           "first, self.stop_failed = not self.stop_failed, True",
           "first, self.stop_failed = not self.stop_failed, False",
           "a failed stop does not hold"),
    Mutant("fence-ignores-peer-writes", "roomstate.py",
           "        return self.own_writes or self.remote_writes\n",
           "        return self.own_writes\n",
           "the fence ignores the peer's writes"),
    Mutant("offered-buffers-not-fenced", "roomstate.py",
           "self.remote_writes = self.remote_writes or writable",
           "self.remote_writes = self.remote_writes",
           "buffers offered are not fenced"),
    Mutant("accept-never-fences", "roomstate.py",
           "        self.remote_writes = one_sided\n",
           "        self.remote_writes = False\n",
           "an accept of one-sided writes does not fence the peer's writes"),
    Mutant("ops-in-flight-do-not-hold", "roomstate.py",
           "return bool(self.tags or self.cancelling or self.stop_failed)",
           "return bool(self.cancelling or self.stop_failed)",
           "ops in flight do not hold"),
    Mutant("writer-stopped-says-no", "roomstate.py",
           """        was, self.remote_writes = self.remote_writes, False
        return was""",
           """        was, self.remote_writes = self.remote_writes, False
        return False""",
           "writer_stopped never reports that the writer had been writing"),
    Mutant("cancel-never-answered", "roomstate.py",
           "        self.cancelling.discard(tag)\n",
           "        pass\n",
           "a cancel's answer never clears it"),
    Mutant("stop-bound-never-passes", "roomstate.py",
           """    def stop_bound_passed(self) -> None:
        self.stop_failed = False""",
           """    def stop_bound_passed(self) -> None:
        pass""",
           "the bound after a failed stop never lets the pages go"),
    Mutant("no-ack-owed", "roomstate.py",
           "        self.ack_when_stopped = True\n",
           "        pass\n",
           "an AbortAck owed once writes stop is never sent"),
    # --- roomstate.LegState / RoomState: when a leg and a room are released
    Mutant("leg-released-before-terminal", "roomstate.py",
           """        if self.machine.is_terminal and not self.released and not self.fence.holds:
            self.phase = LegPhase.RELEASED""",
           """        if not self.released and not self.fence.holds:
            self.phase = LegPhase.RELEASED""",
           "a leg is released before it is terminal"),
    Mutant("room-released-with-one-leg", "roomstate.py",
           "or not all(leg.released for leg in self.legs):\n            return False",
           "or not any(leg.released for leg in self.legs):\n            return False",
           "a room is released once any (not every) leg is"),
    Mutant("room-released-before-done", "roomstate.py",
           "        if not self.done or self.released or not all(",
           "        if self.released or not all(",
           "a room is released before it is done (the phase check then refuses it)"),
    Mutant("failure-not-in-poll", "roomstate.py",
           """        if self.failure is not None:
            return KVPoll.Failed
        if self.all_legs:""",
           """        if self.all_legs:""",
           "a room's failure does not make it Failed"),
    Mutant("missing-legs-count-as-all", "roomstate.py",
           "return self.expected is not None and len(self.legs) >= self.expected",
           "return self.expected is not None and len(self.legs) >= min(self.expected, 1)",
           "a room with fewer legs than it expects counts as whole"),
    # --- rooms.py
    Mutant("leg-state-not-in-room", "rooms.py",
           """        self.legs.append(leg)
        self.state.add(leg.state)""",
           """        self.legs.append(leg)""",
           "a leg's state does not join its room's"),
    Mutant("unit-done-ignores-chunks", "rooms.py",
           """        if len(ends) > 1 and any(Unit(unit.layer, c) not in self.units_done
                                 for c in range(len(ends))):
            return None""",
           "",
           "a layer counts as landed when one chunk of it did"),
    # --- inflight.py: ops in flight
    Mutant("post-not-fenced", "inflight.py",
           "        r.state.fence.posted(tags)\n",
           "",
           "an op posted is not counted in the fence"),
    Mutant("completion-not-counted", "inflight.py",
           "        r.state.fence.completed(op.tags)\n",
           "",
           "a completion is not taken off the fence"),
    Mutant("last-completion-releases-nothing", "inflight.py",
           """        if r.state.terminal:
            self.rooms.maybe_release(r)
            return None""",
           """        if r.state.terminal:
            return None""",
           "the last completion of a terminal leg does not release it"),
    Mutant("stale-hash-accepted", "inflight.py",
           "if r.state.terminal or r.progress.posted.get(job.unit) != job.attempt:",
           "if r.state.terminal:",
           "a hashing job of an earlier attempt is taken for the current one"),
    # --- peers / peerstate / receive: the recheck of a woken agent (what keeps a room a peer
    # gave up from ending Success here)
    Mutant("woken-agent-reads-on", "peers.py",
           "            p.state.recheck_sent(rc)\n",
           "            pass\n",
           "a woken agent asks, but reads its peer's room messages on without the answer"),
    Mutant("rechecked-success-not-held", "receive.py",
           "if r.state.terminal or (p is not None and p.state.recheck is not None):",
           "if r.state.terminal:",
           "a decode room ends Success while its prefill's answer is out"),
    Mutant("any-answer-passes", "peerstate.py",
           "if self.recheck is None or probe != self.recheck.probe:",
           "if self.recheck is None:",
           "an answer to another probe ends the recheck"),
    Mutant("answered-during-a-new-handshake", "peers.py",
           """        if p.matched:
            ctx = self.ctx""",
           """        if True:
            ctx = self.ctx""",
           "a peer answers a probe while its new handshake with the asker is under way"),
    Mutant("unanswered-recheck-never-fails", "peers.py",
           "                if waited > 2 * beat:",
           "                if False:",
           "a recheck nobody answers never declares the peer lost"),
    Mutant("held-messages-dropped", "peers.py",
           """            self._replay_backlog(p)
        return True""",
           """            p.backlog = []
        return True""",
           "the room messages held during a recheck are dropped at the answer"),
    Mutant("answered-then-gives-up", "peers.py",
           "                p.state.recheck_peer_asked(ctx.now)\n",
           "                pass\n",
           "a rechecked peer that asks too is told yes, but the wait for its own answer still "
           "counts from this agent's question (it can give the peer up right after the yes)"),
    Mutant("dropped-news-ignored", "session.py",
           "        if isinstance(msg, P.Failed) and msg.dropped_gen == self.ctx.me.generation:\n",
           "        if False:\n",
           "a Failed saying its sender dropped this agent fails that one room only"),
)

#: Mutants the simulator's seeds cannot kill, with the reason; each must survive the unit tests
#: too (docs/RELIABILITY.md explains them)
EQUIVALENT: dict[str, str] = {}

#: Mutants the simulator's seeds miss (a gap of the simulator, with the reason) which the unit
#: tests (UNIT_TESTS) must kill
SIM_GAPS: dict[str, str] = {
    "one-completion-clears-the-tag":
        "equivalent as the protocol uses the fence: a leg never has two ops of one data tag "
        "in flight (a tag names the transfer, layer, region and attempt; each is posted once "
        "per leg, a retransmit is the next attempt), so a tag's count is never above 1 "
        "(tests/unit/simulator/test_mutants.py checks it over the seeds); the fence's own unit "
        "test posts a tag twice",
    "room-released-before-done":
        "equivalent as the protocol uses it: RoomState.release runs right after finish(), "
        "which makes a room whose legs are all released (so terminal) DONE; the room state's "
        "own unit test calls release() on an open room",
    "no-ack-owed":
        "a liveness rule: without the AbortAck the decode still releases, after its write "
        "quarantine; the simulator checks safety and termination, not how soon",
    "leg-released-before-terminal":
        "every release of a leg the simulator reaches is of a terminal one; a live leg is "
        "released only through a re-handshake after a peer's NO_HANDSHAKE Reject, which keeps "
        "unaccepted legs open across the dropped peer (not scheduled)",
    "unit-done-ignores-chunks":
        "chunked prefill (AddChunk) is not simulated",
    "stale-hash-accepted":
        "needs a retransmit (a flipped byte) while the previous attempt's verification is "
        "still hashing: not reached in seeds 0-1999",
    "any-answer-passes":
        "needs an answer to an earlier probe (or a made-up one) to reach an agent whose newer "
        "recheck is out: the seeds forge nothing and rarely stall an agent twice within one "
        "recheck's round trip",
    "answered-during-a-new-handshake":
        "needs a peer that dropped the woken agent and said Hello to it again before its "
        "probe arrived: not reached in seeds 0-1999",
    "unanswered-recheck-never-fails":
        "a liveness rule: the rooms with a peer that never answers still end, by their own "
        "deadlines (stall, lease), and the invariants check safety and termination, not how "
        "soon",
    "held-messages-dropped":
        "the rooms whose messages were dropped still end, Failed on both sides by their "
        "deadlines: the invariants check that sides agree and rooms end, not that a room "
        "that could succeed does",
    "answered-then-gives-up":
        "needs both agents stalled, the second waking after the first's wait for its answer "
        "ran out and asking it before that first gives it up: seed 13733 of the long run "
        "(seeds 2000-43999), not reached in seeds 0-1999",
    "dropped-news-ignored":
        "needs a decode that is not stalled but whose heartbeats reach its prefill too late, "
        "and that reads one room's Failed before it ends another room Success: seed 22452 of "
        "the long run, not reached in seeds 0-1999",
}

UNIT_TESTS = "tests/unit/protocol"


def run_seeds(src: Path, seeds: int, timeout_s: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "kvhandoff.testing.simulator", "--seeds", str(seeds), "--stop"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=src.parent)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    out = (done.stdout + done.stderr).strip().splitlines()
    first = next((ln for ln in out if "invariant" in ln or "Error" in ln), out[-1] if out else "")
    return done.returncode, first.strip()


def run_unit_tests(src: Path, timeout_s: float) -> int:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", UNIT_TESTS]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        return 124


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2000, help="seeds 0..N-1 (default 2000)")
    ap.add_argument("--only", action="append", default=[], help="run this mutant (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per mutant, seconds")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    with tempfile.TemporaryDirectory(prefix="kvh-mutants-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        rc, line = run_seeds(src, a.seeds, a.timeout)
        if rc != 0:
            print(f"the unmutated tree fails the seeds: {line}")
            return 2
        killed, by_units, equivalent, wrong, bad = [], [], [], [], []
        for m in chosen:
            path = src / PROTO / m.file
            text = (ROOT / "src" / PROTO / m.file).read_text()
            if text.count(m.old) != 1:
                print(f"{m.name}: its text occurs {text.count(m.old)} times in {m.file}")
                bad.append(m.name)
                continue
            path.write_text(text.replace(m.old, m.new))
            t0 = time.monotonic()
            try:
                rc, line = run_seeds(src, a.seeds, a.timeout)
                units = None if rc != 0 else run_unit_tests(src, a.timeout)
            finally:
                path.write_text(text)
            took = f"{m.what}; {time.monotonic() - t0:.0f}s"
            if rc != 0:
                killed.append(m.name)
                print(f"killed     {m.name} ({took}): {line[:200]}", flush=True)
            elif units != 0 and m.name in SIM_GAPS:
                by_units.append(m.name)
                print(f"unit-only  {m.name} ({took}): survives the seeds ({SIM_GAPS[m.name]}); "
                      f"{UNIT_TESTS} kill it", flush=True)
            elif units == 0 and m.name in EQUIVALENT:
                equivalent.append(m.name)
                print(f"equivalent {m.name} ({took}): {EQUIVALENT[m.name]}", flush=True)
            else:
                wrong.append(m.name)
                print(f"SURVIVED   {m.name} ({took}): the seeds "
                      f"{'and the unit tests ' if units == 0 else ''}miss it, and it is not "
                      f"listed as {'equivalent' if units == 0 else 'a simulator gap'}",
                      flush=True)
        print(f"{len(chosen)} mutants, seeds 0..{a.seeds - 1}: {len(killed)} killed by the "
              f"simulator, {len(by_units)} only by {UNIT_TESTS}, {len(equivalent)} "
              f"equivalent, {len(wrong)} unexplained, {len(bad)} not applied")
        if bad:
            return 2
        return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
