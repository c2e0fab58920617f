"""The connector's attention-backend table: a backend it does not know, a quantized cache, the
AMX ISA are refused at start with the reason; a layer the layout probe cannot reach is refused,
not trusted; a named backend that disagrees with the spec is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.backends import BACKENDS, CPU_ISAS, resolve


def test_table_and_refusals() -> None:
    assert set(BACKENDS) == {"CPU_ATTN", "CPU_MLA", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN",
                             "FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "FLASHINFER_MLA",
                             "CUTLASS_MLA", "TRITON_MLA", "FLASH_ATTN_MLA_SPARSE",
                             "FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE"}
    assert resolve("CPU_ATTN", cache_dtype="auto", isa="vec").k_columns
    assert resolve("FLASHMLA", cache_dtype="auto").mla
    with pytest.raises(ConfigError, match=r"'XFORMERS'.*will not guess it from tensor shapes"):
        resolve("XFORMERS", cache_dtype="auto")
    assert resolve("FLASH_ATTN", cache_dtype="fp8").fp8_dtype("fp8") == "float8_e4m3fn"
    with pytest.raises(ConfigError, match=r"cache_dtype: 'fp8_e5m2' with FLASH_ATTN.*"
                                          r"--kv-cache-dtype with one of auto, float16"):
        resolve("FLASH_ATTN", cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match=r"cache_dtype: 'nvfp4' with FLASHINFER"):
        resolve("FLASHINFER", cache_dtype="nvfp4")
    with pytest.raises(ConfigError,
                       match=r"ISA 'amx'.*--dtype float16 or float32, or --block-size 16"):
        resolve("CPU_ATTN", cache_dtype="auto", isa="amx")
    with pytest.raises(ConfigError, match="no attention ISA"):
        resolve("CPU_ATTN", cache_dtype="auto")
    assert "vec16" in CPU_ISAS
    assert "column-major" in BACKENDS["CPU_ATTN"].token_layout("HND")


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is installed by `make setup`")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import vllm_env as env

    return env.model_dir(tmp_path_factory.mktemp("model"))


def register(model: Path, extra: dict[str, object]) -> object:
    import vllm_env as env
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector

    cfg = env.vllm_config(model, role="kv_consumer", engine_id="x", extra=extra)
    kcc = env.kv_cache_config(cfg, 8)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(env.allocate(cfg, kcc))
    return conn


@needs_vllm
def test_connector_refuses_an_unknown_backend(model: Path) -> None:
    with pytest.raises(ConfigError, match="'XFORMERS'"):
        register(model, {"attention_backend": "XFORMERS"})


@needs_vllm
def test_connector_refuses_a_backend_of_the_wrong_kind(model: Path) -> None:
    with pytest.raises(ConfigError, match="FLASHMLA: an MLA backend, but the KV cache spec is "
                                          "full attention"):
        register(model, {"attention_backend": "FLASHMLA"})


@needs_vllm
def test_probe_without_engine_layers_refuses(model: Path) -> None:
    # no model here registered attention layers: no write path for the probe to call
    with pytest.raises(ConfigError, match="refuses to start rather than trust the layout"):
        register(model, {"settings": {"layout_probe": True, "transport": "tcp"}})


@needs_vllm
def test_probe_off_is_said(model: Path) -> None:
    conn = register(model, {"settings": {"transport": "tcp"}})
    try:
        assert conn.probe_report.startswith("layout probe off")  # type: ignore[attr-defined]
    finally:
        conn.shutdown()  # type: ignore[attr-defined]
