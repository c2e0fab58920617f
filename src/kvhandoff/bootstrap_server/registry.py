"""The bootstrap server's state: engines, ranks and rooms — pure, no HTTP, clock injected.

Rules:
- A rank's identity is ``(engine_id, dp_rank, cp_rank, tp_rank, pp_rank)``. Registering the same
  identity again replaces the record (new generation, address, ...) and is counted once.
- An engine's topology (role, dp/tp/cp/pp sizes) and layout hash are fixed by its first
  registrant; a later registrant that disagrees is refused with `BootstrapConflict` carrying
  the differing fields. When an engine has no live rank left, the next registrant sets them
  afresh (a redeploy with another topology must not need a server restart).
- An engine lives while it has a live rank: it is forgotten with its last one (deregistered or
  expired), so a crashed engine leaves after ``rank_ttl_s``.
- Bounds (`compat.bound_problem`): world size <= ``max_world_size`` (so ranks per engine too),
  at most ``max_engines`` engines and ``max_live_ranks`` ranks.
- Counts (expected, live, missing, per transport) are kept as ranks come and go: readiness
  costs O(engines); rank lists are paged (``ranks_page``) or sampled (``missing(limit=)``).
- A rank is live while ``now - last_seen <= rank_ttl_s``; expired ranks are dropped lazily on
  each call (``_expire``), so a heartbeat from a dropped rank gets `BootstrapNotFound` and the
  agent registers again. An expiry pass drops at most EXPIRE_BATCH ranks and EXPIRE_BATCH
  rooms (each O(1)); after a full pass with more due (`expiry_behind`) calls stop expiring
  and only `expire_step` does, one pass per call, so a mass expiry (a registrant's 65,536
  ranks, a million rooms) costs a request at most one pass: the server runs `expire_step`
  once per event-loop turn while `expiry_pending()` (`deps.ServerState.sweep_soon`).
  Meanwhile counts may include ranks past their TTL not yet dropped; a lookup of one rank
  (`_rank`: heartbeat, route, lookup) drops it first, so no caller is answered with an
  expired rank. Ranks
  registered with ``expires=False`` (SGLang's, which never heartbeat) stay until
  deregistered.
- Rooms are random 63-bit ids, never reused while the room is known. A room is forgotten
  ``room_retention_s`` after its last change (allocation, bind or abort); an abort is kept with
  its reason so a later lookup says why.
- Time comes from the injected ``clock`` (seconds, monotonic); randomness from the injected
  ``randbits``. All methods are synchronous and run to completion: the server calls them from
  its one event loop, so no lock is needed.
- ``rank_version`` grows on every change of a rank or engine, so the HTTP layer can prepare
  the answers of lookups once per change (see `fastpath`).

The records live in `records`, the conflict rules in `compat`.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from kvhandoff.bootstrap_server.compat import (
    Limits,
    bound_problem,
    check_generation,
    check_key_in_topology,
    check_room_id,
    engine_diff,
    merge_attributes,
)
from kvhandoff.bootstrap_server.records import (
    EXPIRE_BATCH,
    MAX_ENGINES,
    MAX_LIVE_RANKS,
    MAX_LIVE_ROOMS,
    MAX_ROOMS_PER_CALL,
    MAX_WORLD_SIZE,
    ROOM_BITS,
    EngineRecord,
    RankKey,
    RankRecord,
    RegistrationRequest,
    RoomAssignment,
    RoomRecord,
    RouteTarget,
    Stats,
    Topology,
)
from kvhandoff.errors import (
    BootstrapConflict,
    BootstrapNotFound,
    BootstrapUnavailable,
    ConfigError,
)
from kvhandoff.state_machine.vocabulary import Role

__all__ = [
    "EXPIRE_BATCH", "MAX_LIVE_ROOMS", "MAX_ROOMS_PER_CALL", "ROOM_BITS", "EngineRecord",
    "RankKey", "RankRecord", "RegistrationRequest", "Registry", "RoomAssignment", "RoomRecord",
    "RouteTarget", "Stats", "Topology",
]


def _default_randbits(bits: int) -> int:
    return secrets.randbits(bits)


class Registry:
    """Engines, ranks and rooms of one bootstrap server (see the module rules)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        rank_ttl_s: float,
        room_retention_s: float,
        randbits: Callable[[int], int] = _default_randbits,
        max_live_rooms: int = MAX_LIVE_ROOMS,
        max_world_size: int = MAX_WORLD_SIZE,
        max_engines: int = MAX_ENGINES,
        max_live_ranks: int = MAX_LIVE_RANKS,
    ) -> None:
        if rank_ttl_s <= 0 or room_retention_s <= 0:
            raise ConfigError("rank_ttl_s and room_retention_s must be > 0")
        for name, value in (("max_live_rooms", max_live_rooms),
                            ("max_world_size", max_world_size), ("max_engines", max_engines),
                            ("max_live_ranks", max_live_ranks)):
            if value <= 0:
                raise ConfigError(f"{name}: expected > 0, got {value}")
        self._max_rooms = max_live_rooms
        self.limits = Limits(max_world_size, max_engines, max_live_ranks)
        self._clock = clock
        self._ttl_s = rank_ttl_s
        self._retention_s = room_retention_s
        self._randbits = randbits
        self._engines: dict[str, EngineRecord] = {}
        # ordered by last_seen (a heartbeat moves a rank to the end): expiry pops from the front
        self._ranks: OrderedDict[RankKey, RankRecord] = OrderedDict()
        self._immortal: dict[RankKey, RankRecord] = {}
        # the live ranks of each known engine (an engine is known while this is non-empty),
        # and how many of them use each transport
        self._by_engine: dict[str, dict[RankKey, RankRecord]] = {}
        self._transports: dict[str, Counter[str]] = {}
        self._expected = 0  # sum of the world sizes of the known engines
        # ordered by updated_at, same reason
        self._rooms: OrderedDict[int, RoomRecord] = OrderedDict()
        self.stats = Stats()
        # bumped whenever a rank or an engine changes (register, deregister, expiry): answers
        # derived from ranks and engines only can be cached against it
        self.rank_version = 0
        # the last expiry pass was a full batch with more due: only `expire_step` expires
        # (one batch per call) until it caught up, so one request does one batch at most
        self.expiry_behind = False

    # -- time ---------------------------------------------------------------------------------

    def _now(self) -> float:
        now = self._clock()
        if not self.expiry_behind:
            self._expire(now)
        return now

    def _expire(self, now: float) -> None:
        """Drops at most EXPIRE_BATCH expired ranks and EXPIRE_BATCH forgotten rooms, oldest
        first (see the module rules: the rest go on later calls and `expire_step`)."""
        ranks = rooms = 0
        while self._ranks and ranks < EXPIRE_BATCH:
            key, rec = next(iter(self._ranks.items()))
            if now - rec.last_seen <= self._ttl_s:
                break
            self._drop_rank(key)
            self.stats.ranks_expired += 1
            self.rank_version += 1
            ranks += 1
        while self._rooms and rooms < EXPIRE_BATCH:
            room, rr = next(iter(self._rooms.items()))
            if now - rr.updated_at <= self._retention_s:
                break
            del self._rooms[room]
            self.stats.rooms_forgotten += 1
            rooms += 1
        if max(ranks, rooms) > self.stats.expiry_pass_max:
            self.stats.expiry_pass_max = max(ranks, rooms)
        # a full batch: more may be due; calls stop expiring until `expire_step` caught up
        self.expiry_behind = EXPIRE_BATCH in (ranks, rooms) and self.expiry_pending()

    def expiry_pending(self) -> bool:
        """Whether an expired rank or a room past its retention is still held: O(1)."""
        now = self._clock()
        if self._ranks and now - next(iter(self._ranks.values())).last_seen > self._ttl_s:
            return True
        return bool(self._rooms) and (
            now - next(iter(self._rooms.values())).updated_at > self._retention_s)

    def expire_step(self) -> bool:
        """One bounded expiry pass (EXPIRE_BATCH ranks and rooms at most); whether more is
        pending. The server runs it once per event-loop turn while it says so; another owner
        of a registry calls it until False after a mass expiry."""
        self._expire(self._clock())
        return self.expiry_pending()

    # -- ranks --------------------------------------------------------------------------------

    def _rank(self, key: RankKey) -> RankRecord | None:
        rec = self._ranks.get(key)
        if rec is not None and self._clock() - rec.last_seen > self._ttl_s:
            # expired, not dropped yet (a mass expiry is spread over calls): drop it now
            self._drop_rank(key)
            self.stats.ranks_expired += 1
            self.rank_version += 1
            return None
        return rec or self._immortal.get(key)

    def _live_ranks_of(self, engine_id: str) -> list[RankRecord]:
        return list(self._by_engine.get(engine_id, {}).values())

    def _add_rank(self, rec: RankRecord) -> None:
        (self._ranks if rec.expires else self._immortal)[rec.key] = rec
        self._by_engine.setdefault(rec.key.engine_id, {})[rec.key] = rec
        self._transports.setdefault(rec.key.engine_id, Counter())[rec.transport] += 1

    def _drop_rank(self, key: RankKey, *, forget_engine: bool = True) -> RankRecord | None:
        """Remove a live rank; its engine too when it was the last one (unless
        ``forget_engine`` is False: the caller adds a rank of the engine at once)."""
        rec = self._ranks.pop(key, None) or self._immortal.pop(key, None)
        if rec is None:
            return None
        eid = key.engine_id
        ranks = self._by_engine[eid]
        del ranks[key]
        transports = self._transports[eid]
        transports[rec.transport] -= 1
        if transports[rec.transport] <= 0:
            del transports[rec.transport]
        if not ranks and forget_engine:
            del self._by_engine[eid], self._transports[eid]
            eng = self._engines.pop(eid)
            self._expected -= eng.topology.world_size
            self.stats.engines_forgotten += 1
        return rec

    def _check_bounds(self, reg: RegistrationRequest, engine: EngineRecord | None) -> None:
        problem = bound_problem(
            reg, new_engine=engine is None, new_rank=self._rank(reg.key) is None,
            engines=len(self._engines), ranks=self.live_ranks(), limits=self.limits,
            ttl_s=self._ttl_s)
        if problem is not None:
            self.stats.registrations_refused += 1
            raise problem

    def live_ranks(self) -> int:  # no expiry pass: see `live_rank_count`
        return len(self._ranks) + len(self._immortal)

    def register(self, reg: RegistrationRequest) -> tuple[RankRecord, bool]:
        """Add or replace a rank. Returns ``(record, replaced)``.

        Raises:
            ConfigError: a rank is outside its size, or the world size exceeds
                ``max_world_size``.
            BootstrapConflict: topology, role, layout hash or attributes disagree with the
                engine's first registrant (``diff`` names each field); or a new engine past
                ``max_engines``, a new rank past ``max_live_ranks``.
        """
        now = self._now()
        self._rank(reg.key)  # drops it first if it expired (its engine may go with it)
        engine = self._engines.get(reg.key.engine_id)
        self._check_bounds(reg, engine)
        check_key_in_topology(reg.key, reg.topology)
        if engine is not None:
            diff = engine_diff(engine, reg)
            if diff:
                self.stats.conflicts += 1
                raise BootstrapConflict(
                    f"rank {reg.key} disagrees with the first registrant of engine "
                    f"{engine.engine_id!r}",
                    diff,
                )
            merge_attributes(engine, reg)
        else:
            engine = EngineRecord(
                engine_id=reg.key.engine_id,
                role=reg.role,
                topology=reg.topology,
                layout_hash=reg.shared_layout_hash,
                layout=dict(reg.shared_layout),
                attributes=dict(reg.attributes),
                strict_attributes=dict(reg.strict_attributes),
            )
            self._engines[engine.engine_id] = engine
            self._expected += engine.topology.world_size
        old = self._drop_rank(reg.key, forget_engine=False)
        rec = RankRecord(
            key=reg.key,
            role=reg.role,
            topology=reg.topology,
            agent_address=reg.agent_address,
            generation=reg.generation,
            layout_hash=reg.layout_hash,
            transport=reg.transport,
            registered_at=now,
            last_seen=now,
            expires=reg.expires,
        )
        self._add_rank(rec)
        self.rank_version += 1
        if old is None:
            self.stats.registrations += 1
        else:
            self.stats.re_registrations += 1
        return rec, old is not None

    def heartbeat(self, key: RankKey, generation: str | None = None) -> RankRecord:
        """Mark a rank alive.

        Raises:
            BootstrapNotFound: the rank is not registered (or was dropped): register again.
            BootstrapConflict: ``generation`` is not the registered one (a newer process
                replaced this rank).
        """
        now = self._now()
        rec = self._rank(key)
        if rec is None:
            raise BootstrapNotFound(
                f"rank {key} is not registered (never, deregistered, or dropped after "
                f"{self._ttl_s:g} s without heartbeat): register it again"
            )
        check_generation(rec, generation)
        rec.last_seen = now
        if rec.expires:
            self._ranks.move_to_end(key)
        return rec

    def deregister(self, key: RankKey, generation: str | None = None) -> RankRecord:
        """Remove a rank; the engine goes too when it was its last rank.

        Raises:
            BootstrapNotFound: unknown rank.
            BootstrapConflict: ``generation`` is not the registered one.
        """
        self._now()
        rec = self._rank(key)
        if rec is None:
            raise BootstrapNotFound(f"rank {key} is not registered")
        check_generation(rec, generation)
        self._drop_rank(key)
        self.stats.deregistrations += 1
        self.rank_version += 1
        return rec

    def engine(self, engine_id: str) -> EngineRecord:
        """An engine record. Raises `BootstrapNotFound`."""
        self._now()
        try:
            return self._engines[engine_id]
        except KeyError:
            known = sorted(self._engines)
            raise BootstrapNotFound(
                f"engine {engine_id!r} is not registered "
                f"(known: {', '.join(known[:8]) or 'none'}"
                f"{f' and {len(known) - 8} more' if len(known) > 8 else ''})"
            ) from None

    def engines(self) -> list[EngineRecord]:
        self._now()
        return [self._engines[k] for k in sorted(self._engines)]

    def ranks_of(self, engine_id: str) -> list[RankRecord]:
        """Live ranks of an engine, in identity order."""
        self._now()
        return sorted(self._live_ranks_of(engine_id), key=lambda r: r.key)

    def rank(self, key: RankKey) -> RankRecord:
        """A live rank. Raises `BootstrapNotFound`."""
        self._now()
        rec = self._rank(key)
        if rec is None:
            raise BootstrapNotFound(f"rank {key} is not registered")
        return rec

    def missing(self, engine_id: str | None = None, *, limit: int | None = None
                ) -> list[RankKey]:
        """Expected ranks (dp x cp x tp x pp of each engine) with no live registration, in
        identity order: the first ``limit`` of them (None: all; the count is
        `missing_count`). Engines with none missing are not walked, and the walk of an engine
        stops at ``limit``, so a sample costs at most ``max_world_size`` per engine."""
        self._now()
        out: list[RankKey] = []
        if limit is not None and limit <= 0:
            return out
        for eid in sorted(self._engines) if engine_id is None else [engine_id]:
            eng = self._engines.get(eid)
            if eng is None or not self._missing_of(eng):
                continue
            live = self._by_engine[eid]
            for k in eng.topology.keys(eid):
                if k not in live:
                    out.append(k)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def _missing_of(self, eng: EngineRecord) -> int:
        return eng.topology.world_size - len(self._by_engine[eng.engine_id])

    def missing_count(self, engine_id: str | None = None) -> int:
        """How many expected ranks are not live (one engine, or all): O(1)."""
        self._now()
        if engine_id is None:
            return self._expected - self.live_ranks()
        eng = self._engines.get(engine_id)
        return 0 if eng is None else self._missing_of(eng)

    def expected_count(self) -> int:
        """Expected ranks of every known engine (sum of world sizes): O(1)."""
        self._now()
        return self._expected

    def engine_count(self) -> int:
        self._now()
        return len(self._engines)

    def transports_of(self, engine_id: str) -> dict[str, int]:
        """How many live ranks of an engine use each transport: O(transports)."""
        self._now()
        return dict(self._transports.get(engine_id, {}))

    def live_rank_count(self) -> int:
        self._now()
        return self.live_ranks()

    def ranks_page(self, offset: int, limit: int) -> list[RankRecord]:
        """Live ranks ``offset .. offset+limit-1`` in identity order; engines before the page
        are skipped by their count: O(engines + world sizes of the engines it touches)."""
        self._now()
        out: list[RankRecord] = []
        skip = offset
        for eid in sorted(self._by_engine):
            ranks = self._by_engine[eid]
            if skip >= len(ranks):
                skip -= len(ranks)
                continue
            for rec in sorted(ranks.values(), key=lambda r: r.key)[skip:]:
                if len(out) >= limit:
                    return out
                out.append(rec)
            skip = 0
            if len(out) >= limit:
                break
        return out

    # -- rooms --------------------------------------------------------------------------------

    def _room_slots(self, count: int) -> None:
        """Every route that adds rooms asks here first (allocate, bind and abort of an unknown
        room, SGLang's register_dp_rank): the registry never holds more than its cap.

        Raises:
            BootstrapUnavailable: `count` more rooms would exceed the cap.
        """
        if len(self._rooms) + count > self._max_rooms:
            self.stats.rooms_refused += count
            raise BootstrapUnavailable(
                f"rooms: {len(self._rooms)} rooms are live (limit {self._max_rooms}); retry "
                f"later (rooms are forgotten room_retention_s after their last change)"
            )

    def allocate_rooms(self, count: int) -> list[int]:
        """``count`` new random 63-bit room ids, none equal to a room still known.

        Raises:
            ConfigError: count outside 1..MAX_ROOMS_PER_CALL.
            BootstrapUnavailable: the server already holds MAX_LIVE_ROOMS rooms.
        """
        if not 1 <= count <= MAX_ROOMS_PER_CALL:
            raise ConfigError(f"count: expected 1..{MAX_ROOMS_PER_CALL}, got {count}")
        now = self._now()
        self._room_slots(count)
        out: list[int] = []
        while len(out) < count:
            room = self._randbits(ROOM_BITS)
            if room == 0 or room in self._rooms:
                continue  # 0 is reserved (falsy ids are a classic bug); collisions are redrawn
            self._rooms[room] = RoomRecord(room, RoomAssignment.ALLOCATED, None, None, None,
                                           now, now)
            out.append(room)
        self.stats.rooms_allocated += count
        return out

    def bind_room(
        self, room: int, engine_id: str, dp_rank: int, *, rebind: bool = False
    ) -> RoomRecord:
        """Bind a room to a prefill engine's dp rank. A room not allocated here (SGLang's rooms
        are chosen by its router) is created, within the cap on live rooms. Binding again to
        the same place is a no-op.

        Raises:
            BootstrapUnavailable: a new room and the registry holds its cap of live rooms.
            ConfigError: room id out of range, or dp_rank outside the engine's dp_size.
            BootstrapNotFound: unknown engine (unless ``rebind``: SGLang binds before it may
                have registered).
            BootstrapConflict: the room is aborted, or bound elsewhere and not ``rebind``.
        """
        check_room_id(room)
        now = self._now()
        eng = self._engines.get(engine_id)
        if eng is None and not rebind:
            raise BootstrapNotFound(f"engine {engine_id!r} is not registered")
        if eng is not None:
            if eng.role is not Role.PREFILL:
                raise BootstrapConflict(
                    f"engine {engine_id!r} is a {eng.role.value} engine; rooms bind to prefill"
                )
            if not 0 <= dp_rank < eng.topology.dp_size:
                raise ConfigError(
                    f"dp_rank: expected 0 <= dp_rank < dp_size={eng.topology.dp_size} of "
                    f"engine {engine_id!r}, got {dp_rank}"
                )
        rr = self._rooms.get(room)
        if rr is not None and rr.state is RoomAssignment.ABORTED:
            raise BootstrapConflict(f"room {room} was aborted: {rr.abort_reason}")
        if rr is not None and rr.state is RoomAssignment.BOUND and not rebind:
            if (rr.engine_id, rr.dp_rank) == (engine_id, dp_rank):
                return rr
            raise BootstrapConflict(
                f"room {room} is already bound",
                [f"engine_id: bound={rr.engine_id!r} incoming={engine_id!r}",
                 f"dp_rank: bound={rr.dp_rank} incoming={dp_rank}"],
            )
        if rr is None:
            self._room_slots(1)
            rr = RoomRecord(room, RoomAssignment.BOUND, engine_id, dp_rank, None, now, now)
            self._rooms[room] = rr
        else:
            rr.state, rr.engine_id, rr.dp_rank, rr.updated_at = (
                RoomAssignment.BOUND, engine_id, dp_rank, now)
            self._rooms.move_to_end(room)
        self.stats.rooms_bound += 1
        return rr

    def abort_room(self, room: int, reason: str) -> RoomRecord:
        """Record that a room was aborted (an unknown room is recorded too, so a late lookup by
        the other side still learns why, within the cap on live rooms: else
        `BootstrapUnavailable`). Aborting twice keeps the first reason."""
        check_room_id(room)
        now = self._now()
        rr = self._rooms.get(room)
        if rr is not None and rr.state is RoomAssignment.ABORTED:
            return rr
        if rr is None:
            self._room_slots(1)
            rr = RoomRecord(room, RoomAssignment.ABORTED, None, None, reason, now, now)
            self._rooms[room] = rr
        else:
            rr.state, rr.abort_reason, rr.updated_at = RoomAssignment.ABORTED, reason, now
            self._rooms.move_to_end(room)
        self.stats.rooms_aborted += 1
        return rr

    def room(self, room: int) -> RoomRecord:
        """A known room. Raises `BootstrapNotFound` (never allocated, or forgotten)."""
        check_room_id(room)
        self._now()
        rr = self._rooms.get(room)
        if rr is None:
            raise BootstrapNotFound(
                f"room {room} is not known (never allocated or bound here, or forgotten "
                f"{self._retention_s:g} s after its last change)"
            )
        return rr

    def find_room(self, room: int) -> RoomRecord | None:
        """A known room or None (no error: for batch lookups)."""
        self._now()
        return self._rooms.get(room)

    def live_room_count(self) -> int:
        self._now()
        return len(self._rooms)

    # -- routes -------------------------------------------------------------------------------

    def prefill_engine_ids(self) -> list[str]:
        self._now()
        return sorted(e for e, r in self._engines.items() if r.role is Role.PREFILL)

    def route(self, **query: Any) -> RouteTarget:
        """The prefill ranks a decode rank must talk to (`routing.route`, which documents the
        query and what it raises)."""
        from kvhandoff.bootstrap_server.routing import route

        return route(self, **query)

    def live_rank_or_none(self, key: RankKey) -> RankRecord | None:
        """A live rank, or None (no expiry pass: for the lookups of one route)."""
        return self._rank(key)
