"""`kvhandoff doctor`: checks a node before it goes live (UCX build and lanes, NIXL, RDMA
devices, locked memory, /dev/shm, the shm copy helper, cross-process memory access,
hugepages, CUDA and CUDA IPC, the bootstrap server, the address family of the agents and the
server, whether they listen unauthenticated). Each check returns a `CheckResult`; only FAIL
results are blocking.

Checks read system files through a `root` directory (``/`` on a real node) so tests can run
them against a fake root as well as the real system.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvhandoff.settings import Settings

from .auth import check_auth
from .bootstrap import check_bootstrap
from .cuda import check_cuda_devices, check_cuda_ipc
from .model import CheckResult, Status
from .native import check_native_copy
from .network import check_addresses
from .system import (
    check_hugepages,
    check_memlock,
    check_ptrace,
    check_rdma,
    check_shm,
    rdma_inventory,
)
from .ucx import check_nixl, check_ucx_lanes, check_ucx_library, ucx_build

__all__ = [
    "CheckResult", "Status", "check_addresses", "check_auth", "check_bootstrap",
    "check_cuda_devices", "check_cuda_ipc", "check_hugepages", "check_memlock",
    "check_native_copy", "check_nixl", "check_ptrace",
    "check_rdma", "check_shm", "check_ucx_lanes", "check_ucx_library", "rdma_inventory",
    "report_json", "run_checks", "ucx_build",
]


def run_checks(root: Path = Path("/"), *, bootstrap_url: str | None = None,
               require_rdma: bool = False, transport: str = "ucx",
               auto_cross_host: str = "ucx", probes: bool = True,
               layout_probe: bool = True, agent_host: str = "127.0.0.1",
               settings: Settings | None = None) -> list[CheckResult]:
    """Runs every check. `probes=False` skips those that start processes or endpoints (the
    loopback UCX lanes, the cross-process read, CUDA IPC). `settings`: the node's settings,
    for the checks that read them whole (authentication)."""
    inv = rdma_inventory(root)
    rdma_present = bool(inv.devices or inv.dev_nodes)
    out = [check_ucx_library(root, rdma_present=rdma_present, require_rdma=require_rdma,
                             ucx_is_transport=transport == "ucx" or (
                                 transport == "auto" and auto_cross_host == "ucx"))]
    if probes:
        out.append(check_ucx_lanes(rdma_present=rdma_present, require_rdma=require_rdma))
    else:
        out.append(CheckResult("ucx_lanes", Status.SKIP, "not checked (--no-probes)"))
    out += [
        check_nixl(),
        check_rdma(root, require_rdma=require_rdma),
        check_memlock(root, rdma_present=rdma_present, require_rdma=require_rdma),
        check_shm(root),
        check_native_copy(),
        check_ptrace(root, probe=probes),
        check_hugepages(root),
        check_cuda_devices(root),
        check_cuda_ipc(probe=probes),
        check_bootstrap(bootstrap_url),
        check_addresses(agent_host, bootstrap_url=bootstrap_url, probe=probes),
        _layout_probe(layout_probe),
    ]
    if settings is not None:
        out.append(check_auth(settings))
    return out


def _layout_probe(on: bool) -> CheckResult:
    """The engine adapters' layout probe at start (setting layout_probe)."""
    if on:
        return CheckResult("layout_probe", Status.OK, "on: engine adapters check their KV "
                           "layout against the engine's own cache write at start")
    return CheckResult("layout_probe", Status.WARN, "off (KVHANDOFF_LAYOUT_PROBE=false): KV "
                       "layouts are trusted without asking the engine's kernel",
                       fix="unset KVHANDOFF_LAYOUT_PROBE (the probe runs in milliseconds)")


def report_json(results: list[CheckResult]) -> dict[str, Any]:
    blocking = [r.name for r in results if r.blocking]
    return {"ok": not blocking, "blocking": blocking, "checks": [r.to_json() for r in results]}
