"""Issue 10, items 5 to 9 (and item 13's start-after-close message): deadlines and cancel() bite while
a request's calls wait for a transfer thread, a cancelled close() still finishes the shutdown, calls
holding no caller memory do not hold close() past its timeout, ThreadedKVWorker races with close(),
and a worker refuses a foreign loop. Each test failed on the code before the fix (the failures are
listed in the fix's report) and pins bounded times only ("finishes within N s instead of hanging").

Every test runs a real worker on a real MemoryBackend behind aiokv.testing's FaultInjectingBackend;
hangs are released by the test (or by a timer far past the bound the test asserts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import (
    AiokvError,
    KVWorker,
    MemoryBackend,
    ThreadedKVWorker,
    TransferTimeoutError,
    WorkerClosedError,
)
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache, chunk_value
from tests.helpers import aiokv_threads, chunk_keys, read_value

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on every platform it supports
    uvloop = None  # type: ignore[assignment]

CHUNK = 8
NAMESPACE = "rel-shutdown"
SPEC = {"num_regions": 4, "num_blocks": 128, "block_size": 4, "block_lens": 32}
PER_CHUNK = CHUNK // SPEC["block_size"]
BOUND_S = 3.0  # "finishes within this instead of hanging": hangs in these tests last 8 s or more
QUICK_S = 1.5  # for what should take a fraction of a second (a deadline of 0.5 s, a cancel)
LATE_RELEASE_S = 8.0  # when a timer releases a hang the test expects not to wait for
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Rig:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate([SPEC], fill=SENTINEL)
        self.group = self.cache[0]
        self.inner = MemoryBackend(capacity_bytes=16 << 20)
        self.backend = FaultInjectingBackend(self.inner)
        self._free = list(self.rng.permutation(SPEC["num_blocks"]))

    def worker(self, **options: Any) -> KVWorker:
        options.setdefault("pressure_backoff_s", 0)
        return KVWorker(self.cache.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options)

    def threaded(self, **options: Any) -> ThreadedKVWorker:
        options.setdefault("pressure_backoff_s", 0)
        return ThreadedKVWorker(
            self.cache.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options
        )

    def prompt(self, chunks: int) -> np.ndarray:
        return self.rng.integers(0, 50_000, size=chunks * CHUNK, dtype=np.int64)

    def blocks(self, chunks: int, *, source: bool) -> np.ndarray:
        ids = np.array([self._free.pop() for _ in range(chunks * PER_CHUNK)], dtype=np.int64)
        if source:
            for region in self.group.regions:
                region[ids] = self.rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)
        return ids

    def keys(self, tokens: np.ndarray) -> list[str]:
        return chunk_keys(tokens, CHUNK, self.group.layout, 0, NAMESPACE)

    def expected(self, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.group, ids[chunk * PER_CHUNK : (chunk + 1) * PER_CHUNK])

    def sent(self, op: str, tokens: np.ndarray) -> list[str]:
        wanted = set(self.keys(tokens))
        return [k for k in self.backend.sent_keys(op) if k in wanted]


@pytest.fixture(autouse=True)
def collect_garbage() -> Iterator[None]:
    """Collect each test's garbage at its teardown: a worker a failing test left half-closed is then
    finalised here rather than inside a later test (Python 3.11's ast.parse, which pytest runs to
    format a failure, raises SystemError if a finaliser runs in the middle of it)."""
    yield
    gc.collect()


@pytest.fixture
def release_later() -> Iterator[Callable[[threading.Event, float], None]]:
    """Set an event after a delay (a safety net: the test fails on its bound long before)."""
    timers: list[threading.Timer] = []

    def schedule(event: threading.Event, delay: float) -> None:
        timer = threading.Timer(delay, event.set)
        timer.daemon = True
        timers.append(timer)
        timer.start()

    yield schedule
    for timer in timers:
        timer.cancel()
        timer.function(*timer.args)  # type: ignore[attr-defined]


async def hang_both_transfer_threads(rig: Rig, worker: KVWorker, release: threading.Event) -> Any:
    """A store of two chunks, one put per chunk, both hung: both transfer threads are busy."""
    tokens = rig.prompt(2)
    rig.backend.add_rule(FaultRule(op="put", keys=set(rig.keys(tokens)), hang=release))
    future = worker.store(tokens, [rig.blocks(2, source=True)])
    await rig.backend.wait_hanging_async(2)
    return future


async def settled_within(futures: list[Any], bound: float) -> float:
    """Wait (polling, so any awaitable works) until every future is done; fail past ``bound`` seconds.
    Returns the seconds it took."""
    started = time.monotonic()
    while not all(f.done() for f in futures):
        if time.monotonic() - started > bound:
            raise AssertionError(
                f"{sum(not f.done() for f in futures)} futures still pending after {bound} s"
            )
        await asyncio.sleep(0.01)
    return time.monotonic() - started


# -- item 5: deadlines and cancel() while calls wait in the executor queue ----------------------------


@pytest.mark.asyncio
async def test_a_deadline_and_a_cancel_bite_while_the_calls_wait_in_the_executor_queue(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A request whose calls all wait in the executor queue fails at its deadline (or is cancelled) at
    once, and none of its calls reaches the store afterwards."""
    rig = Rig(seed=5)
    release = threading.Event()
    stored_tokens = rig.prompt(2)
    src = rig.blocks(2, source=True)
    async with rig.worker(max_regions_per_call=1, executor_threads=2) as worker:
        assert (await worker.store(stored_tokens, [src])).stored == 2
        blocker = await hang_both_transfer_threads(rig, worker, release)
        release_later(release, LATE_RELEASE_S)
        timed, cancelled = rig.blocks(2, source=False), rig.blocks(2, source=False)
        started = time.monotonic()
        deadline_load = worker.load(stored_tokens, [timed], timeout=0.5)
        cancelled_load = worker.load(stored_tokens, [cancelled])
        await asyncio.sleep(0.2)  # both are in their batch now, their gets queued behind the hung puts
        assert cancelled_load.cancel()
        await settled_within([deadline_load, cancelled_load], QUICK_S - (time.monotonic() - started))
        assert not release.is_set() and rig.backend.hanging == 2
        assert cancelled_load.cancelled()
        with pytest.raises(TransferTimeoutError):
            deadline_load.result()
        release.set()
        assert (await blocker).stored == 2
        await asyncio.sleep(0.2)  # any call still queued would run now
    assert rig.sent("get", stored_tokens) == [], "a dropped request's gets reached the store"
    assert rig.group.untouched(timed) and rig.group.untouched(cancelled)


@pytest.mark.asyncio
async def test_a_store_of_eight_calls_cancelled_while_queued_in_the_executor_sends_none(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A store whose 8 calls wait in the executor queue is cancelled at once and sends none of them."""
    rig = Rig(seed=6)
    release = threading.Event()
    async with rig.worker(max_regions_per_call=1, executor_threads=2) as worker:
        blocker = await hang_both_transfer_threads(rig, worker, release)
        release_later(release, LATE_RELEASE_S)
        tokens = rig.prompt(8)
        store = worker.store(tokens, [rig.blocks(8, source=True)])
        await asyncio.sleep(0.1)
        assert store.cancel()
        await settled_within([store], QUICK_S)
        assert not release.is_set()
        assert store.cancelled()
        release.set()
        await blocker
        await asyncio.sleep(0.2)
        assert await worker.lookup(tokens) == 0
    assert rig.sent("put", tokens) == [], "puts of a store cancelled before they started were sent"
    assert rig.inner.batch_exists(rig.keys(tokens)) == [False] * 8


@pytest.mark.asyncio
async def test_a_cancel_with_one_call_running_finishes_when_it_returns_and_drops_the_rest(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A store of 4 calls on one transfer thread, cancelled while its first call hangs: it stays
    not-done until that call returns, is cancelled right then, and its 3 other calls never start."""
    rig = Rig(seed=13)
    release = threading.Event()
    async with rig.worker(max_regions_per_call=1, executor_threads=1) as worker:
        tokens = rig.prompt(4)
        first_key = rig.keys(tokens)[0]
        rig.backend.add_rule(FaultRule(op="put", keys={first_key}, hang=release))
        store = worker.store(tokens, [rig.blocks(4, source=True)])
        await rig.backend.wait_hanging_async(1)
        assert store.cancel()
        await asyncio.sleep(0.2)
        assert not store.done(), "cancelled while its call still used the caller's memory"
        release.set()
        await settled_within([store], BOUND_S)
        assert store.cancelled()
        await asyncio.sleep(0.2)  # a call still queued would run now
    assert rig.sent("put", tokens) == [first_key], "calls of a cancelled store started after the cancel"


# -- item 7: calls holding no caller memory do not hold close() past its timeout ----------------------


@pytest.mark.asyncio
async def test_close_with_a_timeout_does_not_wait_for_a_hung_existence_check(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """close(timeout=t) returns within about t while an existence check (no caller memory) hangs, and
    fails the requests waiting on it with WorkerClosedError."""
    rig = Rig(seed=9)
    release = threading.Event()
    worker = rig.worker()
    await worker.start()
    rig.backend.add_rule(FaultRule(op="exists", hang=release, max_hang_s=30))
    tokens = rig.prompt(2)
    store = worker.store(tokens, [rig.blocks(2, source=True)])
    lookup = asyncio.ensure_future(worker.lookup(tokens))
    await rig.backend.wait_hanging_async(1)
    release_later(release, LATE_RELEASE_S)
    started = time.monotonic()
    await asyncio.wait_for(worker.close(timeout=0.5), LATE_RELEASE_S + 5)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0 and not release.is_set(), f"close(timeout=0.5) took {elapsed:.1f} s"
    assert worker.closed
    await settled_within([store, lookup], 1.0)
    assert isinstance(store.exception(), WorkerClosedError)
    assert isinstance(lookup.exception(), WorkerClosedError)
    assert rig.backend.calls_of("put") == []
    release.set()


# -- item 6: a cancelled close() still finishes the shutdown ------------------------------------------


def unregistered(rig: Rig) -> int:
    return len(rig.backend.calls_of("unregister"))


@pytest.mark.asyncio
async def test_a_close_cancelled_from_outside_still_finishes_the_shutdown_before_reraising(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A close() cancelled from outside still waits for the call in flight, unregisters the memory and
    stops the threads, then re-raises CancelledError; afterwards the worker is closed."""
    rig = Rig(seed=7)
    release = threading.Event()
    worker = rig.worker()
    await worker.start()
    registered = len(rig.backend.calls_of("register"))
    tokens = rig.prompt(2)
    src = rig.blocks(2, source=True)
    rig.backend.add_rule(FaultRule(op="put", hang=release))
    store = worker.store(tokens, [src])
    await rig.backend.wait_hanging_async(1)
    closing = asyncio.ensure_future(worker.close())
    await asyncio.sleep(0.1)
    closing.cancel()
    release_later(release, 0.5)  # the call returns a little after the cancellation
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, BOUND_S + 2)
    assert release.is_set(), "the cancelled close returned while a call still used the caller's memory"
    assert worker.closed
    assert rig.backend.in_flight == 0
    assert store.done()
    assert unregistered(rig) == registered
    assert not aiokv_threads()
    with pytest.raises(WorkerClosedError):
        worker.store(tokens, [src])


@pytest.mark.asyncio
async def test_two_concurrent_closes_both_return_only_after_the_backend_is_released(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """Two concurrent close() calls both return only once the memory is unregistered and the backend
    released."""
    rig = Rig(seed=8)
    worker = rig.worker(close_backend=True)
    await worker.start()
    registered = len(rig.backend.calls_of("register"))
    seen_at_return: list[tuple[int, int]] = []

    async def close_and_note() -> None:
        await worker.close()
        seen_at_return.append((unregistered(rig), len(rig.backend.calls_of("close"))))

    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release))
    store = worker.store(rig.prompt(1), [rig.blocks(1, source=True)])
    await rig.backend.wait_hanging_async(1)
    first, second = asyncio.ensure_future(close_and_note()), asyncio.ensure_future(close_and_note())
    await asyncio.sleep(0.1)
    release_later(release, 0.3)
    await asyncio.wait_for(asyncio.gather(first, second), BOUND_S)
    assert seen_at_return == [(registered, 1), (registered, 1)], seen_at_return
    assert store.done() and worker.closed


@pytest.mark.asyncio
async def test_start_after_close_says_the_worker_is_closed() -> None:
    """start() on a closed worker raises WorkerClosedError saying it is closed (not "already called");
    a second start() of a running worker says it is already started."""
    rig = Rig(seed=18)
    worker = rig.worker()
    await worker.start()
    await worker.close()
    with pytest.raises(WorkerClosedError) as info:
        await worker.start()
    assert "closed" in str(info.value) and "already" not in str(info.value), str(info.value)
    async with rig.worker() as running:
        with pytest.raises(AiokvError, match="already"):
            await running.start()


# -- item 8: ThreadedKVWorker races -------------------------------------------------------------------


_RACE_SCRIPT = """
import json, sys, threading, time
import numpy as np
from aiokv import KVLayout, MemoryBackend, ThreadedKVWorker, WorkerClosedError

report = []
for round_ in range(int(sys.argv[1])):
    region = np.zeros((16, 64), dtype=np.uint8)
    layout = KVLayout([region.ctypes.data], [64], 4, 16)
    worker = ThreadedKVWorker(layout, MemoryBackend(1 << 20), namespace="race", chunk_tokens=8)
    start = threading.Barrier(17)
    outcomes = []

    def hammer(call):
        start.wait()
        while True:
            try:
                call()
            except WorkerClosedError:
                outcomes.append("closed")
                return
            except BaseException as exc:
                outcomes.append(repr(exc))
                return

    calls = [worker.stats, lambda: worker.lookup(list(range(16)))]  # a plain call, and a coroutine
    threads = [threading.Thread(target=hammer, args=(calls[i % 2],), daemon=True) for i in range(16)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.0005 * round_)
    worker.close()
    deadline = time.monotonic() + 10
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    report.append({"stuck": sum(t.is_alive() for t in threads), "outcomes": sorted(set(outcomes))})
    if report[-1]["stuck"]:
        break
print(json.dumps(report), flush=True)
"""


def test_stats_racing_close_from_sixteen_threads_always_returns_or_raises_closed() -> None:
    """Every ThreadedKVWorker call (stats(), and lookup(): a coroutine on the loop) racing close() from
    16 threads returns or raises WorkerClosedError within a bound; none blocks forever."""
    # In a child process: threads that do block forever must not outlive the test.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", _RACE_SCRIPT, "20"], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout)
    for round_, outcome in enumerate(report):
        assert outcome["stuck"] == 0, f"round {round_}: {outcome['stuck']} of 16 threads blocked"
        assert outcome["outcomes"] == ["closed"], outcome
    assert len(report) == 20


def test_close_from_a_done_callback_is_refused_clearly_and_leaves_the_worker_intact() -> None:
    """close() and terminate() called on the worker's own loop thread (a future's done callback) raise
    a RuntimeError saying to call them from another thread; the worker keeps serving and closes
    normally afterwards."""
    rig = Rig(seed=10)
    worker = rig.threaded()
    errors: list[BaseException] = []
    called = threading.Event()

    def close_in_callback(_: concurrent.futures.Future[Any]) -> None:
        for method in (worker.close, worker.terminate):
            try:
                method()
            except BaseException as exc:
                errors.append(exc)
        called.set()

    tokens, src = rig.prompt(2), rig.blocks(2, source=True)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, times=1))
    first = worker.store(tokens, [src])
    first.add_done_callback(close_in_callback)  # attached while the store hangs: runs on the loop thread
    release.set()
    assert first.result(timeout=10).stored == 2
    assert called.wait(10)
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors), errors
    for error in errors:
        message = str(error)
        assert "cannot join" not in message and "another thread" in message, message
    # The worker is intact: a second store finishes with its bytes in the store.
    more_tokens, more_src = rig.prompt(2), rig.blocks(2, source=True)
    assert worker.store(more_tokens, [more_src]).result(timeout=10).stored == 2
    for c, key in enumerate(rig.keys(more_tokens)):
        want = rig.expected(more_src, c)
        assert read_value(rig.inner, key, len(want)) == want
    worker.close()
    assert not aiokv_threads()


def test_a_closed_threaded_worker_does_not_break_a_prometheus_scrape() -> None:
    """Scraping a registry holding a closed ThreadedKVWorker's collector succeeds: the collector yields
    the figures of its last scrape (or nothing if it was never scraped), and the registry's other
    metrics are still exported."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from aiokv.metrics import PrometheusExporter

    def stored_line(text: str) -> list[float]:
        prefix = 'aiokv_chunks_total{outcome="stored"}'
        return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]

    registry = prometheus_client.CollectorRegistry()
    other = prometheus_client.Counter("other_total", "another component's metric", registry=registry)
    other.inc(3)
    rig = Rig(seed=11)
    worker = rig.threaded()
    PrometheusExporter(worker, registry)
    assert worker.store(rig.prompt(2), [rig.blocks(2, source=True)]).result(timeout=10).stored == 2
    assert stored_line(prometheus_client.generate_latest(registry).decode()) == [2.0]
    worker.close()
    text = prometheus_client.generate_latest(registry).decode()
    assert "other_total 3.0" in text
    assert stored_line(text) == [2.0]  # the last values
    # Never scraped before its close: nothing of it, the rest of the registry still exported.
    fresh = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("other_total", "another component's metric", registry=fresh).inc(1)
    unscraped = rig.threaded()
    PrometheusExporter(unscraped, fresh)
    unscraped.close()
    text = prometheus_client.generate_latest(fresh).decode()
    assert "other_total 1.0" in text and stored_line(text) == []


# -- item 9: a worker refuses calls from another event loop --------------------------------------------


LOOP_FACTORIES: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
    ("asyncio", asyncio.new_event_loop)
] + ([("uvloop", uvloop.new_event_loop)] if uvloop is not None else [])


def _use_from_two_loops(factory: Callable[[], asyncio.AbstractEventLoop]) -> list[BaseException]:
    rig = Rig(seed=12)
    worker = rig.worker()
    tokens, src = rig.prompt(2), rig.blocks(2, source=True)

    async def first_run() -> int:
        await worker.start()
        return (await worker.store(tokens, [src])).stored

    async def second_run() -> list[BaseException]:
        errors: list[BaseException] = []
        for call in (
            lambda: worker.store(tokens, [src]),
            lambda: worker.load(tokens, [rig.blocks(2, source=False)]),
        ):
            try:
                future = call()
            except (AiokvError, RuntimeError) as exc:
                errors.append(exc)
            else:
                future.cancel()
                errors.append(AssertionError("accepted a request on a dead loop"))
        try:
            await asyncio.wait_for(worker.lookup(tokens), BOUND_S)
        except (AiokvError, RuntimeError, TimeoutError) as exc:
            errors.append(exc)
        return errors

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(first_run()) == 2
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(second_run())


@pytest.mark.parametrize("factory", [f for _, f in LOOP_FACTORIES], ids=[n for n, _ in LOOP_FACTORIES])
def test_a_worker_used_from_a_second_event_loop_refuses_at_the_call(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """store/load/lookup on a worker whose loop is gone (a second asyncio.run) raise at the call, naming
    the event loop; no request is left pending."""
    errors = _use_from_two_loops(factory)
    # The abandoned worker's idle executor threads end once it is collected: none outlives the test.
    gc.collect()
    deadline = time.monotonic() + 10
    while aiokv_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(errors) == 3
    for error in errors:
        assert isinstance(error, (AiokvError, RuntimeError)) and "loop" in str(error), repr(error)
