"""The simulator's world: agents, the simulated network and transport, the engines, the faults,
and the invariants (see the package doc for what each models and what it leaves out).

Each agent is its `TransferSession` driven by production's `runtime.executor.Executor`, handed
the simulated parts of `parts` (transport, peer calls, hasher pool, outbox, views): what the
executor does (a pass's held writes, the flush before a cancel, the peer calls' outcomes, the
hashing dispatch) is production's code; when each part's work happens is this world's seed.

Rules:
- One PRNG (`random.Random(seed)`) makes every choice, and nothing iterates a set of objects
  or reads a real clock, so a seed replays exactly.
- The shadow model of what can still land is the simulated transport's own table of writes and
  transfers in flight (`Flight`): a write can land while its writer is alive and its bound
  (the writer's `stall_timeout_s` after its post) has not passed.
- An invariant is checked where the step that could break it happens (a release, a landing, a
  room's end), and the settled state once the run ends; the first one broken raises
  `Violation` with the step and, when asked for, the trace.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.buffers.devsum import room_checksum
from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import FailureKind, TransportError
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Effect, HashSpans, Log, Release, RoomUpdate
from kvhandoff.protocol.peers import FORGOTTEN_KEEP_S
from kvhandoff.runtime.executor import Call, Executor, Parts
from kvhandoff.runtime.hashing import HASH_INLINE_BYTES, Hasher
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.clock import FakeClock
from kvhandoff.testing.memory import Side, View, make_side
from kvhandoff.testing.simulator.parts import (
    SimCalls,
    SimOutbox,
    SimPool,
    SimTransport,
    SimViews,
    log_part,
)
from kvhandoff.transports.base import OnDone, OnWritten, WriteResult, WriteSpec

PAGE_TOKENS = 16
DECODE_FILL = 0xFF  # a decode page the engine takes (never a pattern byte: those are < 251)
PREFILL_SCRIBBLE = 0xFE  # a prefill page handed back to its engine, which reuses it
TICK_SLACK_S = 0.1  # how late a running agent's due tick may come (its loop is busy)
REPLAY = "python -m kvhandoff.testing.simulator --seed {seed} --trace"


def sim_layout() -> LayoutSpec:
    """Four layers of MLA main KV and a suffix-only indexer on two of them, 16-token pages."""
    return mla_dsa_layout(model="sim", num_layers=4, indexer_layer_ids=(1, 3),
                          page_size_tokens=PAGE_TOKENS).without_page_rules()


def replay_command(seed: int, config: SimConfig | None = None) -> str:
    """The one command that replays `seed` (run with `config`) with its step trace."""
    extra = " --frozen-writer-resumes" if config is not None and \
        config.frozen_writer_resumes else ""
    return REPLAY.format(seed=seed) + extra


class Violation(AssertionError):
    """An invariant failed: which one, what was seen, at which step of which seed."""

    def __init__(self, invariant: str, detail: str, *, seed: int, step: int, now: float,
                 trace: list[str], cause: str = "", replay: str = "") -> None:
        self.invariant, self.detail, self.seed, self.step = invariant, detail, seed, step
        self.now, self.trace, self.cause = now, trace, cause
        self.replay = replay or replay_command(seed)
        why = f"\nlikely cause: {cause}" if cause else ""
        super().__init__(f"seed {seed}: invariant {invariant} broken at step {step} "
                         f"(t={now:.3f}): {detail}{why}\nreplay: {self.replay}")


@dataclass(frozen=True)
class SimConfig:
    """What a run may do. `settings`: overrides for every agent's `Settings` (the defaults of
    the simulated agents are the product's, but shorter bootstrap / waiting deadlines)."""

    max_instances: int = 5  # room instances opened per run (a reused id is a new instance)
    pages: int = 10  # pages per agent's pool
    max_faults: int = 4
    max_steps: int = 5000  # steps of the main phase; then no new fault, and the run settles
    settings: tuple[tuple[str, Any], ...] = ()
    #: a write whose writer was stopped (paused) while it was in flight may land whenever the
    #: writer wakes, past its bound (the shm writer's copy does: docs/RELIABILITY.md, open);
    #: False: the transport gives up every write `stall_timeout_s` after its post
    frozen_writer_resumes: bool = False
    #: force these per-seed choices (tests that script one defect): e.g. ("checksum", ...)
    force: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What one seed's run did (for the CLI and the tests' counts)."""

    seed: int
    steps: int
    sim_time_s: float
    instances: int
    faults: tuple[str, ...]
    states: tuple[str, ...]  # per instance and side: "room@side=Success"


class Token:
    """The engine's handle identity of one room instance on one side (the session compares
    tokens by identity; a reused room id gets a new token)."""

    __slots__ = ("inst", "opened", "room", "side")

    def __init__(self, inst: int, room: int, side: str, opened: int) -> None:
        # opened: how many control messages had been sent when the engine opened it
        self.inst, self.room, self.side, self.opened = inst, room, side, opened

    def __repr__(self) -> str:
        return f"room {self.room}#{self.inst}@{self.side}"


@dataclass(eq=False)
class Instance:
    """One room opened by the engines: its id, prefill and decode ranks, pattern, length."""

    serial: int
    room: int
    pattern: int
    seq_len: int
    prefills: list[str]
    decodes: list[str]
    tokens: dict[str, Token] = field(default_factory=dict)
    pages: dict[str, np.ndarray] = field(default_factory=dict)
    flipped: bool = False  # a byte of one of its writes was flipped


_Queued = tuple[ev.Event | None, None, None]  # the executor's queue entries, as the loop's


@dataclass(eq=False)
class Agent:
    """One simulated process: its session (`side`), the production executor that drives it
    with this world's parts, its event queue, and what the simulator knows of it."""

    side: Side
    role: Role
    writes: bool
    checksum: str
    free: list[int]
    owner: list[Token | None]
    alive: bool = True
    paused_until: float | None = None
    #: (from, to) of each time it did not run: paused, or every agent at a clock jump
    pauses: list[tuple[float, float]] = field(default_factory=list)
    exit_known: bool = False  # its peers' transport learns that its process ended
    read_at: float = 0.0
    #: what its executor's parts posted (completions, call outcomes, engine calls), fed when
    #: the seed says, as the control loop's queue
    queue: deque[_Queued] = field(default_factory=deque)
    pass_open: bool = False  # events were fed since its pass last ended
    executor: Executor = field(init=False)
    outbox: SimOutbox = field(init=False)

    @property
    def name(self) -> str:
        return self.side.name

    @property
    def running(self) -> bool:
        return self.alive and self.paused_until is None

    def post(self, event: ev.Event) -> None:
        self.queue.append((event, None, None))

    @property
    def holds(self) -> bool:
        """Its pass holds writes or messages that leave when it ends."""
        return self.pass_open and (self.executor.batch.pending or bool(self.outbox.queue))



@dataclass(eq=False)
class Part:
    src_buf: str
    src_off: np.ndarray
    src_len: np.ndarray
    dst_buf: str
    dst_off: np.ndarray
    dst_len: np.ndarray
    pages: tuple[int, ...]  # destination pages it touches
    region: str


@dataclass(eq=False)
class Flight:
    """A one-sided write job, or a matched two-sided send/receive, not yet ended."""

    fid: int
    writer: Agent
    dest: Agent
    parts: list[Part]
    tags: tuple[int, ...]
    posted_at: float
    bound_at: float
    on_written: OnWritten | None  # one-sided: the write job's completion (None once spent)
    checksum: bool
    send_done: OnDone | None = None  # two-sided: the sender's and the receiver's completions
    recv_done: OnDone | None = None
    xfer: int = 0
    src_token: Token | None = None
    dst_token: Token | None = None
    landed: int = 0
    frozen: bool = False  # its writer was stopped while it was in flight
    stuck_until: float = 0.0  # a copy that did not stop when cancelled lands no sooner
    digests: list[int | None] = field(default_factory=list)
    waiters: list[CancelWait] = field(default_factory=list)


@dataclass(eq=False)
class CancelWait:
    """A cancel or disconnect call that waits for copies to stop (they land first)."""

    agent: Agent
    peer: str
    tag: int | None
    left: set[int]  # flight ids still to end


@dataclass(eq=False)
class _Op:
    """A two-sided send or receive posted and not yet matched."""

    agent: Agent
    on_done: OnDone
    buffer: str
    offsets: np.ndarray
    nbytes: np.ndarray


@dataclass(eq=False)
class Script:
    """What one engine does for one room instance, in order."""

    inst: Instance
    agent: Agent
    actions: deque[tuple[str, int]]


class Simulation:
    """One seeded run (see the package doc). `play()` raises `Violation` or returns an
    `Outcome`. A test may script the start of a schedule (`add_instance`, `engine`,
    `deliver`, `drain`, `pause`, `abort`) and `play()` the rest."""

    def __init__(self, seed: int, config: SimConfig | None = None, *,
                 trace: bool = False) -> None:
        self.clock = FakeClock()
        self.seed = seed
        self.config = config or SimConfig()
        self.rng = random.Random(seed)
        self.tracing = trace
        self.trace: list[str] = []
        self.steps = 0
        self.agents: dict[str, Agent] = {}
        self.instances: list[Instance] = []
        self.scripts: list[Script] = []
        self.views: dict[Token, View] = {}
        self.channels: dict[tuple[str, str], deque[tuple[Any, int]]] = {}
        #: completions of the transport and the hasher not yet handed back, run in any order
        self.pending: list[tuple[Agent, Callable[[], None]]] = []
        #: each (agent, peer)'s peer calls, in order; a call that waits on copies to stop
        #: (`blocked`) holds the later ones, its outcome posted once they stopped
        self.calls: dict[tuple[str, str], list[Call]] = {}
        self.blocked: dict[tuple[str, str], tuple[CancelWait, list[ev.Event]]] = {}
        self._waiting: CancelWait | None = None  # set by a call that must wait (`_stop_ops`)
        self._sends: dict[tuple[str, str, int], deque[_Op]] = {}
        self._recvs: dict[tuple[str, str, int], deque[_Op]] = {}
        self.flights: dict[int, Flight] = {}
        self.xfers: dict[tuple[str, int], tuple[Token | None, dict[str, set[int]]]] = {}
        self.faults: list[str] = []
        self.faults_left = 0
        self.last_fault = 0.0
        self.flip_next = False
        #: scripted runs: what every cancel does (< 0.65: stops the write, < 0.9: the write
        #: lands first and the cancel is confirmed after, else the cancel fails); None: the PRNG
        self.cancel_roll: float | None = None
        self._fid = 0
        # what the causes of a violation are read from (`_release_cause`)
        self.quarantined: set[tuple[str, int]] = set()  # (decode, room) freed by quarantine
        self.release_cause: dict[Token, str] = {}
        self.stale_stop: dict[Token, str] = {}  # rooms a message of an earlier room reached
        self.stale_done: dict[Token, str] = {}  # rooms a LayerDone came to before the accept
        self._delivering: tuple[Any, int] | None = None
        self._sent = 0  # control messages sent so far (their order, for `_release_cause`)
        # what `success-after-given-up` reads: when a prefill's room failed, the probes each
        # agent answered (its name, the asker's) and when, the decodes told that a prefill
        # dropped them ((prefill, decode))
        self.failed_at: dict[Token, float] = {}
        self.answered: dict[tuple[str, str], list[float]] = {}
        self.told_dropped: set[tuple[str, str]] = set()
        self._build()

    # ------------------------------------------------------------------ the scenario

    def _force(self, key: str, default: Any) -> Any:
        return dict(self.config.force).get(key, default)

    def _build(self) -> None:
        rng, cfg = self.rng, self.config
        lay = sim_layout()
        n_p = self._force("prefills", rng.choice((1, 1, 2)))
        n_d = self._force("decodes", rng.choice((1, 1, 2)))
        base = {"transport": "inproc", "heartbeat_interval_s": 0.5, "lease_s": 5.0,
                "bootstrap_timeout_s": 10.0, "waiting_timeout_s": 20.0, **dict(cfg.settings)}
        for role, n in ((Role.PREFILL, n_p), (Role.DECODE, n_d)):
            for i in range(n):
                name = f"{role.value}:{i}"
                writes = self._force("writes", rng.random() < 0.8)
                checksum = self._force(f"checksum_{role.value}",
                                       "full" if rng.random() < 0.8 else "off")
                st = _make_settings({**base, "checksum": checksum})
                side = make_side(name, role, lay, self._allocate(lay, cfg.pages), settings=st,
                                 writes=writes, generation=len(self.agents) + 11,
                                 now=self.clock())
                a = self.agents[name] = Agent(side, role, writes, checksum,
                                              list(range(cfg.pages)), [None] * cfg.pages,
                                              exit_known=rng.random() < 0.5)
                # the hasher hashes small jobs inline (production's threshold) or never
                self._wire(a, inline_bytes=rng.choice((HASH_INLINE_BYTES, -1)))
        prefills = [a for a in self.agents if a.startswith("prefill")]
        decodes = [a for a in self.agents if a.startswith("decode")]
        n_inst = self._force("instances", rng.randint(1, cfg.max_instances))
        for k in range(n_inst):
            reuse = [i for i in self.instances if rng.random() < 0.35]
            if reuse:  # a room id reopened by the same ranks
                old = reuse[0]
                ps, ds, room = list(old.prefills), list(old.decodes), old.room
            else:
                shape = rng.random()
                if shape < 0.2 and len(prefills) > 1:  # TP fan-in: one decode, two prefills
                    ps, ds = list(prefills), [rng.choice(decodes)]
                elif shape < 0.4 and len(decodes) > 1:  # TP fan-out: one prefill, two decodes
                    ps, ds = [rng.choice(prefills)], list(decodes)
                else:
                    ps, ds = [rng.choice(prefills)], [rng.choice(decodes)]
                room = 100 + k
            inst = Instance(k, room, pattern=1 + (k * 37 + seed_salt(self.seed)) % 240,
                            seq_len=rng.randint(1, 3 * PAGE_TOKENS), prefills=ps, decodes=ds)
            self.instances.append(inst)
            layers = self.agents[ps[0]].side.session.ctx.layers
            for p in ps:
                self.scripts.append(Script(inst, self.agents[p], deque(
                    [("open", 0)] + [("ready", lid) for lid in layers])))
            for d in ds:
                self.scripts.append(Script(inst, self.agents[d], deque([("open", 0),
                                                                        ("init", 0)])))
        self.faults_left = self._force("faults", rng.randint(0, cfg.max_faults))
        st = self._settings()
        # every deadline one after the other, the quarantine as long as a decode may make it
        # (at least the writer's stall bound and two heartbeats), and 10 s more
        self.settle_bound_s = (st.bootstrap_timeout_s + st.waiting_timeout_s
                               + st.stall_timeout_s + st.lease_s + 10.0
                               + max(st.write_quarantine_s,
                                     st.stall_timeout_s + 2 * st.heartbeat_interval_s))
        self.note(f"agents: {', '.join(self._describe(a) for a in self.agents.values())}")
        for inst in self.instances:
            self.note(f"instance {inst.serial}: room {inst.room} seq {inst.seq_len} "
                      f"prefill {inst.prefills} -> decode {inst.decodes}")

    def _wire(self, a: Agent, *, inline_bytes: int) -> None:
        """`a`'s executor, production's, with this world's parts."""
        transport = SimTransport(self, a)
        a.outbox = SimOutbox(self, a)
        hashing = Hasher(buffers=a.side.buffers, transport=transport, post=a.post,
                         pool=SimPool(self, a), inline_bytes=inline_bytes)
        parts = Parts(clock=self.clock, transport=transport, outbox=a.outbox,
                      calls=SimCalls(self, a), hashing=hashing, views=SimViews(self, a),
                      post=a.post, post_now=a.post, log=log_part(self, a))
        a.executor = Executor(parts, a.side.session, observe=self._observer(a),
                              stale_s=2 * a.side.session.settings.heartbeat_interval_s)

    def _observer(self, a: Agent) -> Callable[[ev.Event, list[Effect]], list[Effect]]:
        def observe(event: ev.Event, effects: list[Effect]) -> list[Effect]:
            if self.tracing:
                self.note(f"{a.name} <- {_short(event)}")
                for eff in effects:
                    if not isinstance(eff, Log | HashSpans):
                        self.note(f"{a.name} -> {_short(eff)}")
            return effects
        return observe

    def queue_call(self, a: Agent, peer: str, call: Call) -> None:
        """A peer call of `a` (`parts.SimCalls`): it runs when the seed says, after `a`'s
        earlier calls to `peer`."""
        self.calls.setdefault((a.name, peer), []).append(call)

    def queue_completion(self, a: Agent, fn: Callable[[], None]) -> None:
        """A completion of `a`'s hasher pool or transport, run when the seed says."""
        self.pending.append((a, fn))

    def alive(self, name: str) -> bool:
        a = self.agents.get(name)
        return a is not None and a.alive

    def exited(self, name: str) -> bool:
        """Whether a transport of `name`'s peers knows its process ended (a pidfd)."""
        a = self.agents.get(name)
        return a is not None and not a.alive and a.exit_known

    def _allocate(self, layout: LayoutSpec, num_pages: int) -> dict[str, Any]:
        """Zeroed numpy buffers in `buffers.allocate`'s shape (a torch allocation per agent
        costs more than a whole run)."""
        ps = layout.page_size_tokens
        return {reg.name: {lid: np.zeros(0 if reg.is_empty(lid) else reg.page_nbytes(ps)
                                         * num_pages, dtype=np.uint8)
                           for lid in reg.layer_ids} for reg in layout.regions}

    def _settings(self) -> Settings:
        return next(iter(self.agents.values())).side.session.settings

    @staticmethod
    def _describe(a: Agent) -> str:
        return (f"{a.name}(writes={a.writes}, checksum={a.checksum}, "
                f"exit_known={a.exit_known})")

    def note(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.steps:5d} t={self.clock():9.3f} {text}")

    def violation(self, invariant: str, detail: str, cause: str = "") -> Violation:
        self.note(f"VIOLATION {invariant}: {detail}")
        return Violation(invariant, detail, seed=self.seed, step=self.steps, now=self.clock(),
                         trace=self.trace, cause=cause,
                         replay=replay_command(self.seed, self.config))

    def _release_cause(self, tok: Token) -> str:
        """Which known defect a decode release that broke an invariant looks like."""
        if tok in self.stale_done:
            return (f"a LayerDone from {self.stale_done[tok]} reached this room before its "
                    "TransferAccepted: a message of an earlier use of the room id, which "
                    "counted layers of this one landed")
        stale = self.stale_stop.get(tok)
        if stale is not None:
            return (f"(c) the prefill's {stale} said its writes stopped while this room's "
                    "were in flight: a message of an earlier room with this id (reopened "
                    "before that room's pages came back)")
        g = self.agents[tok.side].side.session.rooms.by_id.get(tok.room)
        # (a leg's phase is RELEASED by now; one_sided is set when its TransferAccepted is read)
        if g is not None and g.token is tok and not any(leg.one_sided for leg in g.legs):
            return ("(a) the decode gave back the pages of a room whose TransferAccepted it "
                    "never read, while the prefill had accepted and writes")
        if (tok.side, tok.room) in self.quarantined:
            return ("(b) the decode's write_quarantine_s passed while the prefill could still "
                    "write")
        return ""

    # ------------------------------------------------------------------ driving the agents

    def feed(self, a: Agent, event: ev.Event) -> None:
        """Feeds `event` to `a` now through its executor (its effects carried out by the
        simulated parts); its pass stays open until `_end_pass`."""
        a.executor.feed(event)
        a.pass_open = True

    def _end_pass(self, a: Agent) -> None:
        """`a`'s pass ends: the writes it held leave, then its messages."""
        a.pass_open = False
        a.executor.end_pass()

    def _run_queued(self, a: Agent) -> None:
        """Feeds `a`'s next queued event (a room's `LayerReady`s one after the other as one
        `Batch`, as the control loop does)."""
        event, _, _ = a.queue.popleft()
        event, _ = a.executor.batch.take_ready(event, a.queue, len(a.queue))
        assert event is not None
        self.feed(a, event)

    def _log(self, a: Agent, eff: Log) -> None:
        if "never confirmed that its writes" in eff.message:
            self.quarantined.add((a.name, int(eff.message.split()[1].rstrip(":"))))
        if self.tracing:
            self.note(f"{a.name} log: {eff.message}")

    # ------------------------------------------------------------------ the network

    def _sending(self, a: Agent, to: str, msg: Any) -> None:
        """A message enters `a`'s outbox: what a TransferRequest offers is noted now."""
        if isinstance(msg, P.TransferRequest):
            g = a.side.session.rooms.by_id.get(msg.room)
            token = g.token if g is not None and isinstance(g.token, Token) else None
            self.xfers[(a.name, msg.xfer % (1 << P.XFER_BITS))] = (
                token, {k: set(v) for k, v in msg.dst_pages.items()})

    def _send(self, a: Agent, to: str, msg: Any) -> None:
        """A message leaves `a` (its pass ended): through the real wire format, framed as the
        session frames it (sealed with a secret), into the FIFO of (a, to)."""
        wire, seal = P.decode_sealed(a.side.session.peers.frames(to, msg), max_bytes=1 << 24)
        dest = self.agents.get(to)
        if dest is None or not dest.alive or not a.alive:
            return
        self._sent += 1
        self.channels.setdefault((a.name, to), deque()).append(((wire, seal), self._sent))
        if isinstance(wire, P.Heartbeat) and wire.answers:
            self.answered.setdefault((a.name, to), []).append(self.clock())

    # ------------------------------------------------------------------ the transport

    def _post_op(self, a: Agent, send: bool, peer: str, tag: int, buffer: str,
                 offsets: np.ndarray, nbytes: np.ndarray, on_done: OnDone) -> None:
        """A two-sided send or receive: matched by (sender, receiver, tag), it becomes a
        transfer in flight (it lands later)."""
        if not self.alive(peer):
            self.pending.append((a, _done(on_done, f"peer {peer} is gone")))
            return
        key = (a.name, peer, tag) if send else (peer, a.name, tag)
        table = self._sends if send else self._recvs
        table.setdefault(key, deque()).append(_Op(a, on_done, buffer, offsets, nbytes))
        sends, recvs = self._sends.get(key), self._recvs.get(key)
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            region = r.buffer.rsplit("/", 1)[0]
            part = Part(s.buffer, s.offsets, s.nbytes, r.buffer, r.offsets, r.nbytes,
                        self._pages(r.agent, region, r.offsets, r.nbytes), region)
            fl = self._flight(s.agent, r.agent, [part], (key[2],), None, False)
            fl.send_done, fl.recv_done = s.on_done, r.on_done

    def _post_writes(self, a: Agent, peer: str, writes: Sequence[WriteSpec],
                     on_done: OnWritten, checksum: bool) -> None:
        """A one-sided write job: in flight until it lands, one part (write) at a time."""
        dest = self.agents.get(peer)
        if dest is None or not dest.alive:
            error = TransportError(f"peer {peer} is gone")
            self.pending.append((a, lambda: on_done(WriteResult(error))))
            return
        parts = []
        for _, name, remote, plan in writes:
            region = name.rsplit("/", 1)[0]
            parts.append(Part(name, plan.src_offsets, plan.nbytes, remote, plan.dst_offsets,
                              plan.nbytes,
                              self._pages(dest, region, plan.dst_offsets, plan.nbytes), region))
        self._flight(a, dest, parts, tuple(w[0] for w in writes), on_done, checksum)

    def _flight(self, writer: Agent, dest: Agent, parts: list[Part], tags: tuple[int, ...],
                on_written: OnWritten | None, checksum: bool) -> Flight:
        self._fid += 1
        now = self.clock()
        xfer = P.split_tag(tags[0])[0]
        dst_token = self.xfers.get((dest.name, xfer), (None, {}))[0]
        src = self._src_token(writer, dest.name, xfer)
        fl = Flight(self._fid, writer, dest, parts, tags, now,
                    now + writer.side.session.settings.stall_timeout_s, on_written, checksum,
                    xfer=xfer, src_token=src, dst_token=dst_token)
        self.flights[fl.fid] = fl
        return fl

    @staticmethod
    def _src_token(writer: Agent, peer: str, xfer: int) -> Token | None:
        for leg in writer.side.session.rooms.legs.values():
            if leg.peer == peer and leg.xfer % (1 << P.XFER_BITS) == xfer:
                tok = leg.parent.token
                return tok if isinstance(tok, Token) else None
        return None

    def _pages(self, dest: Agent, region: str, offsets: np.ndarray,
               nbytes: np.ndarray) -> tuple[int, ...]:
        pn = dest.side.session.layout.region(region).page_nbytes(PAGE_TOKENS)
        pages: list[int] = []
        for o, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
            if n:
                pages.extend(range(o // pn, (o + n - 1) // pn + 1))
        return tuple(sorted(set(pages)))

    # ------------------------------------------------------------------ landing and ending

    def _can_land(self, fl: Flight) -> bool:
        if not fl.writer.alive:
            return False
        return self.clock() <= fl.bound_at or (fl.frozen and self.config.frozen_writer_resumes)

    def _land(self, fl: Flight) -> None:
        """Lands the flight's next part into the destination's memory (checking where)."""
        if not self._can_land(fl):
            self._end(fl, "the transport gave up the write (its bound passed)")
            return
        part = fl.parts[fl.landed]
        src = fl.writer.side.buffers[part.src_buf]
        dst = fl.dest.side.buffers[part.dst_buf]
        data = np.concatenate([src[o:o + n] for o, n in
                               zip(part.src_off.tolist(), part.src_len.tolist(), strict=True)])
        self._check_landing(fl, part)
        pos = 0
        for o, n in zip(part.dst_off.tolist(), part.dst_len.tolist(), strict=True):
            dst[o:o + n] = data[pos:pos + n]
            pos += n
        if self.flip_next and len(part.dst_off):
            self.flip_next = False
            dst[int(part.dst_off[0])] ^= 0x5A
            if fl.dst_token is not None:
                for inst in self.instances:
                    if fl.dst_token in inst.tokens.values():
                        inst.flipped = True
            self.note(f"flipped a byte of {part.dst_buf} in {fl.dest.name}")
        # the source stream's digest, as a transport that hashes while it copies gives it
        fl.digests.append(room_checksum(src, part.src_off, part.src_len, "xxh3")
                          if fl.checksum else None)
        fl.landed += 1
        self.note(f"landed {part.dst_buf} pages {list(part.pages)} of flight {fl.fid} "
                  f"({fl.writer.name} -> {fl.dest.name}, {fl.dst_token})")
        if fl.landed == len(fl.parts):
            self._end(fl, None)

    def _check_landing(self, fl: Flight, part: Part) -> None:
        dest = fl.dest
        if dest.role is not Role.DECODE:
            return
        offered = self.xfers.get((dest.name, fl.xfer), (None, {}))[1].get(part.region, set())
        for page in part.pages:
            owner = dest.owner[page]
            if owner is None or owner is not fl.dst_token:
                raise self.violation(
                    "landed-outside-room",
                    f"a write of {fl.writer.name} for {fl.dst_token} landed in page {page} of "
                    f"{dest.name} ({part.dst_buf}), which "
                    + ("the engine got back (free)" if owner is None else f"{owner} holds"),
                    self.release_cause.get(fl.dst_token, "") if fl.dst_token else "")
            if page not in offered:
                raise self.violation(
                    "landed-outside-room",
                    f"a write of {fl.writer.name} landed in page {page} of {dest.name}, which "
                    f"the TransferRequest of {fl.dst_token} never offered")

    def _end(self, fl: Flight, error: str | None) -> None:
        """The flight ends: its completions not yet spent are queued (in any order with
        others), and the calls that waited for it may answer."""
        self.flights.pop(fl.fid, None)
        if fl.on_written is not None:
            done, fl.on_written = fl.on_written, None
            result = WriteResult(None, tuple(fl.digests)) if error is None else \
                WriteResult(TransportError(error))
            if fl.writer.alive:
                self.pending.append((fl.writer, lambda: done(result)))
        for agent, cb in ((fl.writer, fl.send_done), (fl.dest, fl.recv_done)):
            if agent.alive and cb is not None:
                self.pending.append((agent, _done(cb, error)))
        fl.send_done = fl.recv_done = None
        for w in fl.waiters:
            w.left.discard(fl.fid)
            if not w.left:
                self._unblock(w)

    def _spend(self, fl: Flight, a: Agent, error: str) -> None:
        """The transport ends `a`'s op of the flight now (its completion says `error`); the
        copy it started may go on."""
        if fl.writer is a and fl.on_written is not None:
            done, fl.on_written = fl.on_written, None
            result = WriteResult(TransportError(error))
            self.pending.append((a, lambda: done(result)))
        if fl.writer is a and fl.send_done is not None:
            self.pending.append((a, _done(fl.send_done, error)))
            fl.send_done = None
        if fl.dest is a and fl.recv_done is not None:
            self.pending.append((a, _done(fl.recv_done, error)))
            fl.recv_done = None

    def _unblock(self, w: CancelWait) -> None:
        """A call that waited for copies to stop returns: its outcome is posted, and its
        peer's next call may run."""
        key = (w.agent.name, w.peer)
        held = self.blocked.get(key)
        if held is not None and held[0] is w:
            del self.blocked[key]
            if w.agent.alive:
                for event in held[1]:
                    w.agent.post(event)

    def _stop_ops(self, a: Agent, peer: str, tag: int | None) -> None:
        """The transport's `cancel` (a tag) or `disconnect` (tag None) of `a`'s ops with
        `peer`, run on `a`'s peer-call worker: every op it names ends now, saying
        "cancelled", as the transports' do; a copy in flight is stopped, or lands first (the
        call waits for it), or does not stop: the call fails, and the copy may land until
        its bound."""
        for table, mine in ((self._sends, 0), (self._recvs, 1)):
            for key, ops in table.items():
                if key[1 - mine] != peer or (tag is not None and key[2] != tag):
                    continue
                for op in [o for o in ops if o.agent is a]:
                    ops.remove(op)
                    self.pending.append((a, _done(op.on_done, "cancelled")))
        w = CancelWait(a, peer, tag, set())
        failed = False
        for fl in list(self.flights.values()):
            if not ((fl.writer is a and fl.dest.name == peer)
                    or (fl.dest is a and fl.writer.name == peer)):
                continue
            if tag is not None and tag not in fl.tags:
                continue
            self._spend(fl, a, "cancelled")
            roll = self.rng.random() if self.cancel_roll is None else self.cancel_roll
            if roll < 0.65:
                self._end(fl, "cancelled")
            elif roll < 0.9 or not fl.writer.alive:
                w.left.add(fl.fid)
                fl.waiters.append(w)
            else:  # a stuck copy: it lands later, if at all (within its bound)
                failed = True
                now = self.clock()
                fl.stuck_until = min(fl.bound_at, now + self.rng.uniform(0.05, 5.0))
        if failed:
            for fid in w.left:
                self.flights[fid].waiters.remove(w)
            raise TransportError("the copy did not stop within its bound")
        if w.left:
            self._waiting = w

    # ------------------------------------------------------------------ engine views

    def _room_update(self, a: Agent, eff: RoomUpdate) -> None:
        tok = eff.token
        assert isinstance(tok, Token)
        v = self.views.setdefault(tok, View(tok.room))
        was = v.state
        v.state, v.failure, v.landed, v.done = eff.state, eff.failure, eff.landed, eff.done
        if eff.state is KVPoll.Failed and was is not KVPoll.Failed:
            self.failed_at[tok] = self.clock()
        if a.role is Role.DECODE and eff.state is KVPoll.Success and was is not KVPoll.Success:
            self._check_success(a, tok)
            self._check_not_given_up(a, tok)

    def _instance(self, tok: Token) -> Instance:
        return self.instances[tok.inst]

    def _check_not_given_up(self, a: Agent, tok: Token) -> None:
        """A decode room ends Success only if no prefill rank of it already failed the room
        by declaring this decode lost (the rank no longer holds it: its pages may be freed,
        and it will never count the room done), where the decode could know: it had been told
        (a `Failed` naming it lost, or a `Reject` saying the handshake is gone, reached it), or
        it did not run for more than 2 of its heartbeats from before the prefill gave it up
        and that prefill answered none of its probes between its waking and giving it up (a
        woken agent asks before it reads on). Not counted: a room the prefill fails later (the
        RoomAck lost), or one given up while the decode ran and had not yet been told (its
        heartbeats late on the network, the prefill's Failed still on the way): both the open
        split at the tail, which only a second round trip before Success would close; nor one
        failed for another decode rank."""
        inst = self._instance(tok)
        for p in inst.prefills:
            tp = inst.tokens.get(p)
            v = self.views.get(tp) if tp is not None else None
            f = v.failure if v is not None else None
            if (v is not None and v.state is KVPoll.Failed and f is not None
                    and f.kind is FailureKind.PEER_LOST and not f.remote
                    and f"peer {a.name} " in f.reason
                    and ((p, a.name) in self.told_dropped
                         or tp is not None and self._asked_nobody(a, p, self.failed_at[tp]))):
                raise self.violation(
                    "success-after-given-up",
                    f"{tok} ended Success after {tp} failed the room, having given this "
                    f"decode up ({f.reason})",
                    "(e) the decode read on after a stall without asking its prefill whether "
                    "it still held it (`PeerTable.woke`), or ended a room Success while that "
                    "question was out (`ReceivePath.finish`), or read on after its prefill said "
                    "it dropped it (`Failed.dropped_gen`: `TransferSession._dropped_by`)")

    def _asked_nobody(self, a: Agent, prefill: str, given_up_at: float) -> bool:
        """Decode `a` did not run for more than 2 of its heartbeats from before `prefill`
        gave it up (at `given_up_at`), and `prefill` answered none of its probes between
        that waking and giving it up."""
        beats = 2 * a.side.session.settings.heartbeat_interval_s
        answers = self.answered.get((prefill, a.name), [])
        return any(end - start > beats and start <= given_up_at
                   and not any(end <= t <= given_up_at for t in answers)
                   for start, end in a.pauses)

    def _check_success(self, a: Agent, tok: Token) -> None:
        inst = self._instance(tok)
        if inst.flipped and a.checksum == "off":
            return  # this decode runs without checksums: a flipped byte is its choice
        lay = a.side.session.layout
        pages = inst.pages[a.name]
        bad = 0
        for ri, reg in enumerate(lay.regions):
            for lid in reg.layer_ids:
                bad += check_tokens(a.side.buffers[f"{reg.name}/{lid}"], lay, ri, lid, pages,
                                    0, inst.seq_len, inst.pattern)
        if bad:
            raise self.violation(
                "success-wrong-bytes",
                f"{tok} ended Success with {bad} byte(s) that differ from the prefill's "
                f"(checksum {a.checksum} here, "
                f"{'/'.join(self.agents[p].checksum for p in inst.prefills)} on the prefill; "
                f"a byte was {'flipped' if inst.flipped else 'not flipped'})",
                f"a LayerDone from {self.stale_done[tok]} reached this room before its "
                "TransferAccepted: a message of an earlier use of the room id, which counted "
                "layers of this one landed" if tok in self.stale_done else
                "(d) the decode checks checksums (full) but the prefill sent none (off)"
                if a.checksum == "full" and any(self.agents[p].checksum == "off"
                                                for p in inst.prefills) else "")

    def _release(self, a: Agent, eff: Release) -> None:
        tok = eff.token
        assert isinstance(tok, Token)
        v = self.views.setdefault(tok, View(tok.room))
        v.releases += 1
        if v.releases > 1:
            raise self.violation("double-release", f"{tok} released {v.releases} times")
        inst = self._instance(tok)
        pages = inst.pages.get(a.name)
        if a.role is Role.DECODE:
            cause = self.release_cause[tok] = self._release_cause(tok)
            for fl in self.flights.values():
                if fl.dest is a and self._can_land(fl) and pages is not None and any(
                        p in pages for part in fl.parts[fl.landed:] for p in part.pages):
                    raise self.violation(
                        "released-while-in-flight",
                        f"{a.name} released {tok} (pages {sorted(pages.tolist())}) while a "
                        f"write of {fl.writer.name} for {fl.dst_token} into pages "
                        f"{sorted({p for x in fl.parts for p in x.pages})} can still land "
                        f"(flight {fl.fid}, posted t={fl.posted_at:.3f})", cause)
        else:
            for fl in self.flights.values():
                if fl.writer is a and fl.src_token is tok and self._can_land(fl):
                    raise self.violation(
                        "source-released-in-flight",
                        f"{a.name} released {tok} while flight {fl.fid} still reads its pages")
        if pages is None:
            return
        if a.role is Role.PREFILL:
            for reg in a.side.session.layout.regions:
                for lid in reg.layer_ids:
                    view = a.side.buffers[f"{reg.name}/{lid}"].reshape(
                        -1, reg.page_nbytes(PAGE_TOKENS))
                    view[pages] = PREFILL_SCRIBBLE
        for p in pages.tolist():
            a.owner[p] = None
            a.free.append(p)

    # ------------------------------------------------------------------ engine calls

    def _alloc(self, a: Agent, n: int, tok: Token) -> np.ndarray | None:
        if len(a.free) < n:
            return None
        got = sorted(self.rng.sample(a.free, n)) if self.rng.random() < 0.5 else a.free[:n]
        for p in got:
            a.free.remove(p)
            a.owner[p] = tok
        return np.asarray(got, dtype=np.int64)

    def _script_ready(self, s: Script) -> bool:
        if not s.actions or not s.agent.running:
            return False
        what, _ = s.actions[0]
        if what != "open":
            return True
        # a room id is reused (by the router, for a new request) once every engine of the
        # previous room with that id saw it end: terminal, its pages possibly not yet back
        for other in self.instances[:s.inst.serial]:
            if other.room != s.inst.room:
                continue
            for name in other.prefills + other.decodes:
                if not self.agents[name].alive:
                    continue
                tok = other.tokens.get(name)
                if tok is None or not self.views.get(tok, View(0)).done:
                    return False
        n = -(-s.inst.seq_len // PAGE_TOKENS)
        return s.agent.role is Role.DECODE or len(s.agent.free) >= n

    def _engine_call(self, a: Agent, direct: bool, event: ev.Event) -> None:
        """An engine call: posted to the agent's queue (an engine thread's `post`), or, from
        a test's script (`direct`), fed in a pass of its own."""
        if direct:
            self.feed(a, event)
            self._end_pass(a)
        else:
            a.post(event)

    def _engine(self, s: Script, direct: bool = False) -> None:
        what, arg = s.actions.popleft()
        inst, a = s.inst, s.agent
        lay = a.side.session.layout
        n = -(-inst.seq_len // PAGE_TOKENS)
        if what == "open":
            tok = inst.tokens[a.name] = Token(inst.serial, inst.room, a.name, self._sent)
            if a.role is Role.PREFILL:
                pages = self._alloc(a, n, tok)
                assert pages is not None
                inst.pages[a.name] = pages
                for ri, reg in enumerate(lay.regions):
                    for lid in reg.layer_ids:
                        write_tokens(a.side.buffers[f"{reg.name}/{lid}"], lay, ri, lid, pages,
                                     0, inst.seq_len, inst.pattern)
                self._engine_call(a, direct, ev.OpenSender(
                    inst.room, tok, {r.name: pages for r in lay.regions}, inst.seq_len,
                    len(inst.decodes)))
            else:
                self._engine_call(a, direct, ev.OpenReceiver(
                    inst.room, tok, tuple((p, 0) for p in inst.prefills)))
            return
        tok = inst.tokens[a.name]
        if self.views.get(tok, View(0)).done:
            s.actions.clear()  # the engine stops calling a room that ended
            return
        if what == "ready":
            self._engine_call(a, direct, ev.LayerReady(inst.room, tok, arg))
        elif what == "init":
            pages = self._alloc(a, n, tok)
            if pages is None:
                s.actions.appendleft((what, arg))  # waits for pages
                return
            inst.pages[a.name] = pages
            for reg in lay.regions:
                for lid in reg.layer_ids:
                    view = a.side.buffers[f"{reg.name}/{lid}"].reshape(
                        -1, reg.page_nbytes(PAGE_TOKENS))
                    view[pages] = DECODE_FILL
            self._engine_call(a, direct, ev.ReceiverInit(
                inst.room, tok, {r.name: pages for r in lay.regions}, inst.seq_len, 0))

    # ------------------------------------------------------------------ faults

    def _fault(self) -> None:
        rng = self.rng
        live = [a for a in self.agents.values() if a.running]
        kinds = ["pause", "abort", "abort", "timeout", "flip", "jump"]
        if len(live) > 1:
            kinds.append("kill")
        kind = rng.choice(kinds)
        now = self.clock()
        self.faults_left -= 1
        if kind in ("pause", "kill") and live:
            a = rng.choice(live)
            if kind == "kill":
                a.alive = False
                self._died(a)
                desc = f"{a.name} died"
            else:
                r = rng.random()
                dt = rng.uniform(0.05, 1.5) if r < 0.4 else rng.uniform(1.5, 12.0) \
                    if r < 0.75 else rng.uniform(12.0, 45.0)
                self._stop(a, now + dt)
                desc = f"{a.name} paused for {dt:.2f}s"
        elif kind in ("abort", "timeout"):
            open_ = [t for t, v in self.views.items() if not v.done
                     and self.agents[t.side].running]
            if not open_:
                return
            tok = rng.choice(open_)
            reason = "engine abort" if kind == "abort" else "engine timeout"
            desc = f"{reason} of {tok}"
            self.note(f"FAULT {desc}")
            # the engine's abort goes ahead of the queued events (`post_ahead`)
            self.feed(self.agents[tok.side], ev.AbortRoom(tok.room, tok, reason))
        elif kind == "flip":
            self.flip_next = True
            desc = "the next landing flips a byte"
        else:
            dt = rng.uniform(0.6, 8.0)
            self.clock.advance(dt)
            desc = f"clock jumps {dt:.2f}s"
            for b in self.agents.values():
                b.pauses.append((self.clock() - dt, self.clock()))
        self.faults.append(desc)
        self.last_fault = max(self.last_fault, self.clock())
        if kind not in ("abort", "timeout"):
            self.note(f"FAULT {desc}")

    def _stop(self, a: Agent, until: float) -> None:
        a.paused_until = until
        a.pauses.append((self.clock(), until))
        for fl in self.flights.values():
            if fl.writer is a:
                fl.frozen = True

    def _died(self, a: Agent) -> None:
        """`a`'s process ended: its writes stop, its queued work is gone, transports that
        talk to it fail their ops."""
        for fl in list(self.flights.values()):
            if fl.writer is a or fl.dest is a:
                self._end(fl, f"peer {a.name} is gone")
        for table in (self._sends, self._recvs):
            for key, ops in table.items():
                for op in list(ops):
                    if op.agent is a:
                        ops.remove(op)
                    elif a.name in key[:2]:
                        ops.remove(op)
                        self.pending.append((op.agent, _done(op.on_done,
                                                             f"peer {a.name} is gone")))
        self.pending = [(x, f) for x, f in self.pending if x is not a]
        for pair in [k for k in self.channels if k[1] == a.name]:
            del self.channels[pair]
        for pair in [k for k in self.calls if k[0] == a.name]:
            del self.calls[pair]
        for pair in [k for k in self.blocked if k[0] == a.name]:
            del self.blocked[pair]
        a.queue.clear()
        a.pass_open = False  # what its pass held never leaves
        for s in self.scripts:
            if s.agent is a:
                s.actions.clear()

    # ------------------------------------------------------------------ scripted schedules

    def add_instance(self, room: int, prefills: list[str], decodes: list[str],
                     seq_len: int = 40) -> Instance:
        """A room instance the test drives (`engine`), besides the seed's own."""
        inst = Instance(len(self.instances), room, pattern=200 + len(self.instances),
                        seq_len=seq_len, prefills=list(prefills), decodes=list(decodes))
        self.instances.append(inst)
        layers = self.agents[prefills[0]].side.session.ctx.layers
        for p in prefills:
            self.scripts.append(Script(inst, self.agents[p], deque(
                [("open", 0)] + [("ready", lid) for lid in layers])))
        for d in decodes:
            self.scripts.append(Script(inst, self.agents[d], deque([("open", 0), ("init", 0)])))
        return inst

    def engine(self, inst: Instance, side: str, calls: int | None = None) -> None:
        """Runs the engine calls `side` has left for `inst` now (open, pages, layers): all of
        them, or the next `calls`."""
        for s in self.scripts:
            if s.inst is inst and s.agent.name == side:
                n = 0
                while s.actions and self._script_ready(s) and (calls is None or n < calls):
                    self._engine(s, direct=True)
                    n += 1

    def abort(self, inst: Instance, side: str, reason: str = "engine abort") -> None:
        """The engine of `side` aborts its room of `inst`."""
        tok = inst.tokens[side]
        self.note(f"FAULT {reason} of {tok}")
        self.faults.append(f"{reason} of {tok}")
        self.last_fault = self.clock()
        a = self.agents[side]
        self.feed(a, ev.AbortRoom(tok.room, tok, reason))
        self._end_pass(a)

    def pause(self, side: str, seconds: float) -> None:
        """Stops `side` (SIGSTOP) for `seconds` of simulated time."""
        self._stop(self.agents[side], self.clock() + seconds)
        self.last_fault = self.clock() + seconds
        self.note(f"FAULT {side} paused for {seconds:.2f}s")

    def queued(self, src: str, dst: str) -> list[Any]:
        """The control messages in flight from `src` to `dst`, oldest first."""
        return [m for (m, _), _ in self.channels.get((src, dst), ())]

    def deliver(self, src: str, dst: str, n: int = 1) -> None:
        """Delivers the next `n` control messages from `src` to `dst` (each in a pass of its
        own: what it makes `dst` send is queued at once)."""
        for _ in range(n):
            self._deliver((src, dst))
            self._end_pass(self.agents[dst])

    def _callable(self, key: tuple[str, str]) -> bool:
        """Whether (agent, peer)'s next peer call may run now."""
        return bool(self.calls.get(key)) and key not in self.blocked \
            and self.agents[key[0]].running

    def busy(self) -> bool:
        """Whether a message, completion, queued event, pass end or peer call of a running
        agent is waiting (what `drain` runs)."""
        return (any(q and self.agents[k[1]].running for k, q in self.channels.items())
                or any(a.running for a, _ in self.pending)
                or any(a.running and (a.queue or a.holds) for a in self.agents.values())
                or any(self._callable(k) for k in self.calls))

    def drain(self, *, land: bool = True, until: Callable[[], bool] | None = None) -> None:
        """Runs every pending message, completion, queued event, pass end, peer call and due
        tick (and lands every write when `land`) until none is left or `until()` holds,
        without moving the clock.

        Raises:
            AssertionError: `until` was given and never held.
        """
        while until is None or not until():
            if land and self.flights:
                self._land(next(iter(self.flights.values())))
                continue
            key = next((k for k, q in self.channels.items() if q
                        and self.agents[k[1]].running), None)
            if key is not None:
                self._deliver(key)
                continue
            a = next((a for a in self.agents.values() if a.running and a.queue), None)
            if a is not None:
                self._run_queued(a)
                continue
            ready = [i for i, (a, _) in enumerate(self.pending) if a.running]
            if ready:
                _, run = self.pending.pop(ready[0])
                run()
                continue
            a = next((a for a in self.agents.values() if a.running and a.holds), None)
            if a is not None:
                self._end_pass(a)
                continue
            key = next((k for k in self.calls if self._callable(k)), None)
            due = next((a for a in self.agents.values() if a.running
                        and self.clock() >= a.side.session.next_wakeup()), None)
            if key is None and due is not None:  # LayerDones out, timers due now
                self._tick(due)
                continue
            if key is None:
                if until is not None:
                    raise AssertionError("nothing left to run and the condition never held")
                return
            self._answer_call(key)

    # ------------------------------------------------------------------ the scheduler

    def _choices(self, faults: bool) -> list[tuple[float, Callable[[], None]]]:
        now = self.clock()
        out: list[tuple[float, Callable[[], None]]] = []
        for key, q in self.channels.items():
            if q and self.agents[key[1]].running:
                out.append((4.0, _bind(self._deliver, key)))
        if any(a.running for a, _ in self.pending):
            out.append((3.0 * min(3, len(self.pending)), self._complete))
        for key in self.calls:
            if self._callable(key):
                out.append((3.0, _bind(self._answer_call, key)))
        for fl in self.flights.values():
            if fl.writer.running and now >= fl.stuck_until:
                out.append((3.0, _bind(self._land, fl)))
        for s in self.scripts:
            if s.actions and s.agent.running and self._script_ready(s):
                out.append((2.0, _bind(self._engine, s)))
        for a in self.agents.values():
            if not a.running:
                continue
            if a.queue:
                out.append((3.0, _bind(self._run_queued, a)))
            if a.pass_open:
                out.append((3.0, _bind(self._end_pass, a)))
            if now >= a.side.session.next_wakeup():
                out.append((3.0, _bind(self._tick, a)))
        if faults and self.faults_left > 0:
            out.append((0.15, self._fault))
        return out

    def _deliver(self, key: tuple[str, str]) -> None:
        (msg, seal), sent = self._delivering = self.channels[key].popleft()
        dest = self.agents[key[1]]
        if dest.role is Role.DECODE and (isinstance(msg, P.AbortAck) or isinstance(
                msg, P.Failed | P.Abort) and msg.writes_stopped):
            # "my writes stopped" sent before this room was opened, or while the shadow model
            # holds writes of this room in flight: a message of an earlier room with the same
            # id (or a transport's lie)
            g = dest.side.session.rooms.by_id.get(msg.room)
            tok = g.token if g is not None else None
            if isinstance(tok, Token) and (sent <= tok.opened or any(
                    fl.dst_token is tok and self._can_land(fl) for fl in self.flights.values())):
                self.stale_stop[tok] = type(msg).__name__ + (
                    " sent before this room was opened" if sent <= tok.opened else "")
        if dest.role is Role.DECODE and (
                isinstance(msg, P.Failed) and msg.failure_kind == FailureKind.PEER_LOST.value
                and f"peer {dest.name} " in msg.reason
                or isinstance(msg, P.Reject) and msg.reason.startswith("no handshake")):
            self.told_dropped.add((key[0], dest.name))  # its prefill gave it up, it now knows
        if dest.role is Role.DECODE and isinstance(msg, P.LayerDone):
            # FIFO per connection: a LayerDone of this use of the room comes after its
            # TransferAccepted; one before it is from an earlier use of the id
            leg = dest.side.session.rooms.legs.get((msg.room, msg.src))
            if leg is not None and not leg.state.accepted and not leg.state.terminal \
                    and isinstance(leg.parent.token, Token):
                self.stale_done[leg.parent.token] = msg.src
        try:
            self.feed(dest, ev.MessageReceived(msg, seal))
        finally:
            self._delivering = None

    def _complete(self) -> None:
        ready = [i for i, (a, _) in enumerate(self.pending) if a.running]
        i = self.rng.choice(ready)
        _, run = self.pending.pop(i)
        run()

    def _answer_call(self, key: tuple[str, str]) -> None:
        """(agent, peer)'s next peer call runs; its outcome is posted when it returns, or
        once the copies it waits for stopped."""
        a = self.agents[key[0]]
        call = self.calls[key].pop(0)
        self._waiting = None
        events = call()
        w, self._waiting = self._waiting, None
        if w is not None and w.left:
            self.blocked[key] = (w, events)
            return
        for event in events:
            a.post(event)

    def _tick(self, a: Agent) -> None:
        """`a`'s control loop ticks at the end of a pass, its sockets just read (messages
        still in its channels wait for the next pass), then the pass ends."""
        a.read_at = self.clock()
        self.feed(a, ev.Tick(read_at=a.read_at))
        self._end_pass(a)

    def _resume(self) -> None:
        now = self.clock()
        for a in self.agents.values():
            if a.paused_until is not None and now >= a.paused_until:
                a.paused_until = None
                self.last_fault = max(self.last_fault, now)
                self.note(f"{a.name} resumed")

    def _advance(self, dt: float) -> None:
        self.clock.advance(dt)
        self._resume()
        for fl in list(self.flights.values()):  # the transport's bound, where it runs
            if fl.writer.running and not self._can_land(fl):
                self._end(fl, "the transport gave up the write (its bound passed)")

    def _step_dt(self) -> float:
        """How far the clock moves in one step: a little, and never more than
        `TICK_SLACK_S` past the time a running agent's tick is due (a control loop runs on
        time unless a fault stops it: a pause, a clock jump)."""
        dt = min(self.rng.expovariate(8.0), 0.6)
        due = [a.side.session.next_wakeup() for a in self.agents.values() if a.running]
        if due:
            dt = min(dt, max(0.0, min(due) + TICK_SLACK_S - self.clock()))
        return dt

    def _pick(self, choices: list[tuple[float, Callable[[], None]]]) -> Callable[[], None]:
        total = sum(w for w, _ in choices)
        x = self.rng.random() * total
        for w, fn in choices:
            x -= w
            if x < 0:
                return fn
        return choices[-1][1]

    def _settled(self) -> bool:
        if self.flights or any(s.actions for s in self.scripts):
            return False
        if any(q for k, q in self.channels.items() if self.agents[k[1]].alive):
            return False
        if self.pending or any(q for q in self.calls.values()) or self.blocked:
            return False
        if any(a.alive and (a.queue or a.holds) for a in self.agents.values()):
            return False
        return all(v.done and v.releases == 1 for t, v in self.views.items()
                   if self.agents[t.side].alive)

    def play(self) -> Outcome:
        """Runs the seed to its end; raises `Violation` when an invariant breaks."""
        cfg = self.config
        while self.steps < cfg.max_steps:
            if not any(s.actions for s in self.scripts) and self.faults_left <= 0:
                break
            self.steps += 1
            choices = self._choices(True)
            if self.rng.random() < 0.08 or not choices:
                self._advance(self._step_dt())
                continue
            self._pick(choices)()
        self.faults_left = 0
        deadline = max(self.clock(), self.last_fault) + self.settle_bound_s
        while True:
            self.steps += 1
            self._resume()
            choices = self._choices(False)
            if choices:
                self._pick(choices)()
                continue
            if self._settled():
                break
            nxt = [a.side.session.next_wakeup() for a in self.agents.values() if a.running]
            nxt += [a.paused_until for a in self.agents.values()
                    if a.alive and a.paused_until is not None]
            nxt += [fl.bound_at + 1e-6 for fl in self.flights.values()]
            nxt += [fl.stuck_until for fl in self.flights.values()
                    if fl.stuck_until > self.clock()]
            at = max(min(nxt), self.clock() + 1e-3) if nxt else self.clock() + 0.5
            if at > deadline:
                raise self.violation("not-terminal", self._unsettled())
            self._advance(at - self.clock())
        self._final_checks()
        states = tuple(f"{t}={v.state.name}" for t, v in self.views.items())
        return Outcome(self.seed, self.steps, self.clock() - 1000.0, len(self.instances),
                       tuple(self.faults), states)

    def _unsettled(self) -> str:
        what = [f"{t}: {v.state.name}{' done' if v.done else ''}, released {v.releases}"
                for t, v in self.views.items()
                if self.agents[t.side].alive and not (v.done and v.releases == 1)]
        stuck = [f"{s.agent.name} {s.inst.room}#{s.inst.serial} waits to {s.actions[0][0]}"
                 for s in self.scripts if s.actions]
        return (f"{self.settle_bound_s:g}s after the last fault: "
                + "; ".join(what + stuck + [f"{len(self.flights)} flight(s)"]))

    def _final_checks(self) -> None:
        for inst in self.instances:
            if len(inst.prefills) > 1:
                # TP fan-in: one prefill rank's leg may end Success before another rank's
                # failure fails the decode's room (the first rank delivered all it had to)
                continue
            for p in inst.prefills:
                tp = inst.tokens.get(p)
                if tp is None or not self.agents[p].alive:
                    continue
                if self.views[tp].state is not KVPoll.Success:
                    continue
                for d in inst.decodes:
                    td = inst.tokens.get(d)
                    if td is not None and self.agents[d].alive and \
                            self.views[td].state is KVPoll.Failed:
                        raise self.violation(
                            "prefill-success-decode-failed",
                            f"{tp} ended Success while {td} ended Failed "
                            f"({self.views[td].failure})")
        st = self._settings()
        # each tick after the gap wakes the agents, which recheck the peers they hold (no
        # message moves here: those rechecks stay out); the peers declared lost before the
        # gap are forgotten at the first tick (the second is what it took when a woken agent
        # dropped every peer, forgotten only a retention period later)
        for _ in range(2):
            self._advance(max(st.room_retention_s, FORGOTTEN_KEEP_S, st.bootstrap_timeout_s)
                          + 1)
            for a in self.agents.values():
                if a.alive:
                    self._tick(a)
        for a in self.agents.values():
            if not a.alive:
                continue
            s = a.side.session
            held = {"rooms": len(s.rooms.by_id), "legs": len(s.rooms.legs),
                    "early messages": len(s._early), "aborts ahead": len(s._aborts_ahead),
                    "ops": len(s.inflight.ops), "hash jobs": len(s.inflight.jobs),
                    "cancels": len(s.rooms._cancelling), "lost peers": len(s.peers._forgotten)}
            grown = {k: v for k, v in held.items() if v}
            if grown:
                raise self.violation("unbounded", f"{a.name} still holds {grown} after the "
                                                  "retention periods")


_SETTINGS: dict[tuple[tuple[str, Any], ...], Settings] = {}


def _make_settings(values: dict[str, Any]) -> Settings:
    """Settings built once per distinct value set (building one reads the environment)."""
    key = tuple(sorted((k, str(v)) for k, v in values.items()))
    st = _SETTINGS.get(key)
    if st is None:
        st = _SETTINGS[key] = Settings(**values)
    return st


def seed_salt(seed: int) -> int:
    return (seed * 2654435761) % 251


def _bind(fn: Callable[[Any], None], arg: Any) -> Callable[[], None]:
    return lambda: fn(arg)


def _done(on_done: OnDone, error: str | None) -> Callable[[], None]:
    """A send's or receive's completion, as the transport's thread calls it."""
    exc = None if error is None else TransportError(error)
    return lambda: on_done(exc)


def _short(x: object) -> str:
    if isinstance(x, ev.MessageReceived):
        x = x.msg
    text = repr(x)
    return text if len(text) < 240 else text[:237] + "..."


def run_seed(seed: int, config: SimConfig | None = None, *, trace: bool = False) -> Outcome:
    """Runs one seed; raises `Violation` (with the trace when `trace`)."""
    return Simulation(seed, config, trace=trace).play()


def run_seeds(seeds: Iterable[int], config: SimConfig | None = None
              ) -> tuple[int, list[Violation]]:
    """Runs every seed; returns (how many ran, the violations met, in seed order)."""
    found: list[Violation] = []
    n = 0
    for seed in seeds:
        n += 1
        try:
            run_seed(seed, config)
        except Violation as v:
            found.append(v)
    return n, found
