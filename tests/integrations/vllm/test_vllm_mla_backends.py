"""The MLA and DSA backends vLLM 0.33 picks on Hopper and Blackwell (``vllm/platforms/cuda.py``),
and per-tensor fp8 caches, as the connector's backend table describes them, checked against
vLLM's own code:

- each table entry's kernel block rule and cache dtypes equal what vLLM's backend class says
  (``get_supported_kernel_block_sizes``, ``supported_kv_cache_dtypes``): from the class where it
  imports on this CPU machine, else from the class's source in the installed vLLM (its
  module needs CUDA kernel libraries to import: FlashAttention, FlashInfer, CUTLASS);
- the dense MLA backends' pages, from vLLM's own ``MLAAttentionSpec`` (customised by the
  backend's ``customize_spec`` where the class imports), planner and allocator, laid out by the
  connector as one ``latent`` row per token, in the model dtype or 1-byte fp8;
- FLASHINFER_MLA_SPARSE on the real DSA layers (``DeepseekV32Attention`` built with vLLM's
  ``FlashInferMLASparseTRTLLMBackend``), bfloat16 and fp8, registered by the connector; the
  fp8 scales are part of the layout identity, so engines with other scales do not pair.

On the code before this change every one of these backends was refused at start (not in the
table), and any ``fp8`` cache with them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402

from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm.backends import (  # noqa: E402
    BACKENDS,
    FP8_PER_TENSOR,
    dtype_identity,
    resolve,
)
from kvhandoff.integrations.vllm.layout import build_layout  # noqa: E402

NEW = ("FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA", "FLASH_ATTN_MLA_SPARSE",
       "FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE")
DENSE = ("FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHMLA")
CUDA_TABLE = tuple(n for n, b in BACKENDS.items() if b.device == "cuda")


def _class_source(name: str) -> tuple[type | None, ast.ClassDef]:
    """vLLM's backend class of `name` (None where its module does not import here) and its
    definition in the installed vLLM's source (found by its ``get_name()``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = AttentionBackendEnum[name].get_path()
    module, cls_name = path.rsplit(".", 1)
    cls: type | None = None
    if module in sys.modules or _imports(module):
        cls = getattr(sys.modules[module], cls_name)
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return cls, node


def _imports(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - CUDA-only kernel libraries: read the source instead
        sys.modules.pop(module, None)
        return False
    return True


def vllm_facts(name: str) -> tuple[list[Any], list[str]]:
    """(kernel block sizes, cache dtypes) as vLLM's class of backend `name` states them."""
    from vllm.v1.attention.backend import MultipleOf

    cls, node = _class_source(name)
    if cls is not None:
        assert cls.get_name() == name
        return list(cls.get_supported_kernel_block_sizes()), list(cls.supported_kv_cache_dtypes)
    blocks = dtypes = None
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", "") == \
                "supported_kv_cache_dtypes":
            dtypes = ast.literal_eval(item.value)  # type: ignore[arg-type]
        if isinstance(item, ast.FunctionDef) and item.name == "get_name":
            ret = next(s for s in item.body if isinstance(s, ast.Return))
            assert ast.literal_eval(ret.value) == name  # type: ignore[arg-type]
        if isinstance(item, ast.FunctionDef) and item.name == "get_supported_kernel_block_sizes":
            (ret,) = [s for s in item.body if isinstance(s, ast.Return)]  # unconditional
            blocks = eval(compile(ast.Expression(ret.value), "<vllm>", "eval"),  # noqa: S307
                          {"MultipleOf": MultipleOf})
    assert blocks is not None and dtypes is not None, f"{name}: not stated in its class"
    return list(blocks), list(dtypes)


def test_the_table_has_vllms_default_mla_backends() -> None:
    assert set(NEW) <= set(BACKENDS)
    for n in NEW:
        assert BACKENDS[n].mla and BACKENDS[n].orders == ("MLA",), n


@pytest.mark.parametrize("name", CUDA_TABLE)
def test_block_rule_and_dtypes_are_vllms(name: str) -> None:
    from vllm.v1.attention.backend import MultipleOf

    b = BACKENDS[name]
    blocks, dtypes = vllm_facts(name)
    if b.mla:  # the GQA backends' rules depend on the model; their pages take any size here
        multiples = [x.base for x in blocks if isinstance(x, MultipleOf)]
        exact = tuple(x for x in blocks if isinstance(x, int))
        assert (b.block_multiple, b.kernel_blocks) == ((multiples[0], ()) if multiples
                                                       else (1, exact)), (name, blocks)
    described = {"auto", "float16", "bfloat16", *FP8_PER_TENSOR, *b.quantized_dtypes}
    assert set(b.cache_dtypes) == set(dtypes) & described, (name, dtypes)
    for dt in set(dtypes) - described:  # vLLM's other modes: refused naming what is taken
        with pytest.raises(ConfigError, match=rf"cache_dtype: '{dt}' with {name}.*one of"):
            resolve(name, cache_dtype=dt)


def _dense_views(name: str, cache_dtype: str, block: int, tmp: Path) -> dict[str, Any]:
    """vLLM's per-layer views of dense MLA caches: ``MLAAttentionSpec`` (576 = 512 latent + 64
    RoPE), the backend's ``customize_spec`` where its class imports, vLLM's planner and
    allocator."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = env.vllm_config(env.model_dir(tmp), role="kv_consumer", engine_id="x")
    dt = torch.uint8 if cache_dtype in FP8_PER_TENSOR else torch.bfloat16
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=dt,
                            cache_dtype_str=cache_dtype)
    cls, _ = _class_source(name)
    if cls is not None:
        spec = cls.customize_spec(spec)
    names = env.layer_names()
    kcc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(names, spec)],
                                          8 * spec.page_size_bytes * len(names))
    return allocate_kv_cache(kcc, torch.device("cpu"),  # type: ignore[no-any-return]
                             cfg.cache_config.get_resolved_kv_cache_layout())


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", DENSE)
def test_dense_mla_pages_from_vllms_spec(name: str, cache_dtype: str, tmp_path: Path) -> None:
    b = BACKENDS[name]
    if cache_dtype not in b.cache_dtypes:
        with pytest.raises(ConfigError, match=f"'{cache_dtype}' with {name}"):
            resolve(name, cache_dtype=cache_dtype)
        return
    block = b.kernel_blocks[0] if b.kernel_blocks else b.block_multiple
    views = _dense_views(name, cache_dtype, block, tmp_path)
    ident = dtype_identity(cache_dtype, "uint8" if cache_dtype != "auto" else "bfloat16", b,
                           [(n, 1.0, 1.0) for n in views])
    vl = build_layout(views, backend=resolve(name, cache_dtype=cache_dtype), block_size=block,
                      kv_dtype=ident, model="m", total_kv_heads=1)
    (reg,) = vl.layout.regions
    row = 576 * (1 if cache_dtype == "fp8" else 2)
    assert vl.order == "MLA" and [(p.name, p.bytes_per_token) for p in reg.planes] == \
        [("latent", row)]
    assert vl.layout.page_size_tokens == block
    b.check_block(block)
    assert reg.page_nbytes(block) == next(iter(views.values()))[0].numel() * \
        next(iter(views.values())).element_size()
    if cache_dtype == "fp8":
        assert ident == "fp8:uint8:scale k=1.0 v=1.0"


def test_a_page_size_the_kernel_does_not_run_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"CUTLASS_MLA: its kernel runs pages of 128 tokens, "
                                          r"but the KV cache pages hold 64 tokens"):
        BACKENDS["CUTLASS_MLA"].check_block(64)
    with pytest.raises(ConfigError, match="a multiple of 64 tokens.*hold 32"):
        BACKENDS["FLASH_ATTN_MLA_SPARSE"].check_block(32)
    BACKENDS["FLASHINFER_MLA_SPARSE"].check_block(96)


def test_fp8_scales_are_part_of_the_identity() -> None:
    b = BACKENDS["FLASHINFER_MLA"]
    one = dtype_identity("fp8", "uint8", b, [("a", 1.0, 1.0), ("b", 1.0, 1.0)])
    two = dtype_identity("fp8", "uint8", b, [("a", 1.0, 1.0), ("b", 0.5, 1.0)])
    same = dtype_identity("fp8", "uint8", b, [("b", 0.5, 1.0), ("a", 1.0, 1.0)])
    assert one != two and two == same and two.startswith("fp8:uint8:scales sha256 ")
    assert dtype_identity("auto", "bfloat16", b, []) == "auto:bfloat16"
    with pytest.raises(ConfigError, match="no attention layer says its fp8 scales"):
        dtype_identity("fp8_e4m3", "uint8", b, [])
    # FLASHMLA_SPARSE's fp8 is fp8_ds_mla: self-contained rows, no per-tensor scale
    assert dtype_identity("fp8", "uint8", BACKENDS["FLASHMLA_SPARSE"], []) == "fp8:uint8"


# ---- the real DSA layers with FlashInfer's sparse MLA backend


def _dsa_connector(tmp: Path, cache_dtype: str, k_scale: float | None = None) -> Any:
    import vllm_dsa_env as dsa
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
        FlashInferMLASparseTRTLLMBackend,
    )

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg = dsa.vllm_config(dsa.model_dir(tmp), role="kv_consumer", engine_id="x")
    cfg.cache_config.cache_dtype = cache_dtype
    specs = dsa.build_layers(cfg, tmp, backend=FlashInferMLASparseTRTLLMBackend)
    if k_scale is not None:  # as a checkpoint's scale of one layer would load
        layer = cfg.compilation_config.static_forward_context["model.layers.1.self_attn.attn"]
        layer._k_scale_float = k_scale
    kcc = dsa.kv_cache_config(cfg, specs, num_blocks=4)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(dsa.allocate(cfg, kcc))
    except BaseException:
        conn.shutdown()
        raise
    return conn


@pytest.mark.parametrize(("cache_dtype", "row", "ident"), [
    ("auto", 1152, "auto:bfloat16"),
    ("fp8", 576, "fp8:uint8:scale k=1.0 v=1.0"),
])
def test_flashinfer_sparse_dsa_layers_register(tmp_path: Path, cache_dtype: str, row: int,
                                               ident: str) -> None:
    conn = _dsa_connector(tmp_path, cache_dtype)
    try:
        lay = conn.layout.layout
        assert conn.layout.backend.name == "FLASHINFER_MLA_SPARSE"
        assert [(p.name, p.bytes_per_token) for p in lay.region("kv").planes] == \
            [("latent", row)]
        assert lay.kv_dtype == ident and lay.page_size_tokens == 64
    finally:
        conn.shutdown()


def test_fp8_engines_with_other_scales_do_not_pair(tmp_path: Path) -> None:
    from kvhandoff.kv_layout import layout_compat_diff

    a = _dsa_connector(tmp_path / "a", "fp8")
    try:
        b = _dsa_connector(tmp_path / "b", "fp8", k_scale=0.25)
        try:
            la, lb = a.layout.layout, b.layout.layout
            assert la.kv_dtype != lb.kv_dtype
            assert "kv_dtype" in str(layout_compat_diff(la, lb))
        finally:
            b.shutdown()
    finally:
        a.shutdown()

