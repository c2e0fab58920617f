"""What the bootstrap server writes per request: uvicorn's access line, and a warning when slow.

Rules: SGLang's decode asks ``GET /route`` for its prefill rank on every request, thousands of
times a second, so by default (``route_access_log`` off) a ``GET /route`` answer gets no access
line unless it is an error (status 400 or above); every other request keeps uvicorn's access
line at log level ``info``, as uvicorn writes it. A request slower than ``slow_request_s``, on
any route, is logged as a warning with its duration by the layer that answered it (the fast
path or the metrics middleware), whatever the access-log setting.

An access line has uvicorn's five arguments (client, method, path with query, HTTP version,
status): uvicorn's ``AccessFormatter`` unpacks exactly those, and a record with other arguments
becomes a ``--- Logging error ---`` traceback instead of a line. `RouteAccessFilter` drops the
quiet lines uvicorn itself writes (a ``GET /route`` that went through FastAPI, e.g. pipelined);
the fast path asks `AccessPolicy.logs` before it builds a record at all.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhandoff.settings import Settings

ACCESS_LOGGER = "uvicorn.access"
ACCESS_FORMAT = '%s - "%s %s HTTP/%s" %d'

log = logging.getLogger("kvhandoff.bootstrap_server")


def is_route(target: str) -> bool:
    """True for SGLang's lookup path, ``/route`` with or without a query."""
    return target == "/route" or target.startswith("/route?")


class AccessPolicy:
    """Which answers get an access line and which count as slow (see the module rules)."""

    __slots__ = ("route_access_log", "slow_request_s")

    def __init__(self, *, route_access_log: bool = False, slow_request_s: float = 1.0) -> None:
        self.route_access_log = route_access_log
        self.slow_request_s = slow_request_s

    @classmethod
    def from_settings(cls, settings: Settings) -> AccessPolicy:
        """The policy of ``route_access_log`` and ``slow_request_s``."""
        return cls(route_access_log=settings.route_access_log,
                   slow_request_s=settings.slow_request_s)

    def __repr__(self) -> str:
        return (f"AccessPolicy(route_access_log={self.route_access_log}, "
                f"slow_request_s={self.slow_request_s})")

    def logs(self, method: str, target: str, status: int) -> bool:
        """Whether the answer ``status`` to ``method target`` gets an access line."""
        return method != "GET" or not is_route(target) or self.logs_route(status)

    def logs_route(self, status: int) -> bool:
        """Whether a ``GET /route`` answer with ``status`` gets an access line."""
        return self.route_access_log or status >= 400

    def check_slow(self, method: str, target: str, status: int, seconds: float) -> None:
        """Log a warning when the request took ``slow_request_s`` or longer."""
        if seconds >= self.slow_request_s:
            log.warning("slow request: %s %s answered %d after %.3f s (slow_request_s=%g)",
                        method, target, status, seconds, self.slow_request_s)


class RouteAccessFilter(logging.Filter):
    """On uvicorn's access logger: drops the lines `AccessPolicy` keeps quiet."""

    def __init__(self, policy: AccessPolicy) -> None:
        super().__init__()
        self.policy = policy

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True  # not an access line of the known shape: never hide it
        _, method, target, _, status = args
        try:
            return self.policy.logs(str(method), str(target), int(status))  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return True


def install(policy: AccessPolicy) -> RouteAccessFilter:
    """Put a `RouteAccessFilter` on uvicorn's access logger (after uvicorn configured logging)."""
    f = RouteAccessFilter(policy)
    logging.getLogger(ACCESS_LOGGER).addFilter(f)
    return f
