"""The route lookup of the bootstrap server: which prefill ranks a decode rank must talk to,
from a room's binding or an engine and dp rank (the TP/CP/PP mapping is `mapping`'s). Pure: it
reads the `Registry` through its public methods, on the caller's thread (the event loop)."""

from __future__ import annotations

from kvhandoff.bootstrap_server.mapping import prefill_axis_ranks, prefill_tp_ranks
from kvhandoff.bootstrap_server.records import RankKey, RoomAssignment, RouteTarget
from kvhandoff.bootstrap_server.registry import Registry
from kvhandoff.errors import BootstrapConflict, BootstrapUnavailable, ConfigError
from kvhandoff.state_machine.vocabulary import Role


def route(
    reg: Registry,
    *,
    engine_id: str | None,
    room: int | None,
    dp_rank: int | None,
    tp_rank: int,
    tp_size: int,
    cp_rank: int = 0,
    cp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    replicated: bool = False,
) -> RouteTarget:
    """The prefill ranks a decode rank must talk to (TP/CP/PP mapping in `mapping`).

    The prefill engine and dp rank come from the room's binding when ``room`` is given,
    else from ``engine_id`` (optional when exactly one prefill engine is registered) and
    ``dp_rank``.

    Raises:
        ConfigError: missing/contradicting inputs, sizes that cannot map.
        BootstrapNotFound: unknown room or engine.
        BootstrapConflict: the room was aborted (the message says why) or is bound to
            another engine than ``engine_id``.
        BootstrapUnavailable: the room is not bound yet, or a needed rank is not live.
    """
    if room is not None:
        rr = reg.room(room)
        if rr.state is RoomAssignment.ABORTED:
            raise BootstrapConflict(f"room {room} was aborted: {rr.abort_reason}")
        if rr.state is not RoomAssignment.BOUND or rr.engine_id is None or rr.dp_rank is None:
            raise BootstrapUnavailable(
                f"room {room} is not bound to a prefill dp rank yet; retry"
            )
        if engine_id is not None and engine_id != rr.engine_id:
            raise BootstrapConflict(
                f"room {room} is bound to engine {rr.engine_id!r}, not {engine_id!r}"
            )
        if dp_rank is not None and dp_rank != rr.dp_rank:
            raise BootstrapConflict(
                f"room {room} is bound to dp_rank {rr.dp_rank}, not {dp_rank}"
            )
        engine_id, dp_rank = rr.engine_id, rr.dp_rank
    else:
        reg.engine_count()  # the expiry pass
    if engine_id is None:
        prefill = reg.prefill_engine_ids()
        if len(prefill) != 1:
            raise ConfigError(
                "engine_id: required when the server knows "
                f"{len(prefill)} prefill engines ({', '.join(prefill) or 'none'})"
            )
        engine_id = prefill[0]
    if dp_rank is None:
        raise ConfigError("dp_rank: give a room or a dp_rank")
    eng = reg.engine(engine_id)
    if eng.role is not Role.PREFILL:
        raise ConfigError(f"engine_id: {engine_id!r} is a {eng.role.value} engine")
    topo = eng.topology
    if not 0 <= dp_rank < topo.dp_size:
        raise ConfigError(
            f"dp_rank: expected 0 <= dp_rank < {topo.dp_size} (dp_size of {engine_id!r}), "
            f"got {dp_rank}"
        )
    tps = prefill_tp_ranks(tp_rank, tp_size, topo.tp_size, replicated=replicated)
    cps = prefill_axis_ranks("cp", cp_rank, cp_size, topo.cp_size)
    pps = prefill_axis_ranks("pp", pp_rank, pp_size, topo.pp_size)
    keys = [RankKey(engine_id, dp_rank, c, t, p) for c in cps for t in tps for p in pps]
    found = [reg.live_rank_or_none(k) for k in keys]
    missing = [str(k) for k, r in zip(keys, found, strict=True) if r is None]
    if missing:
        raise BootstrapUnavailable(f"prefill ranks not registered yet: {', '.join(missing)}")
    return RouteTarget(engine_id, dp_rank, topo, tuple(r for r in found if r is not None))
