"""Cluster tests: a master and 3 nodes, each in its own network namespace (see support.py); marked
``cluster`` and ``mooncake`` by tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import Cluster, cluster_world


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A fresh world per test (tests kill nodes and masters); everything stopped by pid at teardown."""
    with cluster_world(3) as world:
        yield world
