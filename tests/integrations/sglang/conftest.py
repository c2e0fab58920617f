"""SGLang integration tests: real SGLang 0.5.23 classes on CPU (installed by `make setup`, no
deps; see requirements/engines-*.txt). `sglang_loaded` imports SGLang's disaggregation modules
and loads the kvhandoff plugin through SGLang's own plugin loader (this process)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def sglang_loaded() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.fail("sglang is not installed: run `make setup` (installs sglang==0.5.23 with "
                    "--no-deps and requirements/engines-deps.txt)")
    import sglang_env

    sglang_env.import_sglang()
    sglang_env.load_plugins()
