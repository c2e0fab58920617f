"""Checksums of landed bytes: xxh3-64 over the spans of one (layer, region), in plan order.

Both sides hash the same logical bytes in the same order (the span plan is shared), so the
value does not depend on where pages sit. CPU buffers are hashed through memoryviews (no
copies). `sampled` mode hashes every `SAMPLE_EVERY`-th layer (and always the last one).
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvhandoff.settings import ChecksumMode

SAMPLE_EVERY = 8


def span_checksum(buf: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> int:
    """xxh3-64 of the concatenation of ``buf[o:o+n]`` for each span, in order."""
    h = xxhash.xxh3_64()
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
    for o, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
        h.update(mv[o:o + n])
    return int(h.intdigest())


def wants_checksum(mode: ChecksumMode, layer_index: int, num_layers: int) -> bool:
    """Whether the layer at position `layer_index` (0-based, in layer order) is hashed."""
    if mode is ChecksumMode.OFF:
        return False
    if mode is ChecksumMode.FULL:
        return True
    return layer_index % SAMPLE_EVERY == 0 or layer_index == num_layers - 1
