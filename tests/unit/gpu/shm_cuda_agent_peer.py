"""Child process of test_shm_cuda_handoff.py (``python shm_cuda_agent_peer.py``): one transfer
agent with CUDA buffers over the shm transport, talking JSON lines with the parent.

stdin line 1: {"role", "room", "seq", "num_pages", "pages", "seed", "die_after": layer index
or -1}. The agent starts and prints {"address"}. A prefill writes the pattern of `seed` into
`pages`, opens its sender and marks every layer ready behind a CUDA event; a decode reads one
more line {"peer"} (the prefill's control address), opens its receiver into `pages`, and with
`die_after` >= 0 kills itself (SIGKILL) once that layer landed. Then it prints {"state",
"one_sided", "lanes", "bad"} (bad: bytes of the decode's pages that differ from the pattern),
waits for stdin to close and closes the agent."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import numpy as np

WAIT_S = 60.0


def tiny_layout() -> Any:
    from kvhandoff.kv_layout.presets import mla_dsa_layout

    return mla_dsa_layout(model="tiny", num_layers=6, indexer_layer_ids=(0, 3, 5),
                          page_size_tokens=16).without_page_rules()


def layers_of(layout: Any) -> list[int]:
    return sorted({lid for reg in layout.regions for lid in reg.layer_ids})


def fill(bufs: dict[str, Any], layout: Any, pages: np.ndarray, seq: int, seed: int) -> None:
    """Writes the token pattern of `seed` into `pages` of every CUDA buffer."""
    import torch

    from kvhandoff.engine_sim.pattern import write_tokens

    for ri, reg in enumerate(layout.regions):
        for lid in reg.layer_ids:
            t = bufs[reg.name][lid]
            if t.numel():
                host = t.cpu().numpy()
                write_tokens(host, layout, ri, lid, pages, 0, seq, seed)
                t.copy_(torch.from_numpy(host))


def bad_bytes(bufs: dict[str, Any], layout: Any, pages: np.ndarray, seq: int,
              seed: int) -> int:
    from kvhandoff.engine_sim.pattern import check_tokens

    return sum(check_tokens(bufs[reg.name][lid].cpu().numpy(), layout, ri, lid, pages, 0,
                            seq, seed)
               for ri, reg in enumerate(layout.regions) for lid in reg.layer_ids
               if bufs[reg.name][lid].numel())


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    import torch

    from kvhandoff.buffers.bufferset import allocate
    from kvhandoff.settings import Settings
    from kvhandoff.transfer import TransferAgent

    cfg = json.loads(sys.stdin.readline())
    layout = tiny_layout()
    pages = np.asarray(cfg["pages"], dtype=np.int64)
    seq, seed, room = int(cfg["seq"]), int(cfg["seed"]), int(cfg["room"])
    bufs = allocate(layout, int(cfg["num_pages"]), device="cuda")
    if cfg["role"] == "prefill":
        fill(bufs, layout, pages, seq, seed)
    torch.cuda.synchronize()
    agent = TransferAgent(cfg["role"], layout, bufs,
                          Settings(transport="shm", heartbeat_interval_s=0.2),
                          engine_id=f"gpu-child-{cfg['role']}")
    say({"address": agent.address})
    try:
        if cfg["role"] == "prefill":
            handle: Any = agent.sender(room, pages=pages, seq_len=seq)
            for lid in layers_of(layout):
                ev = torch.cuda.Event()
                ev.record()
                handle.layer_ready(lid, ev)
        else:
            peer = json.loads(sys.stdin.readline())["peer"]
            handle = agent.receiver(room, peer=peer)
            handle.init(pages, seq, 0)
            die_after = int(cfg.get("die_after", -1))
            if die_after >= 0:
                lid = layers_of(layout)[die_after]
                if handle.wait_for_layer(lid, WAIT_S):
                    os.kill(os.getpid(), signal.SIGKILL)
        state = handle.wait(WAIT_S)
        stats = handle.stats()
        say({"state": state.name, "one_sided": bool(stats.get("one_sided")),
             "lanes": list(agent.transport.status().lanes),
             "bad": bad_bytes(bufs, layout, pages, seq, seed)
             if cfg["role"] == "decode" else 0})
        sys.stdin.read()  # the parent closes stdin once it is done with us
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
