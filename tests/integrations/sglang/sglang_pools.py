"""SGLang's own KV pools on CPU, and ``KVArgs`` filled from them by SGLang's own code.

The pools are SGLang 0.5.23's classes, constructed with ``device="cpu"`` (their constructors
allow it): ``DSATokenToKVPool`` (a ``MLATokenToKVPool`` subclass; fp8_ds_mla main KV of
``kv_cache_dim`` 656 B/token) with its ``IndexKeyCache`` (one buffer per layer, 0-row
placeholders on the skip-topk layers) and, with ``index_kpool`` compression, its per-request
tail ring; a second ``DSATokenToKVPool`` of one layer as the MTP draft pool; and
``MetadataBuffers``. `kv_args` fills ``KVArgs`` as SGLang's ``_init_kv_manager`` does, with the
same SGLang functions: ``get_kv_transfer_buf_infos`` (-> ``get_contiguous_buf_infos``), the
draft pool's ``get_contiguous_buf_infos``, ``build_kv_layer_ids``,
``MetadataBuffers.get_buf_infos`` and ``setup_state_kv_args`` (-> ``get_state_buf_infos`` ->
``IndexKeyCache.state_buf_infos``, ``get_compress_tail_buf_infos``). Nothing of the lists is
written here.

Configurations (`CONFIGS`): GLM-5.3 (78 layers, 21 full indexer layers, 57 skip-topk 0-row
layers, page 64); the same with its MTP draft pool; and ``index_kpool`` 2 with compression
(page 128, tail ring of 2 slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GLM53_LAYERS = 78
# the 21 full indexer layers of the kvhandoff GLM-5.3 preset (kv_layout.presets)
GLM53_FULL = (*range(0, 77, 4), 77)
MAX_REQS = 4  # max_running_requests (the tail ring has MAX_REQS + 1 rows)


@dataclass(frozen=True)
class Config:
    name: str
    page: int = 64
    pages: int = 6  # usable pages of the pool (SGLang adds one padded page)
    kpool: int = 1
    draft_layers: int = 0
    layers: int = GLM53_LAYERS
    full: tuple[int, ...] = GLM53_FULL

    @property
    def skip_topk(self) -> list[bool]:
        return [i not in self.full for i in range(self.layers)]


CONFIGS = {
    "small": Config("small", layers=6, full=(0, 2, 5), pages=48),  # the many-room pair tests
    "small-5": Config("small-5", layers=5, full=(0, 2, 4), pages=48),  # another checkpoint
    "glm-5.3": Config("glm-5.3"),
    "glm-5.3-mtp": Config("glm-5.3-mtp", draft_layers=1),
    "glm-5.3-kpool2": Config("glm-5.3-kpool2", page=128, kpool=2, pages=4),
}


@dataclass
class Pools:
    config: Config
    target: Any  # DSATokenToKVPool
    draft: Any | None  # DSATokenToKVPool (MTP), or None
    metadata: Any  # MetadataBuffers


def _dsa_pool(c: Config, layers: int, skip: list[bool]) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=c.pages * c.page, page_size=c.page, kv_lora_rank=512,
        dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=layers, device="cpu",
        index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656,
        # what SGLang computes for DCP 1 (given, so no runtime context is needed)
        index_buf_size=c.pages * c.page,
        index_kpool=c.kpool, index_kpool_compress=c.kpool > 1,
        max_running_requests=MAX_REQS, skip_topk_layers=skip)


def pools(name: str, *, pages: int | None = None) -> Pools:
    """SGLang's pools of configuration `name` (see `CONFIGS`; `pages` overrides its page
    count), on CPU, zero-filled."""
    import dataclasses

    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    c = CONFIGS[name]
    if pages is not None:
        c = dataclasses.replace(c, pages=pages)
    draft = _dsa_pool(c, c.draft_layers, [False] * c.draft_layers) if c.draft_layers else None
    meta = MetadataBuffers(size=8, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=1)
    return Pools(config=c, target=_dsa_pool(c, c.layers, c.skip_topk), draft=draft,
                 metadata=meta)


def kv_args(p: Pools) -> Any:
    """``KVArgs`` as SGLang's prefill/decode ``_init_kv_manager`` fills them (rank 0, TP1)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import (
        build_kv_layer_ids,
        get_kv_transfer_buf_infos,
        setup_state_kv_args,
    )

    a = KVArgs()
    a.engine_rank = 0
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.rust_http_port = None
    a.kv_cache_dtype_str = "fp8_e4m3"
    a.kv_layout = None
    a.prefill_start_layer = 0
    ptrs, lens, items = get_kv_transfer_buf_infos(p.target)
    a.prefill_end_layer = p.target.end_layer
    n_draft = 0
    if p.draft is not None:
        dp, dl, di = p.draft.get_contiguous_buf_infos()
        ptrs, lens, items = ptrs + dp, lens + dl, items + di
        n_draft = len(dp)
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = ptrs, lens, items
    a.num_draft_entries = n_draft
    a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=p.target,
                                        draft_token_to_kv_pool=p.draft,
                                        num_draft_entries=n_draft,
                                        num_hidden_layers=p.config.layers)
    a.page_size = p.target.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = p.metadata.get_buf_infos()
    a.ib_device = None
    a.gpu_id = 0
    setup_state_kv_args(a, p.target, p.draft, p.config.layers)
    return a


def tail_indices(p: Pools, req_pool_idx: int, seq_len: int) -> list[int]:
    """SGLang's DSA_TAIL state indices of a request (``get_dsa_tail_state_indices``).

    SGLang 0.5.23's function reads ``pool.full_kv_pool`` of any pool with ``use_dsa`` (as a
    ``HybridLinearKVPool`` has), which a plain ``DSATokenToKVPool`` (``use_dsa`` True too) lacks:
    it is given the pool the way the hybrid wrapper presents it."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

    wrapper = SimpleNamespace(use_dsa=True, full_kv_pool=p.target)
    return list(get_dsa_tail_state_indices(wrapper, req_pool_idx, seq_len))
