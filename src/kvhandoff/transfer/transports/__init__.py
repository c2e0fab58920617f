"""Data transports of kvhandoff.transfer: one small ABC, backends loaded by name on first use."""

from .base import (
    TAG_LIMIT,
    OnDone,
    OnWritten,
    Transport,
    TransportKind,
    TransportStatus,
    load_transport,
)

__all__ = ["TAG_LIMIT", "OnDone", "OnWritten", "Transport", "TransportKind", "TransportStatus",
           "load_transport"]
