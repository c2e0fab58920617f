"""SGLang integration tests: real SGLang 0.5.23 classes on CPU (installed by `make setup`, no
deps; see requirements/engines-*.txt). `sglang_loaded` imports SGLang's disaggregation modules
and loads the kvhandoff plugin through SGLang's own plugin loader (this process)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def sglang_loaded() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.fail("sglang is not installed: run `make setup` (installs sglang==0.5.23 with "
                    "--no-deps and requirements/engines-deps.txt)")
    import sglang_env

    sglang_env.import_sglang()
    sglang_env.load_plugins()


@pytest.fixture
def bootstrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's bootstrap server class of the kvhandoff backend on 127.0.0.1 port 0, with the
    agents on UCX (no sidecar URL from the environment)."""
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    # several agents and the test in one process on a loaded 2-core machine: a lenient heartbeat
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL_S", "3")
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.close()
