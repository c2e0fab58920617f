"""An auto-transport peer in a separate process, driven by JSON lines on stdin (no pickle).

Usage: python auto_peer_proc.py CROSS_KIND BUF_BYTES HOST
Registers one zeroed buffer "kv". HOST "same" prints its real address; "other" prints it with
another host identity (as if it ran on another host), so the parent routes it cross-host.
Lines out: {"address": hex, "descriptor": hex}, {"connected": route}, {"digest": hex of the
bytes of a span list of "kv"}, {"posted": tag}, {"done": tag, "error": str|null},
{"status": {"lanes": [...], "degraded": bool}}, {"closed": true}.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import xxhash

from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport
from kvhandoff.transports.auto import AutoTransport, decode_address, encode_address

OTHER_HOST = b"\xee" * 16


def as_other_host(address: bytes) -> bytes:
    a = decode_address(address)
    return encode_address(OTHER_HOST, a.shm, a.cross_kind, a.cross, pidns=a.pidns)


def main() -> None:
    cross, size, host = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tr = load_transport("auto", Settings(auto_cross_host=cross, chunk_bytes=64 << 10))
    assert isinstance(tr, AutoTransport)
    buf = np.zeros(size, np.uint8)
    tr.register("kv", buf)
    lock = threading.Lock()

    def say(obj: object) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    address = tr.address if host == "same" else as_other_host(tr.address)
    say({"address": address.hex(), "descriptor": tr.describe("kv").hex()})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "connect":
            tr.connect("parent", bytes.fromhex(msg["address"]))
            say({"connected": tr.route("parent")})
        elif msg["cmd"] == "digest":
            h = xxhash.xxh3_64()
            for o, n in zip(msg["offsets"], msg["nbytes"], strict=True):
                h.update(buf[o:o + n].data)
            say({"digest": h.hexdigest()})
        elif msg["cmd"] == "recv":
            tag = msg["tag"]

            def done(exc: BaseException | None, tag: int = tag) -> None:
                say({"done": tag, "error": None if exc is None else str(exc)})

            tr.post_recv("parent", tag, "kv", np.asarray(msg["offsets"], np.int64),
                         np.asarray(msg["nbytes"], np.int64), done)
            say({"posted": tag})
        elif msg["cmd"] == "status":
            st = tr.status()
            say({"status": {"lanes": list(st.lanes), "degraded": st.degraded}})
        elif msg["cmd"] == "exit":
            break
    tr.close()
    say({"closed": True})


if __name__ == "__main__":
    main()
