"""Real vLLM 0.33 objects on CPU for the connector tests: a tiny local Llama-style model config
(a config.json stands in for a hub model), a `VllmConfig` selecting `KVHandoffConnector` by
module path, vLLM's own KV cache planning and allocation (per-layer ``[B, H, N, C]`` views
into one backing tensor), and the byte pattern both sides of a handoff agree on.

Used by the tests in this folder and by `vllm_worker_proc.py` (the prefill process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

NUM_LAYERS = 3
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 64
ENGINE_P = "vllm-prefill"
ENGINE_D = "vllm-decode"

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "head_dim": HEAD_SIZE, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False,
}


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def model_dir(root: Path) -> Path:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def vllm_config(model: Path, *, role: str, engine_id: str, extra: dict[str, Any] | None = None,
                policy: str = "fail", layout: str = "LBHNC", batched_tokens: int = 1024) -> Any:
    """A `VllmConfig` on CPU whose kv_transfer_config loads KVHandoffConnector by module path.

    No model runs here (vLLM 0.33 is a CUDA build; its ops do not load on CPU), so no attention
    layer exists to say which backend writes the caches or to run the layout probe with: the
    extra config names FLASH_ATTN (rows K|V per token and head, the layout these tests write
    through vLLM's views) and the probe is off. The probe itself runs against the CPU build's
    real layers and ops in test_vllm_cpu_probe.py."""
    extra = dict(extra or {})
    extra.setdefault("attention_backend", "FLASH_ATTN")
    if role == "kv_consumer":  # these tests drive the layerwise load unless they name async
        extra.setdefault("load_mode", "layerwise")
    extra["settings"] = {"layout_probe": False, **extra.get("settings", {})}
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=1024, seed=0)
    cfg = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched_tokens,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHandoffConnector",
            kv_connector_module_path="kvhandoff.integrations.vllm",
            kv_role=role, engine_id=engine_id, kv_load_failure_policy=policy,
            kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.kv_cache_layout = layout
    return cfg


def kv_cache_config(cfg: Any, num_blocks: int = NUM_BLOCKS) -> Any:
    """vLLM's own plan for the tiny model: one full-attention group, `num_blocks` blocks."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(layer_names(), spec)]
    # vLLM's block pool keeps block 0 as its null block: num_blocks - 1 are usable
    return get_kv_cache_config_from_groups(cfg, groups,
                                           num_blocks * spec.page_size_bytes * NUM_LAYERS)


def allocate(cfg: Any, kcc: Any) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's worker allocates and registers."""
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(kcc, torch.device("cpu"), layout)


def block_pattern(layer: int, seq_block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of the `seq_block`-th block of the sequence on layer `layer` (uint8)."""
    g = torch.Generator().manual_seed(1_000_003 * (layer + 1) + seq_block)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def as_u8(view: torch.Tensor) -> torch.Tensor:
    """A ``[B, H, N, C]`` view as bytes (the content dim is contiguous in every layout)."""
    return view.view(torch.uint8)


def finished_sending(conn: Any, timeout_s: float) -> set[str]:
    """The requests a prefill worker reports in ``finished_sending``, polled once per engine
    step until it reports some (bounded)."""
    import time

    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not done and time.monotonic() < deadline:
        sent, _ = conn.get_finished(set())
        done |= sent or set()
        time.sleep(0.02)  # one engine step
    return done
