"""A decode worker's holds on the prefill rooms of requests vLLM has queued.

A prefill's room waits `bootstrap_timeout_s` for its decode, then fails. vLLM opens a decode
request's receiver only once it gives the request a slot, so under a backlog longer than that
bound every queued request would fail (``kv_load_failure_policy=fail``) or be computed on the
decode (``recompute``). The scheduler tells the workers, each step, which requests joined the
queue and which left it (`config.HoldReq`, ``KVHandoffMetadata.holds`` / ``unholds``); each
worker's agent holds those rooms at the prefill ranks this rank will read them from
(`TransferAgent.hold_rooms`: wire ``Hold``, resent at every heartbeat; the prefill keeps a held
room past its bound and counts ``holds_renewed``). A hold ends when the request leaves the
queue: its receiver opens (the agent drops the room from its holds itself), it is declined, or
it ends (a client's abort): then the prefill's hold lapses after ``hold_s`` and the room fails
there, counted as ``holds_expired``.

Which prefill agents: the params name the room and its bootstrap server, not the prefill ranks
(their agents' addresses come from the server's route for the room, as a receiver finds them).
So a held request's route is looked up when it joins the queue (the prefill bound the room
before it returned the params, so the answer is there at once), on a lookup thread of this
worker's own (`RouteLookups`: one asyncio thread, every lookup a task), for this rank's TP rank
and size: exactly the ranks its receiver will read. A lookup that fails leaves that request
unheld (said in the log); its receiver looks the route up again when it opens.

The agent sends a hold only to a prefill agent whose handshake with it stands (one this rank
already read a room from, the common case under a backlog); a prefill agent this rank never
talked to is told once a room of it is read.

The state is the requests held and, once looked up, their prefill agents; the engine thread
changes it at each step, the lookup thread when a route comes back, both under one lock, and
each change tells the agent the whole set of rooms held with each prefill agent it touched
(`hold_rooms` replaces the set)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvhandoff.integrations.vllm.config import HoldReq

log = logging.getLogger("kvhandoff.vllm")


@dataclass
class _Held:
    room: int
    peers: tuple[str, ...] = ()  # the prefill agents this rank reads it from (once looked up)


class RoomHolds:
    """The rooms one worker's agent holds (module docstring). `lookups`: a `RouteLookups`
    (default: one of its own, started on the first hold)."""

    def __init__(self, agent: Any, *, hold_s: float | None = None, lookups: Any = None) -> None:
        self._agent = agent
        self._hold_s = hold_s
        self._lookups = lookups
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # request id -> its hold
        self.failed_lookups = 0

    def update(self, new: Mapping[str, HoldReq], ended: Iterable[str]) -> None:
        """(engine thread) The step's changes: `new` requests queued, `ended` no longer."""
        with self._lock:
            touched: set[str] = set()
            for rid in ended:
                h = self._held.pop(rid, None)
                if h is not None:
                    touched.update(h.peers)
            for rid, q in new.items():
                self._held[rid] = _Held(q.room)
            self._tell(touched)
        if not new:
            return
        if self._lookups is None:
            from kvhandoff.runtime.registration import RouteLookups

            self._lookups = RouteLookups(self._agent)
        for rid, q in new.items():
            self._lookups.submit(q.room, q.bootstrap_addr,
                                 functools.partial(self._resolved, rid, q.room))

    def _resolved(self, rid: str, room: int, sources: tuple[tuple[str, int], ...],
                  error: str | None) -> None:
        """(lookup thread) The room's prefill agents for this rank, or why not."""
        with self._lock:
            h = self._held.get(rid)
            if h is None or h.room != room:
                return  # left the queue meanwhile
            if error is not None:
                self.failed_lookups += 1
                log.warning("request %s (room %d): queued, but not held at its prefill (route "
                            "lookup: %s); under a backlog longer than the prefill's "
                            "bootstrap_timeout_s its room may fail", rid, room, error)
                return
            h.peers = tuple(dict.fromkeys(addr for addr, _gen in sources))
            self._tell(set(h.peers))

    def _tell(self, peers: set[str]) -> None:
        """(under the lock) The whole set of rooms held with each of `peers`, to the agent."""
        for peer in sorted(peers):
            rooms = sorted({h.room for h in self._held.values() if peer in h.peers})
            self._agent.hold_rooms(peer, rooms, self._hold_s)

    def held(self) -> dict[str, tuple[str, ...]]:
        """Request id -> the prefill agents its room is held with (empty: not looked up)."""
        with self._lock:
            return {rid: h.peers for rid, h in self._held.items()}

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
