"""Hybrid models and the connector at start: vLLM 0.33's own grouping (`get_kv_cache_groups`)
and planning of per-layer specs (full attention, sliding window, Mamba), handed to
`KVHandoffConnector` as vLLM's engine hands them.

- the connector implements ``SupportsHMA`` (vLLM's own check says so), so vLLM keeps its hybrid
  allocator on for it;
- a model whose every layer has one sliding window is one `SlidingWindowSpec` group: accepted,
  its window read (the live pair is tests/live/vllm/test_live_swa.py);
- a model mixing full-attention and sliding-window layers under the hybrid allocator is two
  groups: refused at start, naming ``--disable-hybrid-kv-cache-manager``; with it vLLM makes
  one full-attention group, which starts;
- a Mamba / SSM hybrid is refused at start naming the model and the spec, on both the
  scheduler and the worker side.

The platform here (vLLM's CUDA build without a GPU) turns the hybrid allocator off whatever the
connector says; the tests set it as vLLM sets it on a GPU for a connector that supports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.integrations.vllm.groups import plan_group  # noqa: E402

FULL = FullAttentionSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS,
                         head_size=env.HEAD_SIZE, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS,
                        head_size=env.HEAD_SIZE, dtype=torch.bfloat16, sliding_window=40)
# a Mamba layer's state, padded to the attention page as vLLM pads a hybrid's specs
MAMBA = MambaSpec(block_size=env.BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.bfloat16,),
                  page_size_padded=FULL.page_size_bytes)


def plan(tmp_path: Path, specs: list[Any], *, hybrid: bool, role: str = "kv_consumer"
         ) -> tuple[Any, Any]:
    """vLLM's config and its KV cache plan for the tiny model's layers with `specs`."""
    cfg = env.vllm_config(env.model_dir(tmp_path), role=role, engine_id=env.ENGINE_D)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    per_layer = dict(zip(env.layer_names(), specs, strict=True))
    groups = get_kv_cache_groups(cfg, per_layer)
    return cfg, get_kv_cache_config_from_groups(
        cfg, groups, env.NUM_BLOCKS * FULL.page_size_bytes * env.NUM_LAYERS)


def test_vllm_sees_hma_support(tmp_path: Path) -> None:
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)


def test_sliding_window_model_is_one_group(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [SWA, SWA, SWA], hybrid=True)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [SlidingWindowSpec]
    p = plan_group(kcc)
    assert p.sliding_window == 40 and not p.mla and p.block_size == env.BLOCK_SIZE
    KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)  # starts


def test_full_and_sliding_under_hma_refused(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=True)
    assert len(kcc.kv_cache_groups) > 1  # vLLM's hybrid allocator: groups per kind
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_full_and_sliding_without_hma_starts(tmp_path: Path) -> None:
    cfg, kcc = plan(tmp_path, [FULL, SWA, SWA], hybrid=False)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [FullAttentionSpec]
    assert plan_group(kcc).sliding_window == 0  # moved whole
    KVHandoffConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_mamba_hybrid_refused_naming_model_and_spec(tmp_path: Path,
                                                    role: KVConnectorRole) -> None:
    cfg, kcc = plan(tmp_path, [FULL, MAMBA, MAMBA], hybrid=True)
    assert kcc.has_mamba_layers
    with pytest.raises(ConfigError, match=r"model '.*tiny-llama' has Mamba / SSM state "
                                          r"layers \(\['MambaSpec'\]"):
        KVHandoffConnector(cfg, role, kcc)
