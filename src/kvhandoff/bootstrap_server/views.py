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
    READY_LIST_MAX,
    EngineSummary,
    PrefillRankInfo,
    RankKeyPublic,
    RankPublic,
    ReadyStatus,
    RoomPublic,
)

# "ucx-tcp": a UCX agent that found only TCP lanes (no shared memory, no RDMA device)
DEGRADED_TRANSPORTS = frozenset({"tcp", "ucx-tcp"})


def degraded_transport(t: str) -> bool:
    """Whether a rank's registered transport is degraded: tcp, UCX on TCP lanes, or device
    pages through host staging (``<kind>-staged``, runtime/staging.py)."""
    return t in DEGRADED_TRANSPORTS or t.endswith("-staged")


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


def engine_summary(reg: Registry, eng: EngineRecord) -> EngineSummary:
    """O(transports): counts kept by the registry, no walk over ranks."""
    transports = reg.transports_of(eng.engine_id)
    live = sum(transports.values())
    return EngineSummary(
        engine_id=eng.engine_id, role=eng.role, world_size=eng.topology.world_size,
        live_ranks=live, missing_ranks=eng.topology.world_size - live,
        layout_hash=eng.layout_hash, transports=sorted(transports),
    )


def _degraded_sample(reg: Registry, engines: list[EngineRecord], limit: int) -> list[str]:
    """Up to `limit` degraded ranks; walks only engines that have one, and stops at `limit`."""
    out: list[str] = []
    for eng in engines:
        if not any(degraded_transport(t) for t in reg.transports_of(eng.engine_id)):
            continue
        for r in reg.ranks_of(eng.engine_id):
            if len(out) >= limit:
                return out
            if degraded_transport(r.transport):
                out.append(f"{r.key} ({r.transport})")
    return out


def ready_status(reg: Registry, *, require_rdma: bool) -> ReadyStatus:
    """`/ready`: counts plus bounded samples (`READY_LIST_MAX` engines, missing and degraded
    ranks), so its size and cost do not grow with the ranks registered; the full lists are
    paged at ``/v1/engines`` and ``/v1/ranks``."""
    engines = reg.engines()
    summaries = [engine_summary(reg, e) for e in engines]
    expected, live = reg.expected_count(), reg.live_rank_count()
    missing_n = reg.missing_count()
    degraded_n = sum(n for e in engines for t, n in reg.transports_of(e.engine_id).items()
                     if degraded_transport(t))
    if not engines and not (reg.stats.registrations or reg.stats.re_registrations):
        ready, reason = False, "no rank has registered yet"
    elif not engines:
        ready, reason = False, ("no engine has a live rank: each one's ranks deregistered or "
                                "missed rank_ttl_s")
    elif missing_n:
        ready, reason = False, f"{missing_n} of {expected} expected ranks are not live"
    elif require_rdma and degraded_n:
        ready, reason = False, (f"require_rdma is set and {degraded_n} ranks use tcp or "
                                 "host staging")
    else:
        ready, reason = True, f"all {expected} expected ranks are live"
    # incomplete engines first: they are the ones an operator looks for
    summaries.sort(key=lambda s: (s.missing_ranks == 0, s.engine_id))
    return ReadyStatus(
        ready=ready, reason=reason, expected_ranks=expected, live_ranks=live,
        missing_ranks=missing_n, engine_count=len(engines), degraded_ranks=degraded_n,
        engines=summaries[:READY_LIST_MAX],
        missing=[key_public(k) for k in reg.missing(limit=READY_LIST_MAX)],
        degraded=_degraded_sample(reg, engines, READY_LIST_MAX),
    )


class ReadyCache:
    """`/ready`'s answer, kept while the registry's `rank_version` stays (heartbeats do not
    move it; registrations, departures and expiry do): repeated reads — which need no token —
    cost a dict hit, not the samples' walk."""

    def __init__(self) -> None:
        self._key: tuple[int, bool] | None = None
        self._status: ReadyStatus | None = None

    def get(self, reg: Registry, *, require_rdma: bool) -> ReadyStatus:
        reg.engine_count()  # the expiry pass first: it moves rank_version
        key = (reg.rank_version, require_rdma)
        if self._status is None or key != self._key:
            self._status, self._key = ready_status(reg, require_rdma=require_rdma), key
        return self._status
