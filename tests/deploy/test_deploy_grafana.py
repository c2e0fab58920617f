"""deploy/grafana/kvhandoff.json: a loadable dashboard whose every query names metrics that a
real bootstrap server or a real transfer agent exports.

The exported names come from the live registries (a `create_app` server and an inproc
`TransferAgent`), never from a list written here. A family's series names follow from its
type: counter -> `<name>_total`, histogram -> `_bucket`/`_count`/`_sum`, info -> `_info`,
gauge -> the name itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvhandoff.bootstrap_server import create_app
from kvhandoff.buffers.bufferset import allocate
from kvhandoff.kv_layout import preset
from kvhandoff.runtime.metrics import registry_for
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvhandoff.json"

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
             "info": ("_info",), "gauge": ("",), "summary": ("_count", "_sum", ""),
             "untyped": ("",)}


def _series_names(reg: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for fam in reg.collect():
        names |= {fam.name + s for s in _SUFFIXES[fam.type]}
        names |= {s.name for s in fam.samples}
    return names


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    app = create_app(Settings(port=0, auth_token=None))
    server = _series_names(app.state.kvhandoff.metrics.collector_registry)
    spec = preset("glm-5.3")
    agent: set[str] = set()
    for transport in ("inproc", "tcp"):  # tcp adds the data plane's counters
        with TransferAgent("prefill", spec, allocate(spec, 2),
                           Settings(transport=transport)) as ag:
            agent |= _series_names(registry_for(ag))
    assert any(n.startswith("kvhandoff_bootstrap_") for n in server)
    assert any(n.startswith("kvhandoff_agent_") for n in agent)
    return {"server": server, "agent": agent}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def _queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(d) for t in p.get("targets", [])]


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                 "and", "or", "unless", "offset", "le", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that are metric names: not functions (followed by
    '('), not labels (inside {...} or by/without (...)), not $variables, not keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le, route) (rate('
                        'kvhandoff_bootstrap_request_seconds_bucket{job=~"$job"}'
                        '[$__rate_interval])))') == {"kvhandoff_bootstrap_request_seconds_bucket"}
    assert metric_names("sum(rate(a_total[1m])) / 1e9 + min(b == bool 0)") == {"a_total", "b"}


def test_dashboard_is_a_loadable_grafana_dashboard() -> None:
    d = _dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    assert "datasource" in variables
    for p in _panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] in ("row", "text"):
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval", "__interval"}
            assert used <= variables, f"{p['title']}: undefined variable(s) {used - variables}"


def test_every_query_names_an_exported_metric(exported: dict[str, set[str]]) -> None:
    every = exported["server"] | exported["agent"]
    queries = _queries(_dashboard())
    assert queries
    unknown = []
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: query names no metric: {expr}"
        unknown += [f"{title}: {n}" for n in sorted(names - every)]
    assert not unknown, "metrics not exported by the server or the agent:\n" + "\n".join(unknown)


def test_dashboard_covers_the_issue_list(exported: dict[str, set[str]]) -> None:
    """Rooms by state, GB/s, checksum failures and retransmits, peer losses, tail latency,
    bootstrap request rates and readiness, degraded transports."""
    used = set().union(*(metric_names(e) for _, e in _queries(_dashboard())))
    for name in ("kvhandoff_agent_rooms", "kvhandoff_agent_bytes_received_total",
                 "kvhandoff_agent_checksum_failures_total", "kvhandoff_agent_retransmits_total",
                 "kvhandoff_agent_peers_lost_total", "kvhandoff_agent_transport_degraded",
                 "kvhandoff_bootstrap_request_seconds_bucket",
                 "kvhandoff_bootstrap_requests_total", "kvhandoff_bootstrap_ranks_missing"):
        assert name in used, name
    # and every counter the agent exports is on the dashboard
    agent_counters = {n for n in exported["agent"] if n.endswith("_total")}
    assert agent_counters <= used, sorted(agent_counters - used)
