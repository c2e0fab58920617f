"""Checks of the registry: a rank inside its topology, room ids, process generations, the
bounds of what a registration may add (`bound_problem`), and the comparison of a registrant
with its engine's first registrant (what makes a conflict).

Rules: a registrant conflicts with its engine when the role, a size, the shared layout hash or
a compared attribute differs. An attribute the registrant does not send (``None``) is no
disagreement — SGLang's PUT /route makes most fields optional and an older or differently
configured rank leaves them out; the engine keeps the value it has, and a value missing on the
engine is filled by the first registrant that sends it (as SGLang does). Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvhandoff.bootstrap_server.records import (
    ROOM_BITS,
    EngineRecord,
    RankKey,
    RankRecord,
    RegistrationRequest,
    Topology,
)
from kvhandoff.errors import BootstrapConflict, ConfigError
from kvhandoff.kv_layout import LayoutSpec, layout_diff


def check_key_in_topology(key: RankKey, topo: Topology) -> None:
    for name, rank, size in (
        ("dp", key.dp_rank, topo.dp_size),
        ("cp", key.cp_rank, topo.cp_size),
        ("tp", key.tp_rank, topo.tp_size),
        ("pp", key.pp_rank, topo.pp_size),
    ):
        if size < 1:
            raise ConfigError(f"{name}_size: expected >= 1, got {size}")
        if not 0 <= rank < size:
            raise ConfigError(
                f"{name}_rank: expected 0 <= {name}_rank < {name}_size={size}, got {rank}"
            )


def check_room_id(room: int) -> None:
    # 0 is never allocated here but SGLang's router may pick it, so it is a valid id
    if not 0 <= room < (1 << ROOM_BITS):
        raise ConfigError(f"room: expected 0 <= room < 2**{ROOM_BITS}, got {room}")


def check_generation(rec: RankRecord, generation: str | None) -> None:
    if generation is not None and generation != rec.generation:
        raise BootstrapConflict(
            f"rank {rec.key} is registered by another process generation",
            [f"generation: registered={rec.generation!r} incoming={generation!r}"],
        )


def engine_diff(engine: EngineRecord, reg: RegistrationRequest) -> list[str]:
    """Each field where ``reg`` disagrees with ``engine`` (empty: they agree)."""
    out: list[str] = []

    def cmp(name: str, have: object, got: object) -> None:
        if have != got:
            out.append(f"{name}: registered={have!r} incoming={got!r}")

    cmp("role", engine.role.value, reg.role.value)
    for size in ("dp_size", "tp_size", "cp_size", "pp_size"):
        cmp(size, getattr(engine.topology, size), getattr(reg.topology, size))
    for k in sorted(set(engine.attributes) | set(reg.attributes)):
        have, got = engine.attributes.get(k), reg.attributes.get(k)
        if have is not None and got is not None:  # a value left out is no disagreement
            cmp(k, have, got)
    for k in sorted(set(engine.strict_attributes) | set(reg.strict_attributes)):
        cmp(k, engine.strict_attributes.get(k), reg.strict_attributes.get(k))
    if engine.layout_hash != reg.shared_layout_hash:
        out.append(f"layout_hash: registered={engine.layout_hash} "
                   f"incoming={reg.shared_layout_hash}")
        out += layout_diff_lines(engine.layout, reg.shared_layout)
    return out


def layout_diff_lines(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """`layout_diff` between two layout dicts; empty when either is not a full layout."""
    if not a or not b:
        return []
    try:
        return layout_diff(
            LayoutSpec.from_dict(dict(a)), LayoutSpec.from_dict(dict(b)),
            names=("registered", "incoming"),
        )
    except ConfigError:
        return []


def merge_attributes(engine: EngineRecord, reg: RegistrationRequest) -> None:
    """Fill the engine's missing (None) attributes from an agreeing registrant."""
    for k, v in reg.attributes.items():
        if v is not None and engine.attributes.get(k) is None:
            engine.attributes[k] = v


@dataclass(frozen=True, slots=True)
class Limits:
    """What a registration may add (Settings.max_world_size, max_engines, max_live_ranks)."""

    max_world_size: int
    max_engines: int
    max_live_ranks: int


def bound_problem(reg: RegistrationRequest, *, new_engine: bool, new_rank: bool, engines: int,
                  ranks: int, limits: Limits, ttl_s: float
                  ) -> ConfigError | BootstrapConflict | None:
    """Why `reg` would take the registry past a bound (naming the field and the bound), or
    None: the world size (400), a new engine past max_engines or a new rank past
    max_live_ranks (409)."""
    t = reg.topology
    if t.world_size > limits.max_world_size:
        return ConfigError(
            f"world size: dp_size*tp_size*cp_size*pp_size = {t.dp_size}*{t.tp_size}*"
            f"{t.cp_size}*{t.pp_size} = {t.world_size} exceeds max_world_size="
            f"{limits.max_world_size} (KVHANDOFF_MAX_WORLD_SIZE)")
    if new_engine and engines >= limits.max_engines:
        return BootstrapConflict(
            f"engine_id: {reg.key.engine_id!r} would be a new engine and the server holds "
            f"max_engines={limits.max_engines} (KVHANDOFF_MAX_ENGINES); an engine is "
            f"forgotten when its last rank deregisters or misses rank_ttl_s={ttl_s:g} s")
    if new_rank and ranks >= limits.max_live_ranks:
        return BootstrapConflict(
            f"rank {reg.key}: the server holds max_live_ranks={limits.max_live_ranks} ranks "
            f"(KVHANDOFF_MAX_LIVE_RANKS); a rank is dropped when it deregisters or misses "
            f"rank_ttl_s={ttl_s:g} s")
    return None
