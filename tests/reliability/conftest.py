"""Fixtures of the reliability matrix (helpers live in relkit.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from relkit import Engine, engine_pair

_ROOM_IDS = itertools.count(1000)


@pytest.fixture
def room_id() -> Iterator[int]:
    """A room id no other test of the session uses."""
    yield next(_ROOM_IDS)


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[Engine, Engine]]:
    """One prefill and one decode engine over tcp, shared by a module's tests (each test uses
    its own rooms and checks that every page of the pools came back)."""
    with engine_pair(num_pages=256) as pair:
        yield pair
