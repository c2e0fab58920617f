"""Bench (not a test): one GLM-5.3 request (78 layers x 656 B/token main KV, 21 indexer layers
x 132 B/token, page 64, 4,096 tokens sent in 4 chunks) through the real SGLang classes and the
kvhandoff backend, prefill and decode as two processes on this machine; the baseline in the same
run is a plain in-process copy (torch index_select) of the same pages.

    .venv/bin/python tests/integrations/sglang/bench_sglang_pair.py [ucx|tcp|shm] [forward_s]

`forward_s` (default 0): a pause before each chunk after the first, standing for that chunk's
forward pass (chunked prefill streams earlier chunks meanwhile; 0: chunks back to back).

Prints the tail (last chunk's send() -> prefill poll() Success), its GB/s, the copy's GB/s and
the ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    transport = sys.argv[1] if len(sys.argv) > 1 else "ucx"
    forward_s = sys.argv[2] if len(sys.argv) > 2 else "0"
    sys.path.insert(0, str(HERE))
    import sglang_env

    sglang_env.import_sglang(scheduler_modules=False)
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    os.environ.pop("KVHANDOFF_BOOTSTRAP_URL", None)
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    env = dict(os.environ, PYTHONPATH=str(HERE), KVHANDOFF_TRANSPORT=transport,
               KVH_SGLANG_SHAPE="glm-5.3", KVH_BENCH_FORWARD_S=forward_s,
               SGLANG_HOST_IP="127.0.0.1")
    try:
        procs = [subprocess.Popen([sys.executable, str(HERE / "sglang_worker.py"), role,
                                   str(srv.port)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for role in ("prefill", "decode")]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        srv.close()
    res = {}
    for text in outs:
        for line in text.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                res[(r["side"], r.get("name", "ready"))] = r
    pre, dec = res.get(("prefill", "bench")), res.get(("decode", "bench"))
    if pre is None or dec is None or dec.get("bad") != []:
        print(outs[0][-3000:], outs[1][-3000:])
        raise SystemExit("bench failed")
    gb = pre["bytes"] / 1e9
    print(f"transport {transport}, forward {forward_s} s per chunk: {pre['bytes']:,} B of KV "
          f"(main + indexer, byte-exact on decode) in {pre['tail_s']:.3f} s after the last "
          f"chunk = {gb / pre['tail_s']:.2f} GB/s; same pages copied in-process: "
          f"{pre['memcpy_s']:.3f} s = {gb / pre['memcpy_s']:.2f} GB/s; "
          f"ratio {pre['tail_s'] / pre['memcpy_s']:.1f}x")


if __name__ == "__main__":
    main()
