"""GPU tests (marker `gpu`; skipped with "no CUDA device" without one; run by
scripts/gpu_check.sh): the lane choice every integration shares (`integrations.lanes`) on real
CUDA buffers. The settings an SGLang rank and a vLLM worker start with by default (transport
auto, nothing else set) give an agent over CUDA pages that starts: shm's CUDA IPC lane for this
host and nixl (VRAM registration) for the others, where before its UCX part refused the CUDA
buffers at register. A host-only transport takes host staging, or with host_staging=off is
refused at the choice, naming the setting.

Written without a GPU at hand: its first run on a lent machine is the first check."""

from __future__ import annotations

import pytest
import torch

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.errors import ConfigError
from kvhandoff.integrations.lanes import buffers_memory, choose_lane, nixl_missing
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent
from kvhandoff.transports.base import TransportKind

from .shm_cuda_agent_peer import tiny_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_default_settings_start_an_agent_on_cuda_pages() -> None:
    if nixl_missing():
        pytest.skip(f"NIXL is not installed here ({nixl_missing()}): pip install "
                    "'kvhandoff[nixl]'")
    layout = tiny_layout()
    bufs = allocate(layout, 8, device="cuda")
    assert buffers_memory(bufs, "kv") == "cuda"
    settings, line = choose_lane(Settings(), "cuda")
    assert settings.auto_cross_host is TransportKind.NIXL, line
    agent = TransferAgent("decode", layout, bufs, settings, engine_id="gpu-lanes")
    try:
        st = agent.status()
        assert st["transport"]["kind"] == "auto", st["transport"]
    finally:
        agent.close()


@pytest.mark.parametrize("given", [{"transport": "ucx"}, {"transport": "tcp"},
                                   {"auto_cross_host": "ucx"}])
def test_host_only_lanes_are_refused_for_cuda_pages(given: dict[str, str]) -> None:
    bufs = allocate(tiny_layout(), 8, device="cuda")
    _, line = choose_lane(Settings(**given), buffers_memory(bufs, "kv"))
    assert "through HOST STAGING" in line  # host_staging=auto
    with pytest.raises(ConfigError, match=r"settings\.(transport|auto_cross_host)="):
        choose_lane(Settings(**given, host_staging="off"), buffers_memory(bufs, "kv"))
