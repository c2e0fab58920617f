"""Loopback fixtures: real servers on 127.0.0.1, port 0.

`bootstrap_server` is a factory: ``url = bootstrap_server(rank_ttl_s=0.5, auth_token="t")``
starts a real uvicorn bootstrap server (in a background thread of the test process) with those
`Settings` overrides, waits until it serves, and stops it at the end of the test. Pass
``settings=`` for a full `Settings`, ``clock=`` for a fake clock. Several servers per test are
fine.

When a test fails because a server did not answer (`BootstrapUnavailable`), the report gets a
section with the stack of every thread of the test process at that moment: the server threads
live there, and their stacks say what kept them from answering.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from kvhandoff.bootstrap_server.background import run_server
from kvhandoff.errors import BootstrapUnavailable
from kvhandoff.settings import Settings


@pytest.fixture
def bootstrap_server() -> Iterator[Callable[..., str]]:
    with ExitStack() as stack:

        def start(settings: Settings | None = None, *, clock: Callable[[], float] | None = None,
                  **overrides: Any) -> str:
            base = settings or Settings(port=0, auth_token=None)
            return stack.enter_context(run_server(base, clock=clock, **overrides))

        yield start


def _thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(f))
                     for ident, f in sys._current_frames().items())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    seen = exc
    while seen is not None and not isinstance(seen, BootstrapUnavailable):
        seen = seen.__cause__ or seen.__context__
    if seen is not None:
        report.sections.append(("threads when the server did not answer", _thread_stacks()))
    return report
