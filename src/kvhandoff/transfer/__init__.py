"""transfer — the public face of the transfer agent: `TransferAgent`, the `Sender` / `Receiver`
handles engines hold, `PagePool` and `allocate` (buffers for tests and simulations).

The code lives in `kvhandoff.protocol` (sans-IO), `kvhandoff.runtime` (threads and I/O),
`kvhandoff.buffers` (memory and checksums) and `kvhandoff.transports` (data transports); these
names are loaded on first use, so importing this package pulls in no ZMQ and no transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.buffers.bufferset import allocate
    from kvhandoff.buffers.pool import PagePool
    from kvhandoff.runtime.agent import TransferAgent
    from kvhandoff.runtime.handles import Receiver, Sender

_WHERE = {"TransferAgent": "runtime.agent", "allocate": "buffers.bufferset",
          "Receiver": "runtime.handles", "Sender": "runtime.handles", "PagePool": "buffers.pool"}

__all__ = ["PagePool", "Receiver", "Sender", "TransferAgent", "allocate"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvhandoff.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvhandoff.{where}"), name)
