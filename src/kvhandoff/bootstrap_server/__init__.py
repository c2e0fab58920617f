"""bootstrap_server — the HTTP control point: ranks register, rooms are assigned, decode asks
where its prefill is.

`create_app(settings)` builds the FastAPI app (`kvhandoff serve` runs it with uvicorn);
`Registry` is its pure state; `BootstrapClient` / `AsyncBootstrapClient` are what agents use;
`bootstrap_server.background.run_server` runs a real server in a thread. See docs/BOOTSTRAP.md.

The names below are loaded on first use, so importing `kvhandoff.bootstrap_server.client` (what
an agent does) does not import FastAPI or the app.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.bootstrap_server.app import create_app
    from kvhandoff.bootstrap_server.client import AsyncBootstrapClient, BootstrapClient
    from kvhandoff.bootstrap_server.mapping import prefill_axis_ranks, prefill_tp_ranks
    from kvhandoff.bootstrap_server.records import (
        RankKey,
        RegistrationRequest,
        RoomAssignment,
        Topology,
    )
    from kvhandoff.bootstrap_server.registry import Registry
    from kvhandoff.bootstrap_server.schemas import PrefillRankInfo

_WHERE = {
    "AsyncBootstrapClient": "client",
    "BootstrapClient": "client",
    "PrefillRankInfo": "schemas",
    "RankKey": "records",
    "RegistrationRequest": "records",
    "Registry": "registry",
    "RoomAssignment": "records",
    "Topology": "records",
    "create_app": "app",
    "prefill_axis_ranks": "mapping",
    "prefill_tp_ranks": "mapping",
}

__all__ = [
    "AsyncBootstrapClient",
    "BootstrapClient",
    "PrefillRankInfo",
    "RankKey",
    "RegistrationRequest",
    "Registry",
    "RoomAssignment",
    "Topology",
    "create_app",
    "prefill_axis_ranks",
    "prefill_tp_ranks",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
