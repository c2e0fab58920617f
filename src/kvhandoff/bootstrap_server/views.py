"""Registry records -> response schemas (the only place that knows both)."""

from __future__ import annotations

from kvhandoff.bootstrap_server.registry import (
    EngineRecord,
    RankKey,
    RankRecord,
    Registry,
    RoomRecord,
)
from kvhandoff.bootstrap_server.schemas import (
    EngineSummary,
    EngineTopology,
    PrefillRankInfo,
    RankKeyPublic,
    RankPublic,
    ReadyStatus,
    RoomPublic,
)

# "ucx-tcp": a UCX agent that found only TCP lanes (no shared memory, no RDMA device)
DEGRADED_TRANSPORTS = frozenset({"tcp", "ucx-tcp"})


def rank_public(rec: RankRecord, now: float) -> RankPublic:
    k, t = rec.key, rec.topology
    return RankPublic(
        engine_id=k.engine_id, role=rec.role,
        dp_rank=k.dp_rank, tp_rank=k.tp_rank, cp_rank=k.cp_rank, pp_rank=k.pp_rank,
        dp_size=t.dp_size, tp_size=t.tp_size, cp_size=t.cp_size, pp_size=t.pp_size,
        agent_address=rec.agent_address, generation=rec.generation,
        layout_hash=rec.layout_hash, transport=rec.transport,
        seconds_since_heartbeat=max(0.0, now - rec.last_seen),
    )


def key_public(k: RankKey) -> RankKeyPublic:
    return RankKeyPublic(engine_id=k.engine_id, dp_rank=k.dp_rank, cp_rank=k.cp_rank,
                         tp_rank=k.tp_rank, pp_rank=k.pp_rank)


def prefill_rank_info(rec: RankRecord) -> PrefillRankInfo:
    k, t = rec.key, rec.topology
    return PrefillRankInfo(
        engine_id=k.engine_id, dp_rank=k.dp_rank, tp_rank=k.tp_rank, cp_rank=k.cp_rank,
        pp_rank=k.pp_rank, tp_size=t.tp_size, cp_size=t.cp_size, pp_size=t.pp_size,
        agent_address=rec.agent_address, generation=rec.generation,
        layout_hash=rec.layout_hash, transport=rec.transport,
    )


def room_public(rr: RoomRecord, now: float) -> RoomPublic:
    return RoomPublic(room=rr.room, state=rr.state.value, engine_id=rr.engine_id,
                      dp_rank=rr.dp_rank, abort_reason=rr.abort_reason,
                      seconds_since_change=max(0.0, now - rr.updated_at))


def engine_topology(reg: Registry, eng: EngineRecord, now: float) -> EngineTopology:
    t = eng.topology
    return EngineTopology(
        engine_id=eng.engine_id, role=eng.role, dp_size=t.dp_size, tp_size=t.tp_size,
        cp_size=t.cp_size, pp_size=t.pp_size, world_size=t.world_size,
        layout_hash=eng.layout_hash, layout=dict(eng.layout),
        ranks=[rank_public(r, now) for r in reg.ranks_of(eng.engine_id)],
        missing=[key_public(k) for k in reg.missing(eng.engine_id)],
    )


def ready_status(reg: Registry, *, require_rdma: bool) -> ReadyStatus:
    engines = reg.engines()
    summaries = []
    degraded: list[str] = []
    live = 0
    expected = 0
    for eng in engines:
        ranks = reg.ranks_of(eng.engine_id)
        live += len(ranks)
        expected += eng.topology.world_size
        summaries.append(EngineSummary(
            engine_id=eng.engine_id, role=eng.role, world_size=eng.topology.world_size,
            live_ranks=len(ranks), layout_hash=eng.layout_hash,
            transports=sorted({r.transport for r in ranks}),
        ))
        degraded += [f"{r.key} ({r.transport})" for r in ranks
                     if r.transport in DEGRADED_TRANSPORTS]
    missing = [key_public(k) for k in reg.missing()]
    if not engines:
        ready, reason = False, "no rank has registered yet"
    elif missing:
        ready, reason = False, f"{len(missing)} of {expected} expected ranks are not live"
    elif require_rdma and degraded:
        ready, reason = False, f"require_rdma is set and {len(degraded)} ranks use tcp"
    else:
        ready, reason = True, f"all {expected} expected ranks are live"
    return ReadyStatus(ready=ready, reason=reason, expected_ranks=expected, live_ranks=live,
                       engines=summaries, missing=missing, degraded=degraded)
