"""The lane choice every integration shares (`integrations.lanes`), on CPU: where the buffers
live (CUDA stand-ins: objects with ``__cuda_array_interface__`` over addresses nobody reads)
decides the transport; a host without NIXL refuses a choice that needs it at start, naming the
setting and the install line; the vLLM connector's old import path is the same function."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.integrations import lanes
from kvhandoff.integrations.lanes import NIXL_INSTALL, buffers_memory, choose_lane
from kvhandoff.settings import Settings
from kvhandoff.transports.base import TransportKind

_BASE = 0x7E00_0000_0000


class FakeCuda:
    """A device byte range as CuPy/Numba describe one (no GPU needed)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3}


def no_nixl() -> str:
    return "the nixl_cu12 package is not installed"


def test_buffers_memory_reads_every_buffer() -> None:
    dev = {"main_kv": {0: FakeCuda(_BASE, 4096), 1: FakeCuda(_BASE + 8192, 4096)}}
    host = {"aux": {0: np.zeros(64, np.uint8)}, "more": [torch.zeros(4)]}
    assert buffers_memory(dev, "kv") == "cuda"
    assert buffers_memory(host, "aux") == "host"
    assert buffers_memory({}, "tail") == "host"
    with pytest.raises(ConfigError, match=r"^both: some buffers in cuda memory, some in host"):
        buffers_memory({"a": dev, "b": host}, "both")


def test_cuda_default_takes_nixl_across_hosts_when_installed() -> None:
    s, line = choose_lane(Settings(), "cuda", missing=lambda: None)
    assert s.transport is TransportKind.AUTO and s.auto_cross_host is TransportKind.NIXL
    assert "shm's CUDA IPC lane with peers on this host, nixl with other hosts" in line
    # host memory: the settings stand (ucx across hosts)
    h, line = choose_lane(Settings(), "host", missing=no_nixl)
    assert h.auto_cross_host is TransportKind.UCX and "host memory" in line


@pytest.mark.parametrize(("given", "named"), [
    ({}, "settings.transport=auto (its lane to other hosts is nixl for CUDA caches)"),
    ({"auto_cross_host": "nixl"}, "settings.auto_cross_host=nixl"),
    ({"transport": "nixl"}, "settings.transport=nixl"),
])
def test_a_host_without_nixl_refuses_at_start_with_the_install_line(
        given: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as e:
        choose_lane(Settings(**given), "cuda", missing=no_nixl)
    msg = str(e.value)
    assert msg.startswith(named), msg
    assert NIXL_INSTALL in msg and "pip install 'kvhandoff[nixl]'" in msg
    assert "nixl_cu12 package is not installed" in msg and "transport=shm" in msg


def test_same_host_cuda_lane_needs_no_nixl() -> None:
    s, line = choose_lane(Settings(transport="shm"), "cuda", missing=no_nixl)
    assert s.transport is TransportKind.SHM and "peers on this host only" in line


def test_host_memory_named_nixl_is_refused_without_nixl_too() -> None:
    with pytest.raises(ConfigError, match=re.escape("settings.transport=nixl: the KV caches "
                                                    "are host memory")):
        choose_lane(Settings(transport="nixl"), "host", missing=no_nixl)
    choose_lane(Settings(transport="tcp"), "host", missing=no_nixl)  # nothing needs NIXL


def test_the_default_check_is_looked_up_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanes, "nixl_missing", no_nixl)
    with pytest.raises(ConfigError, match=re.escape(NIXL_INSTALL)):
        choose_lane(Settings(), "cuda")


def test_this_host_has_nixl() -> None:
    # the venv installs the nixl extra (`make setup`): the real check finds it
    assert lanes.nixl_missing() is None


def test_vllm_connector_uses_the_shared_choice() -> None:
    from kvhandoff.integrations.vllm import lanes as vllm_lanes

    assert vllm_lanes.choose_lane is choose_lane


def test_engine_extras_bring_the_cuda_lane() -> None:
    """`pip install 'kvhandoff[vllm]'` / `[sglang]` on a (Linux) CUDA host brings NIXL, the
    lane CUDA caches take to other hosts; the refusal's install line names a real extra."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    meta = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    env = {"sys_platform": "linux", "platform_machine": "x86_64"}
    for name in ("vllm", "sglang", "nixl"):
        reqs = [Requirement(r) for r in extras[name]]
        nixl = [r for r in reqs if r.name == "nixl-cu12"]
        assert nixl and (nixl[0].marker is None or nixl[0].marker.evaluate(env)), name
    assert NIXL_INSTALL == "pip install 'kvhandoff[nixl]'"
