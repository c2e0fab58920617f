"""A DSA model's KV (main MLA latent + DSA indexer, MTP layer included) handed off between two
processes through KVHandoffConnector's worker side: a prefill process (`vllm_dsa_proc.py`,
vLLM's block-outermost allocation: one packed row of every cache per block) and the decode in
this process (layer-compact: one buffer per layer cache), each with vLLM's own layers, specs,
grouping, planner and allocator (`vllm_dsa_env`), a real bootstrap server on 127.0.0.1 port 0
and the tcp transport.

Driven as vLLM drives a DSA model: the prefill's forward writes the pages and reports no layer
through ``save_kv_layer`` (vLLM 0.33's DSA attention calls no per-layer hook), the decode calls
no ``wait_for_layer_load``. Room A1 (layerwise) comes from vLLM's own MTP scheduler on the
decode: a local request cached 3 blocks, the remote request extends them, and vLLM rolls the hit
back to 2 blocks (``drop_eagle_block``); it must have landed when ``start_load_kv`` returns, from
the rolled-back hit on (the block vLLM dropped is a fresh block of the table and gets the
prefill's pages; the cached pages, the dropped cached block included, stay untouched). Room A2
(async, a one-block hit) when ``get_finished`` reports it. Byte-exact in every cache of every
layer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_dsa_env as dsa  # noqa: E402
from test_vllm_worker import Child  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.connector import RecvReq  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

WARM = 3 * dsa.BLOCK_SIZE + 8  # A1: the decode's local request, 3 full blocks cached
SEQ1 = 3 * dsa.BLOCK_SIZE + 40  # A1's prompt extends it: 4 blocks, the last one partial
SEQ2, LOCAL2 = 150, 64  # A2: 3 blocks (the last holds 22 tokens), a one-block hit
START_S = 180.0  # the prefill process imports vLLM and builds the layers on a loaded machine
DONE_S = 60.0
MARK = 0xAB
PROC = Path(__file__).with_name("vllm_dsa_proc.py")
SRC = {"A1": [2, 3, 4, 5], "A2": [6, 7, 8]}  # the prefill's blocks
SEQ = {"A1": SEQ1, "A2": SEQ2}


@pytest.fixture
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


def landed(views: dict[str, torch.Tensor], dst: list[int], local: int, seq: int,
           untouched: list[int]) -> None:
    """Every block of the sequence from the hit on byte-exact in every layer cache; the
    `untouched` blocks still hold the marker."""
    bs = dsa.BLOCK_SIZE
    for name, v in views.items():
        u = v.view(torch.uint8)
        shape = tuple(u.shape[1:])
        for b in untouched:
            assert bool((u[b] == MARK).all()), f"{name}: block {b} overwritten"
        for j in range(local // bs, -(-seq // bs)):  # whole pages, the partial last one too
            assert torch.equal(u[dst[j]], dsa.page_pattern(name, j, shape)), (name, j)


@pytest.mark.timeout(420)
def test_two_process_dsa_handoff_suffix_only(bootstrap: str, tmp_path: Path) -> None:
    mdir = dsa.model_dir(tmp_path)
    room = {rid: room_of(dsa.ENGINE_P, rid) for rid in SRC}
    child = Child({"bootstrap_url": bootstrap, "model_dir": str(mdir), "layout": "BLHNC",
                   "scratch": str(tmp_path), "sends": [
                       {"rid": rid, "room": room[rid], "blocks": SRC[rid], "seq": SEQ[rid]}
                       for rid in SRC]}, proc=PROC)
    try:
        cfg = dsa.vllm_config(mdir, role="kv_consumer", engine_id=dsa.ENGINE_D, layout="LBHNC",
                              mtp=True, extra={"settings": {"transport": "tcp",
                                                            "heartbeat_interval_s": 1.0},
                                               "layer_timeout_s": DONE_S})
        specs = dsa.build_layers(cfg, tmp_path, mtp=True)
        kcc = dsa.kv_cache_config(cfg, specs)
        views = dsa.allocate(cfg, kcc)
        conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
        conn.register_kv_caches(views)
        assert conn.layout is not None and not conn.layout.layout.rows
        for v in views.values():
            v.view(torch.uint8).fill_(MARK)
        host, port = split_addr(bootstrap)
        addr = f"{host}:{port}"
        # A1's RecvReq: what vLLM's MTP scheduler hands the workers for this request
        sched = dsa.scheduler(cfg, dsa.kv_cache_config(cfg, specs))
        params = {"do_remote_prefill": True, "remote_room": room["A1"],
                  "remote_bootstrap_addr": addr, "remote_num_tokens": SEQ1,
                  "remote_engine_id": dsa.ENGINE_P, "remote_request_id": "A1"}
        r1, warm, table, sync_loads = dsa.decode_after_local_prefix(sched, warm=WARM,
                                                                    prompt=SEQ1, params=params)
        assert r1.local_tokens == 2 * dsa.BLOCK_SIZE and r1.sync  # rolled back by one block
        assert sync_loads  # so vLLM calls start_load_kv before the forward, as below
        assert table[2] != warm[2]  # the dropped block: a fresh one
        free = sorted(set(range(1, kcc.num_blocks)) - set(warm) - set(table))
        r2 = RecvReq(room=room["A2"], bootstrap_addr=addr, block_ids=free[:3], num_tokens=SEQ2,
                     local_tokens=LOCAL2, load_tokens=SEQ2, sync=False)
        reg = child.expect("registered", START_S)
        assert reg["ok"] and reg["packed"]
        assert reg["regions"] == ["draft_indexer", "draft_kv", "indexer", "kv"]
        with BootstrapClient(bootstrap) as c:  # what the prefill scheduler does per request
            for rid in SRC:
                c.bind_room(room[rid], dsa.ENGINE_P, 0)

        # layerwise: loaded whole before the forward; no per-layer wait follows
        conn.bind_connector_metadata(KVHandoffMetadata(recvs={"A1": r1}))
        conn.start_load_kv(None)  # type: ignore[arg-type]  (the forward context is unused)
        assert conn.get_block_ids_with_load_errors() == set()
        # untouched: the hit's pages, and the warm request's others (its dropped, cached block)
        # unless vLLM handed one to this request
        keep = [b for b in [*table[:2], *warm[2:]] if b not in table[2:]]
        assert warm[2] in keep
        landed(views, table, r1.local_tokens, SEQ1, untouched=keep)
        conn.clear_connector_metadata()

        # async: the load runs between steps; the request comes back through get_finished
        conn.bind_connector_metadata(KVHandoffMetadata(recvs={"A2": r2}))
        conn.start_load_kv(None)  # type: ignore[arg-type]
        conn.clear_connector_metadata()
        recvd: set[str] = set()
        deadline = time.monotonic() + DONE_S
        while "A2" not in recvd and time.monotonic() < deadline:
            _, got = conn.get_finished(set())
            recvd |= got or set()
            time.sleep(0.02)  # one engine step
        assert recvd == {"A2"}
        assert conn.get_block_ids_with_load_errors() == set()
        landed(views, r2.block_ids, LOCAL2, SEQ2, untouched=r2.block_ids[:1])
        fin = child.expect("finished", DONE_S)
        assert fin["rids"] == sorted(SRC)
        conn.shutdown()
    finally:
        child.close()
