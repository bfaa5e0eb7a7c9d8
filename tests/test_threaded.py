"""ThreadedKVWorker from plain threads: real bytes, SyncTransferFuture cancel rules, bad input, shutdown.

Every test runs on the standard loop and on uvloop (the background loop comes from ``loop_factory``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokv import StoreResult, SyncTransferFuture, ThreadedKVWorker, WorkerClosedError
from aiokv.testing import FaultInjectingBackend, PagedCache, same_blocks
from benchmarks import cli as bench_cli

from .helpers import (
    SAFETY_TIMEOUT_S,
    aiokv_threads,
    chunk_keys,
    hold_loop,
    prompt,
    recording_backend,
    scattered_block_ids,
)

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

C = 64
SPECS: list[dict[str, Any]] = [
    {"num_regions": 2, "num_blocks": 64, "block_size": 16, "block_lens": 64},
    {"num_regions": 3, "num_blocks": 48, "block_size": 32, "block_lens": [96, 32]},
]
PER_CHUNK = [C // spec["block_size"] for spec in SPECS]
NS = "threaded-model"

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop


@pytest.fixture(params=sorted(LOOPS))
def loop_factory(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    return LOOPS[request.param]


@pytest.fixture
def cache() -> PagedCache:
    return PagedCache.allocate(SPECS, fill="random", seed=5)


@pytest.fixture
def backend() -> Iterator[FaultInjectingBackend]:
    b = recording_backend()
    yield b
    b.release()


def make(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any], **options: Any
) -> ThreadedKVWorker:
    return ThreadedKVWorker(
        cache.layouts, backend, namespace=NS, chunk_tokens=C, loop_factory=loop_factory, **options
    )


def consecutive(chunks: int, start: int = 0) -> list[np.ndarray]:
    return [np.arange(start, start + chunks * per, dtype=np.int64) for per in PER_CHUNK]


def keys_of(tokens: list[int], cache: PagedCache) -> set[str]:
    return {k for g, layout in enumerate(cache.layouts) for k in chunk_keys(tokens, C, layout, g, NS)}


def wait_event(event: threading.Event) -> None:
    assert event.wait(SAFETY_TIMEOUT_S), "the backend call never started"


def test_two_threads_store_lookup_and_load_concurrently(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    chunks = 3
    rng = np.random.default_rng(6)
    # Per thread: its own prompt, source blocks and destination blocks, all disjoint; plus a prompt
    # both threads store at the same time.
    picks = [
        scattered_block_ids(rng, spec["num_blocks"], 4 * chunks * per)
        for spec, per in zip(SPECS, PER_CHUNK, strict=True)
    ]
    plans = []
    for t in range(2):
        span = [
            ids[2 * t * chunks * per : (2 * t + 2) * chunks * per]
            for ids, per in zip(picks, PER_CHUNK, strict=True)
        ]
        src = [s[: chunks * per] for s, per in zip(span, PER_CHUNK, strict=True)]
        dst = [s[chunks * per :] for s, per in zip(span, PER_CHUNK, strict=True)]
        plans.append((prompt(10 + t, chunks), src, dst))
    shared = prompt(20, chunks)
    original = [[group.blocks(src[g]) for g, group in enumerate(cache.groups)] for _, src, _ in plans]
    barrier = threading.Barrier(2)
    outcomes: dict[int, Any] = {}
    errors: list[BaseException] = []

    def engine_thread(t: int, worker: ThreadedKVWorker) -> None:
        try:
            tokens, src, dst = plans[t]
            barrier.wait(SAFETY_TIMEOUT_S)
            stores = [worker.store(tokens, src), worker.store(shared, src)]
            stored = [f.result(SAFETY_TIMEOUT_S) for f in stores]
            hit = worker.lookup(tokens)
            loaded = worker.load(tokens, dst).result(SAFETY_TIMEOUT_S)
            outcomes[t] = (stored, hit, loaded)
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    with make(cache, backend, loop_factory) as worker:
        threads = [threading.Thread(target=engine_thread, args=(t, worker)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SAFETY_TIMEOUT_S)
    assert errors == []
    for t, (_, src, dst) in enumerate(plans):
        (own, _), hit, loaded = outcomes[t]
        assert (own.stored, own.skipped, own.failed) == (chunks, 0, 0)
        assert hit == chunks * C
        assert loaded.loaded_tokens == chunks * C and loaded.failed_block_ids == ((), ())
        for g, group in enumerate(cache.groups):
            # The destination blocks now hold what the source blocks held when stored.
            assert all(
                np.array_equal(a, b) for a, b in zip(group.blocks(dst[g]), original[t][g], strict=True)
            )
            assert same_blocks(group, src[g], group, dst[g])
    shared_results = [outcomes[t][0][1] for t in range(2)]
    assert sum(r.stored for r in shared_results) == chunks  # the shared prompt was written once
    assert sum(r.skipped for r in shared_results) == chunks
    put = Counter(backend.keys_seen("put"))
    assert set(put.values()) == {1}
    assert set(put) == keys_of(shared, cache) | keys_of(plans[0][0], cache) | keys_of(plans[1][0], cache)


def test_cancel_inside_a_backend_call_returns_true_and_completes_after_the_call(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    tokens = prompt(30, 2)
    with make(cache, backend, loop_factory) as worker:
        with backend.blocked("put"):
            future = worker.store(tokens, consecutive(2))
            assert isinstance(future, SyncTransferFuture) and isinstance(future, concurrent.futures.Future)
            wait_event(backend.entered("put"))
            called: list[concurrent.futures.Future[Any]] = []
            future.add_done_callback(called.append)
            assert future.cancel() is True
            time.sleep(0.05)
            assert not future.done() and not future.cancelled() and called == []
            backend.release()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(SAFETY_TIMEOUT_S)
        assert future.done() and future.cancelled() and called == [future]
        assert future.cancel() is False
        assert worker.stats()["requests_cancelled"] == {"store": 1}
        after = worker.store(prompt(31, 1), consecutive(1, start=20)).result(SAFETY_TIMEOUT_S)
    assert after.stored == 1


def test_cancel_of_a_queued_request_is_done_at_once(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    first, second = prompt(32, 2), prompt(33, 2)
    with make(cache, backend, loop_factory, max_concurrent_batches=1) as worker:
        with backend.blocked("put"):
            running = worker.store(first, consecutive(2))
            wait_event(backend.entered("put"))
            queued = worker.store(second, consecutive(2, start=20))
            assert queued.cancel() is True
            assert queued.done() and queued.cancelled()  # at once, while the first is still blocked
            assert not running.done()
            backend.release()
        assert isinstance(running.result(SAFETY_TIMEOUT_S), StoreResult)
        assert worker.lookup(second) == 0
    assert not set(backend.keys_seen("put")) & keys_of(second, cache)


def test_bad_input_raises_at_the_call(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    tokens = prompt(34, 2)
    good = consecutive(2)
    with make(cache, backend, loop_factory) as worker:
        backend.clear_calls()
        for submit in (worker.store, worker.load):
            with pytest.raises(ValueError):
                submit(tokens, [good[0]])  # one group of two
            with pytest.raises(ValueError):
                submit(tokens, [good[0][:-1], good[1]])  # too few block ids
            with pytest.raises(ValueError):
                submit(tokens, [good[0], np.array([0, 1, 2, SPECS[1]["num_blocks"]])])  # out of range
            with pytest.raises(ValueError):
                submit(tokens, [[-1, *good[0][1:].tolist()], good[1]])
            with pytest.raises(ValueError):
                submit(tokens, [[float(b) for b in good[0]], good[1]])
        assert backend.count() == 0
        # Token values are checked as they are hashed: the future fails, with ValueError.
        with pytest.raises(ValueError):
            worker.store([*tokens[:-1], 2**40], good).result(SAFETY_TIMEOUT_S)
        with pytest.raises(ValueError):
            worker.lookup([-1] * C)
        assert backend.count() == 0
        result = worker.store(tokens, good).result(SAFETY_TIMEOUT_S)
    assert (result.stored, result.failed) == (2, 0)


def test_close_finishes_pending_work_and_joins_the_loop_thread(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    before = aiokv_threads()
    worker = make(cache, backend, loop_factory)
    assert "aiokv-loop" in {t.name for t in aiokv_threads() - before}
    futures = [worker.store(prompt(40 + i, 2), consecutive(2, start=8 * i)) for i in range(4)]
    worker.close()
    assert all(f.done() for f in futures)
    assert [f.result().stored for f in futures] == [2] * 4
    assert not aiokv_threads() - before  # the loop thread and the executor threads are gone
    with pytest.raises(WorkerClosedError):
        worker.store(prompt(44, 1), consecutive(1))
    with pytest.raises(WorkerClosedError):
        worker.lookup(prompt(44, 1))
    worker.close()  # a second close is a no-op
    assert len(backend.inner) == 4 * 2 * len(SPECS)


def test_terminate_fails_queued_work_at_once_and_waits_for_the_call_in_flight(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    before = aiokv_threads()
    worker = make(cache, backend, loop_factory, max_concurrent_batches=1)
    with backend.blocked("put"):
        running = worker.store(prompt(50, 2), consecutive(2))
        wait_event(backend.entered("put"))
        queued = worker.store(prompt(51, 2), consecutive(2, start=20))
        terminating = threading.Thread(target=worker.terminate)
        terminating.start()
        with pytest.raises(WorkerClosedError):
            queued.result(SAFETY_TIMEOUT_S)  # failed while the first request is still blocked
        assert not running.done() and terminating.is_alive()
        backend.release()
    terminating.join(SAFETY_TIMEOUT_S)
    assert not terminating.is_alive()
    assert running.done()
    assert not aiokv_threads() - before


def test_store_many_and_load_many_move_every_request_and_fail_only_the_refused_one(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    """Several requests in one hop to the loop: each its own future, in order; a request with bad
    arguments gets a failed future and the others move their bytes."""
    from aiokv import InvalidRequestError

    chunks = 2
    prompts = [prompt(70 + i, chunks) for i in range(3)]
    src = [consecutive(chunks, start=i * 8) for i in range(3)]
    dst = [consecutive(chunks, start=24 + i * 8) for i in range(3)]
    bad_blocks = [np.array([-1]), np.array([-1])]  # negative block ids: refused at the call
    with make(cache, backend, loop_factory) as worker:
        stored = worker.store_many([(prompts[0], src[0]), (prompts[1], bad_blocks), (prompts[2], src[2])])
        assert len(stored) == 3
        with pytest.raises(InvalidRequestError):
            stored[1].result(SAFETY_TIMEOUT_S)
        for i in (0, 2):
            assert stored[i].result(SAFETY_TIMEOUT_S).stored == chunks
        loaded = worker.load_many([(prompts[i], dst[i]) for i in (0, 2)])
        for future in loaded:
            result = future.result(SAFETY_TIMEOUT_S)
            assert result.loaded_tokens == chunks * C and result.failed_block_ids == ((), ())
    for i in (0, 2):
        for g, group in enumerate(cache.groups):
            assert same_blocks(group, src[i][g], group, dst[i][g])
    assert set(backend.keys_seen("put")) == keys_of(prompts[0], cache) | keys_of(prompts[2], cache)
    with pytest.raises(WorkerClosedError):
        worker.store_many([(prompts[0], src[0])])


def test_store_many_load_many_and_lookup_many_never_wait_for_the_loop_thread(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    """An engine's thread hands a step's requests over and goes on: with the loop thread busy, the calls
    return at once, the requests go ahead once it is free, in order."""
    chunks = 2
    prompts = [prompt(110 + i, chunks) for i in range(2)]
    src = [consecutive(chunks, start=i * 8) for i in range(2)]
    with make(cache, backend, loop_factory) as worker:
        release = hold_loop(worker)
        try:
            stored = worker.store_many([(prompts[i], src[i]) for i in range(2)])
            looked = worker.lookup_many(prompts)
            assert not any(f.done() for f in stored + looked)
            assert [f.request_id for f in stored] == [None, None]  # not taken by the loop yet
        finally:
            release.set()
        assert [f.result(SAFETY_TIMEOUT_S).stored for f in stored] == [chunks, chunks]
        assert stored[0].request_id is not None and stored[0].request_id < stored[1].request_id  # type: ignore[operator]
        # Each lookup was taken after the stores were, yet may answer before they finish: 0 or all.
        assert all(f.result(SAFETY_TIMEOUT_S) in (0, chunks * C) for f in looked)
        release = hold_loop(worker)
        try:
            loaded = worker.load_many([(prompts[0], consecutive(chunks, start=24))])
            assert not loaded[0].done()
        finally:
            release.set()
        assert loaded[0].result(SAFETY_TIMEOUT_S).loaded_tokens == chunks * C


def test_a_store_many_future_cancelled_on_the_loop_thread_before_its_request_is_taken_is_cancelled(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    chunks = 2
    tokens = prompt(120, chunks)
    with make(cache, backend, loop_factory) as worker:
        handed: list[SyncTransferFuture[StoreResult]] = []
        answers: list[bool] = []
        go = threading.Event()

        def cancel_first() -> None:  # on the loop thread, ahead of the request in the loop's queue
            go.wait(SAFETY_TIMEOUT_S)
            answers.append(handed[0].cancel())

        worker._loop.call_soon_threadsafe(cancel_first)
        handed += worker.store_many([(tokens, consecutive(chunks))])
        go.set()
        with pytest.raises(concurrent.futures.CancelledError):
            handed[0].result(SAFETY_TIMEOUT_S)
        assert answers == [True]
        assert worker.lookup(tokens) == 0
    assert backend.keys_seen("put") == []


def test_lookup_many_answers_without_blocking_and_fails_only_the_refused_prompt(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    from aiokv import InvalidRequestError

    chunks = 2
    stored, absent = prompt(90, chunks), prompt(91, chunks)
    with make(cache, backend, loop_factory) as worker:
        assert worker.store(stored, consecutive(chunks)).result(SAFETY_TIMEOUT_S).stored == chunks
        with backend.blocked("exists"):
            # Submitted while the store's existence checks hang: the call itself does not wait.
            futures = worker.lookup_many([stored, absent, "not tokens"])  # type: ignore[list-item]
            assert len(futures) == 3 and not any(f.done() for f in futures[:2])
        assert futures[0].result(SAFETY_TIMEOUT_S) == chunks * C
        assert futures[1].result(SAFETY_TIMEOUT_S) == 0
        with pytest.raises((InvalidRequestError, TypeError)):
            futures[2].result(SAFETY_TIMEOUT_S)
        # Cancelling a lookup that hangs cancels it on the loop; the worker keeps serving.
        with backend.blocked("exists"):
            (hung,) = worker.lookup_many([absent])
            assert backend.entered("exists").wait(SAFETY_TIMEOUT_S)
            assert hung.cancel()
        assert worker.lookup_many([stored])[0].result(SAFETY_TIMEOUT_S) == chunks * C
        with backend.blocked("exists"):
            (stranded,) = worker.lookup_many([absent])
            assert backend.entered("exists").wait(SAFETY_TIMEOUT_S)
            closer = threading.Thread(target=worker.terminate)
            closer.start()
        closer.join(SAFETY_TIMEOUT_S)
        with pytest.raises(WorkerClosedError):
            stranded.result(SAFETY_TIMEOUT_S)
    with pytest.raises(WorkerClosedError):
        worker.lookup_many([stored])


def test_bench_handoff_reports_both_paths_and_their_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "handoff.json"
    argv = ["handoff", "--steps", "6", "--per-step", "2", "--chunks", "2", "--engine-ms", "0.2"]
    assert bench_cli.main([*argv, "--json", str(json_path)]) == 0
    assert "store_many / store" in capsys.readouterr().out
    report = json.loads(json_path.read_text())
    figures = report["figures"]
    assert set(figures) == {"store", "store_many"}
    for path in figures.values():
        assert 0 < path["p50_ms"] <= path["p90_ms"] <= path["p99_ms"] <= path["max_ms"]
    for key, ratio in report["store_many_vs_store"].items():
        assert ratio == pytest.approx(figures["store_many"][key] / figures["store"][key])
    assert bench_cli.main(["handoff", "--steps", "0"]) == 2


def test_stats_soon_never_waits_for_the_loop_and_answers_once_it_is_free(
    cache: PagedCache, backend: FaultInjectingBackend, loop_factory: Callable[[], Any]
) -> None:
    chunks = 2
    with make(cache, backend, loop_factory) as worker:
        stored = worker.store(prompt(130, chunks), consecutive(chunks)).result(SAFETY_TIMEOUT_S)
        assert stored.stored == chunks
        release = hold_loop(worker)
        try:
            soon = worker.stats_soon()
            assert not soon.done()  # handed out while the loop thread is busy
        finally:
            release.set()
        stats = soon.result(SAFETY_TIMEOUT_S)
        assert stats["requests"]["store"] == 1
        assert stats["chunks"]["stored"] == chunks
        assert stats == worker.stats() | {"latency": stats["latency"]}  # the same counters
    with pytest.raises(WorkerClosedError):
        worker.stats_soon()
