"""Request and response bodies of the native `/v1` API, split by use.

Rules: request models forbid unknown fields (a typo is an error naming the field, not a silent
default); every size and rank is bounded so no request can make the server enumerate a huge
topology; response models are built from registry records by the routers, so registry objects
never leak. `PrefillRankInfo` is also what `BootstrapClient.lookup_route` returns.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvhandoff.netaddr import split_host_port
from kvhandoff.state_machine.vocabulary import Role

MAX_AXIS_SIZE = 4096
MAX_WORLD_SIZE = 65536  # the schema's hard bound; the server's is Settings.max_world_size
#: most engines, missing ranks and degraded ranks `/ready` lists (the counts are exact)
READY_LIST_MAX = 16
#: most items a page of `/v1/engines` or `/v1/ranks` holds
PAGE_MAX = 1000
ROOM_MAX = (1 << 63) - 1

EngineId = Annotated[
    str,
    Field(
        min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
        description="Engine name (letters, digits, . _ : -); all ranks of one engine share it.",
    ),
]
Rank = Annotated[int, Field(ge=0, lt=MAX_AXIS_SIZE)]
Size = Annotated[int, Field(ge=1, le=MAX_AXIS_SIZE)]
Generation = Annotated[
    str, Field(min_length=1, max_length=128, description="Nonce of the process (new per start).")
]
RoomId = Annotated[int, Field(ge=0, le=ROOM_MAX, description="Room id (63-bit).")]
TransportName = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$", description="ucx, tcp, ...")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankIdentity(_Request):
    """Who a rank is: unique per (engine_id, dp_rank, cp_rank, tp_rank, pp_rank)."""

    engine_id: EngineId
    dp_rank: Rank = 0
    tp_rank: Rank = 0
    cp_rank: Rank = 0
    pp_rank: Rank = 0


class RankRegister(RankIdentity):
    """Register (or re-register: same identity replaces) a rank."""

    role: Role
    dp_size: Size = 1
    tp_size: Size = 1
    cp_size: Size = 1
    pp_size: Size = 1
    agent_address: str = Field(
        max_length=300, description="Control address of the rank's transfer agent, host:port."
    )
    generation: Generation
    layout: dict[str, Any] = Field(description="`LayoutSpec.to_dict()` of the rank's KV cache.")
    layout_hash: str | None = Field(
        None, max_length=200, description="`layout_hash(layout)`; checked when given."
    )
    transport: TransportName = "ucx"

    @field_validator("agent_address")
    @classmethod
    def _address(cls, v: str) -> str:
        split_host_port(v)
        return v

    @model_validator(mode="after")
    def _ranks_in_sizes(self) -> RankRegister:
        for axis in ("dp", "tp", "cp", "pp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if rank >= size:
                raise ValueError(f"{axis}_rank={rank} must be < {axis}_size={size}")
        world = self.dp_size * self.tp_size * self.cp_size * self.pp_size
        if world > MAX_WORLD_SIZE:
            raise ValueError(f"dp_size*tp_size*cp_size*pp_size={world} exceeds {MAX_WORLD_SIZE}")
        return self


class RankHeartbeat(RankIdentity):
    """A live rank says so; a 404 answer means: register again."""

    generation: Generation | None = None


class RankDeregister(RankIdentity):
    """A rank leaves (clean shutdown)."""

    generation: Generation | None = None


class RankPublic(BaseModel):
    """A registered rank as the API shows it."""

    engine_id: str
    role: Role
    dp_rank: int
    tp_rank: int
    cp_rank: int
    pp_rank: int
    dp_size: int
    tp_size: int
    cp_size: int
    pp_size: int
    agent_address: str
    generation: str
    layout_hash: str
    transport: str
    seconds_since_heartbeat: float


class RankRegistered(RankPublic):
    replaced: bool = Field(description="True when this identity was registered before.")


class HeartbeatAck(BaseModel):
    generation: str
    rank_ttl_s: float


class RankKeyPublic(BaseModel):
    engine_id: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int


class EngineTopology(BaseModel):
    """An engine: sizes, layout, which ranks are live and which are missing."""

    engine_id: str
    role: Role
    dp_size: int
    tp_size: int
    cp_size: int
    pp_size: int
    world_size: int
    layout_hash: str
    layout: dict[str, Any]
    ranks: list[RankPublic]
    missing: list[RankKeyPublic]


class EngineSummary(BaseModel):
    engine_id: str
    role: Role
    world_size: int
    live_ranks: int
    missing_ranks: int = 0
    layout_hash: str
    transports: list[str]


class RoomsAllocate(_Request):
    count: int = Field(1, ge=1, le=4096, description="How many room ids to allocate.")


class RoomsAllocated(BaseModel):
    rooms: list[int]


class RoomBind(_Request):
    engine_id: EngineId
    dp_rank: Rank


class RoomAbort(_Request):
    reason: str = Field(min_length=1, max_length=2000)


class RoomPublic(BaseModel):
    room: int
    state: str = Field(description="allocated, bound or aborted.")
    engine_id: str | None
    dp_rank: int | None
    abort_reason: str | None
    seconds_since_change: float


class RouteQuery(_Request):
    """Where a decode rank finds its prefill: a room (bound) or an engine's dp rank."""

    engine_id: EngineId | None = None
    room: RoomId | None = None
    dp_rank: Rank | None = None
    tp_rank: Rank = 0
    tp_size: Size = 1
    cp_rank: Rank = 0
    cp_size: Size = 1
    pp_rank: Rank = 0
    pp_size: Size = 1
    replicated: bool = Field(
        False, description="The region is replicated on every prefill TP rank (MLA): one source."
    )


class PrefillRankInfo(BaseModel):
    """A prefill rank a decode rank must talk to."""

    model_config = ConfigDict(frozen=True)

    engine_id: str
    dp_rank: int
    tp_rank: int
    cp_rank: int
    pp_rank: int
    tp_size: int
    cp_size: int
    pp_size: int
    agent_address: str
    generation: str
    layout_hash: str
    transport: str


class RouteAnswer(BaseModel):
    engine_id: str
    dp_rank: int
    ranks: list[PrefillRankInfo]


class ReadyStatus(BaseModel):
    """`/ready`: ready when at least one engine is known and every expected rank of every known
    engine is registered and live (an engine is known while it has a live rank).

    Counts are exact; the lists are samples of at most `READY_LIST_MAX` items (the full lists
    are paged at ``/v1/engines`` and ``/v1/ranks``), so the answer's size does not grow with
    the ranks registered."""

    ready: bool
    reason: str
    expected_ranks: int
    live_ranks: int
    missing_ranks: int = Field(0, description="Expected ranks not live (all engines).")
    engine_count: int = Field(0, description="Engines known (each has a live rank).")
    degraded_ranks: int = Field(0, description="Live ranks on a degraded (tcp) transport.")
    engines: list[EngineSummary] = Field(
        description=f"Up to {READY_LIST_MAX} engines, incomplete ones first.")
    missing: list[RankKeyPublic] = Field(
        description=f"The first {READY_LIST_MAX} missing ranks, in identity order.")
    degraded: list[str] = Field(
        default_factory=list,
        description=f"Up to {READY_LIST_MAX} ranks on a degraded (tcp) transport.",
    )
    auth: str = Field(
        "secret", description="How this server authenticates writes: secret (auth_token set), "
        "loopback (no token, loopback host only) or off (no token on a non-loopback host, "
        "allowed by allow_unauthenticated)."
    )


class Page(_Request):
    """``?offset=&limit=`` of a listing."""

    offset: int = Field(0, ge=0, le=1 << 31, description="Items to skip.")
    limit: int = Field(PAGE_MAX, ge=1, le=PAGE_MAX, description="Most items to return.")
