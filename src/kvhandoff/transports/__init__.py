"""Data transports: one small ABC (`base`), backends loaded by name on first use."""

from kvhandoff.transports.base import (
    TAG_LIMIT,
    OnDone,
    OneSidedTransport,
    OnWritten,
    OnWrittenMany,
    Transport,
    TransportKind,
    TransportStatus,
    WriteSpec,
    load_transport,
)

__all__ = ["TAG_LIMIT", "OnDone", "OnWritten", "OnWrittenMany", "OneSidedTransport", "Transport",
           "TransportKind", "TransportStatus", "WriteSpec", "load_transport"]
