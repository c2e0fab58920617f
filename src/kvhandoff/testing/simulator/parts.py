"""The simulated parts an agent's `runtime.executor.Executor` is handed in the simulator: the
same executor production runs (its `PassBatch`, its flush before a cancel, its peer calls and
their outcomes, its hashing dispatch), over parts whose timing the simulation's seed decides.

- `SimTransport`: a `OneSidedTransport` whose sends, receives and write jobs become the
  world's flights (`core.Flight`), landing when the seed says; a cancel or disconnect ends
  the ops it names at once (their completions say "cancelled", as the transports' do) while
  the copies they started may go on: stopped, landing first (the call waits for them), or not
  stopping (the call fails, the copy may land until its bound).
- `SimCalls`: the peer-call workers: each (agent, peer)'s calls in order, run when the seed
  picks them; a call that waits on the transport holds its peer's later calls.
- `SimPool`: the hasher's pool: jobs run when the seed picks them, in any order.
- `SimOutbox`: the control messages of a pass, through the real wire format at its end into
  the world's channels (FIFO per connection, as ZMQ's are).
- `SimViews`: the engine's views, checked by the world's invariants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Log, Release, RoomUpdate
from kvhandoff.runtime.executor import Call
from kvhandoff.settings import TransportKind
from kvhandoff.transports.base import (
    OnDone,
    OneSidedTransport,
    OnWritten,
    TransportStatus,
    WriteSpec,
)

#: one simulated agent (`core.Agent`): the parts hand it back to their world as it is
Agent = Any


class World(Protocol):
    """What the parts ask of the simulated world (`core.Simulation`), which decides when
    everything they hand it happens."""

    def alive(self, name: str) -> bool: ...

    def exited(self, name: str) -> bool: ...

    def queue_call(self, a: Agent, peer: str, call: Call) -> None: ...

    def queue_completion(self, a: Agent, fn: Callable[[], None]) -> None: ...

    def _stop_ops(self, a: Agent, peer: str, tag: int | None) -> None: ...

    def _post_op(self, a: Agent, send: bool, peer: str, tag: int, buffer: str,
                 offsets: np.ndarray, nbytes: np.ndarray, on_done: OnDone) -> None: ...

    def _post_writes(self, a: Agent, peer: str, writes: Sequence[WriteSpec],
                     on_done: OnWritten, checksum: bool) -> None: ...

    def _sending(self, a: Agent, to: str, msg: Any) -> None: ...

    def _send(self, a: Agent, to: str, msg: Any) -> None: ...

    def _room_update(self, a: Agent, eff: RoomUpdate) -> None: ...

    def _release(self, a: Agent, eff: Release) -> None: ...

    def _log(self, a: Agent, eff: Log) -> None: ...


class SimTransport(OneSidedTransport):
    """One agent's data plane in the simulated world (see the module doc)."""

    kind: ClassVar[TransportKind] = TransportKind.INPROC

    def __init__(self, world: World, agent: Agent) -> None:  # noqa: D107
        self._world = world
        self._agent = agent

    @property
    def address(self) -> bytes:
        return f"{self._agent.name}".encode()

    def register(self, name: str, buf: np.ndarray) -> None:
        return None

    def describe(self, name: str) -> bytes:
        return f"{self._agent.name}:{name}".encode()

    def connect(self, peer: str, address: bytes) -> None:
        if not self._world.alive(peer):
            raise TransportError(f"no process at {peer}")

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        return None

    def disconnect(self, peer: str) -> None:
        self._world._stop_ops(self._agent, peer, None)

    def cancel(self, peer: str, tag: int) -> None:
        self._world._stop_ops(self._agent, peer, tag)

    def peer_exited(self, peer: str) -> bool:
        return self._world.exited(peer)

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._world._post_op(self._agent, True, peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        self._world._post_op(self._agent, False, peer, tag, name, offsets, nbytes, on_done)

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        self._world._post_writes(self._agent, peer, writes, on_done, checksum)

    def status(self) -> TransportStatus:
        return TransportStatus(kind="sim", lanes=(), degraded=False, reason="", bytes_sent=0,
                               bytes_received=0)

    def close(self) -> None:
        return None


class SimCalls:
    """One agent's peer-call workers (see the module doc): the world runs a call when its
    seed picks it (`Simulation._answer_call`)."""

    def __init__(self, world: World, agent: Agent) -> None:
        self._world = world
        self._agent = agent

    def run(self, peer: str, call: Call) -> None:
        self._world.queue_call(self._agent, peer, call)


class SimPool:
    """One agent's hasher pool: a job runs (reading the buffers then) when the seed says."""

    def __init__(self, world: World, agent: Agent) -> None:
        self._world = world
        self._agent = agent

    def submit(self, fn: Callable[[], None]) -> None:
        self._world.queue_completion(self._agent, fn)


class SimOutbox:
    """One agent's outbox: the messages of a pass leave at its end (`flush`)."""

    def __init__(self, world: World, agent: Agent) -> None:
        self._world = world
        self._agent = agent
        self.queue: list[tuple[str, P.Message]] = []

    def send(self, addr: str, msg: P.Message) -> None:
        self._world._sending(self._agent, addr, msg)
        self.queue.append((addr, msg))

    def forget(self, peer: str) -> None:
        return None  # its last messages still leave (production's socket lingers)

    def flush(self) -> None:
        queue, self.queue = self.queue, []
        for addr, msg in queue:
            self._world._send(self._agent, addr, msg)


class SimViews:
    """One agent's engine views: the world records them and checks its invariants."""

    def __init__(self, world: World, agent: Agent) -> None:
        self._world = world
        self._agent = agent

    def update(self, eff: RoomUpdate) -> None:
        self._world._room_update(self._agent, eff)

    def release(self, eff: Release) -> None:
        self._world._release(self._agent, eff)


def log_part(world: World, agent: Agent) -> Callable[[Log], None]:
    def log(eff: Log) -> None:
        world._log(agent, eff)
    return log


