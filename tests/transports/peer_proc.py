"""A transport peer in a separate process, driven by JSON lines on stdin (no pickle).

Usage: python peer_proc.py KIND CHUNK_BYTES BUF_BYTES SEED
Sends read buffer "out" (numpy default_rng(SEED) bytes, which the parent can rebuild);
receives land in buffer "in" (a kvhandoff shared segment when KIND is "shm-map").
Lines out: {"address": hex}, {"connected": true}, {"posted": tag}, {"done": tag, "error": str|null,
"digest": hex of the bytes of the span list (receives)}, {"status": {"lanes": [...]}},
{"describe": {"descriptor": hex}} (buffer "in", for a one-sided writer).
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import xxhash

from kvhandoff.buffers.shared import SharedSegment
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport


def content(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> None:
    kind, chunk, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    tr = load_transport(kind.split("-")[0],
                        Settings(chunk_bytes=chunk, ucx_same_host_error_handling=False))
    out = content(seed, size)  # sends read this
    # receives land here
    buf = SharedSegment(size).array if kind == "shm-map" else np.zeros(size, np.uint8)
    tr.register("out", out)
    tr.register("in", buf)
    out_lock = threading.Lock()

    def say(obj: object) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    say({"address": tr.address.hex()})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "connect":
            tr.connect("parent", bytes.fromhex(msg["address"]))
            say({"connected": True})
        elif msg["cmd"] in ("send", "recv"):
            tag = msg["tag"]
            off = np.asarray(msg["offsets"], dtype=np.int64)
            nb = np.asarray(msg["nbytes"], dtype=np.int64)

            def done(exc: BaseException | None, tag: int = tag, off: np.ndarray = off,
                     nb: np.ndarray = nb, recv: bool = msg["cmd"] == "recv") -> None:
                digest = None
                if recv and exc is None:
                    h = xxhash.xxh3_64()
                    for o, n in zip(off.tolist(), nb.tolist(), strict=True):
                        h.update(buf[o:o + n].data)
                    digest = h.hexdigest()
                say({"done": tag, "error": None if exc is None else str(exc), "digest": digest})

            if msg["cmd"] == "recv":
                tr.post_recv("parent", tag, "in", off, nb, done)
            else:
                tr.post_send("parent", tag, "out", off, nb, done)
            say({"posted": tag})
        elif msg["cmd"] == "describe":
            say({"describe": {"descriptor": tr.describe("in").hex()}})
        elif msg["cmd"] == "status":
            say({"status": {"lanes": list(tr.status().lanes)}})
        elif msg["cmd"] == "exit":
            break
    tr.close()
    say({"closed": True})


if __name__ == "__main__":
    main()
