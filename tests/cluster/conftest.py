"""Cluster tests: a master and 3 nodes, each in its own network namespace (see support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import Cluster, cluster_world


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: needs network namespaces (a Mooncake cluster world)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in item.nodeid:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.mooncake)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A fresh world per test (tests kill nodes and masters); everything stopped by pid at teardown."""
    with cluster_world(3) as world:
        yield world
