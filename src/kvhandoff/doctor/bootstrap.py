"""Bootstrap server check: does the configured server answer /health and /ready, and what does
/ready report (live/expected ranks, what is missing, degraded ranks)."""

from __future__ import annotations

from typing import Any

import httpx

from .model import CheckResult, Status


def check_bootstrap(url: str | None, *, timeout_s: float = 5.0) -> CheckResult:
    if not url:
        return CheckResult("bootstrap", Status.SKIP, "no bootstrap server configured "
                           "(--bootstrap-url or KVHANDOFF_BOOTSTRAP_URL)", {})
    base = url.rstrip("/")
    details: dict[str, Any] = {"url": base}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            h = client.get(base + "/health")
            details["health"] = {"status": h.status_code, "body": h.text[:200]}
            if h.status_code != 200:
                return CheckResult("bootstrap", Status.FAIL, f"{base}/health answered "
                                   f"{h.status_code}: {h.text[:120]!r}", details,
                                   fix="is this a kvhandoff bootstrap server? check the URL and "
                                   "the server's log")
            r = client.get(base + "/ready")
    except httpx.HTTPError as e:
        return CheckResult("bootstrap", Status.FAIL, f"{base} does not answer: "
                           f"{type(e).__name__}: {e}", details,
                           fix="start it (`kvhandoff serve`, the sidecar) or fix "
                           "KVHANDOFF_BOOTSTRAP_URL")
    try:
        ready: dict[str, Any] = r.json()
    except ValueError:
        ready = {}
    details["ready"] = {"status": r.status_code, "body": ready or r.text[:200]}
    if r.status_code not in (200, 503) or not isinstance(ready.get("ready"), bool):
        return CheckResult("bootstrap", Status.FAIL, f"{base}/ready answered {r.status_code} "
                           f"without a readiness report: {r.text[:120]!r}", details,
                           fix="is this a kvhandoff bootstrap server (same version)?")
    live, expected = ready.get("live_ranks"), ready.get("expected_ranks")
    engines = ready.get("engines") or []
    degraded = ready.get("degraded") or []
    counts = f"{live}/{expected} ranks live, {len(engines)} engine(s)"
    if degraded:
        counts += f", degraded (tcp): {', '.join(map(str, degraded))}"
    if ready["ready"]:
        return CheckResult("bootstrap", Status.OK if not degraded else Status.WARN,
                           f"{base}: /health OK, /ready 200: {counts}", details,
                           fix=None if not degraded else
                           "the degraded ranks fell back to tcp: see the rdma/ucx checks on "
                           "their nodes")
    return CheckResult("bootstrap", Status.WARN, f"{base}: /health OK, /ready "
                       f"{r.status_code}: {ready.get('reason', '')} ({counts})", details,
                       fix="start the engines' ranks (not ready until every expected rank is "
                       "registered and heartbeating)")
