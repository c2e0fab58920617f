"""kvhandoff's transfer figures in vLLM's own metrics (its connector-stats API).

How vLLM moves them: each worker's ``get_kv_connector_stats()`` hands one `KVHandoffStats` per
step (None when nothing ended); vLLM sums the workers' objects with ``aggregate``, sends the
``data`` dict to its front end, where ``build_kv_connector_stats(data)`` rebuilds the object for
the periodic "KV Transfer metrics: ..." log line (``reduce``) and `KVHandoffPromMetrics`
records the same dict into vLLM's Prometheus registry (``vllm:kvhandoff_*`` in ``/metrics``).

Rules:
- one record per room leg that ended on this worker (Success or Failed), taken from the
  handle's own figures (`Sender.stats()` / `Receiver.stats()`) once, when the worker sees it
  terminal (one query to its agent's control thread per ended room, none for the rest); a
  room that could not even open is a failed record of kind ``not_opened``;
- ``data`` holds only plain lists, dicts, strings and numbers: it crosses processes (vLLM's
  serializer), and ``aggregate`` is a concatenation of records, so workers and intervals sum;
- times are the agent's own (monotonic, one clock per side): the transfer time runs from the
  room's opening on that side to its end, the tail (prefill) from the last layer handed over
  to the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvhandoff.state_machine import KVPoll

NOT_OPENED = "not_opened"  # failure reason of a room the agent refused to open
_TERMINAL = (KVPoll.Success, KVPoll.Failed)
# seconds: a handoff of a few MB on a LAN up to one that waited for a slow decode
_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
_BYTES_BUCKETS = tuple(float(2 ** k) for k in range(12, 36, 2))  # 4 KiB .. 16 GiB


def room_record(*, role: str, transport: str, stats: dict[str, Any]) -> dict[str, Any]:
    """One room leg's record, from the handle's ``stats()`` dict."""
    ok = stats["state"] == KVPoll.Success.name
    t0, t_last, t_end = stats.get("t_created"), stats.get("t_last_ready"), stats.get("t_done")
    return {
        "role": role,
        "ok": ok,
        "reason": None if ok else (stats.get("failure_kind") or "unknown"),
        "lane": "one_sided" if stats.get("one_sided") else "two_sided",
        "transport": transport,
        "bytes": int(stats.get("bytes") or 0),
        "region_bytes": {k: int(v) for k, v in (stats.get("bytes_per_region") or {}).items()}
        if ok else {},
        "retransmits": int(stats.get("retransmits") or 0),
        "transfer_s": max(0.0, t_end - t0) if ok and t0 and t_end is not None else None,
        "tail_s": max(0.0, t_end - t_last) if ok and t_last and t_end is not None else None,
    }


def refused_record(*, role: str, transport: str) -> dict[str, Any]:
    """The record of a room the agent refused to open (nothing moved)."""
    return {"role": role, "ok": False, "reason": NOT_OPENED, "lane": "two_sided",
            "transport": transport, "bytes": 0, "region_bytes": {}, "retransmits": 0,
            "transfer_s": None, "tail_s": None}


@dataclass
class KVHandoffStats(KVConnectorStats):
    """The room legs that ended in one interval (a step on a worker, then summed by vLLM);
    ``data = {"rooms": [record, ...]}`` (`room_record`)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        rooms = self.data.get("rooms")
        if not isinstance(rooms, list):
            raise ValueError(f"KVHandoffStats data: expected {{'rooms': [...]}}, got keys "
                             f"{sorted(self.data)}")

    @property
    def rooms(self) -> list[dict[str, Any]]:
        rooms: list[dict[str, Any]] = self.data["rooms"]
        return rooms

    def reset(self) -> None:
        self.data = {"rooms": []}

    def is_empty(self) -> bool:
        return not self.rooms

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # a new object: vLLM's front end hands the same payload dict to the log line and to
        # Prometheus, so neither may see the other's later intervals appended to it
        more = other.data.get("rooms", []) if other is not None else []
        return KVHandoffStats(data={"rooms": [*self.rooms, *more]})

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's log line ("KV Transfer metrics: k=v, ...")."""
        done = [r for r in self.rooms if r["ok"]]
        failed = [r for r in self.rooms if not r["ok"]]
        out: dict[str, int | float] = {"Rooms done": len(done), "Rooms failed": len(failed)}
        for reason in sorted({r["reason"] for r in failed}):
            out[f"Failed {reason}"] = sum(1 for r in failed if r["reason"] == reason)
        if not done:
            return out
        for lane in ("one_sided", "two_sided"):
            out[f"Rooms {lane.replace('_', '-')}"] = sum(1 for r in done if r["lane"] == lane)
        for kind in sorted({r["transport"] for r in done}):
            out[f"Rooms over {kind}"] = sum(1 for r in done if r["transport"] == kind)
        total = sum(r["bytes"] for r in done)
        out["MB moved"] = round(total / 2**20, 3)
        for region, n in sorted(_region_totals(done).items()):
            out[f"MB {region}"] = round(n / 2**20, 3)
        for key, label in (("transfer_s", "transfer"), ("tail_s", "tail")):
            xs = sorted(r[key] for r in done if r[key] is not None)
            if xs:
                out[f"Avg {label} (ms)"] = round(1e3 * sum(xs) / len(xs), 3)
                out[f"P90 {label} (ms)"] = round(1e3 * _quantile(xs, 0.9), 3)
                out[f"Max {label} (ms)"] = round(1e3 * xs[-1], 3)
        out["Retransmits"] = sum(r["retransmits"] for r in self.rooms)
        return out


def _region_totals(rooms: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rooms:
        for region, n in r["region_bytes"].items():
            out[region] = out.get(region, 0) + n
    return out


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted `xs`, linear between ranks (numpy's default)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class StatsRecorder:
    """A worker's room legs until they end: `watch` each handle when it opens, `take` the
    step's records (vLLM's ``get_kv_connector_stats``). Owned by the worker's engine thread."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.transport = "none"  # the agent's transport kind, set once the agent runs
        self._watched: list[Any] = []
        self._stats = KVHandoffStats()

    def watch(self, handle: Any) -> None:
        self._watched.append(handle)

    def forget(self, handle: Any) -> None:
        """Stop watching `handle` (a preempted prefill's sender: the request sends again)."""
        self._watched = [h for h in self._watched if h is not handle]

    def refused(self) -> None:
        self._stats.rooms.append(refused_record(role=self.role, transport=self.transport))

    def take(self) -> KVHandoffStats | None:
        """The records of the legs that ended since the last call (None when none did)."""
        still = []
        for h in self._watched:
            if h.poll() in _TERMINAL:
                self._stats.rooms.append(room_record(role=self.role, transport=self.transport,
                                                     stats=h.stats()))
            else:
                still.append(h)
        self._watched = still
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVHandoffStats()
        return out


class KVHandoffPromMetrics(KVConnectorPromMetrics):
    """kvhandoff's counters and histograms in vLLM's Prometheus registry (``vllm:kvhandoff_``),
    with vLLM's labels (model_name, engine) first; `observe` records one payload."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        # vLLM's classes (plain prometheus_client ones, or Ray's wrappers); typed as a union
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self.rooms_done = counter(
            name="vllm:kvhandoff_rooms_done",
            documentation="kvhandoff room legs that ended in Success, by lane (one-sided "
                          "writes or two-sided sends) and data transport.",
            labelnames=[*names, "role", "lane", "transport"])
        self.rooms_failed = counter(
            name="vllm:kvhandoff_rooms_failed",
            documentation="kvhandoff room legs that ended in Failed, by failure kind "
                          "(not_opened: the agent refused to open the room).",
            labelnames=[*names, "role", "reason"])
        self.bytes = counter(
            name="vllm:kvhandoff_bytes",
            documentation="KV bytes of the room legs that ended in Success, per region "
                          "(sent on a prefill, received and verified on a decode).",
            labelnames=[*names, "role", "region"])
        self.retransmits = counter(
            name="vllm:kvhandoff_retransmits",
            documentation="Layers kvhandoff sent again after a checksum mismatch.",
            labelnames=[*names, "role"])
        self.transfer_time = histogram(
            name="vllm:kvhandoff_transfer_time_seconds",
            documentation="Per request: the room's opening on this side to its Success (on a "
                          "prefill this includes waiting for the decode to come).",
            buckets=list(_TIME_BUCKETS_S), labelnames=[*names, "role"])
        self.tail = histogram(
            name="vllm:kvhandoff_tail_seconds",
            documentation="Per request (prefill): the last layer handed over to the room's "
                          "Success, the handoff's tail after the forward.",
            buckets=list(_TIME_BUCKETS_S), labelnames=[*names, "role"])
        self.room_bytes = histogram(
            name="vllm:kvhandoff_room_bytes",
            documentation="Per request: KV bytes moved by a room leg that ended in Success.",
            buckets=list(_BYTES_BUCKETS), labelnames=[*names, "role"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        eng = self.per_engine_labelvalues[engine_idx]
        for r in transfer_stats_data.get("rooms", []):
            role = r["role"]
            if r["retransmits"]:
                self.retransmits.labels(*eng, role).inc(r["retransmits"])
            if not r["ok"]:
                self.rooms_failed.labels(*eng, role, r["reason"]).inc()
                continue
            self.rooms_done.labels(*eng, role, r["lane"], r["transport"]).inc()
            for region, n in r["region_bytes"].items():
                self.bytes.labels(*eng, role, region).inc(n)
            self.room_bytes.labels(*eng, role).observe(r["bytes"])
            if r["transfer_s"] is not None:
                self.transfer_time.labels(*eng, role).observe(r["transfer_s"])
            if r["tail_s"] is not None:
                self.tail.labels(*eng, role).observe(r["tail_s"])


__all__ = ["NOT_OPENED", "KVHandoffPromMetrics", "KVHandoffStats", "StatsRecorder",
           "room_record"]
