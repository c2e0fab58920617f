"""The answers of SGLang's ``GET /route``, prepared once per registry change.

Rules: an answer (status, headers, body bytes) depends only on the query and on the ranks and
engine ``sglang`` — which never expire (SGLang ranks send no heartbeat) and so change only when
a rank registers or leaves, which bumps `Registry.rank_version`. `SglangRoutes` keeps the
answers of the queries it has seen for the current version and drops them all when the version
moves, so a lookup is a dict hit. The FastAPI route and the fast path in `fastpath` both answer
from here, so they cannot disagree. Bodies are serialised as Starlette's `JSONResponse` does,
and error bodies are the app's ``{"error", "detail"}`` JSON with its headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from kvhandoff.bootstrap_server.records import RankKey
from kvhandoff.bootstrap_server.registry import Registry
from kvhandoff.bootstrap_server.schemas import MAX_AXIS_SIZE
from kvhandoff.errors import (
    BootstrapNotFound,
    BootstrapUnavailable,
    ConfigError,
    KVHandoffError,
)
from kvhandoff.netaddr import split_host_port

SGLANG_ENGINE_ID = "sglang"
ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
# the FastAPI route declares the parameters with max_length=32; longer ones go to it (422)
_MAX_PARAM_LEN = 32
_MAX_CACHED = 4096
_OUTCOMES = {200: "ok", 400: "bad_request", 404: "not_found", 503: "unavailable"}


def dump_json(body: Any) -> bytes:
    """JSON bytes exactly as Starlette's `JSONResponse` renders them."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True, slots=True)
class Answer:
    """A prepared HTTP answer."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    # the header lines as HTTP/1.1 writes them (for the protocol-level fast path)
    header_lines: bytes

    @property
    def outcome(self) -> str:
        """The ``route_lookups`` label: ok, bad_request, not_found, unavailable."""
        return _OUTCOMES.get(self.status, "error")

    @classmethod
    def json(cls, status: int, body: Any, extra: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
        data = dump_json(body)
        headers = ((b"content-length", str(len(data)).encode()),
                   (b"content-type", b"application/json"), *extra)
        return cls(status, data, headers, b"".join(b"%s: %s\r\n" % h for h in headers))

    @classmethod
    def error(cls, exc: KVHandoffError) -> Answer:
        extra = ((b"retry-after", b"1"),) if exc.http_status == 503 else ()
        return cls.json(exc.http_status, {"error": type(exc).__name__, "detail": str(exc)},
                        extra)


def parse_route_query(params: dict[str, str | None]) -> tuple[int, int, int, int]:
    """The four ranks of a ``GET /route`` query.

    Raises:
        ConfigError: a rank is missing, not an integer, or outside -1..MAX_AXIS_SIZE-1.
    """
    missing = [k for k in ROUTE_PARAMS if not params.get(k)]
    if missing:
        raise ConfigError(f"Missing inputs for bootstrap server: {', '.join(missing)}")
    out: list[int] = []
    for k in ROUTE_PARAMS:
        v = params[k]
        try:
            n = int(v or "")
        except ValueError:
            raise ConfigError(f"{k}: expected an integer, got {v!r}") from None
        if not -1 <= n < MAX_AXIS_SIZE:
            raise ConfigError(f"{k}: expected -1 or 0..{MAX_AXIS_SIZE - 1}, got {n}")
        out.append(n)
    return out[0], out[1], out[2], out[3]


class SglangRoutes:
    """Prepared answers of SGLang's ``GET /route`` (see the module rules)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._version = -1
        self._by_query: dict[bytes, Answer] = {}
        self._by_ranks: dict[tuple[int, int, int, int], Answer] = {}

    def _sync(self) -> None:
        if self._registry.rank_version != self._version:
            self._version = self._registry.rank_version
            self._by_query.clear()
            self._by_ranks.clear()

    def answer(self, ranks: tuple[int, int, int, int]) -> Answer:
        """The answer for parsed ranks (all -1: the server info)."""
        self._sync()
        got = self._by_ranks.get(ranks)
        if got is None:
            if len(self._by_ranks) >= _MAX_CACHED:
                self._by_ranks.clear()
            got = self._by_ranks[ranks] = self._compute(ranks)
        return got

    def for_query_string(self, raw: bytes) -> Answer | None:
        """The answer for a raw query string, or None when the query is not a plain one
        (a parameter too long or repeated, bytes that are not ASCII): the FastAPI route then
        answers it, with its validation."""
        self._sync()
        got = self._by_query.get(raw)
        if got is not None:
            return got
        try:
            pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True)
        except UnicodeDecodeError:
            return None
        params: dict[str, str | None] = {}
        for k, v in pairs:
            if k in ROUTE_PARAMS:
                if k in params or len(v) > _MAX_PARAM_LEN:
                    return None
                params[k] = v
        try:
            got = self.answer(parse_route_query(params))
        except ConfigError as e:
            got = Answer.error(e)
        if len(self._by_query) >= _MAX_CACHED:
            self._by_query.clear()
        self._by_query[raw] = got
        return got

    def _compute(self, ranks: tuple[int, int, int, int]) -> Answer:
        try:
            return Answer.json(200, self._body(ranks))
        except (ConfigError, BootstrapNotFound, BootstrapUnavailable) as e:
            return Answer.error(e)

    def _body(self, ranks: tuple[int, int, int, int]) -> dict[str, Any]:
        reg = self._registry
        try:
            eng = reg.engine(SGLANG_ENGINE_ID)
        except BootstrapNotFound:
            raise BootstrapUnavailable(
                "Prefill server not fully registered yet (0 workers registered).") from None
        n_missing = reg.missing_count(SGLANG_ENGINE_ID)
        if n_missing:
            n = sum(reg.transports_of(SGLANG_ENGINE_ID).values())
            missing = reg.missing(SGLANG_ENGINE_ID, limit=8)
            raise BootstrapUnavailable(
                f"Prefill server not fully registered yet ({n} workers registered, "
                f"{n_missing} missing: {', '.join(map(str, missing))}"
                f"{' ...' if n_missing > 8 else ''})."
            )
        if all(v == -1 for v in ranks):
            return server_info(eng.topology.tp_size, eng.topology.cp_size, eng.topology.dp_size,
                               eng.topology.pp_size, eng.attributes, eng.strict_attributes)
        if any(v < 0 for v in ranks):
            raise ConfigError("ranks: give all four as -1 (server info) or all >= 0")
        dp, cp, tp, pp = ranks
        try:
            rec = reg.rank(RankKey(SGLANG_ENGINE_ID, dp, cp, tp, pp))
        except BootstrapNotFound:
            raise BootstrapNotFound(
                f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                f"pp_rank={pp}"
            ) from None
        ip, port = split_host_port(rec.agent_address)
        return {"rank_ip": ip, "rank_port": port}


def server_info(tp_size: int, cp_size: int, dp_size: int, pp_size: int,
                attributes: dict[str, Any], strict: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.23's server-info object (its ``PrefillServerInfo`` fields, in order;
    ``dsv41_spec_layout`` and ``kv_layout`` only when set, as SGLang leaves them out)."""
    a = attributes
    follow = a.get("follow_bootstrap_room")
    out: dict[str, Any] = {
        "attn_tp_size": tp_size, "attn_cp_size": cp_size, "dp_size": dp_size,
        "pp_size": pp_size, "page_size": a.get("page_size"),
        "kv_cache_dtype": a.get("kv_cache_dtype"),
        "follow_bootstrap_room": True if follow is None else bool(follow),
        "enable_dsa_cache_layer_split": bool(a.get("enable_dsa_cache_layer_split")),
    }
    if strict.get("dsv41_spec_layout") is not None:
        out["dsv41_spec_layout"] = strict["dsv41_spec_layout"]
    if a.get("kv_layout") is not None:
        out["kv_layout"] = a["kv_layout"]
    out.update({
        "decode_allocation_policy": strict.get("decode_allocation_policy", "early"),
        "enable_kv_cache_sharding": bool(a.get("enable_kv_cache_sharding")),
        "prefill_http_port": a.get("prefill_http_port"),
        "target_tp_rank": None, "target_tp_ranks": None, "target_cp_ranks": None,
        "target_pp_ranks": None, "required_dst_info_num": None,
        "required_prefill_response_num": None,
    })
    return out
