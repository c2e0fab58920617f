"""transfer — the agents that move the bytes: control channel (ZMQ), data transports (UCX, TCP,
in-process), per-layer pipeline, checksums, leases, abort.

The names below are loaded on first use, so importing a pure part (`transfer.session`,
`transfer.protocol`, ...) does not pull in ZMQ or a transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.transfer.agent import TransferAgent
    from kvhandoff.transfer.buffers import allocate
    from kvhandoff.transfer.handles import Receiver, Sender
    from kvhandoff.transfer.pool import PagePool

_WHERE = {"TransferAgent": "agent", "allocate": "buffers", "Receiver": "handles",
          "Sender": "handles", "PagePool": "pool"}

__all__ = ["PagePool", "Receiver", "Sender", "TransferAgent", "allocate"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvhandoff.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvhandoff.transfer.{where}"), name)
