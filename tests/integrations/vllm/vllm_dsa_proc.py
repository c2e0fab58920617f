"""The prefill worker of the two-process DSA handoff test: the tiny GLM-5-style model's KV cache
as vLLM plans and allocates it (`vllm_dsa_env`: MLA + indexer caches, block-outermost, MTP
layer included), KVHandoffConnector in the WORKER role, driven as vLLM's model runner drives it
for a DSA model: bind_connector_metadata, the forward writes every layer's main KV and indexer
pages WITHOUT a ``save_kv_layer`` call (vLLM's DSA attention makes none), then wait_for_save /
get_finished.

    python vllm_dsa_proc.py '<json config>'

Config: bootstrap_url, model_dir, scratch, layout, sends: [{"rid", "room", "blocks", "seq"}].
Prints one JSON object per line: registered, finished (the finished_sending ids). Exits when
stdin closes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_dsa_env as dsa  # noqa: E402
from vllm_worker_proc import report_finished, say  # noqa: E402


def main() -> None:
    cfg_in = json.loads(sys.argv[1])
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata
    from kvhandoff.integrations.vllm.connector import SendReq

    cfg = dsa.vllm_config(Path(cfg_in["model_dir"]), role="kv_producer", engine_id=dsa.ENGINE_P,
                          layout=cfg_in["layout"], mtp=True,
                          extra={"bootstrap_url": cfg_in["bootstrap_url"],
                                 "settings": {"transport": "tcp", "heartbeat_interval_s": 1.0}})
    specs = dsa.build_layers(cfg, Path(cfg_in["scratch"]), mtp=True)
    kcc = dsa.kv_cache_config(cfg, specs)
    views = dsa.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(views)
    ok = conn.agent.wait_registered(60)
    say(event="registered", ok=ok, agent=conn.agent.address,
        regions=sorted(r.name for r in conn.layout.layout.regions),
        packed=bool(conn.layout.layout.rows))

    sends = cfg_in["sends"]
    meta = KVHandoffMetadata(sends={s["rid"]: SendReq(room=s["room"], block_ids=s["blocks"],
                                                      num_tokens=s["seq"]) for s in sends})
    conn.bind_connector_metadata(meta)
    for name, v in views.items():  # the forward writes every cache of every layer ...
        u = v.view(torch.uint8)
        for s in sends:
            for j, b in enumerate(s["blocks"]):
                u[b] = dsa.page_pattern(name, j, tuple(u.shape[1:]))
    conn.wait_for_save()  # ... and no layer was reported through save_kv_layer
    done: set[str] = set()
    sent, _ = conn.get_finished(set())
    done |= sent or set()
    conn.clear_connector_metadata()

    report_finished(conn, {s["rid"] for s in sends}, done)


if __name__ == "__main__":
    main()
