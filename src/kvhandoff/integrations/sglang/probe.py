"""The layout probe of the SGLang backend (issue 26): does the layout `layout.build` infers from
``KVArgs`` say where SGLang's own cache-write kernels put a token?

At manager start (setting ``layout_probe``, on by default) `verify` builds a scratch pool of the
live pool's class and per-layer shape (`scratch_pool`: ONE layer, TWO pages plus SGLang's padded
page, same device, never the live pages): ``DSATokenToKVPool`` when the KVArgs carry the DSA
state, else ``MLATokenToKVPool``. It maps the scratch pool's own buffer lists
(``get_contiguous_buf_infos``, ``get_state_buf_infos``) through `layout.build` exactly as the live
ones, checks that the scratch regions have the live regions' per-layer layout, then writes known
values for chosen token slots (first and last row of pages 1 and 2; page 0 is SGLang's padding
page) through the pool's own write path:

- main KV: ``set_mla_kv_buffer`` (the op SGLang's MLA backends call; for the fp8_ds_mla cache it
  quantizes with SGLang's ``quantize_k_cache_separate`` and scatters with its Triton kernel) or,
  for a bf16 MLA pool, ``set_kv_buffer``; a token row is the latent (nope, with its fp32 block
  scales for fp8) then the rope part, so a mismatch names which of the two moved;
- DSA indexer: ``set_index_k_scale_buffer`` (``IndexKeyCache.store_quantized``), planes ``key``
  and ``scale``; with ``index_kpool`` the slot is a compressed row.

Each (slot, plane) is read back at the address the adapter's `LayoutSpec` gives
(`kvhandoff.integrations.layout_probe.check_region`) and compared byte for byte. Agreement:
"layout verified against <pool class>". Disagreement: `LayoutProbeError` (refuse to start,
naming the pool class, the token slot, the plane and the layout expected).

A pool the probe cannot drive (an MHA pool, an MLA geometry it does not know, a write kernel that
cannot run on this device: SGLang's Triton kernels need a GPU, or ``TRITON_INTERPRET=1`` on a CPU
build) starts unverified: SGLang moves whole pages of equal size on both sides (the layout hash
holds the page size), so what the layout cannot get wrong there is the page, and the report says
the in-page layout was not checked and why (the manager logs it as a WARNING and keeps it as
``probe_report``). The kpool tail and the draft regions (the draft pool has the target's class and
item lengths) are not probed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.layout_probe import LayoutProbeError, check_region, describe_region
from kvhandoff.integrations.sglang.layout import Built, Parallel, build
from kvhandoff.kv_layout import LayoutSpec

KV_LORA_RANK = 512  # the MLA geometry of the DSA models (GLM-5.x, DeepSeek-V3.x)
ROPE_DIM = 64
FP8_DS_MLA_BYTES = 656  # 512 fp8 + 4 fp32 scales + 64 bf16
PAGES = 2


@dataclass(frozen=True)
class Outcome:
    verified: bool
    pool_class: str
    report: str


class NotProbed(Exception):
    """The probe cannot drive this pool's write path here (the reason)."""


def _slots(rows_per_page: int) -> list[int]:
    """The first and last row of scratch pages 1 and 2 (SGLang keeps page 0 for padding: its
    kernels drop writes to slot 0)."""
    r = rows_per_page
    return [r, 2 * r - 1, 2 * r, 3 * r - 1]


def scratch_pool(kv_args: Any, built: Built, device: str) -> Any:
    """A one-layer, two-page pool of the live pool's class and per-layer shape."""
    import torch

    ps = int(kv_args.page_size)
    # the target's main-KV regions (a draft pool's follow as draft_*: not probed)
    if [n for n in built.kv_regions if not built.kv_layout.region(n).draft] != ["kv"]:
        raise NotProbed("an MHA pool (K and V buffers): the probe drives MLA pools only")
    kv = built.kv_layout.region("kv")
    bpt = kv.bytes_per_token
    if bpt == FP8_DS_MLA_BYTES:
        dtype, dim = torch.float8_e4m3fn, FP8_DS_MLA_BYTES
    elif bpt == (KV_LORA_RANK + ROPE_DIM) * 2:
        dtype, dim = torch.bfloat16, KV_LORA_RANK + ROPE_DIM
    else:
        raise NotProbed(f"an MLA cache of {bpt} B/token: the probe knows the 512 + 64 geometry "
                        f"(fp8_ds_mla {FP8_DS_MLA_BYTES} B, bf16 1152 B)")
    size = PAGES * ps
    if built.dsa_slot is not None and "indexer" in {r.name for r in built.kv_layout.regions}:
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        kpool = built.kv_layout.region("indexer").tokens_per_row
        return DSATokenToKVPool(
            size=size, page_size=ps, kv_lora_rank=KV_LORA_RANK, dtype=dtype,
            qk_rope_head_dim=ROPE_DIM, layer_num=1, device=device, index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=dim, index_buf_size=size,
            index_kpool=kpool, skip_topk_layers=[False])
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=size, page_size=ps, dtype=dtype, kv_lora_rank=KV_LORA_RANK,
                            qk_rope_head_dim=ROPE_DIM, layer_num=1, device=device,
                            enable_memory_saver=False,
                            override_kv_cache_dim=dim if dim != KV_LORA_RANK + ROPE_DIM else None)


def scratch_built(pool: Any, kv_args: Any, device: str) -> Built:
    """`layout.build` over the scratch pool's own buffer lists (as SGLang lists the live ones)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import StateType

    ptrs, lens, items = pool.get_contiguous_buf_infos()
    state: dict[str, Any] = {"state_types": [], "state_data_ptrs": [], "state_data_lens": [],
                             "state_item_lens": []}
    if hasattr(pool, "get_state_buf_infos"):
        sp, sl, si = pool.get_state_buf_infos()
        state = {"state_types": [StateType.DSA], "state_data_ptrs": [sp],
                 "state_data_lens": [sl], "state_item_lens": [si]}
    args = SimpleNamespace(page_size=pool.page_size, kv_cache_dtype_str=kv_args.kv_cache_dtype_str,
                           kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items,
                           num_draft_entries=0, kv_layer_ids=[], **state)
    return build(args, is_mla=True, parallel=Parallel(), device=device)


def _same_page_layout(live: LayoutSpec, scratch: LayoutSpec, region: str) -> None:
    a, b = live.region(region), scratch.region(region)
    if (a.planes, a.tokens_per_row, live.page_size_tokens) != \
            (b.planes, b.tokens_per_row, scratch.page_size_tokens):
        raise ConfigError(f"layout probe: the scratch pool's {region!r} pages "
                          f"({describe_region(scratch, region)}) are not the live pool's "
                          f"({describe_region(live, region)})")


def _write_main(pool: Any, loc: Any, rows: int, seed: int) -> tuple[Any, int]:
    """Known latent/rope values for `loc` through the pool's own write op; the token rows as
    the op was given them (uint8 [n, row bytes]) and the latent's share of a row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = loc.numel()
    nope = torch.randn(n, 1, KV_LORA_RANK, generator=g).to(torch.bfloat16)
    rope = torch.randn(n, 1, ROPE_DIM, generator=g).to(torch.bfloat16)
    dev = pool.kv_buffer[0].device
    nope, rope, loc = nope.to(dev), rope.to(dev), loc.to(dev)
    if getattr(pool, "dsa_kv_cache_store_fp8", False):
        from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate

        n8, r8 = quantize_k_cache_separate(nope, rope)
        given = torch.cat([n8.reshape(n, -1), r8.reshape(n, -1)], dim=1)
        pool.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=0)
        return given.view(torch.uint8).cpu(), n8.reshape(n, -1).shape[1]
    row = torch.cat([nope, rope], dim=2)
    pool.set_kv_buffer(None, loc, row, None, layer_id_override=0)
    return row.reshape(n, -1).view(torch.uint8).cpu(), KV_LORA_RANK * 2


def _write_indexer(pool: Any, loc: Any, seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = loc.numel()
    dev = pool.kv_buffer[0].device
    key = (torch.randn(n, 128, generator=g) * 4).to(torch.float8_e4m3fn).to(dev)
    scale = (torch.rand(n, 1, generator=g, dtype=torch.float32) + 0.5).to(dev)
    pool.set_index_k_scale_buffer(0, loc.to(dev), key, scale)
    return key.view(torch.uint8).reshape(n, 128).cpu(), scale.view(torch.uint8).reshape(n, 4).cpu()


def check_pool(pool: Any, layout: LayoutSpec, buffers: dict[str, Any], *, seed: int = 26) -> str:
    """Writes known values through `pool`'s own ops and reads them back through `layout` over
    `buffers` (the pool's memory as the adapter views it); the report, or `LayoutProbeError`."""
    import torch

    backend = type(pool).__name__
    kv_name = "kv"
    kv = layout.region(kv_name)
    rows = kv.rows_per_page(layout.page_size_tokens)
    slots = _slots(rows)
    loc = torch.tensor(slots, dtype=torch.int64)
    given, latent = _write_main(pool, loc, rows, seed)
    if kv.bytes_per_token != given.shape[1]:
        raise ConfigError(f"layout probe: region {kv_name!r} holds {kv.bytes_per_token} B per "
                          f"token, {backend}'s write op was given {given.shape[1]} B rows")
    expected = {(s, pl.name): given[i].numpy()[off:off + pl.bytes_per_token].tobytes()
                for i, s in enumerate(slots)
                for pl, off in zip(kv.planes, kv.plane_offsets(), strict=True)}
    bad = check_region(layout, kv_name, buffers, expected)
    if bad and len(kv.planes) > 1:
        raise LayoutProbeError(backend, bad, describe_region(layout, kv_name))
    if bad:
        # which field of the token row moved: the latent (nope + scales) or the rope part
        fields = []
        for m in bad:
            parts = [name for name, a, b in (("latent", 0, latent),
                                             ("rope", latent, len(m.expected)))
                     if m.expected[a:b] != m.got[a:b]]
            fields.append(f"slot {m.slot}: {'+'.join(parts) or 'row'}")
        raise LayoutProbeError(backend, bad, describe_region(layout, kv_name)
                               + f" (token row: latent bytes 0..{latent}, rope "
                               f"{latent}..{kv.bytes_per_token}; moved: {', '.join(fields)})")
    checked = [f"{kv_name} ({len(slots)} slots: latent, rope)"]
    if "indexer" in {r.name for r in layout.regions} and hasattr(pool, "set_index_k_scale_buffer"):
        idx = layout.region("indexer")
        irows = idx.rows_per_page(layout.page_size_tokens)
        islots = _slots(irows)
        key, scale = _write_indexer(pool, torch.tensor(islots, dtype=torch.int64), seed + 1)
        exp: dict[tuple[int, str], bytes] = {}
        for i, s in enumerate(islots):
            exp[(s, "key")] = key[i].numpy().tobytes()
            exp[(s, "scale")] = scale[i].numpy().tobytes()
        bad = check_region(layout, "indexer", buffers, exp)
        if bad:
            raise LayoutProbeError(backend, bad, describe_region(layout, "indexer"))
        checked.append(f"indexer ({len(islots)} row slots: key, scale)")
    return f"layout verified against {backend}: " + ", ".join(checked)


def verify(kv_args: Any, built: Built, device: str) -> Outcome:
    """The probe at manager start: `Outcome` (verified, or not probed and why), or
    `LayoutProbeError` / `ConfigError` (refuse to start)."""
    has_dsa = built.dsa_slot is not None
    cls = "DSATokenToKVPool" if has_dsa else "MLATokenToKVPool" \
        if "kv" in built.kv_regions else "an MHA pool"
    try:
        pool = scratch_pool(kv_args, built, device)
        cls = type(pool).__name__
        sb = scratch_built(pool, kv_args, device)
        for r in sb.kv_layout.regions:
            if r.name in {x.name for x in built.kv_layout.regions}:
                _same_page_layout(built.kv_layout, sb.kv_layout, r.name)
        try:
            report = check_pool(pool, sb.kv_layout, sb.kv_buffers)
        except (LayoutProbeError, ConfigError):
            raise
        except Exception as e:  # the write kernel cannot run here (e.g. Triton on a CPU)
            raise NotProbed(f"{cls}'s write kernel did not run on {device}: "
                            f"{type(e).__name__}: {str(e)[:200]}") from e
    except NotProbed as e:
        return Outcome(False, cls, f"layout NOT verified against {cls}: {e}; SGLang moves "
                       "whole pages of the same size on both sides, the in-page layout is "
                       "unchecked")
    return Outcome(True, cls, report)


def wrong_planes(layout: LayoutSpec, region: str) -> LayoutSpec:
    """`layout` with the planes of `region` in reverse order (a deliberately wrong layout for
    the probe's tests and ``doctor``-style checks)."""
    regions = tuple(dataclasses.replace(r, planes=tuple(reversed(r.planes)), placement=None)
                    if r.name == region else dataclasses.replace(r, placement=None)
                    for r in layout.regions)
    return dataclasses.replace(layout, regions=regions)


__all__ = ["NotProbed", "Outcome", "check_pool", "scratch_built", "scratch_pool", "verify",
           "wrong_planes"]
