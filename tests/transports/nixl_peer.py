"""A nixl transport in a separate process, the target of one-sided writes (JSON lines on stdin,
no pickle).

Usage: python nixl_peer.py BUF_BYTES
Registers a zeroed buffer "in" of BUF_BYTES. Lines out: {"address": hex, "descriptor": hex}
first, then {"connected": true}, {"digest": hex of xxh3-64 over the asked spans of "in"},
{"closed": true}.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import xxhash

from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport


def main() -> None:
    size = int(sys.argv[1])
    tr = load_transport("nixl", Settings())
    buf = np.zeros(size, np.uint8)
    tr.register("in", buf)

    def say(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"address": tr.address.hex(), "descriptor": tr.describe("in").hex()})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "connect":
            tr.connect("parent", bytes.fromhex(msg["address"]))
            say({"connected": True})
        elif msg["cmd"] == "digest":
            h = xxhash.xxh3_64()
            for o, n in zip(msg["offsets"], msg["nbytes"], strict=True):
                h.update(buf[o:o + n].data)
            say({"digest": h.hexdigest()})
        elif msg["cmd"] == "exit":
            break
    tr.close()
    say({"closed": True})


if __name__ == "__main__":
    main()
