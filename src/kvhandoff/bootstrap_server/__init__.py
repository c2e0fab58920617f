"""bootstrap_server — the HTTP control point: ranks register, rooms are assigned, decode asks
where its prefill is.

`create_app(settings)` builds the FastAPI app (`kvhandoff serve` runs it with uvicorn);
`Registry` is its pure state; `BootstrapClient` / `AsyncBootstrapClient` are what agents use;
`kvhandoff.bootstrap_server.testing.run_server` runs a real server in a thread. See
docs/BOOTSTRAP.md.
"""

from kvhandoff.bootstrap_server.app import create_app
from kvhandoff.bootstrap_server.client import AsyncBootstrapClient, BootstrapClient
from kvhandoff.bootstrap_server.mapping import prefill_axis_ranks, prefill_tp_ranks
from kvhandoff.bootstrap_server.registry import (
    RankKey,
    Registration,
    Registry,
    RoomState,
    Topology,
)
from kvhandoff.bootstrap_server.schemas import PrefillRankInfo

__all__ = [
    "AsyncBootstrapClient",
    "BootstrapClient",
    "PrefillRankInfo",
    "RankKey",
    "Registration",
    "Registry",
    "RoomState",
    "Topology",
    "create_app",
    "prefill_axis_ranks",
    "prefill_tp_ranks",
]
