"""The optional NIXL baseline of `kvhandoff bench` (case `nixl`): one NIXL WRITE of the same
page set the memcpy case copies, every piece one descriptor, all in one transfer request.

It runs in a worker process (`python -m kvhandoff.bench.worker nixl`): two NIXL agents (UCX
backend), source and destination buffers of the memcpy case's sizes registered as DRAM, the
request built from two N x 3 numpy arrays (address, length, device 0) and posted once; the time
is from creating the request to NIXL reporting DONE, and the last repetition checks every
piece. A process of its own, which leaves with os._exit after its last answer: a NIXL process
could crash with SIGSEGV at interpreter exit. The cause is NIXL's bundled UCX efa module, whose
system libefa brings a second libnl into the process (not the two agents, as first thought);
the nixl transport leaves that module out (`transports/_nixl_lib.py`). Needs
the `nixl` extra (`pip install 'kvhandoff[nixl]'`: nixl-cu12, imported as `nixl_cu12`, runs on
a CPU-only machine for DRAM).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError


def _import_nixl() -> Any:
    # by name: NIXL is an optional extra, and mypy must not depend on whether it is installed
    try:
        return importlib.import_module("nixl_cu12._api")
    except ImportError:
        try:
            return importlib.import_module("nixl._api")
        except ImportError as e:
            raise ConfigError("bench case 'nixl' needs NIXL: pip install 'kvhandoff[nixl]' "
                              f"(nixl-cu12); import failed: {e}") from None


def check_installed() -> None:
    """Raises ConfigError (with the install hint) when NIXL cannot be imported."""
    _import_nixl()


def setup_message(mc_spans: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]],
                  seed: int) -> dict[str, Any]:
    """The worker's setup: buffer sizes and the pieces (buffer index, src, dst, bytes)."""
    sizes = [[int(src.size), int(dst.size)] for src, dst, _ in mc_spans]
    pieces = [[i, so, do, n] for i, (_, _, spans) in enumerate(mc_spans) for so, do, n in spans]
    return {"cmd": "setup", "sizes": sizes, "pieces": pieces, "seed": seed}


class _Pair:
    """Two NIXL agents of the worker and the one WRITE request's descriptors."""

    def __init__(self, msg: dict[str, Any]) -> None:
        api = _import_nixl()
        rng = np.random.default_rng(int(msg["seed"]))
        self.srcs = [rng.integers(0, 256, s, dtype=np.uint8) for s, _ in msg["sizes"]]
        self.dsts = [np.zeros(d, np.uint8) for _, d in msg["sizes"]]
        p = np.asarray(msg["pieces"], dtype=np.int64).reshape(-1, 4)
        self.pieces = p
        self.src_agent = api.nixl_agent(f"kvh-bench-src-{os.getpid()}",
                                        api.nixl_agent_config(backends=["UCX"]))
        self.dst_agent = api.nixl_agent(f"kvh-bench-dst-{os.getpid()}",
                                        api.nixl_agent_config(backends=["UCX"]))
        self.src_agent.register_memory(_regions(self.srcs), "DRAM")
        self.dst_agent.register_memory(_regions(self.dsts), "DRAM")
        self.remote = self.src_agent.add_remote_agent(self.dst_agent.get_agent_metadata())
        src_base = np.asarray([a.ctypes.data for a in self.srcs], dtype=np.int64)
        dst_base = np.asarray([a.ctypes.data for a in self.dsts], dtype=np.int64)
        zeros = np.zeros(len(p), np.int64)
        self.local = self.src_agent.get_xfer_descs(
            np.stack([src_base[p[:, 0]] + p[:, 1], p[:, 3], zeros], axis=1), "DRAM")
        self.remote_descs = self.src_agent.get_xfer_descs(
            np.stack([dst_base[p[:, 0]] + p[:, 2], p[:, 3], zeros], axis=1), "DRAM")
        self.backend = "?"
        self.version = _dist_version()

    def write(self, verify: bool) -> dict[str, Any]:
        if verify:
            for d in self.dsts:
                d[:] = 0
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
            return {"error": f"NIXL WRITE ended in state {state}"}
        ok = None
        if verify:
            ok = all(np.array_equal(self.dsts[i][do:do + n], self.srcs[i][so:so + n])
                     for i, so, do, n in self.pieces.tolist())
        return {"t": dt, "ok": ok}


    def rooms(self, n: int, inflight: int) -> dict[str, Any]:
        """Rooms mode: `n` WRITE requests of the page set, `inflight` of them posted at once
        (one polling loop over them, as NIXL's users poll): each one's time from creating
        the request to DONE, the wall time of all, and this process's CPU seconds (both
        agents: NIXL runs the two sides in this one process)."""
        lat: list[float] = []
        pending: list[tuple[Any, float]] = []
        posted = 0
        cpu0, t_start = time.process_time(), time.perf_counter()
        while posted < n or pending:
            while posted < n and len(pending) < inflight:
                t0 = time.perf_counter()
                h = self.src_agent.initialize_xfer("WRITE", self.local, self.remote_descs,
                                                   self.remote)
                state = self.src_agent.transfer(h)
                posted += 1
                if state == "DONE":
                    lat.append(time.perf_counter() - t0)
                    h.release()
                elif state == "PROC":
                    pending.append((h, t0))
                else:
                    return {"error": f"NIXL WRITE ended in state {state}"}
            still = []
            for h, t0 in pending:
                state = self.src_agent.check_xfer_state(h)
                if state == "PROC":
                    still.append((h, t0))
                    continue
                lat.append(time.perf_counter() - t0)
                h.release()
                if state != "DONE":
                    return {"error": f"NIXL WRITE ended in state {state}"}
            pending = still
        return {"lat": lat, "wall_s": time.perf_counter() - t_start,
                "cpu_s": time.process_time() - cpu0}


def serve() -> None:
    """The worker loop (JSON lines): setup -> {descriptors, version}; write{verify} ->
    {t, ok}; rooms{n, inflight} -> {lat, wall_s, cpu_s}; describe -> {backend}; exit ->
    os._exit(0) (see the module comment)."""
    pair: _Pair | None = None

    def say(**obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "setup":
            pair = _Pair(msg)
            say(descriptors=int(len(pair.pieces)), version=pair.version)
        elif msg["cmd"] == "write" and pair is not None:
            say(**pair.write(bool(msg.get("verify"))))
        elif msg["cmd"] == "rooms" and pair is not None:
            say(**pair.rooms(int(msg["n"]), int(msg["inflight"])))
        elif msg["cmd"] == "describe" and pair is not None:
            say(backend=pair.backend)
        elif msg["cmd"] == "exit":
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _regions(arrays: list[np.ndarray]) -> np.ndarray:
    return np.asarray([[a.ctypes.data, a.nbytes, 0] for a in arrays], dtype=np.int64)


def _dist_version() -> str | None:
    from importlib import metadata

    for name in ("nixl-cu12", "nixl"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
