"""The optional NIXL baseline of `kvhandoff bench` (case `nixl`): one NIXL WRITE of the same
page set the memcpy case copies, every piece one descriptor, all in one transfer request.

Two NIXL agents (UCX backend) in this process, source and destination registered as DRAM;
the request is built from two N x 3 numpy arrays (address, length, device 0) and posted once;
the time is from creating the request to NIXL reporting DONE. Needs the `nixl` extra
(`pip install 'kvhandoff[nixl]'`, i.e. nixl-cu12, which imports as `nixl_cu12` and runs on a
CPU-only machine for DRAM); without it the case is refused with that reason.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError


def _import_nixl() -> Any:
    try:
        from nixl_cu12 import _api
    except ImportError:
        try:
            from nixl import _api  # type: ignore[no-redef]
        except ImportError as e:
            raise ConfigError("bench case 'nixl' needs NIXL: pip install 'kvhandoff[nixl]' "
                              f"(nixl-cu12); import failed: {e}") from None
    return _api


class NixlWrite:
    """The `nixl` case: src -> dst arrays of the memcpy case, spans (src_off, dst_off, n)."""

    def __init__(self, mc_spans: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]]
                 ) -> None:
        api = _import_nixl()
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.version = getattr(api, "__version__", None) or _dist_version()
        self.src_agent = api.nixl_agent(f"kvh-bench-src-{os.getpid()}",
                                        api.nixl_agent_config(backends=["UCX"]))
        self.dst_agent = api.nixl_agent(f"kvh-bench-dst-{os.getpid()}",
                                        api.nixl_agent_config(backends=["UCX"]))
        srcs = {id(s): s for s, _, _ in mc_spans}
        dsts = {id(d): d for _, d, _ in mc_spans}
        self.src_agent.register_memory(_regions(srcs.values()), "DRAM")
        self.dst_agent.register_memory(_regions(dsts.values()), "DRAM")
        self.remote = self.src_agent.add_remote_agent(self.dst_agent.get_agent_metadata())
        local, remote = [], []
        for src, dst, spans in mc_spans:
            if not spans:
                continue
            a = np.asarray(spans, dtype=np.int64)
            local.append(np.stack([a[:, 0] + src.ctypes.data, a[:, 2],
                                   np.zeros(len(a), np.int64)], axis=1))
            remote.append(np.stack([a[:, 1] + dst.ctypes.data, a[:, 2],
                                    np.zeros(len(a), np.int64)], axis=1))
        self.local = self.src_agent.get_xfer_descs(np.concatenate(local), "DRAM")
        self.remote_descs = self.src_agent.get_xfer_descs(np.concatenate(remote), "DRAM")
        self.descriptors = int(sum(len(x) for x in local))
        self.mc_spans = mc_spans
        self.backend = "?"

    def write(self, verify: bool, verified: dict[str, bool]) -> float:
        if verify:
            for _, dst, _ in self.mc_spans:
                dst[:] = 0
        t0 = time.perf_counter()
        handle = self.src_agent.initialize_xfer("WRITE", self.local, self.remote_descs,
                                                self.remote)
        state = self.src_agent.transfer(handle)
        while state == "PROC":
            state = self.src_agent.check_xfer_state(handle)
        dt = time.perf_counter() - t0
        try:
            self.backend = self.src_agent.query_xfer_backend(handle)
        except Exception:  # informational only
            pass
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE ended in state {state}")
        if verify:
            verified["nixl"] = all(
                np.array_equal(dst[d:d + n], src[s:s + n])
                for src, dst, spans in self.mc_spans for s, d, n in spans)
        return dt

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "backend": self.backend,
                "descriptors": self.descriptors,
                "setup": "two NIXL agents (UCX backend) in the bench process, DRAM -> DRAM, "
                         "one WRITE request of every piece"}


def _regions(arrays: Any) -> np.ndarray:
    return np.asarray([[a.ctypes.data, a.nbytes, 0] for a in arrays], dtype=np.int64)


def _dist_version() -> str | None:
    from importlib import metadata

    for name in ("nixl-cu12", "nixl"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
