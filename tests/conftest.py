"""Shared test configuration: the markers of the slow kinds of test, and the loops async tests run on.

Markers (registered in pyproject.toml), so that ``scripts/test-fast.sh`` (``-m "not (engine or cluster
or soak or subprocess or mooncake)"``) runs the library's own tests in under two minutes:

- ``engine``: runs real vLLM engines (``tests/vllm/``, ``tests/test_bench_vllm.py``), 15-40 s each;
- ``cluster``: a Mooncake cluster in network namespaces (``tests/cluster/``);
- ``soak``: the 1,000-request soak;
- ``subprocess``: runs a fresh Python per case (the documents' code blocks, the examples, the demo);
- ``mooncake`` (``tests/mooncake_support.py``): uses a real ``mooncake_master``.

Async tests run on the standard loop; those marked ``loop_matters`` (whole modules, with
``pytestmark``) also on uvloop: the ones about what the loop does (its kind, lifecycle and shutdown,
cancellation and deadlines, loop stalls), where uvloop's different scheduling could change an outcome.
Elsewhere a second loop only doubled the run time.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on every platform it supports
    uvloop = None  # type: ignore[assignment]

pytest_plugins = ["tests.mooncake_support"]


TESTS = Path(__file__).resolve().parent
# Path (relative to tests/) -> the markers of every test under it.
MARKS_BY_PATH = {
    "vllm/": ("engine",),
    "test_bench_vllm.py": ("engine",),
    "cluster/": ("cluster", "mooncake"),
    "test_docs.py": ("subprocess",),
    "test_examples.py": ("subprocess",),
    "test_examples_prefill_decode.py": ("subprocess",),
    "test_demo.py": ("subprocess",),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        where = path.relative_to(TESTS).as_posix()
        for prefix, marks in MARKS_BY_PATH.items():
            if where == prefix or (prefix.endswith("/") and where.startswith(prefix)):
                for mark in marks:
                    item.add_marker(mark)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None and item.get_closest_marker("loop_matters") is not None:
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
