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

Every region moves whole pages where both sides use one page size (`RegionSpec.whole_pages`), so
a partly filled last page is right by construction; token-granular pairing (different page
sizes) relies on the planes above. Only the ``auto`` cache dtype (the model's dtype) is accepted,
but for the self-contained quantised rows a backend lists (``quantized_dtypes``): other
quantized caches keep scales the probe does not check yet.

Pure: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.errors import ConfigError

__all__ = ["BACKENDS", "CPU_ISAS", "Backend", "resolve"]

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
            write_op="cpu_attn_reshape_and_cache", device="cpu"),
    Backend("CPU_MLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="CPUMLAImpl.do_kv_cache_update", device="cpu"),
    Backend("FLASH_ATTN", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="reshape_and_cache_flash", device="cuda"),
    Backend("FLASHINFER", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="reshape_and_cache_flash", device="cuda"),
    Backend("TRITON_ATTN", mla=False, orders=("HND", "NHD"), k_columns=False,
            write_op="triton_reshape_and_cache_flash", device="cuda"),
    Backend("FLASHMLA", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda"),
    Backend("FLASHMLA_SPARSE", mla=True, orders=("MLA",), k_columns=False,
            write_op="concat_and_cache_mla", device="cuda",
            quantized_dtypes=("fp8_ds_mla", "fp8")),
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
    if cache_dtype != "auto" and cache_dtype not in b.quantized_dtypes:
        raise ConfigError(
            f"cache_config.cache_dtype: {cache_dtype!r} with {name}: quantized KV caches carry "
            "scales the connector's layout probe does not check yet; run with "
            "--kv-cache-dtype auto")
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
