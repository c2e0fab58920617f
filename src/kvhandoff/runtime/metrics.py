"""Prometheus metrics of a transfer agent, read from `agent.status()` at scrape time.

Nothing on the hot path touches Prometheus: the agent keeps plain counters under its lock and
this collector turns a snapshot into metric families when scraped. The transport's kind, its
lanes and whether it is degraded (TCP instead of shared memory/RDMA) are exported, so a silent
fallback shows on a dashboard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector


class Reporting(Protocol):
    """What the collector reads: an agent's `status()` (`TransferAgent` is one)."""

    def status(self) -> dict[str, Any]: ...


_COUNTER_HELP = {
    "messages_in": "Control messages received.",
    "messages_out": "Control messages sent.",
    "control_out_dropped": "Control messages dropped because the queue of the socket to "
                           "their address was at its bound (an address that does not read: "
                           "64 messages for an address with no peer record, 16,384 for a "
                           "peer).",
    "messages_out_local": "Of messages_out, those sent to a peer of this host over the "
                          "same-host Unix socket (Settings.local_control_lane).",
    "rejected_messages": "Control messages rejected (malformed, wrong version, oversized).",
    "lane_refused": "Same-host control lane connections refused because the process at the "
                    "other end (SO_PEERCRED) is of another user: a squatter on a peer's lane "
                    "name (the peer is then reached over ZMQ), or a stranger connecting.",
    "lane_squatted": "1 when this agent's own same-host lane name was already held by another "
                     "process at start (its peers reach it over ZMQ).",
    "stale_messages": "Messages of an unknown peer or an older peer generation, ignored.",
    "holds_renewed": "Prefill: rooms whose wait for their decode a decode's hold renewed (it "
                     "has the request queued), one per room per hold message.",
    "holds_expired": "Prefill: rooms failed by their bootstrap bound after a decode's hold on "
                     "them lapsed (not renewed: the decode stopped holding them or died).",
    "unauthenticated_messages": "With hmac_secret set: messages dropped because they did "
                                "not authenticate (a Hello or HelloReject whose MAC does not "
                                "verify, a message not sealed under its sender's session).",
    "replayed_messages": "With hmac_secret set: messages dropped as replays (a sequence number "
                         "not above the last one taken, a HelloAck that echoes no Hello of "
                         "ours, a copy of a Hello already taken or waiting for its "
                         "confirmation).",
    "data_unproven_chunks": "tcp data plane: chunks dropped because their connection had not "
                            "proven the control session with their sender (hmac_secret set), "
                            "or named no sender.",
    "data_refused_proofs": "tcp data plane: connection proofs (claims without hmac_secret) "
                           "refused: they did not verify, or named no peer of this transport.",
    "data_replayed_proofs": "tcp data plane: connection proofs refused as replays (a nonce "
                            "already taken in this session).",
    "data_forged_chunks": "tcp data plane: chunks on a proven connection whose MAC did not "
                          "verify or whose sequence number was taken already.",
    "data_forged_replies": "tcp data plane (hmac_secret set), sending side: receiver replies "
                           "(credits, finals) refused: their MAC did not verify or their "
                           "sequence number was taken already (forged, replayed, reordered).",
    "data_unverified_replies": "tcp data plane (hmac_secret set), sending side: 'chunk not "
                               "taken' replies the receiver could not MAC, taken only as a "
                               "hint to prove the connection again (never to fail a send).",
    "data_early_dropped": "tcp and ucx data planes: chunks for receives not posted yet "
                          "dropped over the bound (tcp_early_bytes: per peer on tcp, per "
                          "stream on ucx; 4 times that in all) or held past stall_timeout_s; "
                          "their room fails or is retried.",
    "retransmits": "Layers sent again after a checksum mismatch.",
    "checksum_failures": "Landed layers whose checksum did not match.",
    "checksums_verified": "Landed (layer, region) checksums that matched.",
    "checksums_writer_verified": "Of checksums_verified, those the writer verified by reading "
                                 "back what it wrote (same host, shm's mapped lane), with the "
                                 "plan it wrote by checked against this side's: not read "
                                 "again here.",
    "bytes_sent": "KV bytes sent.",
    "bytes_received": "KV bytes received and verified.",
    "rooms_success": "Room legs that ended in Success.",
    "rooms_failed": "Room legs that ended in Failed.",
    "peers_lost": "Peers declared dead (missed heartbeats) or restarted.",
    "rechecks": "Matched peers asked, after this agent's control loop woke from a stall of "
                "more than 2 heartbeats, whether they still hold this agent (their room "
                "messages wait for the answer).",
    "rechecks_passed": "Rechecks a peer answered: it still held this agent, and the rooms "
                       "with it went on (an unanswered one declares the peer lost).",
    "early_dropped": "Messages for rooms not yet opened by the engine, dropped because the "
                     "agent already held its limit of such rooms, messages or bytes (transfer "
                     "requests are refused).",
    "rooms_one_sided": "Room legs moved by one-sided writes (the prefill writes straight into "
                       "the decode's pages; the rest are sent two-sided).",
    "write_quarantines": "Failed one-sided room legs whose pages the decode held for the "
                         "write quarantine (write_quarantine_s, at least stall_timeout_s + 2 "
                         "heartbeats) because the prefill never confirmed its writes stopped "
                         "(it died, froze or was cut off).",
    "staged_bytes_out": "Host staging (CUDA caches on a lane that cannot reach device "
                        "memory): bytes copied from device pages to pinned host buffers and "
                        "sent (prefill).",
    "staged_bytes_in": "Host staging: bytes received into pinned host buffers and copied into "
                       "device pages (decode).",
    "staging_waits": "Host staging: sends or receives that waited for room in the staging "
                     "arena (host_staging_mib).",
    "cancel_failures": "Cancels or disconnects the transport could not confirm (a copy that "
                       "did not stop): the room's pages stayed held until write_quarantine_s.",
    "internal_errors": "Rooms failed (both sides told) because handling one of their events "
                       "raised (a bug; logged with its traceback).",
    "loop_errors": "Events of no room (ticks, peer messages) whose handling raised (a bug; "
                   "logged with its traceback).",
    "loop_stalls": "Passes of the control loop that began over a heartbeat after their poll's "
                   "timeout or ran over a heartbeat (logged): 2 heartbeats of that and the "
                   "peers give this agent's rooms up (a busy host, or the GIL held).",
}


class AgentCollector(Collector):
    """Collects one agent's metrics (prefix ``kvhandoff_agent_``)."""

    def __init__(self, agent: Reporting) -> None:
        self._agent = agent

    def collect(self) -> Iterator[InfoMetricFamily | GaugeMetricFamily | CounterMetricFamily
                                  | HistogramMetricFamily]:
        st = self._agent.status()
        tr = st["transport"]
        info = InfoMetricFamily("kvhandoff_agent_transport", "The agent's data transport.")
        info.add_metric([], {"kind": tr["kind"], "lanes": ",".join(tr["lanes"]),
                             "role": st["role"], "reason": tr["reason"]})
        yield info
        deg = GaugeMetricFamily("kvhandoff_agent_transport_degraded",
                                "1 when the transport runs degraded (TCP instead of shm/RDMA).")
        deg.add_metric([], 1.0 if tr["degraded"] else 0.0)
        yield deg
        if "auth" in st:
            auth = GaugeMetricFamily(
                "kvhandoff_agent_unauthenticated", "1 when the agent listens on a non-loopback "
                "address without hmac_secret (allowed by allow_unauthenticated).")
            auth.add_metric([], 1.0 if st["auth"] == "off" else 0.0)
            yield auth
        rooms = GaugeMetricFamily("kvhandoff_agent_rooms", "Rooms by KVPoll state.",
                                  labels=["state"])
        for state in ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed"):
            rooms.add_metric([state], float(st["rooms"].get(state, 0)))
        yield rooms
        rb = CounterMetricFamily("kvhandoff_agent_region_bytes",
                                 "KV bytes moved per region (sent: posted and completed; "
                                 "received: landed and verified).", labels=["direction", "region"])
        rd = CounterMetricFamily("kvhandoff_agent_region_descriptors",
                                 "Span descriptors (after coalescing) moved per region.",
                                 labels=["direction", "region"])
        for direction, region, n in st.get("region_bytes", []):
            rb.add_metric([direction, region], float(n))
        for direction, region, n in st.get("region_descriptors", []):
            rd.add_metric([direction, region], float(n))
        yield rb
        yield rd
        tail = st.get("tail")
        if tail is not None:
            cum, buckets = 0, []
            for bound, n in zip([*tail["buckets_s"], float("inf")], tail["counts"], strict=True):
                cum += n
                buckets.append((str(bound) if bound != float("inf") else "+Inf", float(cum)))
            h = HistogramMetricFamily("kvhandoff_agent_tail_seconds",
                                      "Last layer_ready -> room Success (prefill side): the "
                                      "handoff's tail after the last layer.",
                                      buckets=buckets, sum_value=tail["sum_s"])
            yield h
        for name, value in st["counters"].items():
            c = CounterMetricFamily(f"kvhandoff_agent_{name}",
                                    _COUNTER_HELP.get(name, name.replace("_", " ")))
            c.add_metric([], float(value))
            yield c


def registry_for(agent: Reporting) -> CollectorRegistry:
    """A registry holding only this agent's collector (several agents per process are fine)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    return reg


def metrics_text(agent: Reporting) -> str:
    """The agent's metrics in Prometheus text format."""
    return generate_latest(registry_for(agent)).decode()
