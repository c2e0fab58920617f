"""The bootstrap registry's records: rank identities, topologies, engines, ranks, rooms and the
counters (plain data, no behaviour beyond small helpers; see `registry` for the rules)."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.state_machine.vocabulary import Role

ROOM_BITS = 63
MAX_ROOMS_PER_CALL = 4096
MAX_LIVE_ROOMS = 1_000_000
MAX_WORLD_SIZE = 1024
MAX_ENGINES = 256
MAX_LIVE_RANKS = 65536
# ranks, and rooms, one expiry pass drops at most (each O(1): a few ms of the event loop)
EXPIRE_BATCH = 4096


class RoomAssignment(enum.Enum):
    """Where a room stands as far as the bootstrap server knows: handed out, bound to a prefill
    dp rank, or aborted (the protocol's own per-room state is `protocol.roomstate.RoomState`)."""

    ALLOCATED = "allocated"
    BOUND = "bound"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True, order=True)
class RankKey:
    """The unique identity of a rank."""

    engine_id: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int

    def __str__(self) -> str:
        return (
            f"{self.engine_id}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"
        )


@dataclass(frozen=True, slots=True)
class Topology:
    """Parallel sizes of an engine."""

    dp_size: int
    tp_size: int
    cp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.cp_size * self.pp_size

    def keys(self, engine_id: str) -> Iterator[RankKey]:
        for dp in range(self.dp_size):
            for cp in range(self.cp_size):
                for tp in range(self.tp_size):
                    for pp in range(self.pp_size):
                        yield RankKey(engine_id, dp, cp, tp, pp)


@dataclass(slots=True)
class RankRecord:
    """One registered rank (what the server keeps and the route lookup returns)."""

    key: RankKey
    role: Role
    topology: Topology
    agent_address: str
    generation: str
    layout_hash: str
    transport: str
    registered_at: float
    last_seen: float
    expires: bool = True


@dataclass(slots=True)
class EngineRecord:
    """An engine: fixed by its first registrant. `layout` / `layout_hash` are what every rank
    of the engine shares (the TP-invariant form for head-sharded layouts)."""

    engine_id: str
    role: Role
    topology: Topology
    layout_hash: str
    layout: Mapping[str, Any]
    # e.g. SGLang's page_size and kv_cache_dtype: a registrant that sends another value is
    # refused, one that leaves a value out (None) is not, and fills one the engine lacks
    attributes: dict[str, Any] = field(default_factory=dict)
    # compared exactly, absence (None) included, e.g. SGLang's decode_allocation_policy
    strict_attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RoomRecord:
    """A room: allocated, bound to a prefill dp rank, or aborted (with why)."""

    room: int
    state: RoomAssignment
    engine_id: str | None
    dp_rank: int | None
    abort_reason: str | None
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class RegistrationRequest:
    """What a rank asks to register (built by the HTTP layer from a validated body)."""

    key: RankKey
    role: Role
    topology: Topology
    agent_address: str
    generation: str
    layout_hash: str
    layout: Mapping[str, Any]
    transport: str
    attributes: Mapping[str, Any] = field(default_factory=dict)
    strict_attributes: Mapping[str, Any] = field(default_factory=dict)
    expires: bool = True
    # what all ranks of the engine must share (the TP-invariant layout); None = `layout`
    engine_layout_hash: str | None = None
    engine_layout: Mapping[str, Any] | None = None

    @property
    def shared_layout_hash(self) -> str:
        return self.layout_hash if self.engine_layout_hash is None else self.engine_layout_hash

    @property
    def shared_layout(self) -> Mapping[str, Any]:
        return self.layout if self.engine_layout is None else self.engine_layout


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """The answer of a route lookup: the engine, its dp rank and the ranks to talk to."""

    engine_id: str
    dp_rank: int
    topology: Topology
    ranks: tuple[RankRecord, ...]


@dataclass(slots=True)
class Stats:
    """Monotonic counters (read by the metrics collector)."""

    registrations: int = 0  # unique identities added (a re-registration is not counted)
    re_registrations: int = 0
    deregistrations: int = 0
    ranks_expired: int = 0
    conflicts: int = 0
    rooms_allocated: int = 0
    rooms_bound: int = 0
    rooms_aborted: int = 0
    rooms_forgotten: int = 0
    rooms_refused: int = 0  # rooms not created: the registry held its cap of live rooms
    engines_forgotten: int = 0  # engines dropped with their last rank (deregister or expiry)
    # registrations refused by a bound: max_world_size, max_engines, max_live_ranks
    registrations_refused: int = 0
    # the most ranks (or rooms) one expiry pass dropped: at most EXPIRE_BATCH
    expiry_pass_max: int = 0
