"""The attention backends KVHandoffConnector accepts, and where each one's kernel keeps a token
inside a page. Read from vLLM's own backend code (0.32 CPU build, 0.33), checked at every start by
the layout probe (`integrations.vllm.probe`); a backend that is not in this table is refused at
start with the reason, never guessed from tensor shapes.

vLLM's allocator hands each attention layer a ``[B, H, N, C]`` view (blocks, KV head slots,
tokens of a kernel block, content); the resolved ``KVCacheLayout`` orders it in memory (HND:
head-major pages, NHD: token-major pages, read from the strides by `layout.build_layout`). What
a token's bytes are inside that view is the backend's business:

- ``CPU_ATTN`` (vLLM's CPU attention; ISAs vec, vec16, neon, vsx, vxe, rvv): the view is declared
  ``[B, H, N, 2*D]`` but the backend views it as ``[B, H, 2N, D]`` and splits K and V at dim 2;
  ``cpu_attn_reshape_and_cache`` writes K column-major (element d of every token of the block,
  then element d+1: ``[D, N]``) and V row-major (``[N, D]``). Inside one (block, head): all of
  K, then all of V. Planes per head g: ``h<g>.k<d>`` (one element per token) for each d, then
  ``h<g>.v`` (D elements per token). Head-major pages only (its kernels read LBHNC). The AMX ISA
  stores tiles of its own: refused.
- ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``: the view is split at the last dim into K and
  V (``reshape_and_cache_flash``): per token and head one row K|V of 2*D elements. HND pages give
  one plane per head ``h<g>``; NHD pages one plane ``kv`` holding every local head per token.
- ``CPU_MLA``, ``FLASHMLA``: one row per token, the ``kv_lora_rank`` latent then the RoPE key
  (``concat_and_cache_mla``, or CPU_MLA's indexed write): one plane ``latent``.
- ``FLASHMLA_SPARSE`` (DeepSeek-V3.2 / GLM-5.x, DSA): the MLA cache of the sparse kernel, the
  same row per token (``auto`` dtype: 576 elements), beside the DSA indexer's cache
  (``DEEPSEEK_V32_INDEXER``, its own region: `layout`). It also takes ``fp8_ds_mla`` (alias
  ``fp8``): one opaque 656-byte row per token (fp8 NoPE, its fp32 scales, bf16 RoPE: vLLM's spec
  gives ``state_content_bytes`` 656), moved as whole pages; the layout probe cannot compare a
  quantising write with raw bytes, so that row is not probed (said in the probe report).

- The MLA backends vLLM 0.33 picks on Hopper and Blackwell (``vllm/platforms/cuda.py``):
  ``FLASH_ATTN_MLA`` (Hopper's first), ``FLASHINFER_MLA`` (Blackwell's first), ``CUTLASS_MLA``,
  ``TRITON_MLA``, and for DSA ``FLASH_ATTN_MLA_SPARSE`` (Hopper), ``FLASH_ATTN_MLA_SPARSE_FA4``
  and ``FLASHINFER_MLA_SPARSE`` (Blackwell): every one of them stores the same row per token as
  FLASHMLA (``MLACommonBackend`` / the sparse backends' flat rows: latent then RoPE key, or the
  512-element latent of a no-RoPE model), written by ``concat_and_cache_mla``: one plane
  ``latent``. What differs is each kernel's block size (``kernel_blocks`` / ``block_multiple``,
  vLLM's ``get_supported_kernel_block_sizes``; checked against the live pages at start) and the
  cache dtypes it takes (``cache_dtypes``, vLLM's ``supported_kv_cache_dtypes`` less the ones
  this table does not describe).

Cache dtypes: ``auto``, ``float16``, ``bfloat16`` (the model's or a named 16-bit dtype) and the
per-tensor fp8 caches (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``; `FP8_PER_TENSOR`): the same rows in
1-byte elements, each layer's one K and one V scale kept in the layer (vLLM's ``_k_scale`` /
``_v_scale``), not in the page. The bytes move as they are; the scales are part of the layout
identity (`dtype_identity`), so a prefill and a decode that would read the same bytes with other
scales are refused at the handshake, and the layout probe compares the kernel's quantised write
with the same quantisation of its input. Self-contained quantised rows (``quantized_dtypes``:
FLASHMLA_SPARSE's ``fp8_ds_mla``) move as opaque rows, not probed. Everything else (per-token-head
scales, nvfp4, turboquant ...) is refused at start naming the accepted dtypes.

Every region moves whole pages where both sides use one page size (`RegionSpec.whole_pages`), so
a partly filled last page is right by construction; token-granular pairing (different page
sizes) relies on the planes above.

Pure: no vLLM import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import ConfigError

__all__ = ["BACKENDS", "CPU_ISAS", "FP8_PER_TENSOR", "Backend", "dtype_identity",
           "layer_scales", "resolve"]

#: vLLM's per-tensor fp8 cache dtypes (``KVQuantMode.FP8_PER_TENSOR``) and the torch dtype each
#: one stores (``fp8`` is e4m3 on CUDA and on the CPU build)
FP8_PER_TENSOR = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                  "fp8_e5m2": "float8_e5m2"}
_PLAIN = ("auto", "float16", "bfloat16")
_FP8_E4M3 = ("fp8", "fp8_e4m3")

# the CPU attention ISAs whose cache write keeps K column-major and V rows (read in vLLM's
# csrc/cpu/cpu_attn_*.hpp; vec and vec16 are the ones this project's CPUs run)
CPU_ISAS = ("vec", "vec16", "neon", "vsx", "vxe", "rvv")


@dataclass(frozen=True, slots=True)
class Backend:
    """What the connector knows of one vLLM attention backend."""

    name: str  # vLLM's ``AttentionBackend.get_name()``
    mla: bool  # one latent row per token (MLA) instead of per-head K and V
    orders: tuple[str, ...]  # page interiors the backend's kernels read ("HND", "NHD", "MLA")
    k_columns: bool  # K column-major inside a (block, head), then V rows (CPU_ATTN)
    write_op: str  # the engine's cache write the probe calls (for people)
    device: str  # "cpu" or "cuda"
    # quantised cache dtypes whose rows are self-contained per token (scales inside the row)
    quantized_dtypes: tuple[str, ...] = ()
    # the cache dtypes accepted (vLLM's supported_kv_cache_dtypes that this table describes)
    cache_dtypes: tuple[str, ...] = ("auto",)
    # vLLM's get_supported_kernel_block_sizes: exact sizes, or a multiple (1: no rule read)
    kernel_blocks: tuple[int, ...] = ()
    block_multiple: int = 1

    def block_rule(self) -> str:
        """The kernel block sizes the backend runs, for people."""
        if self.kernel_blocks:
            return " or ".join(str(n) for n in self.kernel_blocks) + " tokens"
        if self.block_multiple > 1:
            return f"a multiple of {self.block_multiple} tokens"
        return "any size"

    def check_block(self, tokens: int) -> None:
        """Refuses a page of `tokens` tokens this backend's kernel does not run (the layers'
        backend and the caches disagree: the page layout cannot be this backend's)."""
        ok = (tokens in self.kernel_blocks if self.kernel_blocks
              else tokens % self.block_multiple == 0)
        if not ok:
            raise ConfigError(f"attention backend {self.name}: its kernel runs pages of "
                              f"{self.block_rule()}, but the KV cache pages hold {tokens} "
                              "tokens; the caches were not laid out for this backend")

    def fp8_dtype(self, cache_dtype: str) -> str | None:
        """The torch dtype name of a per-tensor fp8 cache of this backend (None: not one)."""
        if cache_dtype in self.quantized_dtypes:
            return None
        return FP8_PER_TENSOR.get(cache_dtype)

    def token_layout(self, order: str) -> str:
        """Where a token lives inside a page, for logs, errors and docs."""
        if self.mla:
            return "one row per token: latent then RoPE key"
        if self.k_columns:
            return ("per KV head: K column-major [head_size, block] then V rows "
                    "[block, head_size]")
        if order == "HND":
            return "per KV head: one row K|V per token"
        return "per token: one row of every local KV head's K|V"


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("CPU_ATTN", mla=False, orders=("HND",), k_columns=True,
            write_op="cpu_attn_reshape_and_cache", device="cpu",
            cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    Backend("CPU_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="CPUMLAImpl.do_kv_cache_update", device="cpu", kernel_blocks=(16,)),
    Backend("FLASH_ATTN", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="reshape_and_cache_flash", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3)),
    Backend("FLASHINFER", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="reshape_and_cache_flash", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3, "fp8_e5m2")),
    Backend("TRITON_ATTN", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="triton_reshape_and_cache_flash", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3, "fp8_e5m2")),
    Backend("FLASHMLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3), kernel_blocks=(64,)),
    Backend("FLASHMLA_SPARSE", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            quantized_dtypes=("fp8_ds_mla", "fp8"),
            cache_dtypes=("auto", "bfloat16", "fp8_ds_mla", "fp8"), block_multiple=64),
    Backend("FLASH_ATTN_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda", cache_dtypes=_PLAIN,
            block_multiple=16),
    Backend("FLASHINFER_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3), kernel_blocks=(32, 64)),
    Backend("CUTLASS_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3), kernel_blocks=(128,)),
    Backend("TRITON_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3), block_multiple=16),
    Backend("FLASH_ATTN_MLA_SPARSE", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda", cache_dtypes=_PLAIN,
            block_multiple=64),
    Backend("FLASH_ATTN_MLA_SPARSE_FA4", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda", cache_dtypes=("auto", "bfloat16"),
            block_multiple=64),
    Backend("FLASHINFER_MLA_SPARSE", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            cache_dtypes=(*_PLAIN, *_FP8_E4M3), block_multiple=32),
)}


def resolve(name: str, *, cache_dtype: str, isa: str | None = None) -> Backend:
    """The table entry of backend `name`, or `ConfigError` saying why it is refused.

    Args:
        name: vLLM's backend name (``get_name()``).
        cache_dtype: vLLM's ``cache_config.cache_dtype``.
        isa: the CPU attention ISA the layers use (``layer.isa``; CPU_ATTN only).
    """
    b = BACKENDS.get(name)
    if b is None:
        raise ConfigError(
            f"attention backend {name!r}: KVHandoffConnector does not know where this backend's "
            f"kernels keep a token inside a page, and will not guess it from tensor shapes "
            f"(known: {', '.join(sorted(BACKENDS))}); run one of those (vLLM's "
            "--attention-backend) or add this one to the table with its layout probe")
    if cache_dtype not in b.cache_dtypes:
        raise ConfigError(
            f"cache_config.cache_dtype: {cache_dtype!r} with {name}: the connector does not "
            f"describe this cache dtype's rows for {name} (its scales or packing are not in "
            f"the table); run --kv-cache-dtype with one of {', '.join(b.cache_dtypes)}")
    if b.k_columns:
        if isa is None:
            raise ConfigError(f"{name}: the layers carry no attention ISA (layer.isa); cannot "
                              "tell how the kernel stores K")
        if isa not in CPU_ISAS:
            raise ConfigError(
                f"{name} ISA {isa!r}: its cache write stores K and V in tiles of its own that "
                f"the connector does not describe (known ISAs: {', '.join(CPU_ISAS)}); vLLM "
                "picks AMX for bfloat16 with blocks of a multiple of 32 tokens on CPUs with AMX "
                "tiles: run --dtype float16 or float32, or --block-size 16")
    return b


def dtype_identity(cache_dtype: str, dtype: str, backend: Backend,
                   scales: Iterable[tuple[str, float, float]]) -> str:
    """The layout's ``kv_dtype``: vLLM's cache dtype and the element dtype, plus, for a
    per-tensor fp8 cache, the scales the bytes are read with (`scales`: per layer, its name,
    K scale and V scale), so two engines whose scales differ have different layouts and are
    refused at the handshake instead of reading each other's bytes wrongly. One scale pair for
    every layer is written out; per-layer scales (from a checkpoint) as a digest."""
    base = f"{cache_dtype}:{dtype}"
    if backend.fp8_dtype(cache_dtype) is None:
        return base
    rows = sorted((str(n), float(k), float(v)) for n, k, v in scales)
    pairs = {(k, v) for _, k, v in rows}
    if not pairs:
        raise ConfigError(f"cache_config.cache_dtype: {cache_dtype!r}: no attention layer "
                          "says its fp8 scales (layer._k_scale_float / _v_scale_float); the "
                          "connector will not move fp8 bytes without them")
    if len(pairs) == 1:
        ((k, v),) = pairs
        return f"{base}:scale k={k!r} v={v!r}"
    text = ";".join(f"{n}={k!r}/{v!r}" for n, k, v in rows)
    return f"{base}:scales sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def layer_scales(layers: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(name, K scale, V scale) of every layer that has them (vLLM's ``_k_scale_float`` and
    ``_v_scale_float``, set when the checkpoint's scales load)."""
    out = []
    for name, layer in layers.items():
        k = getattr(layer, "_k_scale_float", None)
        v = getattr(layer, "_v_scale_float", None)
        if k is not None:
            out.append((name, float(k), float(v if v is not None else k)))
    return out
