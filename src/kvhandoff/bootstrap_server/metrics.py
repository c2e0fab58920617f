"""Prometheus metrics of one app, in its own `CollectorRegistry` (several apps in one process —
tests, the demo — must not collide in the global one).

Counters of the registry (registrations, rooms, ...) are read from `Registry.stats` at scrape
time by a custom collector, so they cannot drift from the state; its gauges are counts the
registry keeps (O(1) per scrape, whatever the number of ranks); request latency and route
lookup outcomes are recorded by the HTTP layer.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvhandoff.bootstrap_server.registry import Registry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "kvhandoff_bootstrap_"


class _RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        st = self._registry.stats
        counters = {
            "registrations": ("Unique rank identities registered.", st.registrations),
            "re_registrations": ("Registrations that replaced an identity.", st.re_registrations),
            "deregistrations": ("Ranks that deregistered.", st.deregistrations),
            "ranks_expired": ("Ranks dropped after missing heartbeats.", st.ranks_expired),
            "conflicts": ("Registrations refused for topology/layout.", st.conflicts),
            "rooms_allocated": ("Room ids allocated.", st.rooms_allocated),
            "rooms_bound": ("Rooms bound to a prefill dp rank.", st.rooms_bound),
            "rooms_aborted": ("Rooms aborted.", st.rooms_aborted),
            "engines_forgotten": ("Engines forgotten with their last rank (deregistered or "
                                  "expired).", st.engines_forgotten),
            "registrations_refused": ("Registrations refused by a bound (max_world_size, "
                                      "max_engines, max_live_ranks).",
                                      st.registrations_refused),
            "rooms_refused": ("Rooms not created (allocate, bind, abort, register_dp_rank): "
                              "the server held its cap of live rooms.", st.rooms_refused),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(_PREFIX + name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily(_PREFIX + "ranks_live", "Ranks registered and live.")
        g.add_metric([], self._registry.live_rank_count())
        yield g
        g = GaugeMetricFamily(_PREFIX + "rooms_live", "Rooms known to the server.")
        g.add_metric([], self._registry.live_room_count())
        yield g
        g = GaugeMetricFamily(_PREFIX + "ranks_missing", "Expected ranks not live.")
        g.add_metric([], self._registry.missing_count())
        yield g
        g = GaugeMetricFamily(_PREFIX + "engines_live", "Engines known (each has a live rank).")
        g.add_metric([], self._registry.engine_count())
        yield g
        g = GaugeMetricFamily(_PREFIX + "expiry_pass_max",
                              "The most ranks (or rooms) one expiry pass dropped on the event "
                              "loop (at most 4,096: a mass expiry is spread over loop turns).")
        g.add_metric([], st.expiry_pass_max)
        yield g
        c = CounterMetricFamily(_PREFIX + "rooms_forgotten",
                                "Rooms forgotten room_retention_s after their last change.")
        c.add_metric([], st.rooms_forgotten)
        yield c


class Metrics:
    """The metrics of one app."""

    def __init__(self, registry: Registry) -> None:
        self.collector_registry = CollectorRegistry(auto_describe=True)
        self.collector_registry.register(_RegistryCollector(registry))
        self.route_lookups = Counter(
            _PREFIX + "route_lookups",
            "Route lookups by API (native, sglang) and outcome.",
            ["api", "outcome"],
            registry=self.collector_registry,
        )
        self.requests = Counter(
            _PREFIX + "requests",
            "HTTP requests by method, route template and status.",
            ["method", "route", "status"],
            registry=self.collector_registry,
        )
        self.latency = Histogram(
            _PREFIX + "request_seconds",
            "HTTP request latency by method and route template.",
            ["method", "route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.collector_registry,
        )
        self.unauthenticated = Gauge(
            _PREFIX + "unauthenticated",
            "1 when the server listens on a non-loopback host without auth_token (allowed by "
            "allow_unauthenticated).",
            registry=self.collector_registry,
        )
        self.query_slice_max = Gauge(
            _PREFIX + "query_dp_ranks_slice_max",
            "The most rooms one POST /query_dp_ranks looked up in one turn of the event loop "
            "(at most 1,024: a bigger query gives the loop back between slices).",
            registry=self.collector_registry,
        )
        self._query_slice_max = 0

    def query_slice(self, rooms: int) -> None:
        """One slice of `rooms` lookups of /query_dp_ranks ran (the gauge keeps the most)."""
        if rooms > self._query_slice_max:
            self._query_slice_max = rooms
            self.query_slice_max.set(rooms)

    def render(self) -> bytes:
        return generate_latest(self.collector_registry)
