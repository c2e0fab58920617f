"""SGLang-compatible routes: the paths, payloads, answers and status codes of SGLang's
``CommonKVBootstrapServer`` (``python/sglang/srt/disaggregation/common/conn.py``), so an
unmodified SGLang prefill and decode can use this server.

- ``PUT /route``: a prefill rank registers (attn_tp/cp/dp sizes and ranks, pp, system_dp,
  rank_ip, rank_port, page_size, kv_cache_dtype, ...); answers text ``OK``.
- ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``: all four -1
  -> the server info object (exactly SGLang's ``PrefillServerInfo`` fields: the decode builds
  the dataclass from it with ``**data``, so no field may be added); otherwise
  ``{"rank_ip", "rank_port"}``. 400 missing input, 503 until every rank registered, 404 unknown.
- ``POST /register_dp_rank`` ``{"bootstrap_room", "dp_rank"}`` -> ``OK``;
  ``POST /query_dp_ranks`` ``{"bootstrap_rooms": [...]}`` -> ``{"<room>": dp_rank}`` for the
  known rooms only.

Fixed faults of the original: a duplicate PUT of one rank is counted once (the original counts
PUTs, so a restarted rank makes a half-registered server look ready); a rank whose topology,
page size, dtype or layout disagrees with the first is refused (400, each differing field);
malformed JSON, wrong types, missing fields -> 400/422 naming the field, never 500; writes
need the bearer token when one is configured. The ranks are kept in the shared registry under
the engine id ``sglang``, without TTL (SGLang ranks send no heartbeat).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvhandoff.bootstrap_server.deps import MetricsDep, RegistryDep, StateDep, WriteAuth
from kvhandoff.bootstrap_server.registry import RankKey, Registration, Topology
from kvhandoff.bootstrap_server.schemas import (
    MAX_AXIS_SIZE,
    MAX_WORLD_SIZE,
    ROOM_MAX,
    join_address,
    split_address,
)
from kvhandoff.errors import (
    BootstrapConflict,
    BootstrapNotFound,
    BootstrapUnavailable,
    ConfigError,
)
from kvhandoff.kv_layout import LayoutSpec, layout_hash
from kvhandoff.state_machine.events import Role

SGLANG_ENGINE_ID = "sglang"

sglang = APIRouter(tags=["sglang-compatible"])

_Rank = Annotated[int, Field(ge=0, lt=MAX_AXIS_SIZE)]
_Size = Annotated[int, Field(ge=1, le=MAX_AXIS_SIZE)]


class SglangRouteRegister(BaseModel):
    """SGLang's PUT /route payload (unknown extra fields of other versions are ignored)."""

    model_config = ConfigDict(extra="ignore")

    attn_tp_size: _Size
    attn_tp_rank: _Rank
    attn_cp_size: _Size = 1
    attn_cp_rank: _Rank = 0
    attn_dp_size: _Size
    attn_dp_rank: _Rank
    pp_size: _Size
    pp_rank: _Rank
    system_dp_size: _Size = 1
    system_dp_rank: _Rank = 0
    rank_ip: str = Field(min_length=1, max_length=255)
    rank_port: int = Field(ge=1, le=65535)
    page_size: int | None = Field(None, ge=1, le=1 << 20)
    kv_cache_dtype: str | None = Field(None, max_length=64)
    load_balance_method: str | None = Field(None, max_length=64)
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = Field(None, ge=1, le=65535)
    kv_layout: dict[str, Any] | None = None


class SglangRegisterDpRank(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bootstrap_room: int = Field(ge=0, le=ROOM_MAX)
    dp_rank: _Rank


class SglangQueryDpRanks(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bootstrap_rooms: list[Annotated[int, Field(ge=0, le=ROOM_MAX)]] = Field(max_length=65536)


class SglangServerInfo(BaseModel):
    """Exactly the fields of SGLang's ``PrefillServerInfo`` dataclass, in order."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None
    target_tp_rank: int | None = None
    target_tp_ranks: list[int] | None = None
    target_cp_ranks: list[int] | None = None
    target_pp_ranks: list[int] | None = None
    required_dst_info_num: int | None = None
    required_prefill_response_num: int | None = None


class SglangRankInfo(BaseModel):
    rank_ip: str
    rank_port: int


def _layout_identity(kv_layout: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    if not kv_layout:
        return "", {}
    try:
        spec = LayoutSpec.from_dict(kv_layout)
    except ConfigError:
        # not a kvhandoff layout: compare it as opaque canonical JSON
        canon = json.dumps(kv_layout, sort_keys=True, separators=(",", ":"), default=str)
        return "opaque:" + hashlib.sha256(canon.encode()).hexdigest(), {}
    return layout_hash(spec), spec.to_dict()


@sglang.put("/route", dependencies=[WriteAuth], response_class=PlainTextResponse,
            responses={400: {"description": "Disagrees with the first registrant."}})
async def register_prefill_rank(body: SglangRouteRegister, state: StateDep) -> str:
    """SGLang prefill rank registration. A repeated PUT of one rank replaces it."""
    single = body.system_dp_size == 1
    dp_size = body.attn_dp_size if single else body.system_dp_size
    dp_group = body.attn_dp_rank if single else body.system_dp_rank
    checks = (("attn_dp_rank" if single else "system_dp_rank", dp_group, "dp size", dp_size),
              ("attn_tp_rank", body.attn_tp_rank, "attn_tp_size", body.attn_tp_size),
              ("attn_cp_rank", body.attn_cp_rank, "attn_cp_size", body.attn_cp_size),
              ("pp_rank", body.pp_rank, "pp_size", body.pp_size))
    for rank_name, rank, size_name, size in checks:
        if rank >= size:
            raise ConfigError(f"{rank_name}: {rank} is not < {size_name}={size}")
    topo = Topology(dp_size, body.attn_tp_size, body.attn_cp_size, body.pp_size)
    if topo.world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"sizes: world size {topo.world_size} exceeds {MAX_WORLD_SIZE}")
    lhash, layout = _layout_identity(body.kv_layout)
    reg = Registration(
        key=RankKey(SGLANG_ENGINE_ID, dp_group, body.attn_cp_rank, body.attn_tp_rank,
                    body.pp_rank),
        role=Role.PREFILL,
        topology=topo,
        agent_address=join_address(body.rank_ip, body.rank_port),
        generation=join_address(body.rank_ip, body.rank_port),
        layout_hash=lhash,
        layout=layout,
        transport="sglang",
        attributes={
            "page_size": body.page_size,
            "kv_cache_dtype": body.kv_cache_dtype,
            "follow_bootstrap_room": (body.load_balance_method or "follow_bootstrap_room")
            == "follow_bootstrap_room",
            "enable_dsa_cache_layer_split": body.enable_dsa_cache_layer_split,
            "prefill_http_port": body.prefill_http_port,
        },
        expires=False,
    )
    try:
        state.registry.register(reg)
    except BootstrapConflict as e:
        # SGLang callers see a 400; the body names every differing field
        raise ConfigError(str(e)) from e
    return "OK"


def _parse_route_query(**params: str | None) -> dict[str, int]:
    missing = [k for k, v in params.items() if not v]
    if missing:
        raise ConfigError(f"Missing inputs for bootstrap server: {', '.join(missing)}")
    out = {}
    for k, v in params.items():
        try:
            out[k] = int(v or "")
        except ValueError:
            raise ConfigError(f"{k}: expected an integer, got {v!r}") from None
        if not -1 <= out[k] < MAX_AXIS_SIZE:
            raise ConfigError(f"{k}: expected -1 or 0..{MAX_AXIS_SIZE - 1}, got {out[k]}")
    return out


def _not_ready(registry: RegistryDep) -> BootstrapUnavailable | None:
    missing = registry.missing(SGLANG_ENGINE_ID)
    try:
        registry.engine(SGLANG_ENGINE_ID)
    except BootstrapNotFound:
        return BootstrapUnavailable("Prefill server not fully registered yet (0 workers "
                                    "registered).")
    if missing:
        n = len(registry.ranks_of(SGLANG_ENGINE_ID))
        return BootstrapUnavailable(
            f"Prefill server not fully registered yet ({n} workers registered, "
            f"{len(missing)} missing: {', '.join(map(str, missing[:8]))}"
            f"{' ...' if len(missing) > 8 else ''})."
        )
    return None


@sglang.get("/route", response_model=SglangServerInfo | SglangRankInfo, responses={
    400: {"description": "Missing or non-integer inputs."},
    404: {"description": "Unknown rank."},
    503: {"description": "Not every prefill rank registered yet."},
})
async def get_route(
    registry: RegistryDep,
    metrics: MetricsDep,
    prefill_dp_rank: Annotated[str | None, Query(max_length=32)] = None,
    prefill_cp_rank: Annotated[str | None, Query(max_length=32)] = None,
    target_tp_rank: Annotated[str | None, Query(max_length=32)] = None,
    target_pp_rank: Annotated[str | None, Query(max_length=32)] = None,
) -> JSONResponse:
    """All four -1: the prefill server info; otherwise the rank's ``rank_ip``/``rank_port``."""
    try:
        q = _parse_route_query(prefill_dp_rank=prefill_dp_rank, prefill_cp_rank=prefill_cp_rank,
                               target_tp_rank=target_tp_rank, target_pp_rank=target_pp_rank)
        err = _not_ready(registry)
        if err is not None:
            raise err
        if all(v == -1 for v in q.values()):
            eng = registry.engine(SGLANG_ENGINE_ID)
            a = eng.attributes
            info = SglangServerInfo(
                attn_tp_size=eng.topology.tp_size, attn_cp_size=eng.topology.cp_size,
                dp_size=eng.topology.dp_size, pp_size=eng.topology.pp_size,
                page_size=a.get("page_size"), kv_cache_dtype=a.get("kv_cache_dtype"),
                follow_bootstrap_room=bool(a.get("follow_bootstrap_room", True)),
                enable_dsa_cache_layer_split=bool(a.get("enable_dsa_cache_layer_split")),
                prefill_http_port=a.get("prefill_http_port"),
            )
            body: dict[str, Any] = info.model_dump()
        else:
            if any(v < 0 for v in q.values()):
                raise ConfigError("ranks: give all four as -1 (server info) or all >= 0")
            key = RankKey(SGLANG_ENGINE_ID, q["prefill_dp_rank"], q["prefill_cp_rank"],
                          q["target_tp_rank"], q["target_pp_rank"])
            try:
                rec = registry.rank(key)
            except BootstrapNotFound:
                raise BootstrapNotFound(
                    f"Bootstrap info not found for dp_rank={key.dp_rank} cp_rank={key.cp_rank} "
                    f"tp_rank={key.tp_rank} pp_rank={key.pp_rank}"
                ) from None
            ip, port = split_address(rec.agent_address)
            body = SglangRankInfo(rank_ip=ip, rank_port=port).model_dump()
    except (ConfigError, BootstrapNotFound, BootstrapUnavailable) as e:
        outcome = {400: "bad_request", 404: "not_found", 503: "unavailable"}[e.http_status]
        metrics.route_lookups.labels("sglang", outcome).inc()
        raise
    metrics.route_lookups.labels("sglang", "ok").inc()
    return JSONResponse(body)


@sglang.post("/register_dp_rank", dependencies=[WriteAuth], response_class=PlainTextResponse)
async def register_dp_rank(body: SglangRegisterDpRank, registry: RegistryDep) -> str:
    """Record which prefill dp rank serves a room (a repeated call moves it, as SGLang does)."""
    registry.bind_room(body.bootstrap_room, SGLANG_ENGINE_ID, body.dp_rank, rebind=True)
    return "OK"


@sglang.post("/query_dp_ranks")
async def query_dp_ranks(body: SglangQueryDpRanks, registry: RegistryDep) -> dict[str, int]:
    """``{"<room>": dp_rank}`` for each known, bound room; unknown rooms are left out."""
    out: dict[str, int] = {}
    for room in body.bootstrap_rooms:
        rr = registry.find_room(room)
        if rr is not None and rr.dp_rank is not None and rr.engine_id == SGLANG_ENGINE_ID \
                and rr.state.value == "bound":
            out[str(room)] = rr.dp_rank
    return out
