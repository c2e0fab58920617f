"""MTP (speculative decoding) with a DSA model: vLLM's scheduler rolls a decode's prefix-cache
hit back by one block (``drop_eagle_block``: the draft head needs the hidden state of the token
before the hit), and the connector's hit length must be that rolled-back one: the decode's
receiver tells the prefill ``decode_prefix_len = local_tokens``, so the prefill sends from it,
and the block vLLM dropped (a fresh block in the request's table) is loaded, not left empty.

vLLM's own `Scheduler` and KV cache manager over the tiny DSA model's plan (`vllm_dsa_env`),
with and without vLLM's MTP speculative config; no processes, no model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_dsa_env as dsa  # noqa: E402

WARM = 3 * dsa.BLOCK_SIZE + 8  # a local request: 3 full blocks cached
PROMPT = 3 * dsa.BLOCK_SIZE + 40  # the remote request extends it: 4 blocks
PARAMS = {"do_remote_prefill": True, "remote_room": 77, "remote_bootstrap_addr": "127.0.0.1:9",
          "remote_num_tokens": PROMPT, "remote_engine_id": dsa.ENGINE_P,
          "remote_request_id": "p"}


@pytest.mark.parametrize("mtp", [False, True])
def test_decode_hit_is_vllms_rolled_back_hit(tmp_path: Path, mtp: bool) -> None:
    cfg = dsa.vllm_config(dsa.model_dir(tmp_path), role="kv_consumer", engine_id=dsa.ENGINE_D,
                          mtp=mtp)
    specs = dsa.build_layers(cfg, tmp_path, mtp=mtp)
    s = dsa.scheduler(cfg, dsa.kv_cache_config(cfg, specs, num_blocks=16))
    assert s.use_eagle_block_drop is mtp
    rv, warm, table, sync_loads = dsa.decode_after_local_prefix(s, warm=WARM, prompt=PROMPT,
                                                    params=dict(PARAMS))
    hit_blocks = 2 if mtp else 3  # MTP: the last cached block of the hit is dropped
    hit = hit_blocks * dsa.BLOCK_SIZE
    # the connector's hit is vLLM's: the receiver's decode_prefix_len, the prefill's start
    assert rv.local_tokens == hit
    assert rv.sync and rv.load_tokens == PROMPT - 1
    assert sync_loads  # vLLM calls start_load_kv before this step's forward
    assert table[:hit_blocks] == warm[:hit_blocks]  # the hit: the cached pages, untouched
    loaded = rv.block_ids[rv.local_tokens // dsa.BLOCK_SIZE: -(-rv.load_tokens // dsa.BLOCK_SIZE)]
    assert loaded == table[hit_blocks:]
    if mtp:  # the dropped block is a fresh one in this table, and the load fills it
        assert table[2] != warm[2] and table[2] in loaded
