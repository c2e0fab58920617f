"""kvhandoff.engine_sim — a simulated engine on each side of a handoff, run as real processes (the
demo, the bench, tests).

Three modules, one job each:
- `engine_sim.pattern`: the deterministic page contents (`pattern`, `write_tokens`, `check_tokens`,
  `PREFIX_MARKER`), so a decode checks what landed without seeing the prefill's memory;
- `engine_sim.engine`: one simulated engine (`run_prefill`, `run_decode`, `main`) around a
  `TransferAgent`; ``python -m kvhandoff.engine_sim prefill|decode '<json config>'`` runs one and
  prints its events, one JSON object per line;
- `engine_sim.process`: the parent's side (`spawn`, `EngineProcess`): starts such a process
  and waits, bounded, for its events.

Rules: nothing is re-exported here (each name has one import path); product code may import
this package (the demo and the bench do), so it never imports `kvhandoff.testing`.
"""
