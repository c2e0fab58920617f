"""transfer — the agents that move the bytes: control channel (ZMQ), data transports (UCX, TCP,
in-process), per-layer pipeline, checksums, leases, abort."""

from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.transfer.buffers import allocate
from kvhandoff.transfer.pool import PagePool
from kvhandoff.transfer.rooms import Receiver, Sender

__all__ = ["PagePool", "Receiver", "Sender", "TransferAgent", "allocate"]
