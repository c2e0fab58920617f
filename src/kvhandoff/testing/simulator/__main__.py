"""`python -m kvhandoff.testing.simulator`: run seeds of the simulator, or replay one.

    python -m kvhandoff.testing.simulator --seeds 2000        # seeds 0..1999, a summary
    python -m kvhandoff.testing.simulator --seed 17 --trace   # one seed, its step trace

Exit status 1 when an invariant broke (the first violation of each seed is printed with the
command that replays it)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from kvhandoff.testing.simulator.core import (
    SimConfig,
    Simulation,
    Violation,
    run_seed,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvhandoff.testing.simulator",
                                 description="Deterministic simulation of the kvhandoff "
                                 "transfer protocol: one seeded PRNG picks every delivery, "
                                 "completion, timer, engine call and fault; invariants are "
                                 "checked after every step.")
    ap.add_argument("--seed", type=int, help="run this one seed")
    ap.add_argument("--seeds", type=int, default=200,
                    help="run seeds FIRST..FIRST+N-1 (default 200)")
    ap.add_argument("--first", type=int, default=0, help="first seed of --seeds (default 0)")
    ap.add_argument("--trace", action="store_true",
                    help="print the step trace of --seed (or of each failing seed)")
    ap.add_argument("--stop", action="store_true", help="stop at the first failing seed")
    ap.add_argument("--frozen-writer-resumes", action="store_true",
                    help="a write whose writer was paused may land whenever it wakes, past "
                    "its bound (as the shm writer's copy does today)")
    args = ap.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.first,
                                                            args.first + args.seeds)
    cfg = SimConfig(frozen_writer_resumes=args.frozen_writer_resumes)
    failed: Counter[str] = Counter()
    t0 = time.perf_counter()
    n = 0
    for seed in seeds:
        n += 1
        try:
            out = run_seed(seed, cfg, trace=args.trace and args.seed is not None)
        except Violation as v:
            failed[v.invariant] += 1
            if args.trace:
                if args.seed is None:
                    try:
                        run_seed(seed, cfg, trace=True)
                    except Violation as again:
                        v = again
                print("\n".join(v.trace))
            print(f"FAIL seed {seed}: {v.invariant}: {v.detail}")
            if v.cause:
                print(f"  likely cause: {v.cause}")
            print(f"  replay: {v.replay}")
            if args.stop:
                break
            continue
        if args.seed is not None:
            if args.trace:
                print("\n".join(_trace_of(seed, cfg)))
            print(f"ok seed {seed}: {out.steps} steps, {out.sim_time_s:.1f}s simulated, "
                  f"{out.instances} room instance(s), faults {list(out.faults)}")
            print("  " + ", ".join(out.states))
    dt = time.perf_counter() - t0
    print(f"{n} seed(s) in {dt:.1f}s: {n - sum(failed.values())} ok"
          + "".join(f", {k}: {v}" for k, v in sorted(failed.items())))
    return 1 if failed else 0


def _trace_of(seed: int, cfg: SimConfig) -> list[str]:
    sim = Simulation(seed, cfg, trace=True)
    sim.play()
    return sim.trace


if __name__ == "__main__":
    sys.exit(main())
