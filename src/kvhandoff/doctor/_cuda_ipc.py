"""Child side of the CUDA IPC check (``python -m kvhandoff.doctor._cuda_ipc``).

Reads one msgpack map from stdin: the fields of ``UntypedStorage._share_cuda_()`` of the
parent's buffer, its length and the pattern seed. Opens the buffer through CUDA IPC, checks it
holds ``(arange(n) + seed) % 256``, writes ``(arange(n) + seed + 1) % 256`` in place,
synchronizes and prints one msgpack map on stdout: {"ok": bool, "error": str}. The parent then
checks the new bytes.
"""

from __future__ import annotations

import sys

import msgspec


def main() -> int:
    req = msgspec.msgpack.decode(sys.stdin.buffer.read())
    try:
        import torch

        dev = int(req["device"])
        torch.cuda.set_device(dev)
        storage = torch.UntypedStorage._new_shared_cuda(
            dev, req["handle"], int(req["size_bytes"]), int(req["offset_bytes"]),
            req["ref_counter_handle"], int(req["ref_counter_offset"]), req["event_handle"],
            bool(req["event_sync_required"]))
        n = int(req["n"])
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage, 0, (n,), (1,))
        want = (torch.arange(n, device=t.device, dtype=torch.int64) + int(req["seed"])) % 256
        if not torch.equal(t.to(torch.int64), want):
            out = {"ok": False, "error": "the bytes read through CUDA IPC differ from the "
                                         "parent's"}
        else:
            t.copy_(((want + 1) % 256).to(torch.uint8))
            torch.cuda.synchronize(dev)
            out = {"ok": True, "error": ""}
    except Exception as e:  # report, never crash silently: the parent prints this
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    sys.stdout.buffer.write(msgspec.msgpack.encode(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
