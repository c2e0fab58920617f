"""Read-outs of `session.TransferSession` (a mixin, split out for size; sans-IO like the
session): the agent's status (room states, peers, counters, per-region bytes, the tail
histogram) and one room's figures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.kv_layout import LayoutSpec
    from kvhandoff.transfer.handshake import Peer
    from kvhandoff.transfer.rooms import Group

# upper bounds (s) of the tail histogram (last layer_ready -> Success); one more bucket: +Inf
TAIL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ReadOuts:
    """Mixin of `TransferSession` (see the module doc)."""

    if TYPE_CHECKING:  # what the session provides
        layout: LayoutSpec
        groups: dict[int, Group]
        peers: dict[str, Peer]
        counters: dict[str, int]
        region_bytes: dict[tuple[str, str], int]
        region_descriptors: dict[tuple[str, str], int]
        tail_buckets: list[int]
        tail_sum_s: float

        def _group(self, room: int, token: object) -> Group | None: ...

    def status(self) -> dict[str, Any]:
        """Room states by name, peers and counters."""
        from kvhandoff.transfer.handshake import peer_summary

        states: dict[str, int] = {}
        for g in self.groups.values():
            states[g.state.name] = states.get(g.state.name, 0) + 1
        return {"rooms": states, "peers": [peer_summary(p) for p in self.peers.values()],
                "counters": dict(self.counters),
                "region_bytes": [[d, r, n] for (d, r), n in sorted(self.region_bytes.items())],
                "region_descriptors": [[d, r, n] for (d, r), n in
                                       sorted(self.region_descriptors.items())],
                "tail": {"buckets_s": list(TAIL_BUCKETS_S), "counts": list(self.tail_buckets),
                         "sum_s": self.tail_sum_s}}

    def room_stats(self, room: int, token: object) -> dict[str, Any] | None:
        """Byte and timing figures of a room (None when it is forgotten)."""
        g = self._group(room, token)
        if g is None:
            return None
        desc: dict[str, int] = {}
        before: dict[str, int] = {}
        per_region: dict[str, int] = {}
        for r in g.legs:
            for k, p in [kp for plans in (r.chunk_plans or [r.plans]) for kp in plans.items()]:
                layers = self.layout.region(k).num_live_layers  # 0-row layers move nothing
                desc[k] = desc.get(k, 0) + p.count * layers
                before[k] = before.get(k, 0) + p.descriptors_before * layers
                per_region[k] = per_region.get(k, 0) + p.total_bytes * layers
        return {
            "room": g.room, "state": g.state.name,
            "failure": g.failure.reason if g.failure else None,
            "failure_kind": g.failure.kind.value if g.failure else None,
            "legs": len(g.legs), "peers": [r.peer for r in g.legs],
            "bytes": sum(r.bytes_moved for r in g.legs),
            "retransmits": sum(r.retransmits for r in g.legs),
            "one_sided": bool(g.legs) and all(r.one_sided for r in g.legs),
            "checksums_verified": sum(r.checksums_verified for r in g.legs),
            "descriptors": desc, "descriptors_before": before, "bytes_per_region": per_region,
            "t_created": g.t_created, "t_last_ready": g.t_last_ready, "t_done": g.t_done,
        }
