"""A DSA decode's loaded blocks are not in vLLM's zeroing list: vLLM 0.33's own `Scheduler` over
the tiny GLM-5-style DSA model's plan (vllm_dsa_env: MLA bf16 + indexer uint8 caches: a KV
cache of mixed precisions, whose new blocks vLLM zeroes, ``needs_kv_cache_zeroing``).

vLLM zeroes the blocks listed in ``SchedulerOutput.new_block_ids_to_zero`` on the compute stream
before the step's forward. For an async load it leaves the external blocks out itself
(``get_loaded_kv_cache_group_ids``); for a layerwise (synchronous) load it lists them, and the
prefill's writes, which start once the connector opens the room, could land before the zeroing
ran. The connector takes this step's layerwise loads' blocks out of the list it is handed in
``build_connector_meta`` (the output vLLM built, before the workers see it); the blocks the step
computes itself (the local request's, the block of the remote request's last prompt token
beyond the loaded pages) stay listed. Without that, the layerwise case fails ("loaded blocks
[1, 2, 3] zeroed").

Found: vLLM 0.33's engine core hands its scheduler a config that keeps one spec of the DSA
group (``generate_scheduler_kv_cache_config``), so today it zeroes no DSA block at all (first
test); the others switch vLLM's scheduler to zeroing, as it runs for a group of both
precisions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_dsa_env as dsa  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_room": 91, "remote_bootstrap_addr": "127.0.0.1:9",
          "remote_engine_id": dsa.ENGINE_P, "remote_request_id": "p"}


def zeroing_scheduler(cfg: Any, kcc: Any) -> Any:
    """vLLM's `Scheduler` as the engine core builds it, switched to zeroing new blocks as it
    does for a KV cache of mixed precisions: the two flags vLLM derives from the config it
    would get if it kept both specs of the group (``needs_kv_cache_zeroing``, and each block
    manager's ``_record_new_block_ids``); vLLM's own allocation then lists the blocks."""
    s = dsa.scheduler(cfg, kcc)
    assert kcc.needs_kv_cache_zeroing  # the workers' plan: two precisions in one group
    s.needs_kv_cache_zeroing = True
    for mgr in s.kv_cache_manager.coordinator.single_type_managers:
        mgr._record_new_block_ids = True
    return s


def test_engine_scheduler_zeroes_no_dsa_block(tmp_path: Path) -> None:
    # what vLLM 0.33's engine core builds: its scheduler's config keeps one spec of the group
    # (generate_scheduler_kv_cache_config), so it sees one precision and zeroes nothing. The
    # test below covers the day it sees both.
    cfg = dsa.vllm_config(dsa.model_dir(tmp_path), role="kv_consumer", engine_id=dsa.ENGINE_D)
    s = dsa.scheduler(cfg, dsa.kv_cache_config(cfg, dsa.build_layers(cfg, tmp_path),
                                               num_blocks=16))
    assert not s.needs_kv_cache_zeroing
    s.add_request(dsa.request("local", list(range(3, 43))))
    assert s.schedule().new_block_ids_to_zero is None


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_loaded_blocks_not_zeroed(tmp_path: Path, mode: str) -> None:
    cfg = dsa.vllm_config(dsa.model_dir(tmp_path), role="kv_consumer", engine_id=dsa.ENGINE_D,
                          extra={"load_mode": mode})
    specs = dsa.build_layers(cfg, tmp_path)
    s = zeroing_scheduler(cfg, dsa.kv_cache_config(cfg, specs, num_blocks=16))
    prompt = 3 * dsa.BLOCK_SIZE + 1  # layerwise: loads 3 blocks, computes the 4th's token
    s.add_request(dsa.request("remote", [(5 * i + 3) % 250 + 3 for i in range(prompt)],
                              {**PARAMS, "remote_num_tokens": prompt}))
    s.add_request(dsa.request("local", [(3 * i + 7) % 250 + 3 for i in range(40)]))
    out = s.schedule()
    zeroed = set(out.new_block_ids_to_zero or ())
    local = set(s.kv_cache_manager.get_block_ids("local")[0])
    assert local and local <= zeroed  # vLLM zeroes what the step computes
    rv = out.kv_connector_metadata.recvs["remote"]
    bs = dsa.BLOCK_SIZE
    loaded = rv.block_ids[rv.local_tokens // bs: -(-rv.load_tokens // bs)]
    # layerwise: 3 blocks loaded, the 4th's one token computed here; async: all 4 loaded
    assert len(loaded) == (3 if mode == "layerwise" else 4)
    assert not zeroed & set(loaded), f"loaded blocks {sorted(zeroed & set(loaded))} zeroed"
    if mode == "layerwise":
        # the block of the last prompt token, computed in this step, is zeroed first
        table = s.kv_cache_manager.get_block_ids("remote")[0]
        assert rv.sync and table[3] in zeroed
