"""Loopback fixtures: real servers on 127.0.0.1, port 0.

`bootstrap_server` is a factory: ``url = bootstrap_server(rank_ttl_s=0.5, auth_token="t")``
starts a real uvicorn bootstrap server (in a background thread of the test process) with those
`Settings` overrides, waits until it serves, and stops it at the end of the test. Pass
``settings=`` for a full `Settings`, ``clock=`` for a fake clock. Several servers per test are
fine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from kvhandoff.settings import Settings
from kvhandoff.testing.server import run_server


@pytest.fixture
def bootstrap_server() -> Iterator[Callable[..., str]]:
    with ExitStack() as stack:

        def start(settings: Settings | None = None, *, clock: Callable[[], float] | None = None,
                  **overrides: Any) -> str:
            base = settings or Settings(port=0, auth_token=None)
            return stack.enter_context(run_server(base, clock=clock, **overrides))

        yield start
