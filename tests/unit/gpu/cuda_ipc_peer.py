"""Child process of the CUDA IPC GPU tests (``python cuda_ipc_peer.py``): reads one msgpack map
on stdin: the parent's buffer descriptors (`IpcExport.encode()`), per buffer a source span
list of this process's pattern buffer and the destination span list in the parent's buffer.
Opens each parent buffer through `PeerBlocks`, copies with `copy_spans`, waits on the returned
events, and prints one msgpack map: {"ok", "error", "opens", "digests"} (the device checksum of
each source stream, which the parent compares with its destination's)."""

from __future__ import annotations

import sys

import msgspec
import numpy as np


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main() -> int:
    req = msgspec.msgpack.decode(sys.stdin.buffer.read())
    out: dict[str, object]
    try:
        import torch

        from kvhandoff.buffers.devsum import devsum
        from kvhandoff.kv_layout import pair_spans
        from kvhandoff.transports.shm.cuda_ipc import (
            PeerBlocks,
            copy_spans,
            decode_export,
        )

        dev = int(req["device"])
        torch.cuda.set_device(dev)
        src = torch.from_numpy(pattern(int(req["seed"]), int(req["src_bytes"]))).cuda(dev)
        blocks = PeerBlocks()
        events, digests = [], []
        for item in req["items"]:
            exp = decode_export(item["desc"])
            dst = blocks.open("parent", exp)
            assert dst.numel() == exp.nbytes and dst.dtype == torch.uint8
            plan = pair_spans(item["src_off"], item["src_nb"], item["dst_off"], item["dst_nb"])
            events.append(copy_spans(src, dst, plan, small=int(req["small"])))
            digests.append(devsum(src, item["src_off"], item["src_nb"]))
        for e in events:
            e.synchronize()
        out = {"ok": True, "error": "", "opens": blocks.opens, "digests": digests}
    except Exception as e:  # report to the parent, which fails the test with it
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "opens": 0, "digests": []}
    sys.stdout.buffer.write(msgspec.msgpack.encode(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
