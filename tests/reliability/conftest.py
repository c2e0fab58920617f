"""Fixtures of the reliability matrix (helpers live in relkit.py)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator

import pytest
import relkit
from relkit import Engine, engine_pair

# tests that choose their transports themselves (these fixtures, or a module saying
# OWN_LANES = True), or share a module-wide pair, run as written
_OWN_LANES = {"transport", "lane", "shared_pair"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every other test of the matrix runs on each of `relkit.LANES` (a test that parametrizes
    `rel_lane` itself, indirectly, runs as written)."""
    own = any(m.args and m.args[0] == "rel_lane"
              for m in metafunc.definition.iter_markers("parametrize"))
    if ("rel_lane" in metafunc.fixturenames and not _OWN_LANES & set(metafunc.fixturenames)
            and not own and not getattr(metafunc.module, "OWN_LANES", False)):
        metafunc.parametrize("rel_lane", relkit.LANES, indirect=True)


@pytest.fixture(autouse=True)
def rel_lane(request: pytest.FixtureRequest) -> Iterator[str]:
    """The transport `relkit.fast_settings` gives during the test."""
    relkit.lane = getattr(request, "param", "tcp")
    try:
        yield relkit.lane
    finally:
        relkit.lane = "tcp"

_ROOM_IDS = itertools.count(1000)


@pytest.fixture
def room_id() -> Iterator[int]:
    """A room id no other test of the session uses."""
    yield next(_ROOM_IDS)


@pytest.fixture
def rng() -> Iterator[random.Random]:
    """The random choices of a test, seeded: the seed is printed (pytest shows it with a
    failure's captured output); KVHANDOFF_TEST_SEED=<seed> replays a run."""
    seed = int(os.environ.get("KVHANDOFF_TEST_SEED") or random.SystemRandom().getrandbits(32))
    print(f"random seed: {seed} (replay with KVHANDOFF_TEST_SEED={seed})")
    yield random.Random(seed)


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[Engine, Engine]]:
    """One prefill and one decode engine over tcp, shared by a module's tests (each test uses
    its own rooms and checks that every page of the pools came back)."""
    with engine_pair(num_pages=256) as pair:
        yield pair
