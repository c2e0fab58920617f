"""What a test process needs to build SGLang's real disaggregation classes on a CPU machine:
SGLang importable (`sglang_cpu_import`), the kvhandoff plugin loaded through SGLang's own plugin
loader (the installed entry point), SGLang's process-wide runtime context set from a real
``ServerArgs`` (ranks stated as a launcher would publish them), and ``KVArgs`` over CPU tensors
shaped like GLM-5.3 (fp8_ds_mla main KV: 656 B/token/layer; DSA indexer K: 128 + 4 B/token on a
subset of layers; SGLang's metadata buffers), at small sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

FULL_SIZE = os.environ.get("KVH_SGLANG_SHAPE") == "glm-5.3"  # bench_sglang_pair.py
PAGE = 64 if FULL_SIZE else 8  # tokens per page
PAGES = 80 if FULL_SIZE else 48  # pages per buffer
MAIN_LAYERS = 78 if FULL_SIZE else 6
INDEXER_LAYERS = 21 if FULL_SIZE else 3  # GLM-5.3 has an indexer on some layers only
MAIN_BPT = 656  # fp8_ds_mla bytes per token per layer (GLM-5.3)
INDEXER_BPT = 128 + 4  # fp8 key + fp32 scale per token (GLM-5.3)
AUX_ITEMS = (16, 64)  # bytes per request slot of two SGLang metadata buffers
AUX_SLOTS = 8
DTYPE = "fp8_e4m3"


def import_sglang(*, scheduler_modules: bool = True) -> None:
    """Imports SGLang's disaggregation modules (CPU stand-in for torchvision, see there);
    `scheduler_modules`: also ``prefill.py`` and ``decode.py`` (slow to import; the pair's
    workers make their calls themselves and skip them)."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    os.environ.setdefault("SGLANG_PLUGINS", "kvhandoff")
    import sglang_cpu_import

    sglang_cpu_import.install()
    import sglang.srt.disaggregation.common.conn  # noqa: F401
    import sglang.srt.disaggregation.utils  # noqa: F401

    if scheduler_modules:
        import sglang.srt.disaggregation.decode  # noqa: F401
        import sglang.srt.disaggregation.prefill  # noqa: F401


def load_plugins() -> None:
    """SGLang's own plugin loader: finds our entry point (group ``sglang.srt.plugins``)."""
    from sglang.srt.plugins import load_plugins as sglang_load_plugins

    sglang_load_plugins()


def server_args(mode: str, bootstrap_port: int) -> Any:
    """A real ``ServerArgs`` published as this process's runtime context (rank 0 of TP1)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", host="127.0.0.1", device="cpu",
                    disaggregation_mode=mode, disaggregation_transfer_backend="kvhandoff",
                    disaggregation_bootstrap_port=bootstrap_port)
    rc.get_context().set_server_args(sa)
    rc.get_parallel().override_permanently(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0,
                                           attn_dcp_rank=0, pp_group=None)
    return sa


@dataclass
class Pools:
    main: list[Any]  # per layer: uint8 tensor [PAGES, PAGE * MAIN_BPT]
    indexer: list[Any]
    aux: list[Any]  # per metadata buffer: uint8 tensor [AUX_SLOTS, item]


def pools() -> Pools:
    import torch

    return Pools(
        main=[torch.zeros(PAGES, PAGE * MAIN_BPT, dtype=torch.uint8) for _ in range(MAIN_LAYERS)],
        indexer=[torch.zeros(PAGES, PAGE * INDEXER_BPT, dtype=torch.uint8)
                 for _ in range(INDEXER_LAYERS)],
        aux=[torch.zeros(AUX_SLOTS, n, dtype=torch.uint8) for n in AUX_ITEMS],
    )


def kv_args(p: Pools) -> Any:
    """SGLang's ``KVArgs`` as its scheduler fills them, over the CPU pools."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    a = KVArgs()
    a.engine_rank = 0
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.rust_http_port = None
    a.kv_cache_dtype_str = DTYPE
    a.kv_layout = None
    a.prefill_start_layer = 0
    a.prefill_end_layer = MAIN_LAYERS
    a.kv_data_ptrs = [t.data_ptr() for t in p.main]
    a.kv_data_lens = [t.numel() for t in p.main]
    a.kv_item_lens = [t.shape[1] for t in p.main]
    a.kv_layer_ids = list(range(MAIN_LAYERS))
    a.num_draft_entries = 0
    a.page_size = PAGE
    a.aux_data_ptrs = [t.data_ptr() for t in p.aux]
    a.aux_data_lens = [t.numel() for t in p.aux]
    a.aux_item_lens = [t.shape[1] for t in p.aux]
    a.ib_device = None
    a.gpu_id = 0
    a.state_types = [StateType.DSA]
    a.state_data_ptrs = [[t.data_ptr() for t in p.indexer]]
    a.state_data_lens = [[t.numel() for t in p.indexer]]
    a.state_item_lens = [[t.shape[1] for t in p.indexer]]
    a.state_layer_ids = [[]]
    a.state_dim_per_tensor = [[]]
    a.state_slice_outer_counts = [[]]
    a.state_conv_shard_groups = [[]]
    a.is_hybrid_mla_backend = False
    a.swa_kv_cache_layout = None
    a.mla_compression_ratios = None
    return a


def page_bytes(kind: str, layer: int, page: int, room: int, nbytes: int) -> np.ndarray:
    """The deterministic content prefill writes in (kind, layer, page) for `room`."""
    rng = np.random.default_rng([room, layer, page, {"main": 1, "indexer": 2, "aux": 3}[kind]])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)
