"""The SGLang backend's lane choice (`integrations.lanes`, shared with the vLLM connector), per
agent of a rank: CUDA pools (stood for by ``__cuda_array_interface__`` objects over addresses
nobody reads) take shm's CUDA IPC lane on this host and nixl to other hosts instead of the
settings' UCX (which refuses CUDA memory at register, so SGLang on GPUs did not start with the
documented launch); a setting that cannot move the pool is refused at start naming it; a host
without NIXL is refused at the real manager's start with the install line."""

from __future__ import annotations

from typing import Any

import pytest
import sglang_env as E

from kvhandoff.errors import ConfigError
from kvhandoff.settings import Settings
from kvhandoff.transports.base import TransportKind

pytestmark = pytest.mark.usefixtures("sglang_loaded")


class FakeCuda:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3}


def cuda_pool() -> dict[str, dict[int, Any]]:
    return {"main_kv": {i: FakeCuda(0x7D00_0000_0000 + i * 65536, 4096) for i in range(2)}}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cuda_pool_takes_nixl_across_hosts(role: str) -> None:
    from kvhandoff.integrations.sglang.conn import _agent_settings, agent_lane

    base = _agent_settings(role, "127.0.0.1", "http://127.0.0.1:1" if role == "prefill"
                           else None)
    assert base.auto_cross_host is TransportKind.UCX  # what the agents started with before
    s, line = agent_lane(base, cuda_pool(), "kv", role)
    assert s.transport is TransportKind.AUTO and s.auto_cross_host is TransportKind.NIXL
    assert "nixl with other hosts" in line
    # SGLang's raised bounds are kept
    assert s.bootstrap_timeout_s == base.bootstrap_timeout_s and s.lease_s == base.lease_s
    # the metadata buffers (host memory) keep the settings as given
    h, line = agent_lane(base, {"aux": {0: bytearray(64)}}, "aux", role)
    assert h == base and "host memory" in line


def test_a_host_only_transport_is_refused_naming_the_setting() -> None:
    from kvhandoff.integrations.sglang.conn import agent_lane

    # host staging (the default, host_staging=auto) moves CUDA pages over a host-only lane
    _, line = agent_lane(Settings(transport="tcp"), cuda_pool(), "kv", "decode")
    assert "through HOST STAGING" in line
    with pytest.raises(ConfigError, match=r"kvhandoff SGLang decode backend, kv agent: "
                                          r"settings\.transport=tcp: the KV caches are CUDA.*"
                                          r"settings\.host_staging=off"):
        agent_lane(Settings(transport="tcp", host_staging="off"), cuda_pool(), "kv", "decode")


def test_manager_start_without_nixl_names_the_install_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations import lanes
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "nixl")
    monkeypatch.setattr(lanes, "nixl_missing", lambda: "the nixl_cu12 package is not installed")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        sa = E.server_args("prefill", srv.port)
        with pytest.raises(ConfigError) as e:
            E.kv_class("MANAGER")(E.kv_args(E.pools()), DisaggregationMode.PREFILL, sa, True)
        msg = str(e.value)
        assert "kvhandoff SGLang prefill backend, kv agent: settings.transport=nixl" in msg
        assert "pip install 'kvhandoff[nixl]'" in msg
    finally:
        srv.close()


def test_manager_logs_each_agents_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "tcp")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        sa = E.server_args("prefill", srv.port)
        mgr = E.kv_class("MANAGER")(E.kv_args(E.pools()), DisaggregationMode.PREFILL, sa, True)
        try:
            assert mgr.lanes["kv"] == "KV caches in host memory: transport tcp (tcp)"
            assert set(mgr.lanes) == {"kv", "aux", "tail"}
        finally:
            mgr.close()
    finally:
        srv.close()
