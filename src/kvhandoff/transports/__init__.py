"""Data transports: one small ABC (`base`), backends loaded by name on first use."""

from kvhandoff.transports.base import (
    TAG_LIMIT,
    OnDone,
    OneSidedTransport,
    OnWritten,
    Transport,
    TransportKind,
    TransportStatus,
    WriteResult,
    WriteSpec,
    load_transport,
)

__all__ = ["TAG_LIMIT", "OnDone", "OnWritten", "OneSidedTransport", "Transport", "TransportKind",
           "TransportStatus", "WriteResult", "WriteSpec", "load_transport"]
