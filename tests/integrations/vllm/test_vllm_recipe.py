"""docs/VLLM.md's launch recipe, read out of the document (so the two cannot drift) and started:
the connectors of its prefill and decode on CPU with vLLM's own config, planner and allocator,
its secrets and a bootstrap server that requires its token; and the lane the same code path
(`lanes.choose_lane`, called by ``register_kv_caches`` with the caches' memory kind) picks for
the CUDA caches a GPU user of the recipe has.

Only the addresses are replaced (the recipe's hosts are not this machine); the test adds the
two keys a test without a model needs (`vllm_env.vllm_config`: the attention backend's name, no
layout probe) and asserts that nothing else differs from the recipe.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.errors import ConfigError  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector  # noqa: E402
from kvhandoff.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvhandoff.integrations.vllm.lanes import choose_lane  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of  # noqa: E402
from kvhandoff.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402
from kvhandoff.transports.base import TransportKind  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "VLLM.md"
SECRET, TOKEN = "recipe-test-hmac-secret", "recipe-test-auth-token"


def recipe() -> tuple[str, dict[str, dict[str, Any]], set[str]]:
    """The launch section's shell block: its text, the two ``--kv-transfer-config`` objects by
    ``kv_role`` and the ``KVHANDOFF_*`` variables it sets."""
    text = DOC.read_text()
    section = text[text.index("## Launch"):]
    block = section[section.index("```sh") + 5:]
    block = block[:block.index("```")]
    configs = [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", block,
                                                 flags=re.S)]
    env_vars = set(re.findall(r"\b(KVHANDOFF_[A-Z_]+)=", block))
    return block, {c["kv_role"]: c for c in configs}, env_vars


def test_recipe_shape() -> None:
    block, configs, env_vars = recipe()
    assert set(configs) == {"kv_producer", "kv_consumer"}
    # a GPU user copies this: nothing that cannot move device memory, no layout variable to
    # remember, the secrets every non-loopback agent and bootstrap server needs
    assert "VLLM_KV_CACHE_LAYOUT" not in block
    assert {"KVHANDOFF_HMAC_SECRET", "KVHANDOFF_AUTH_TOKEN", "KVHANDOFF_AGENT_HOST"} <= env_vars
    for c in configs.values():
        assert c["kv_connector"] == "KVHandoffConnector"
        settings = c.get("kv_connector_extra_config", {}).get("settings", {})
        assert settings.get("transport", "auto") == "auto", settings


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_recipe_moves_cuda_caches_across_hosts(role: str) -> None:
    """The lane for the recipe's settings on a GPU: auto with nixl across hosts (what the old
    recipe's ``"transport": "ucx"`` could not do: ucx refuses CUDA buffers)."""
    _, configs, _ = recipe()
    extra = configs[role].get("kv_connector_extra_config", {})
    settings, line = choose_lane(Settings(**extra.get("settings", {})), "cuda")
    assert settings.transport is TransportKind.AUTO
    assert settings.auto_cross_host is TransportKind.NIXL
    assert "nixl with other hosts" in line
    # host memory (the CPU build): the settings stand
    host, line = choose_lane(Settings(**extra.get("settings", {})), "host")
    assert host.auto_cross_host is TransportKind.UCX and "host memory" in line


@pytest.mark.parametrize(("given", "named"), [
    ({"transport": "ucx"}, "settings.transport=ucx"),
    ({"transport": "tcp"}, "settings.transport=tcp"),
    ({"auto_cross_host": "ucx"}, "settings.auto_cross_host=ucx"),
    ({"auto_cross_host": "tcp"}, "settings.auto_cross_host=tcp"),
    ({"one_sided_writes": False}, "settings.one_sided_writes=false"),
])
def test_cuda_caches_refuse_host_only_lanes(given: dict[str, Any], named: str) -> None:
    if "one_sided_writes" not in given:  # a host-only lane: host staging unless it is off
        _, line = choose_lane(Settings(**given), "cuda")
        assert "through HOST STAGING" in line, line
        given = {**given, "host_staging": "off"}
        named += r": the KV caches are CUDA memory"
    with pytest.raises(ConfigError, match=re.escape(named)):
        choose_lane(Settings(**given), "cuda")
    choose_lane(Settings(**given), "host")  # host memory: any of these moves it
    for ok in ({"transport": "nixl"}, {"transport": "shm"}, {"auto_cross_host": "nixl"}):
        assert choose_lane(Settings(**ok), "cuda")[0].transport is Settings(**ok).transport


@pytest.fixture
def secured(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The recipe's environment on this host: its secrets, agents on loopback."""
    monkeypatch.setenv("KVHANDOFF_HMAC_SECRET", SECRET)
    monkeypatch.setenv("KVHANDOFF_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("KVHANDOFF_AGENT_HOST", "127.0.0.1")
    with run_server(Settings(port=0, auth_token=TOKEN)) as url:
        yield url


def _localise(cfg: dict[str, Any], url: str) -> dict[str, Any]:
    out = json.loads(json.dumps(cfg))
    extra = out.setdefault("kv_connector_extra_config", {})
    if "bootstrap_url" in extra:
        extra["bootstrap_url"] = url
    return out


def test_recipe_starts_on_cpu(secured: str, tmp_path: Path,
                              caplog: pytest.LogCaptureFixture) -> None:
    """Both connectors of the recipe start (agent up, lane logged); the prefill's scheduler
    binds a room at a bootstrap server that requires the recipe's token (before: its client
    sent none and every binding was refused, so no request was handed off)."""
    _, configs, _ = recipe()
    model = env.model_dir(tmp_path)
    conns = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            kt = _localise(configs[role], secured)
            extra = kt.get("kv_connector_extra_config", {})
            cfg = env.vllm_config(model, role=role, engine_id=kt.get("engine_id", "decode-0"),
                                  extra=extra,
                                  policy=kt.get("kv_load_failure_policy", "fail"))
            if "load_mode" not in extra:  # the helper's layerwise decode: run the recipe's
                cfg.kv_transfer_config.kv_connector_extra_config.pop("load_mode", None)
            added = set(cfg.kv_transfer_config.kv_connector_extra_config) - set(extra)
            assert added <= {"attention_backend", "settings"}, added
            kcc = env.kv_cache_config(cfg)
            conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
            conns.append(conn)
            with caplog.at_level("INFO", logger="kvhandoff.vllm"):
                conn.register_kv_caches(env.allocate(cfg, kcc))
            assert conn.agent.status()["transport"]["kind"] == "auto"
            assert "KV caches in host memory: transport auto" in caplog.text
            if role == "kv_producer":
                # the worker's agent registers on a thread of its own: a bind before the
                # server holds the rank is refused (404, engine not registered), as it was
                # once beside busy loops on every core
                assert conn.agent.wait_registered(60)
                side = SchedulerSide(ConnectorConfig.of(cfg), cfg)
                room = room_of(kt["engine_id"], "cmpl-recipe")
                try:
                    side._bind_now(room)
                finally:
                    side.close()
                with BootstrapClient(secured, token=TOKEN) as c:
                    assert c.room(room).engine_id == kt["engine_id"]
    finally:
        for c in conns:
            c.shutdown()


def test_vllm_resolves_head_major_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own layout resolution, for a backend that prefers token-major pages (FLASH_ATTN's
    order), picks head-major pages because the connector asks for them; so engines of other
    TP sizes pair without VLLM_KV_CACHE_LAYOUT (before: LBNHC, refused across TP sizes)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    cfg = env.vllm_config(env.model_dir(tmp_path), role="kv_consumer", engine_id=env.ENGINE_D)
    cfg.cache_config.kv_cache_layout = None
    assert resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC", "BLNHC", "BLHNC"]]).name == "LBHNC"
