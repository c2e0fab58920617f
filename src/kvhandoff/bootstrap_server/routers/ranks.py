"""`/v1/ranks`: register, heartbeat, deregister; `/v1/engines`: topology.

Rules: the registry is touched on the event loop only (its one owner, no lock); CPU work that
needs no registry — parsing and hashing a layout, rendering an engine's full topology — runs in
the thread pool so it never holds the loop. Listings are paged (``offset``, ``limit``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from kvhandoff.bootstrap_server.deps import RegistryDep, SettingsDep, StateDep, WriteAuth
from kvhandoff.bootstrap_server.registry import RankKey, RegistrationRequest, Topology
from kvhandoff.bootstrap_server.schemas import (
    EngineSummary,
    EngineTopology,
    HeartbeatAck,
    Page,
    RankDeregister,
    RankHeartbeat,
    RankIdentity,
    RankPublic,
    RankRegister,
    RankRegistered,
)
from kvhandoff.bootstrap_server.views import (
    engine_summary,
    key_public,
    rank_public,
)
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


def _layouts(body: RankRegister) -> tuple[LayoutSpec, str, LayoutSpec, str]:
    """The rank's layout, its hash, the TP-invariant layout and its hash (pure CPU work)."""
    spec = LayoutSpec.from_dict(body.layout)  # ConfigError (400) names the bad layout field
    computed = layout_hash(spec)
    if body.layout_hash is not None and body.layout_hash != computed:
        raise ConfigError(
            f"layout_hash: {body.layout_hash!r} is not the hash of the layout sent "
            f"({computed!r}); send layout_hash(LayoutSpec.from_dict(layout))"
        )
    shared = spec.tp_invariant()
    return spec, computed, shared, layout_hash(shared)


@ranks.post("", dependencies=[WriteAuth], responses={
    **_ERRORS,
    400: {"description": "Bad layout, rank outside its size, or world size over "
                         "max_world_size."},
    409: {"description": "Topology or layout disagrees with the engine's first registrant "
                         "(`diff` lists each field), or a new engine past max_engines, a new "
                         "rank past max_live_ranks."}})
async def register_rank(body: RankRegister, state: StateDep) -> RankRegistered:
    """Register a rank; the same identity again replaces it (counted once)."""
    spec, computed, shared, shared_hash = await run_in_threadpool(_layouts, body)
    reg = RegistrationRequest(
        key=_key(body),
        role=body.role,
        topology=Topology(body.dp_size, body.tp_size, body.cp_size, body.pp_size),
        agent_address=body.agent_address,
        generation=body.generation,
        layout_hash=computed,
        layout=spec.to_dict(),
        transport=body.transport,
        # TP ranks of a head-sharded (GQA) engine hold different heads: compare what they share
        engine_layout_hash=shared_hash,
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
async def list_ranks(page: Annotated[Page, Query()], state: StateDep) -> list[RankPublic]:
    """Live ranks in identity order, a page at a time (``offset``, ``limit`` <= 1000)."""
    now = state.clock()
    return [rank_public(r, now) for r in state.registry.ranks_page(page.offset, page.limit)]


@engines.get("")
async def list_engines(page: Annotated[Page, Query()],
                       registry: RegistryDep) -> list[EngineSummary]:
    """Known engines by id with their live and missing rank counts, a page at a time
    (``offset``, ``limit`` <= 1000; ``/ready``'s ``engine_count`` is the total)."""
    engs = registry.engines()[page.offset:page.offset + page.limit]
    return [engine_summary(registry, e) for e in engs]


def _render_topology(fields: dict[str, Any], ranks: list[tuple[Any, float]],
                     missing: list[Any]) -> bytes:
    topo = EngineTopology(**fields, ranks=[rank_public(r, now) for r, now in ranks],
                          missing=[key_public(k) for k in missing])
    return topo.model_dump_json().encode()


@engines.get("/{engine_id}", response_model=EngineTopology,
             responses={404: {"description": "Unknown engine."}})
async def topology(engine_id: str, state: StateDep) -> Response:
    """An engine's sizes and layout, its live ranks and the ranks still missing (at most
    max_world_size of each)."""
    reg = state.registry
    eng = reg.engine(engine_id)
    now = state.clock()
    t = eng.topology
    fields = {"engine_id": eng.engine_id, "role": eng.role, "dp_size": t.dp_size,
              "tp_size": t.tp_size, "cp_size": t.cp_size, "pp_size": t.pp_size,
              "world_size": t.world_size, "layout_hash": eng.layout_hash,
              "layout": dict(eng.layout)}
    # snapshot on the loop (the registry's owner), render in the thread pool
    ranks_now = [(r, now) for r in reg.ranks_of(engine_id)]
    body = await run_in_threadpool(_render_topology, fields, ranks_now, reg.missing(engine_id))
    return Response(body, media_type="application/json")
