"""Shared test configuration: every async test runs under both the default loop and uvloop."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on every platform it supports
    uvloop = None  # type: ignore[assignment]

pytest_plugins = ["tests.mooncake_support"]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture
def no_cyclic_gc_until_teardown() -> Iterator[None]:
    """No cyclic garbage collection from the test's start to its teardown, then one collection.

    Used (``pytest.mark.usefixtures``) by tests whose failure leaves requests with finalisers that log
    (an asyncio future's "exception never retrieved"): run by the cyclic collector inside the
    ``ast.parse`` pytest uses to format the failure, Python 3.11 raised SystemError and aborted the
    whole session."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
