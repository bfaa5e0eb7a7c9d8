"""The counters AiokvConnector hands vLLM's stats hook: taken without waiting for aiokv's loop, none lost.

Runs a real :class:`ThreadedKVWorker` on the embedded backend; vLLM is not needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from aiokv import ThreadedKVWorker
from aiokv.backends.memory import MemoryBackend
from aiokv.integrations.vllm.common.stats_reporter import StatsReporter
from aiokv.testing import PagedCache

from .helpers import SAFETY_TIMEOUT_S, hold_loop

CHUNK_TOKENS = 16


@pytest.fixture
def worker() -> Iterator[ThreadedKVWorker]:
    cache = PagedCache.allocate(
        [{"num_regions": 2, "num_blocks": 32, "block_size": 16, "block_lens": 64}], fill="random", seed=1
    )
    backend = MemoryBackend(1 << 20)
    with ThreadedKVWorker(cache.layouts, backend, namespace="stats", chunk_tokens=CHUNK_TOKENS) as threaded:
        yield threaded
    backend.close()


def store(worker: ThreadedKVWorker, seed: int, chunks: int) -> None:
    blocks = [np.arange(seed * 4, seed * 4 + chunks, dtype=np.int64)]
    tokens = np.random.default_rng(seed).integers(0, 32_000, size=chunks * CHUNK_TOKENS).tolist()
    assert worker.store(tokens, blocks).result(SAFETY_TIMEOUT_S).stored == chunks


def reports_until_quiet(reporter: StatsReporter) -> list[dict[str, int]]:
    """Every report until a snapshot asked for after this began arrives with nothing new (the
    reporter asks at every call here)."""
    reports: list[dict[str, int]] = []
    asked_here: list[object] = []  # kept alive: identity, not ids that could be reused
    for _ in range(1000):
        pending = reporter._pending
        delta = reporter.delta()
        if delta is not None:
            reports.append(delta)
        elif pending is not None and any(pending is f for f in asked_here):
            return reports
        if reporter._pending is not None:
            if reporter._pending is not pending:
                asked_here.append(reporter._pending)
            reporter._pending.result(SAFETY_TIMEOUT_S)
    raise AssertionError("the reporter never went quiet")


def test_counters_are_reported_once_each_and_none_is_lost(worker: ThreadedKVWorker) -> None:
    reporter = StatsReporter(worker, interval_s=0.0)
    store(worker, 1, 2)
    first = reports_until_quiet(reporter)
    assert sum(r.get("chunks_stored", 0) for r in first) == 2
    assert sum(r.get("store_requests", 0) for r in first) == 1
    store(worker, 2, 3)
    store(worker, 3, 1)
    later = reports_until_quiet(reporter)
    assert sum(r.get("chunks_stored", 0) for r in later) == 4
    assert sum(r.get("store_requests", 0) for r in later) == 2
    assert reports_until_quiet(reporter) == []


def test_delta_never_waits_for_a_busy_loop(worker: ThreadedKVWorker) -> None:
    reporter = StatsReporter(worker, interval_s=0.0)
    store(worker, 1, 2)
    release = hold_loop(worker)
    try:
        # The loop thread is held: a blocking snapshot would hang here; these return at once.
        assert [reporter.delta() for _ in range(3)] == [None, None, None]
    finally:
        release.set()
    assert sum(r.get("chunks_stored", 0) for r in reports_until_quiet(reporter)) == 2


def test_a_closed_worker_reports_nothing_and_raises_nothing(worker: ThreadedKVWorker) -> None:
    reporter = StatsReporter(worker, interval_s=0.0)
    store(worker, 1, 2)
    worker.close()
    assert reporter.delta() is None
    assert reporter.delta() is None
