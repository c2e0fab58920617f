"""transfer — the agent API, the one module engines and users import it from: `TransferAgent`,
the `Sender` / `Receiver` handles engines hold, `PagePool` and `allocate` (buffers for tests and
simulations).

    from kvhandoff.transfer import TransferAgent, allocate

Rules: each name here has this one import path outside the packages that define it
(`kvhandoff.runtime`: threads and I/O; `kvhandoff.buffers`: memory and checksums); the imports
are plain (importing this module starts the agent's dependencies: ZMQ, the transport base),
and a test walks `src/` to keep it so.
"""

from __future__ import annotations

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.pool import PagePool
from kvhandoff.runtime.agent import TransferAgent
from kvhandoff.runtime.handles import Receiver, Sender

__all__ = ["PagePool", "Receiver", "Sender", "TransferAgent", "allocate"]
