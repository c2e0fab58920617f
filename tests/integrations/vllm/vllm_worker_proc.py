"""The prefill worker of the two-process connector test: a real vLLM config and KV cache
(vLLM's planner and allocator, CPU), KVHandoffConnector in the WORKER role, driven the way
vLLM's model runner drives it: bind_connector_metadata, then per layer write the KV and
save_kv_layer, then wait_for_save / get_finished.

    python vllm_worker_proc.py '<json config>'

Config: bootstrap_url, model_dir, transport, layout (vLLM's KV cache layout name), steps: a
list of steps, each
``{"sends": [{"rid", "room", "blocks", "seq"}], "aborts": [rid, ...], "forward": bool}``
(``forward: false``: the step's forward never ran, e.g. the engine step was cut short).
Prints one JSON object per line: registered, step, finished (the finished_sending ids).
Exits when stdin closes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_env as env  # noqa: E402


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def report_finished(conn: object, rids: set[str], done: set[str]) -> None:
    """Polls ``get_finished`` once per engine step, as vLLM does, until every request of `rids`
    was reported in ``finished_sending`` (bounded), says which were, then waits for stdin to
    close and shuts the connector down."""
    deadline = time.monotonic() + 60
    while done != rids and time.monotonic() < deadline:
        sent, _ = conn.get_finished(rids)  # type: ignore[attr-defined]
        done |= sent or set()
        time.sleep(0.02)  # one engine step
    say(event="finished", rids=sorted(done))
    sys.stdin.read()
    conn.shutdown()  # type: ignore[attr-defined]


def main() -> None:
    cfg_in = json.loads(sys.argv[1])
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata
    from kvhandoff.integrations.vllm.connector import SendReq

    cfg = env.vllm_config(Path(cfg_in["model_dir"]), role="kv_producer", engine_id=env.ENGINE_P,
                          extra={"bootstrap_url": cfg_in["bootstrap_url"],
                                 "settings": {"transport": cfg_in["transport"],
                                              "heartbeat_interval_s": 1.0}},
                          layout=cfg_in["layout"])
    kcc = env.kv_cache_config(cfg)
    views = env.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(views)
    ok = conn.agent.wait_registered(60)
    say(event="registered", ok=ok, agent=conn.agent.address)

    all_rids: set[str] = set()
    done: set[str] = set()  # finished_sending, as vLLM's scheduler collects it step by step
    for k, step in enumerate(cfg_in["steps"]):
        meta = KVHandoffMetadata(
            sends={s["rid"]: SendReq(room=s["room"], block_ids=s["blocks"], num_tokens=s["seq"])
                   for s in step["sends"]},
            aborts=dict.fromkeys(step.get("aborts", []), "aborted by the test client"))
        all_rids |= set(meta.sends)
        conn.bind_connector_metadata(meta)
        for layer, name in enumerate(env.layer_names() if step.get("forward", True) else []):
            u = env.as_u8(views[name])
            for s in step["sends"]:  # the forward writes this layer's KV ...
                for j, b in enumerate(s["blocks"]):
                    u[b] = env.block_pattern(layer, j, tuple(u.shape[1:]))
            conn.save_kv_layer(name, views[name], None)  # ... and hands it over
        conn.wait_for_save()
        sent, _ = conn.get_finished(set())
        done |= sent or set()
        conn.clear_connector_metadata()
        say(event="step", step=k)

    # vLLM calls get_finished once per step; the requests finished on the scheduler side
    report_finished(conn, all_rids, done)


if __name__ == "__main__":
    main()
