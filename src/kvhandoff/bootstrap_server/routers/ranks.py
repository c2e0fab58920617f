"""`/v1/ranks`: register, heartbeat, deregister; `/v1/engines`: topology."""

from __future__ import annotations

from fastapi import APIRouter

from kvhandoff.bootstrap_server.deps import RegistryDep, SettingsDep, StateDep, WriteAuth
from kvhandoff.bootstrap_server.registry import RankKey, Registration, Topology
from kvhandoff.bootstrap_server.schemas import (
    EngineSummary,
    EngineTopology,
    HeartbeatAck,
    RankDeregister,
    RankHeartbeat,
    RankIdentity,
    RankPublic,
    RankRegister,
    RankRegistered,
)
from kvhandoff.bootstrap_server.views import engine_topology, rank_public, ready_status
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, layout_hash

ranks = APIRouter(prefix="/v1/ranks", tags=["ranks"])
engines = APIRouter(prefix="/v1/engines", tags=["engines"])

_ERRORS: dict[int | str, dict[str, str]] = {
    400: {"description": "Bad layout or rank outside its size."},
    401: {"description": "Missing or wrong bearer token."},
    409: {"description": "Topology or layout disagrees with the engine's first registrant "
                         "(`diff` lists each field)."},
}


def _key(body: RankIdentity) -> RankKey:
    return RankKey(body.engine_id, body.dp_rank, body.cp_rank, body.tp_rank, body.pp_rank)


@ranks.post("", dependencies=[WriteAuth], responses=_ERRORS)
async def register_rank(body: RankRegister, state: StateDep) -> RankRegistered:
    """Register a rank; the same identity again replaces it (counted once)."""
    spec = LayoutSpec.from_dict(body.layout)  # ConfigError (400) names the bad layout field
    computed = layout_hash(spec)
    shared = spec.tp_invariant()
    if body.layout_hash is not None and body.layout_hash != computed:
        raise ConfigError(
            f"layout_hash: {body.layout_hash!r} is not the hash of the layout sent "
            f"({computed!r}); send layout_hash(LayoutSpec.from_dict(layout))"
        )
    reg = Registration(
        key=_key(body),
        role=body.role,
        topology=Topology(body.dp_size, body.tp_size, body.cp_size, body.pp_size),
        agent_address=body.agent_address,
        generation=body.generation,
        layout_hash=computed,
        layout=spec.to_dict(),
        transport=body.transport,
        # TP ranks of a head-sharded (GQA) engine hold different heads: compare what they share
        engine_layout_hash=layout_hash(shared),
        engine_layout=shared.to_dict(),
    )
    rec, replaced = state.registry.register(reg)
    pub = rank_public(rec, state.clock())
    return RankRegistered(**pub.model_dump(), replaced=replaced)


@ranks.post("/heartbeat", dependencies=[WriteAuth],
            responses={404: {"description": "Unknown or dropped rank: register again."},
                       409: {"description": "Another generation holds this identity."}})
async def heartbeat(body: RankHeartbeat, registry: RegistryDep,
                    settings: SettingsDep) -> HeartbeatAck:
    """Keep a rank live (it is dropped after `rank_ttl_s` without one)."""
    rec = registry.heartbeat(_key(body), body.generation)
    return HeartbeatAck(generation=rec.generation, rank_ttl_s=settings.rank_ttl_s)


@ranks.post("/deregister", dependencies=[WriteAuth],
            responses={404: {"description": "Unknown rank."}})
async def deregister(body: RankDeregister, state: StateDep) -> RankPublic:
    """Remove a rank (clean shutdown); its engine goes with its last rank."""
    rec = state.registry.deregister(_key(body), body.generation)
    return rank_public(rec, state.clock())


@ranks.get("")
async def list_ranks(state: StateDep) -> list[RankPublic]:
    """All live ranks."""
    now = state.clock()
    return [rank_public(r, now) for r in state.registry.all_ranks()]


@engines.get("")
async def list_engines(registry: RegistryDep, settings: SettingsDep) -> list[EngineSummary]:
    """Every known engine with its live rank count."""
    return ready_status(registry, require_rdma=settings.require_rdma).engines


@engines.get("/{engine_id}", responses={404: {"description": "Unknown engine."}})
async def topology(engine_id: str, state: StateDep) -> EngineTopology:
    """An engine's sizes and layout, its live ranks and the ranks still missing."""
    eng = state.registry.engine(engine_id)
    return engine_topology(state.registry, eng, state.clock())
