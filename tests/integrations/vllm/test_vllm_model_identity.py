"""The model at the handshake: the layout's ``model`` is the served model name and a digest of
the architecture config (`worker.model_label`), built by ``register_kv_caches`` from vLLM's own
config of the model; the handshake compares it with the rest of the layout
(`layout_compat_diff`), so a prefill serving another model is refused naming ``model`` with
both sides' values. Before, the label was ``vllm:<model_type>``: every Llama-like checkpoint
passed as the same model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.kv_layout import layout_compat_diff  # noqa: E402

SETTINGS = {"transport": "tcp"}


def layout_of(model: Path, role: str, **kw: Any) -> Any:
    cfg = env.vllm_config(model, role=role, engine_id=f"id-{role}",
                          extra={"settings": SETTINGS, **(
                              {"bootstrap_url": "http://127.0.0.1:1"} if role == "kv_producer"
                              else {})})
    if "served" in kw:
        cfg.model_config.served_model_name = kw["served"]
    kcc = env.kv_cache_config(cfg)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(env.allocate(cfg, kcc))
        assert conn.layout is not None
        return conn.layout.layout
    finally:
        conn.shutdown()


def variant(root: Path, name: str, **changes: Any) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**env.CONFIG, **changes}))
    return d


def test_same_model_same_label(tmp_path: Path) -> None:
    model = env.model_dir(tmp_path)
    # another directory holding the same config (a copy on another host): still the same model
    # as far as the handshake goes when it is served under the same name
    copy = variant(tmp_path, "copy")
    pre = layout_of(model, "kv_producer", served="tiny")
    dec = layout_of(copy, "kv_consumer", served="tiny")
    assert pre.model.startswith("vllm:tiny config:")
    assert layout_compat_diff(pre, dec) == []


@pytest.mark.parametrize(("changes", "served"), [
    ({"rope_theta": 500000.0}, "tiny"),  # another architecture config, same name
    ({}, "other-model"),  # another served model
])
def test_other_model_is_refused_naming_it(tmp_path: Path, changes: dict[str, Any],
                                          served: str) -> None:
    pre = layout_of(env.model_dir(tmp_path), "kv_producer", served="tiny")
    dec = layout_of(variant(tmp_path, "other", **changes), "kv_consumer", served=served)
    diff = layout_compat_diff(pre, dec)
    assert diff == [f"model: prefill={pre.model!r} decode={dec.model!r}"], diff
    assert pre.model != dec.model
