"""SGLang's own scheduler-side disaggregation queues on CPU, so that SGLang's code builds the
``KVArgs`` of both sides and constructs the kvhandoff manager with them.

`prefill_queue` builds SGLang's ``PrefillBootstrapQueue`` and `decode_queues` its
``DecodeTransferQueue`` and ``DecodePreallocQueue``; their constructors call their own
``_init_kv_manager``, which fills ``KVArgs`` from the pools and ``get_kv_class``-es our manager.
What they are given is real where SGLang has it on CPU: the KV pools (``MHATokenToKVPool``,
``MLATokenToKVPool``, ``DSATokenToKVPool``), ``PagedTokenToKVPoolAllocator``,
``ReqToTokenPool``, ``MetadataBuffers`` with ``ReqToMetadataIdxAllocator``, the ``ServerArgs``
and a ``ModelConfig`` parsed by SGLang from a ``config.json`` (`model_config`). The scheduler
itself (a GPU process) is a stand-in whose every field is named with the line of SGLang 0.5.23
that reads it (`_prefill_scheduler`, `_decode_scheduler`); nothing of ``KVArgs`` is set here.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# a Llama-shaped dense model (GQA: 8 query heads, 4 KV heads of 16), 3 layers
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 16, "num_hidden_layers": 3, "vocab_size": 256,
         "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def model_config(hf_config: dict[str, Any]) -> Any:
    """SGLang's ``ModelConfig`` of a model whose ``config.json`` is `hf_config`."""
    from sglang.srt.configs.model_config import ModelConfig

    d = Path(tempfile.mkdtemp(prefix="kvh-sglang-model-"))
    (d / "config.json").write_text(json.dumps(hf_config))
    return ModelConfig(str(d))


# a DeepSeek-V3-shaped MLA model (latent 512 + rope 64), 6 layers
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 6,
            "vocab_size": 256, "max_position_embeddings": 4096, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "q_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "first_k_dense_replace": 6, "torch_dtype": "bfloat16"}
# a GLM-5-shaped DSA model: DeepSeek's attention plus the DSA indexer
GLM_DSA = dict(DEEPSEEK, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
               index_topk=64, index_head_dim=128, index_n_heads=4)


def mla_pool(mc: Any, *, pages: int, page: int, layers: int | None = None) -> Any:
    """``MLATokenToKVPool`` (bf16) of `mc` (`layers`: another layer count, e.g. a draft's)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=pages * page, page_size=page, dtype=torch.bfloat16,
                            kv_lora_rank=mc.kv_lora_rank, qk_rope_head_dim=mc.qk_rope_head_dim,
                            layer_num=layers or mc.num_hidden_layers, device="cpu",
                            enable_memory_saver=False)


def dsa_pool(mc: Any, *, pages: int, page: int = 64, layers: int | None = None,
             full: tuple[int, ...] | None = None) -> Any:
    """``DSATokenToKVPool`` (fp8_ds_mla, 656 B/token) of `mc`; the indexer on the layers
    `full` only (the others skip-topk 0-row layers; default: all)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    n = layers or mc.num_hidden_layers
    return DSATokenToKVPool(
        size=pages * page, page_size=page, kv_lora_rank=mc.kv_lora_rank,
        dtype=torch.float8_e4m3fn, qk_rope_head_dim=mc.qk_rope_head_dim, layer_num=n,
        device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656,
        index_buf_size=pages * page, index_kpool=1, index_kpool_compress=False,
        max_running_requests=4,
        skip_topk_layers=[full is not None and i not in full for i in range(n)])


def mha_pool(mc: Any, *, pages: int, page: int, tp_size: int = 1) -> Any:
    """``MHATokenToKVPool`` of `mc` for one attention-TP rank of `tp_size`, as the model
    runner sizes it (``ModelConfig.get_num_kv_heads``)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=pages * page, page_size=page, dtype=torch.bfloat16,
                            head_num=mc.get_num_kv_heads(tp_size), head_dim=mc.head_dim,
                            layer_num=mc.num_hidden_layers, device="cpu",
                            enable_memory_saver=False)


def metadata() -> tuple[Any, Any]:
    """SGLang's ``MetadataBuffers`` and the allocator of their slots."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    return (MetadataBuffers(size=8, hidden_size=16, hidden_states_dtype=torch.float32,
                            max_sampling_mask_tokens=1), ReqToMetadataIdxAllocator(8))


def _prefill_scheduler(mc: Any, pool: Any, server_args: Any, kv_dtype: str) -> Any:
    """The fields of the scheduler ``PrefillBootstrapQueue.__init__`` / ``_init_kv_manager``
    read (sglang/srt/disaggregation/prefill.py, 0.5.23)."""
    return SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(
            effective_logical_max_total_num_tokens=pool.size,  # prefill.py:208
            kv_cache_dtype_str=kv_dtype)),  # prefill.py:269
        kv_shard_widening=1,  # prefill.py:209, 214
        token_to_kv_pool_allocator=SimpleNamespace(page_size=pool.page_size),  # :213, 224
        kv_checksum_computer=None,  # prefill.py:247, 255 (written)
        rust_server=None,  # prefill.py:264-265
        model_config=mc,  # prefill.py:289, 334, 339, 354
        req_to_token_pool=None,  # prefill.py:349 (getattr; only hybrid state pools use it)
        server_args=server_args)  # prefill.py:367


def _decode_scheduler(mc: Any, server_args: Any, kv_dtype: str) -> Any:
    """The fields of the scheduler ``DecodeTransferQueue.__init__`` and
    ``DecodePreallocQueue.__init__`` / ``_init_kv_manager`` read
    (sglang/srt/disaggregation/decode.py, 0.5.23)."""
    return SimpleNamespace(
        spec_algorithm=None,  # decode.py:2554
        tp_worker=SimpleNamespace(
            is_hybrid_swa=False,  # decode.py:462
            model_runner=SimpleNamespace(kv_cache_dtype_str=kv_dtype)),  # decode.py:618
        random_seed=0,  # decode.py:480
        kv_checksum_computer=None,  # decode.py:485, 493 (written)
        enable_hisparse=False,  # decode.py:623, 631, 634
        hisparse_coordinator=None,  # decode.py:622 (read only with enable_hisparse)
        model_config=mc,  # decode.py:666, 680
        server_args=server_args,  # decode.py:769
        # DecodeTransferQueue's failure and deferred-release figures (decode.py:2826, 3040)
        metrics_reporter=SimpleNamespace(enable_metrics=False))


@dataclass
class Side:
    """One side: SGLang's queue(s), its KV pools and metadata buffers; `kv_manager` is ours."""

    queue: Any  # PrefillBootstrapQueue or DecodePreallocQueue
    pool: Any
    draft: Any | None
    metadata: Any
    transfer_queue: Any = None  # DecodeTransferQueue (decode)

    @property
    def kv_manager(self) -> Any:
        return self.queue.kv_manager


def until(h: Any, done: Any, bound_s: float = 20.0) -> int:
    """`h.poll()` once `done` says so of it, or when `bound_s` passed (the caller asserts)."""
    end = time.monotonic() + bound_s
    while not done(int(h.poll())) and time.monotonic() < end:
        time.sleep(0.005)
    return int(h.poll())


def failure_text(h: Any) -> str | None:
    """What SGLang's ``failure_exception()`` raises for a failed handle (its KVTransferError)."""
    try:
        h.failure_exception()
    except Exception as e:  # noqa: BLE001 - SGLang's KVTransferError
        return str(e)
    return None


def outcome(r: Any, s: Any) -> tuple[int, int, str | None]:
    """A handoff's end: the receiver's and the sender's state once each is terminal (bounded),
    and the receiver's failure text where it failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    def ended(st: int) -> bool:
        return st in (KVPoll.Success, KVPoll.Failed)

    rs = until(r, ended)
    reason = failure_text(r) if rs == KVPoll.Failed else None
    return rs, until(s, ended), reason


def publish_ranks(*, tp: bool = True) -> None:
    """The ranks the queues read of SGLang's parallel context (rank 0 of TP1, as
    `sglang_env.server_args` states the attention ranks): ``tp_rank``, ``pp_rank``
    (prefill.py:198-199, decode.py:424, 428) and ``dp_rank`` (prefill.py:262, decode.py:616);
    `tp` False: the TP rank is the one `tp_rank` states for the time being."""
    from sglang.srt.runtime_context import get_parallel

    if tp:
        get_parallel().override_permanently(tp_rank=0, pp_rank=0, dp_rank=None)
    else:
        get_parallel().override_permanently(pp_rank=0, dp_rank=None)


def tp_rank(tp: int, rank: int) -> Any:
    """SGLang's parallel context of attention-TP rank `rank` of `tp` (no DP attention), for
    building that rank's pool and queue in this process (`prefill_queue` / `decode_queues`
    with ``rank=rank``, which then leave the TP rank to this); left, the context is what it
    was."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_size=tp, attn_tp_size=tp, moe_tp_size=tp,
                                   tp_rank=rank, attn_tp_rank=rank)


def _backend() -> Any:
    from sglang.srt.disaggregation.utils import TransferBackend

    return TransferBackend("kvhandoff")


def prefill_queue(mc: Any, pool: Any, server_args: Any, *, draft: Any = None,
                  kv_dtype: str = "bfloat16", meta: tuple[Any, Any] | None = None,
                  rank: int | None = None) -> Side:
    """SGLang's ``PrefillBootstrapQueue`` over `pool` (and `meta`, `metadata()`'s pair, or new
    ones): its ``_init_kv_manager`` builds the kvhandoff prefill manager."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    publish_ranks(tp=rank is None)
    meta, alloc = meta or metadata()
    q = PrefillBootstrapQueue(
        token_to_kv_pool=pool, draft_token_to_kv_pool=draft,
        req_to_metadata_buffer_idx_allocator=alloc, metadata_buffers=meta, gpu_id=0,
        bootstrap_port=server_args.disaggregation_bootstrap_port,
        max_total_num_tokens=pool.size,
        scheduler=_prefill_scheduler(mc, pool, server_args, kv_dtype),
        scheduler_stage_metrics=None, transfer_backend=_backend())
    return Side(queue=q, pool=pool, draft=draft, metadata=meta)


def decode_queues(mc: Any, pool: Any, server_args: Any, *, draft: Any = None,
                  kv_dtype: str = "bfloat16", rank: int | None = None) -> Side:
    """SGLang's ``DecodeTransferQueue`` and ``DecodePreallocQueue`` over `pool` (with a real
    ``PagedTokenToKVPoolAllocator`` and ``ReqToTokenPool``): the prealloc queue's
    ``_init_kv_manager`` builds the kvhandoff decode manager."""
    import torch
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.runtime_context import get_parallel

    publish_ranks(tp=rank is None)
    meta, alloc = metadata()
    sched = _decode_scheduler(mc, server_args, kv_dtype)
    allocator = PagedTokenToKVPoolAllocator(pool.size, pool.page_size, torch.int64, "cpu",
                                            pool, need_sort=True)
    req_to_token = ReqToTokenPool(size=8, max_context_len=pool.size, device="cpu",
                                  enable_memory_saver=False)
    # DecodeTransferQueue.__init__ (decode.py:2545) and DecodePreallocQueue.__init__
    # (decode.py:421) read the attention-TP group's gloo group (used for TP > 1 only)
    with get_parallel().override(attn_tp_group=SimpleNamespace(cpu_group=None)):
        tq = DecodeTransferQueue(req_to_metadata_buffer_idx_allocator=alloc,
                                 metadata_buffers=meta, scheduler=sched, tree_cache=None)
        q = DecodePreallocQueue(
            req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator,
            draft_token_to_kv_pool=draft, req_to_metadata_buffer_idx_allocator=alloc,
            metadata_buffers=meta, scheduler=sched, transfer_queue=tq, tree_cache=None,
            gpu_id=0, bootstrap_port=server_args.disaggregation_bootstrap_port,
            max_total_num_tokens=pool.size, num_reserved_decode_tokens=0,
            transfer_backend=_backend())
    sched.disagg_decode_prealloc_queue = q  # decode.py:2576 (DecodeTransferQueue.extend)
    return Side(queue=q, pool=pool, draft=draft, metadata=meta, transfer_queue=tq)
