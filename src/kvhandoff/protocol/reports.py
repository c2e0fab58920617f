"""`ReadOuts`: the figures a session keeps for its agent's status and metrics, sans-IO.

It owns the labelled counters (bytes and descriptors per direction and region) and the tail
histogram (last layer_ready -> Success, prefill side, as cumulative buckets); the data path and
the room table add to them as bytes move and rooms end. `status` and `room_stats` read them
together with the rooms and peers they are given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.protocol.peerstate import Peer
from kvhandoff.protocol.rooms import Room

# upper bounds (s) of the tail histogram (last layer_ready -> Success); one more bucket: +Inf
TAIL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ReadOuts:
    """Labelled byte counters and the tail histogram of one session (see the module doc)."""

    def __init__(self) -> None:
        self.region_bytes: dict[tuple[str, str], int] = {}  # (direction, region) -> bytes
        self.region_descriptors: dict[tuple[str, str], int] = {}
        self.tail_buckets: list[int] = [0] * (len(TAIL_BUCKETS_S) + 1)
        self.tail_sum_s = 0.0

    def moved(self, direction: str, region: str, nbytes: int, descriptors: int) -> None:
        """`nbytes` in `descriptors` spans of `region` were sent / received."""
        k = (direction, region)
        self.region_bytes[k] = self.region_bytes.get(k, 0) + nbytes
        self.region_descriptors[k] = self.region_descriptors.get(k, 0) + descriptors

    def tail(self, tail_s: float) -> None:
        """A room ended Success `tail_s` after its last layer was marked ready."""
        self.tail_sum_s += tail_s
        i = next((i for i, b in enumerate(TAIL_BUCKETS_S) if tail_s <= b), len(TAIL_BUCKETS_S))
        self.tail_buckets[i] += 1

    def status(self, *, rooms: Iterable[Room], peers: Iterable[Peer],
               counters: Mapping[str, int]) -> dict[str, Any]:
        """Room states by name, peers and counters."""
        states: dict[str, int] = {}
        for g in rooms:
            states[g.state.poll.name] = states.get(g.state.poll.name, 0) + 1
        return {"rooms": states, "peers": [peer_summary(p) for p in peers],
                "counters": dict(counters),
                "region_bytes": [[d, r, n] for (d, r), n in sorted(self.region_bytes.items())],
                "region_descriptors": [[d, r, n] for (d, r), n in
                                       sorted(self.region_descriptors.items())],
                "tail": {"buckets_s": list(TAIL_BUCKETS_S), "counts": list(self.tail_buckets),
                         "sum_s": self.tail_sum_s}}


def room_stats(g: Room, layout: LayoutSpec) -> dict[str, Any]:
    """Byte and timing figures of room `g` (on an agent of `layout`)."""
    desc: dict[str, int] = {}
    before: dict[str, int] = {}
    per_region: dict[str, int] = {}
    for r in g.legs:
        for k, p in [kp for plans in r.plan.chunk_plans for kp in plans.items()]:
            layers = layout.region(k).num_live_layers  # 0-row layers move nothing
            desc[k] = desc.get(k, 0) + p.count * layers
            before[k] = before.get(k, 0) + p.descriptors_before * layers
            per_region[k] = per_region.get(k, 0) + p.total_bytes * layers
    return {
        "room": g.room, "state": g.state.poll.name,
        "failure": g.state.failure.reason if g.state.failure else None,
        "failure_kind": g.state.failure.kind.value if g.state.failure else None,
        "legs": len(g.legs), "peers": [r.peer for r in g.legs],
        "bytes": sum(r.stats.bytes_moved for r in g.legs),
        "retransmits": sum(r.stats.retransmits for r in g.legs),
        "one_sided": bool(g.legs) and all(r.one_sided for r in g.legs),
        "checksums_verified": sum(r.stats.checksums_verified for r in g.legs),
        "descriptors": desc, "descriptors_before": before, "bytes_per_region": per_region,
        "t_created": g.t_created, "t_last_ready": g.given.t_last_ready,
        "t_done": g.state.t_done,
    }


def peer_summary(p: Peer) -> dict[str, Any]:
    """A peer as `status()` shows it."""
    st = p.state
    return {"addr": p.addr, "matched": st.matched, "state": st.phase.value,
            "rejected": st.rejected.reason if st.rejected else None,
            # how this side moves data to it: one-sided writes into its buffers, or two-sided
            "one_sided_writes": st.writes, "memory": p.memory}
