"""Deadlines and cancel() bite while a request's calls wait for a transfer thread, a cancelled close()
still finishes the shutdown, and calls holding no caller memory do not hold close() past its timeout.
Times are bounds only ("finishes within N s instead of hanging").

Every test runs a real worker on a real MemoryBackend behind aiokv.testing's FaultInjectingBackend;
hangs are released by the test (or by a timer far past the bound the test asserts).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiokv import KVWorker, TransferTimeoutError, WorkerClosedError
from aiokv.testing import FaultRule
from tests.helpers import aiokv_threads
from tests.rig import OneGroupRig

pytestmark = [pytest.mark.usefixtures("no_cyclic_gc_until_teardown"), pytest.mark.loop_matters]

BOUND_S = 3.0  # "finishes within this instead of hanging": hangs in these tests last 8 s or more
QUICK_S = 1.5  # for what should take a fraction of a second (a deadline of 0.5 s, a cancel)
LATE_RELEASE_S = 8.0  # when a timer releases a hang the test expects not to wait for


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


async def hang_both_transfer_threads(rig: OneGroupRig, worker: KVWorker, release: threading.Event) -> Any:
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


# -- deadlines and cancel() while calls wait in the executor queue ------------------------------------


@pytest.mark.asyncio
async def test_a_deadline_and_a_cancel_bite_while_the_calls_wait_in_the_executor_queue(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A deadline or cancel() ends a load queued behind busy transfer threads at once; no call of it runs."""
    rig = OneGroupRig(seed=5)
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
    rig = OneGroupRig(seed=6)
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
    """A store cancelled in its first of 4 calls is done when that call returns; the other 3 never start."""
    rig = OneGroupRig(seed=13)
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


# -- a cancelled close() still finishes the shutdown --------------------------------------------------


def unregistered(rig: OneGroupRig) -> int:
    return len(rig.backend.calls_of("unregister"))


@pytest.mark.asyncio
async def test_a_close_cancelled_from_outside_still_finishes_the_shutdown_before_reraising(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """A cancelled close() waits for the call in flight, unregisters, stops threads, then re-raises."""
    rig = OneGroupRig(seed=7)
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
    """Two concurrent close() calls both return only once memory is unregistered and the backend released."""
    rig = OneGroupRig(seed=8)
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


# -- calls holding no caller memory do not hold close() past its timeout ------------------------------


@pytest.mark.asyncio
async def test_close_with_a_timeout_does_not_wait_for_a_hung_existence_check(
    release_later: Callable[[threading.Event, float], None],
) -> None:
    """close(timeout=0.5) returns within 2 s past a hung exists call; its requests fail WorkerClosedError."""
    rig = OneGroupRig(seed=9)
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
