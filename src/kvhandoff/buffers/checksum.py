"""Checksums of landed bytes, the algorithms: xxh3-64 over the spans of one (layer, region), in
plan order, and the names of the algorithms a room may use (`ChecksumAlg`).

Rules:
- This module computes; it does not decide. Which algorithm a room uses, which layers are
  summed and which checksum modes may pair are the protocol's policy
  (`protocol.checksums`), which imports this module, never the reverse.
- Both sides hash the same logical bytes in the same order (the span plan is shared), so the
  value does not depend on where pages sit. CPU buffers are hashed through memoryviews (no
  copies).
"""

from __future__ import annotations

import enum

import numpy as np
import xxhash


class ChecksumAlg(str, enum.Enum):
    """A room's checksum algorithm (what `HashSpans` / `PostWrite` name)."""

    #: xxh3-64 over host bytes (`span_checksum`)
    XXH3 = "xxh3"
    #: the position-keyed device checksum (`devsum.devsum`), computed where the bytes are; a
    #: host side computes the same value on the CPU
    DEVSUM = "devsum"

    def __str__(self) -> str:
        return self.value


def span_checksum(buf: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> int:
    """xxh3-64 of the concatenation of ``buf[o:o+n]`` for each span, in order."""
    h = xxhash.xxh3_64()
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
    for o, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
        h.update(mv[o:o + n])
    return int(h.intdigest())
