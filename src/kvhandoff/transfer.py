"""transfer — the agent API, the one module engines and users import it from: `TransferAgent`
and the `Sender` / `Receiver` handles engines hold.

    from kvhandoff.transfer import TransferAgent

Buffers for tests and simulations come from where they live: `kvhandoff.buffers.bufferset.
allocate`, `kvhandoff.buffers.pool.PagePool`.

Rules: each name here has this one import path outside `kvhandoff.runtime`, which defines them
(threads and I/O); the imports are plain (importing this module starts the agent's
dependencies: ZMQ, the transport base), and a test walks `src/`, `tests/` and `scripts/` to keep
it so.
"""

from __future__ import annotations

from kvhandoff.runtime.agent import TransferAgent
from kvhandoff.runtime.handles import Receiver, Sender

__all__ = ["Receiver", "Sender", "TransferAgent"]
