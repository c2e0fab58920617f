"""Fixtures of the cross-host tests (the parts are in xhost.py).

`hosts` (one per module): two network namespaces joined by a veth pair, each process with
its host's own name, and the bootstrap server on host A. `pair(transport, **settings)`:
a prefill agent process on host A and a decode agent process on host B; at the end they
are closed, must exit 0, and no process of the test may be left in either namespace.
`net`: the link (down/up, netem), restored after each test. Skips, saying why, where
namespaces cannot be made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from xhost import Agent, AgentPair, Hosts, Net, Skip, make_hosts, start_pair, wait_until


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    try:
        with make_hosts() as h:
            yield h
    except Skip as e:
        pytest.skip(str(e))


@pytest.fixture
def net(hosts: Hosts) -> Iterator[Net]:
    n = Net(hosts)
    try:
        yield n
    finally:
        n.restore()


@pytest.fixture
def pair(hosts: Hosts) -> Iterator[AgentPair]:
    started: list[Agent] = []

    def start(transport: str, **extra: Any) -> tuple[Agent, Agent]:
        return start_pair(hosts, transport, started, **extra)

    try:
        yield start
    finally:
        codes = [a.close() for a in started]
    # nothing this test started is left on either host (the bootstrap server stays)
    assert wait_until(lambda: not hosts.strays(), 10.0), (
        f"processes left in the namespaces: {sorted(hosts.strays())}")
    bad = [(a.role, rc, "".join(a.sp.stderr_tail[-20:])) for a, rc in zip(started, codes,
                                                                             strict=True) if rc]
    assert not bad, f"agents that did not exit 0: {bad}"
