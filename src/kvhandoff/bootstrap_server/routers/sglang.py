"""SGLang-compatible routes: the paths, payloads, answers and status codes of SGLang's
``CommonKVBootstrapServer`` (``python/sglang/srt/disaggregation/common/conn.py``), so an
unmodified SGLang prefill and decode can use this server.

- ``PUT /route``: a prefill rank registers (attn_tp/cp/dp sizes and ranks, pp, system_dp,
  rank_ip, rank_port, page_size, kv_cache_dtype, ...); answers text ``OK``.
- ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``: all four -1
  -> the server info object (exactly SGLang 0.5.23's ``PrefillServerInfo`` fields: the decode
  builds the dataclass from it with ``**data``, so no field may be added); otherwise
  ``{"rank_ip", "rank_port"}``. 400 missing input, 503 until every rank registered, 404 unknown.
  The answers are prepared per registry change (`sglang_answers`); the fast path in `fastpath`
  serves them without this router.
- ``POST /register_dp_rank`` ``{"bootstrap_room", "dp_rank"}`` -> ``OK``;
  ``POST /query_dp_ranks`` ``{"bootstrap_rooms": [...]}`` -> ``{"<room>": dp_rank}`` for the
  known rooms only.

Fixed faults of the original: a duplicate PUT of one rank is counted once (the original counts
PUTs, so a restarted rank makes a half-registered server look ready); a rank whose topology,
page size, dtype or layout disagrees with the first is refused (400, each differing field) —
a field the rank leaves out is no disagreement, and fills the value when the engine lacks it;
like SGLang 0.5.23, a rank whose ``decode_allocation_policy`` (absent = ``early``) or
``dsv41_spec_layout`` (absent = none) differs is refused (400);
``kv_layout`` is SGLang's string or a kvhandoff `LayoutSpec` object (anything else: 422 naming
``kv_layout``), ``dsv41_spec_layout`` the typed, bounded `Dsv41SpecLayout` (an unknown or junk
field: 422 naming it); the world size is bounded by ``max_world_size`` like native ranks;
malformed JSON, wrong types, missing fields -> 400/422 naming the field, never 500; writes
need the bearer token when one is configured. The ranks are kept in the shared registry under
the engine id ``sglang``, without TTL (SGLang ranks send no heartbeat).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from kvhandoff.bootstrap_server.deps import MetricsDep, RegistryDep, StateDep, WriteAuth
from kvhandoff.bootstrap_server.records import RankKey, RegistrationRequest, Topology
from kvhandoff.bootstrap_server.schemas import MAX_AXIS_SIZE, ROOM_MAX
from kvhandoff.bootstrap_server.sglang_answers import (
    SGLANG_ENGINE_ID,
    Answer,
    dump_json,
    parse_route_query,
)
from kvhandoff.errors import BootstrapConflict, ConfigError
from kvhandoff.kv_layout import LayoutSpec, layout_hash
from kvhandoff.netaddr import join_host_port
from kvhandoff.state_machine.vocabulary import Role

sglang = APIRouter(tags=["sglang-compatible"])

_Rank = Annotated[int, Field(ge=0, lt=MAX_AXIS_SIZE)]
_Size = Annotated[int, Field(ge=1, le=MAX_AXIS_SIZE)]
# bounds of a DSpark layout: layers and state pools of a real model, with room to spare
_MAX_LAYERS = 4096
_MAX_STATES = 64
_Count = Annotated[int, Field(ge=0, le=1 << 20)]
_Bytes = Annotated[int, Field(ge=0, le=1 << 40)]
QUERY_SLICE = 1024  # rooms /query_dp_ranks looks up per turn of the event loop


class Dsv41SpecLayout(BaseModel):
    """SGLang 0.5.23's DeepSeek-V4.1 DSpark transfer layout (what its
    ``get_dsv41_spec_layout`` sends): both sides must send the same one. Typed and bounded; an
    unknown field or a value of another type is refused (422 naming it): a field this server
    dropped could not be compared, and the decode would learn a layout the prefill never sent.
    Fields left out stay out of the server info (``exclude_unset``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    num_draft_tokens: _Count | None = None
    compression_ratios: list[_Count] | None = Field(None, max_length=_MAX_LAYERS)
    kv_layer_ids: list[_Count] | None = Field(None, max_length=_MAX_LAYERS)
    kv_item_lens: list[_Bytes] | None = Field(None, max_length=_MAX_LAYERS)
    state_types: list[Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")]] | None = Field(
        None, max_length=_MAX_STATES)
    state_item_lens: list[Annotated[list[_Bytes], Field(max_length=_MAX_LAYERS)]] | None = (
        Field(None, max_length=_MAX_STATES))


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
    enable_dsa_cache_layer_split: bool | None = None
    enable_kv_cache_sharding: bool | None = None
    prefill_http_port: int | None = Field(None, ge=1, le=65535)
    # SGLang sends a string (its KVArgs.kv_layout); an object must be a kvhandoff LayoutSpec
    kv_layout: Annotated[str, Field(max_length=256)] | dict[str, Any] | None = None
    decode_allocation_policy: str = Field("early", max_length=64)
    dsv41_spec_layout: Dsv41SpecLayout | None = None

    @field_validator("kv_layout")
    @classmethod
    def _layout_object(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, dict):
            try:
                LayoutSpec.from_dict(v)
            except ConfigError as e:
                raise ValueError(f"an object must be a kvhandoff LayoutSpec ({e})") from e
        return v


class SglangRegisterDpRank(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bootstrap_room: int = Field(ge=0, le=ROOM_MAX)
    dp_rank: _Rank


class SglangQueryDpRanks(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bootstrap_rooms: list[Annotated[int, Field(ge=0, le=ROOM_MAX)]] = Field(max_length=65536)


class SglangServerInfo(BaseModel):
    """The fields of SGLang 0.5.23's ``PrefillServerInfo`` dataclass, in order
    (``dsv41_spec_layout`` and ``kv_layout`` are left out when not set, as SGLang does)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    dsv41_spec_layout: dict[str, Any] | None = None
    kv_layout: str | None = None
    decode_allocation_policy: str = "early"
    enable_kv_cache_sharding: bool = False
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


def _layout_identity(kv_layout: dict[str, Any] | None) -> str | None:
    if not kv_layout:
        return None
    return layout_hash(LayoutSpec.from_dict(kv_layout))  # validated by the model


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
    layout = body.kv_layout
    # parsing and hashing a layout object grows with what the rank sent: off the loop
    layout_id = (await run_in_threadpool(_layout_identity, layout)
                 if isinstance(layout, dict) else None)
    lbm = body.load_balance_method
    reg = RegistrationRequest(
        key=RankKey(SGLANG_ENGINE_ID, dp_group, body.attn_cp_rank, body.attn_tp_rank,
                    body.pp_rank),
        role=Role.PREFILL,
        topology=topo,
        agent_address=join_host_port(body.rank_ip, body.rank_port),
        generation=join_host_port(body.rank_ip, body.rank_port),
        layout_hash="",
        layout={},
        transport="sglang",
        # None = left out: no disagreement (see the module doc)
        attributes={
            "page_size": body.page_size,
            "kv_cache_dtype": body.kv_cache_dtype,
            "kv_layout": layout if isinstance(layout, str) else None,
            "kv_layout_hash": layout_id,
            "follow_bootstrap_room": None if lbm is None else lbm == "follow_bootstrap_room",
            "enable_dsa_cache_layer_split": body.enable_dsa_cache_layer_split,
            "enable_kv_cache_sharding": body.enable_kv_cache_sharding,
            "prefill_http_port": body.prefill_http_port,
        },
        strict_attributes={
            "decode_allocation_policy": body.decode_allocation_policy,
            "dsv41_spec_layout": None if body.dsv41_spec_layout is None
            else body.dsv41_spec_layout.model_dump(exclude_unset=True),
        },
        expires=False,
    )
    try:
        state.registry.register(reg)
    except BootstrapConflict as e:
        # SGLang callers see a 400; the body names every differing field
        raise ConfigError(str(e)) from e
    return "OK"


@sglang.get("/route", response_model=SglangServerInfo | SglangRankInfo, responses={
    400: {"description": "Missing or non-integer inputs."},
    404: {"description": "Unknown rank."},
    503: {"description": "Not every prefill rank registered yet."},
})
async def get_route(
    state: StateDep,
    prefill_dp_rank: Annotated[str | None, Query(max_length=32)] = None,
    prefill_cp_rank: Annotated[str | None, Query(max_length=32)] = None,
    target_tp_rank: Annotated[str | None, Query(max_length=32)] = None,
    target_pp_rank: Annotated[str | None, Query(max_length=32)] = None,
) -> Response:
    """All four -1: the prefill server info; otherwise the rank's ``rank_ip``/``rank_port``."""
    try:
        ranks = parse_route_query({
            "prefill_dp_rank": prefill_dp_rank, "prefill_cp_rank": prefill_cp_rank,
            "target_tp_rank": target_tp_rank, "target_pp_rank": target_pp_rank})
    except ConfigError as e:
        answer = Answer.error(e)
    else:
        answer = state.sglang_routes.answer(ranks)
    state.metrics.route_lookups.labels("sglang", answer.outcome).inc()
    return Response(answer.body, status_code=answer.status,
                    headers={k.decode(): v.decode() for k, v in answer.headers
                             if k != b"content-length"})


@sglang.post("/register_dp_rank", dependencies=[WriteAuth], response_class=PlainTextResponse)
async def register_dp_rank(body: SglangRegisterDpRank, registry: RegistryDep) -> str:
    """Record which prefill dp rank serves a room (a repeated call moves it, as SGLang does)."""
    registry.bind_room(body.bootstrap_room, SGLANG_ENGINE_ID, body.dp_rank, rebind=True)
    return "OK"


@sglang.post("/query_dp_ranks", response_model=dict[str, int])
async def query_dp_ranks(body: SglangQueryDpRanks, registry: RegistryDep,
                         metrics: MetricsDep) -> Response:
    """``{"<room>": dp_rank}`` for each known, bound room; unknown rooms are left out.

    Its work grows with the rooms asked (up to 65,536), so it runs in slices of
    QUERY_SLICE lookups, giving the event loop back between them (`/health`, `/ready` and
    other requests run there), and renders its answer with `json.dumps` (off the loop when
    big), not FastAPI's per-item encoder (0.5–0.9 s for 65,536 entries on the test host, on
    the loop)."""
    out: dict[str, int] = {}
    rooms = body.bootstrap_rooms
    for start in range(0, len(rooms), QUERY_SLICE):
        if start:
            await asyncio.sleep(0)
        chunk = rooms[start:start + QUERY_SLICE]
        metrics.query_slice(len(chunk))
        for room in chunk:
            rr = registry.find_room(room)
            if rr is not None and rr.dp_rank is not None and rr.engine_id == SGLANG_ENGINE_ID \
                    and rr.state.value == "bound":
                out[str(room)] = rr.dp_rank
    # a big answer (at most 65,536 entries, ~1 MB) is rendered off the loop: `out` is ours
    answer = (await run_in_threadpool(dump_json, out) if len(out) > QUERY_SLICE
              else dump_json(out))
    return Response(answer, media_type="application/json")
