"""A deterministic simulator of the kvhandoff transfer protocol (`TransferSession`s, sans-IO),
each driven by production's effect driver (`runtime.executor.Executor`) over simulated parts
(`parts`: transport, peer calls, hasher pool, outbox, views).

One seeded PRNG (`random.Random(seed)`) decides everything: how many prefill and decode agents
(1-2 of each), which rooms they open (one prefill rank to one decode rank, TP fan-in: a decode
room read from two prefill ranks, TP fan-out: a prefill room served to two decode ranks), the
settings (one-sided writes or two-sided sends per agent, checksums full or off per agent), and
then, step by step, which of the pending things happens next: a control message delivered, a
transport or hasher completion handed back, a queued event fed (engine calls and completions
wait in the agent's queue, as in the control loop's), a pass ended (the writes it held, then
its messages), a peer call run (connect, register, cancel, disconnect), a one-sided write or a
two-sided transfer landing into the destination's memory, a timer, an engine call (open,
offer pages, mark a layer ready, abort), or a fault. The same seed gives the same run;
`python -m kvhandoff.testing.simulator --seed N --trace` replays one with its step trace.

What is simulated, and how the real system is followed:
- Control messages go through the real wire format (`protocol.encode` / `decode`) into one
  FIFO per (sender, receiver), as a ZMQ DEALER or the same-host Unix socket keeps them; across
  connections, and between messages, completions and writes, any order may happen.
- Page contents are real byte buffers (`memory.make_side`'s `BufferSet`s): each room instance
  writes its own byte pattern (`kvhandoff.engine_sim`'s, seeded per instance) into the prefill's
  pages, a decode page the engine takes is filled with 0xFF, and a page a room hands back is
  scribbled (0xFE on the prefill), so a stale or misplaced byte shows.
- A one-sided write (`PostWrite`) stays in flight until the PRNG lands it, one part (region)
  at a time, reading the source when it lands; its `Written` completes later, in any order with
  other completions. A `Cancel` or `DropPeer` runs on the agent's peer-call worker when the
  seed says; the ops it names end at once ("cancelled", as the transports' do) while each copy
  is stopped, or lands first (the call waits, and that peer's later calls behind it), or is
  stuck (one in ten): the call fails and the copy may land later, within its bound.
  Two-sided sends and receives are matched by (sender, receiver, tag) and land the same way.
  The transport gives up a write that did not land within the writer's
  `stall_timeout_s` of its post (`SimConfig.frozen_writer_resumes`: a write whose writer was
  stopped meanwhile may land whenever it wakes, as shm's copy does today); a write from a
  stopped (paused) writer does not progress until it resumes; a dead writer's writes never
  land; writes into a stopped decode do land (stopping a process does not stop writes into
  its memory). A running agent is ticked within 0.1 s of when its session asked.
- Faults, at any step and for any length: a paused agent (SIGSTOP: it handles nothing, its
  writes stop, its peers go on), an agent's death (its process ends; sometimes its peers'
  transport knows, as shm's pidfd does: `PeerExited`), an engine abort or engine timeout
  (`AbortRoom`), a room id reopened once the engine saw its previous room end (possibly before
  that room's pages came back), a byte flipped in a landing write, clock jumps.

Invariants, checked at every step that could break them and once the run settled
(`Violation` names the first that fails, the known defect it looks like, and the command that
replays it):
- `released-while-in-flight`: a decode room's pages go back to the engine (`Release`) while a
  write or receive into them is still in flight (the shadow model: the transport's own table of
  what can still land).
- `landed-outside-room`: a write lands in a decode page that the room it was planned for does
  not hold any more (freed, or given to another room) or that its `TransferRequest` never
  offered; `source-released-in-flight`: a prefill room's pages go back while a write still
  reads them.
- `success-wrong-bytes`: a decode room ends Success while a byte of one of its pages differs
  from the prefill's pattern (unless a byte was flipped and the decode itself runs without
  checksums).
- `double-release`, `prefill-success-decode-failed` (the prefill ends Success, a decode rank of
  the same room Failed), `success-after-given-up` (a decode rank ends a room Success after
  its prefill rank failed that room by declaring this decode lost: what a woken decode must
  ask about before it reads on), `not-terminal` (a room of a live agent not terminal and released
  within `settle_bound_s` simulated seconds after the last fault), `unbounded` (after the
  retention periods, a session still holds rooms, legs, early messages, ops, jobs or
  cancels).

A test may also script the start of a schedule (`Simulation.add_instance`, `engine`,
`deliver`, `drain`, `pause`, `abort`) and `play()` the rest under the PRNG
(`tests/unit/simulator/test_defects.py`).

Left out (real transport semantics the simulator does not model): partial pieces of one
region's write (a part lands whole), shm's writer read-back (`Written.landed`), chunked
prefill (`AddChunk`), a decode's cached prefix, route lookups (`PeersResolved`: the decode
names its prefill ranks), HMAC, peers restarting under a new generation, message loss other
than by death, CUDA memory, and the control loop's own pass (its socket reads and their
quarter-heartbeat bounds). A replay is exact within one Python build and process layout: the
session iterates one set of legs (re-handshaking after a peer's `Reject`) in the order of
their addresses.
"""

from kvhandoff.testing.simulator.core import (
    Outcome,
    SimConfig,
    Simulation,
    Violation,
    replay_command,
    run_seed,
    run_seeds,
)

__all__ = ["Outcome", "SimConfig", "Simulation", "Violation", "replay_command", "run_seed",
           "run_seeds"]
