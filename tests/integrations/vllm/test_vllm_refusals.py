"""What the connector refuses at start, and what it asks of vLLM's compilation: vLLM's own
config objects (0.33, CPU) with KVHandoffConnector by module path.

- sleep mode: vLLM itself refuses to build the config (the connector says it cannot follow the
  KV cache remap: its agent registered that memory at start); before, the inherited answer was
  yes and a woken engine handed over freed memory;
- pipeline parallel size > 1: refused naming the setting (the connector hands over every layer
  from one TP group);
- piecewise CUDA graphs are asked for only by a layerwise decode (its per-layer wait runs inside
  the forward); a prefill and an async decode (the default) leave vLLM's full graphs on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402

from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.integrations.vllm.config import ConnectorConfig  # noqa: E402


def test_sleep_mode_refused_by_vllm(tmp_path: Path) -> None:
    # the CPU platform refuses sleep mode before any connector is asked: the check vLLM runs
    # when it builds the config of a GPU engine is called by hand
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="KVHandoffConnector does not support sleep mode"):
        cfg._verify_kv_transfer_compat()


def test_pipeline_parallel_refused(tmp_path: Path) -> None:
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        ConnectorConfig.of(cfg)


def test_async_is_the_default_load_mode(tmp_path: Path) -> None:
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    del cfg.kv_transfer_config.kv_connector_extra_config["load_mode"]  # the helper's
    assert ConnectorConfig.of(cfg).load_mode == "async"


@pytest.mark.parametrize(("extra", "piecewise"), [
    ({}, False),  # a prefill, or a decode with the default (async) load
    ({"bootstrap_url": "http://127.0.0.1:8998"}, False),
    ({"load_mode": "async"}, False),
    ({"load_mode": "layerwise"}, True),
])
def test_piecewise_graphs_only_for_layerwise(extra: dict[str, str], piecewise: bool) -> None:
    assert KVHandoffConnector.requires_piecewise_for_cudagraph(extra) is piecewise
