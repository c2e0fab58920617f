"""A third process holding a canary buffer: prints its pid and the buffer's address as one JSON
line, then, for each line read, one JSON line saying whether the canary is still untouched."""

from __future__ import annotations

import json
import sys

import numpy as np

PATTERN = 0xA5


def main() -> None:
    canary = np.full(1 << 16, PATTERN, dtype=np.uint8)
    print(json.dumps({"pid": __import__("os").getpid(), "addr": int(canary.ctypes.data),
                      "nbytes": int(canary.size)}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"untouched": bool((canary == PATTERN).all())}), flush=True)


if __name__ == "__main__":
    main()
