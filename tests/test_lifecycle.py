"""A request's lifecycle under the caller's control and at shutdown: cancellation in each state, a
caller's own timeout, deadlines queued and in a call, graceful close, close with a timeout, terminate.

One home for these (they once existed twice, in test_worker.py and test_reliability.py): every test runs
a real KVWorker on a real MemoryBackend behind aiokv.testing's FaultInjectingBackend (tests/rig.py), and
checks the bytes in the engine's cache and the keys the store saw.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiokv import KVWorker, LoadResult, StoreResult, TransferFuture, TransferTimeoutError, WorkerClosedError
from aiokv.testing import FaultRule
from tests.helpers import aiokv_threads, wait_until
from tests.rig import CHUNK, SAFETY_S, Rig, loop_tasks

pytestmark = pytest.mark.loop_matters  # also on uvloop (tests/conftest.py)


def keys_seen(rig: Rig) -> set[str]:
    return {k for c in rig.backend.data_calls() for k in c.keys}


class HeldTransfer:
    """A two-chunk store (``kind="store"``) or load of a stored prompt, whose puts or gets hang until
    ``release`` is set; ``src`` holds the prompt's bytes, ``dst`` the load's blocks."""

    def __init__(self, rig: Rig, kind: str) -> None:
        self.rig, self.kind = rig, kind
        self.release = threading.Event()
        self.tokens, self.src, self.dst = (
            rig.prompt(2),
            rig.blocks(2, source=True),
            rig.blocks(2, source=False),
        )
        self.rule = FaultRule(op="put" if kind == "store" else "get", hang=self.release, max_hang_s=SAFETY_S)

    async def start(self, worker: KVWorker) -> TransferFuture[Any]:
        if self.kind == "load":
            await worker.store(self.tokens, self.src)
        self.rig.backend.add_rule(self.rule)
        if self.kind == "store":
            return worker.store(self.tokens, self.src)
        return worker.load(self.tokens, self.dst)


# -- cancellation -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancel_while_queued_is_immediate_and_nothing_reaches_the_store() -> None:
    rig = Rig(seed=12)
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        store = worker.store(tokens, rig.blocks(2, source=True))
        load = worker.load(tokens, rig.blocks(2, source=False))
        assert isinstance(store, TransferFuture) and store.request_id != load.request_id
        for fut in (store, load):
            assert fut.cancel() is True
            assert fut.done() and fut.cancelled()
            with pytest.raises(asyncio.CancelledError):
                fut.result()
            assert fut.cancel() is False
        with pytest.raises(asyncio.CancelledError):
            await store
        other = rig.prompt(1)
        assert (await worker.store(other, rig.blocks(1, source=True))).stored == 1
        stats = worker.stats()
    assert stats["requests_cancelled"] == {"store": 1, "load": 1}
    assert keys_seen(rig) == set(rig.all_keys(other))  # nothing of the cancelled requests


@pytest.mark.asyncio
async def test_cancel_during_the_existence_check_is_immediate_and_its_chunks_are_never_written() -> None:
    """batch_exists touches no caller memory: a request cancelled during it finishes at once."""
    rig = Rig(seed=14)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="exists", hang=release, max_hang_s=SAFETY_S, times=1))
    doomed, kept, after = rig.prompt(2), rig.prompt(2), rig.prompt(1)
    async with rig.worker() as worker:
        fut = worker.store(doomed, rig.blocks(2, source=True))
        sibling = worker.store(kept, rig.blocks(2, source=True))  # same batch
        try:
            await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
            assert fut.cancel() is True
            assert fut.done() and fut.cancelled()  # exists does not touch the blocks
        finally:
            release.set()
        assert (await sibling).stored == 2
        assert (await worker.store(after, rig.blocks(1, source=True))).stored == 1
    assert set(rig.backend.sent_keys("put")) == set(rig.all_keys(kept)) | set(rig.all_keys(after))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["store", "load"])
async def test_cancel_inside_the_backend_call_is_done_only_after_the_call_returns(kind: str) -> None:
    rig = Rig(seed=16)
    held = HeldTransfer(rig, kind)
    tokens, src, dst, release = held.tokens, held.src, held.dst, held.release
    async with rig.worker() as worker:
        fut = await held.start(worker)
        try:
            await rig.backend.wait_hanging_async(2, timeout=SAFETY_S)
            assert fut.cancel() is True
            for _ in range(5):
                await asyncio.sleep(0.01)
                # The store may still read / write these blocks.
                assert not fut.done() and not fut.cancelled()
        finally:
            release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(fut, SAFETY_S)
        assert fut.done() and fut.cancelled()
        assert worker.stats()["requests_cancelled"] == {kind: 1}
        # The worker keeps serving.
        rig.backend.remove_rule(held.rule)
        assert (await worker.store(rig.prompt(2), rig.blocks(2, source=True))).stored == 2
    # The call ran to completion: its bytes were moved in full.
    if kind == "store":
        for g in range(2):
            for c, key in enumerate(rig.keys(tokens, g)):
                assert rig.stored_value(key, g, src[g], c) == rig.value(g, src[g], c)
    else:
        for g in range(2):
            assert rig.same_bytes(g, dst[g], src[g])


# -- the caller's timeout and the request's deadline -------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["store", "load"])
async def test_wait_for_timing_out_does_not_cancel_the_transfer(kind: str) -> None:
    rig = Rig(seed=11)
    held = HeldTransfer(rig, kind)
    tokens, src, dst, release = held.tokens, held.src, held.dst, held.release
    async with rig.worker() as worker:
        fut = await held.start(worker)
        try:
            await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fut, 0.01)
            assert not fut.done() and not fut.cancelled()
        finally:
            release.set()
        result = await fut
        if kind == "store":
            assert isinstance(result, StoreResult)
            assert (result.stored, result.failed) == (2, 0)
            assert await worker.lookup(tokens) == 2 * CHUNK
    if kind == "load":
        assert isinstance(result, LoadResult)
        assert result.loaded_tokens == 2 * CHUNK
        for g in range(2):
            assert rig.same_bytes(g, dst[g], src[g])


@pytest.mark.asyncio
async def test_a_deadline_while_queued_fails_at_once_and_nothing_reaches_the_store() -> None:
    rig = Rig(seed=10)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S))
    first, second = rig.prompt(1), rig.prompt(1)
    async with rig.worker(max_concurrent_batches=1) as worker:
        running = worker.store(first, rig.blocks(1, source=True))
        try:
            await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
            queued = worker.store(second, rig.blocks(1, source=True), timeout=0.02)
            with pytest.raises(TransferTimeoutError, match="before it ran"):
                await asyncio.wait_for(queued, SAFETY_S)
            error = queued.exception()
            assert isinstance(error, TransferTimeoutError) and isinstance(error, TimeoutError)
            assert not running.done()  # failed while the first request was still in the backend
        finally:
            release.set()
        assert (await running).stored == 1
        assert keys_seen(rig).isdisjoint(rig.all_keys(second))
        assert await worker.lookup(second) == 0
        assert worker.stats()["requests_failed"] == {"store": 1}
    assert set(rig.backend.sent_keys("put")).isdisjoint(rig.all_keys(second))


@pytest.mark.asyncio
async def test_a_deadline_in_a_hung_call_is_reported_only_once_the_call_returns() -> None:
    rig = Rig(seed=9)
    release = threading.Event()
    rule = rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S))
    tokens, src = rig.prompt(2), rig.blocks(2, source=True)
    async with rig.worker() as worker:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.3
        fut = worker.store(tokens, src, timeout=0.3)
        try:
            # Both groups' puts hang well before the deadline (or the test says why not).
            await wait_until(lambda: rig.backend.hanging == 2 or fut.done(), SAFETY_S)
            assert not fut.done(), fut
            await asyncio.sleep(deadline + 0.05 - loop.time())  # past the deadline
            assert not fut.done()
            # A caller's own timeout stops its wait, not the transfer.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fut, 0.01)
            assert not fut.done() and not fut.cancelled()
        finally:
            release.set()
        with pytest.raises(TransferTimeoutError):
            await asyncio.wait_for(fut, SAFETY_S)
        assert fut.done()
        # The hung call itself completed, so the data is in the store.
        assert rig.inner.batch_exists(rig.all_keys(tokens)) == [True] * 4
        assert worker.stats()["requests_failed"] == {"store": 1}
        # The worker keeps serving.
        rig.backend.remove_rule(rule)
        assert (await worker.store(rig.prompt(1), rig.blocks(1, source=True))).stored == 1


# -- shutdown ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_graceful_close_finishes_every_pending_request_and_leaves_no_thread_or_task() -> None:
    rig = Rig(seed=18)
    delay = rig.backend.add_rule(FaultRule(op="*", delay_s=0.002))
    threads_before = aiokv_threads()
    worker = rig.worker(executor_threads=3)
    await worker.start()
    prompts = [rig.prompt(2) for _ in range(12)]
    sources = [rig.blocks(2, source=True) for _ in prompts]
    stores = [worker.store(p, ids) for p, ids in zip(prompts, sources, strict=True)]
    loads = [worker.load(p, rig.blocks(2, source=False)) for p in prompts[:6]]
    await worker.close()  # nothing awaited before
    assert worker.closed
    assert all(f.done() for f in stores + loads)
    results = [f.result() for f in stores + loads]  # none failed or was cancelled
    assert all(isinstance(r, StoreResult) and r.failed == 0 for r in results[:12])
    assert all(isinstance(r, LoadResult) for r in results[12:])
    assert sum(r.stored + r.skipped for r in results[:12]) == 24
    assert len(rig.inner) == 12 * 2 * 2  # every chunk of every group
    assert aiokv_threads() == threads_before
    assert loop_tasks() == set()
    with pytest.raises(WorkerClosedError):
        worker.store(prompts[0], rig.blocks(2, source=True))
    with pytest.raises(WorkerClosedError):
        await worker.lookup(prompts[0])
    assert rig.backend.calls_of("unregister")  # our memory was released

    # Also while a backend call is held: close waits for it, then every future is done.
    rig.backend.remove_rule(delay)
    worker = rig.worker()
    await worker.start()
    with rig.backend.blocked("get"):
        dests = [rig.blocks(2, source=False) for _ in range(3)]
        held = [worker.load(p, ids) for p, ids in zip(prompts[:3], dests, strict=True)]
        await wait_until(rig.backend.entered("get").is_set)
        more = worker.store(rig.prompt(1), rig.blocks(1, source=True))
        closing = asyncio.create_task(worker.close())
        await asyncio.sleep(0.02)
        assert not closing.done() and not any(f.done() for f in held)
        with pytest.raises(WorkerClosedError):
            worker.store(rig.prompt(1), rig.blocks(1, source=True))
    await closing
    assert [f.result().loaded_tokens for f in held] == [2 * CHUNK] * 3
    assert more.result().stored == 1
    for ids, dst in zip(sources[:3], dests, strict=True):
        for g in range(2):
            assert rig.same_bytes(g, dst[g], ids[g])


@pytest.mark.asyncio
async def test_close_with_a_timeout_terminates_but_still_waits_for_the_hung_call() -> None:
    rig = Rig(seed=21)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="get", hang=release, max_hang_s=SAFETY_S))
    tokens, src, dst = rig.prompt(2), rig.blocks(2, source=True), rig.blocks(2, source=False)
    threads_before = aiokv_threads()
    worker = rig.worker(max_concurrent_batches=1)
    await worker.start()
    await worker.store(tokens, src)
    load = worker.load(tokens, dst)
    try:
        await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
        queued_tokens = rig.prompt(2)
        queued = worker.store(queued_tokens, rig.blocks(2, source=True))
        closing = asyncio.ensure_future(worker.close(timeout=0.02))
        await wait_until(queued.done)  # the timeout passed: queued work was failed
        assert isinstance(queued.exception(), WorkerClosedError)
        await asyncio.sleep(0.1)
        assert not closing.done() and not load.done()
    finally:
        release.set()
    await asyncio.wait_for(closing, SAFETY_S)
    assert load.done() and load.result().loaded_tokens == 2 * CHUNK  # its calls ran to the end
    for g in range(2):
        assert rig.same_bytes(g, dst[g], src[g])
    assert aiokv_threads() == threads_before and loop_tasks() == set()
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert worker.closed
    assert keys_seen(rig).isdisjoint(rig.all_keys(queued_tokens))


@pytest.mark.asyncio
async def test_terminate_fails_queued_work_at_once_and_waits_for_the_call_in_flight() -> None:
    rig = Rig(seed=19)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S, times=2))
    threads_before = aiokv_threads()
    worker = rig.worker(max_concurrent_batches=1)
    await worker.start()
    assert aiokv_threads() - threads_before  # the worker's threads exist while it runs
    in_flight = worker.store(rig.prompt(1), rig.blocks(1, source=True))
    queued_tokens = [rig.prompt(1) for _ in range(4)]
    try:
        await rig.backend.wait_hanging_async(2, timeout=SAFETY_S)
        # Lookups run on the control lane: answered although every transfer thread is stuck.
        assert await asyncio.wait_for(worker.lookup(rig.prompt(1)), SAFETY_S) == 0
        queued = [worker.store(t, rig.blocks(1, source=True)) for t in queued_tokens[:3]]
        queued.append(worker.load(queued_tokens[3], rig.blocks(1, source=False)))
        lookup = asyncio.ensure_future(worker.lookup(rig.prompt(1)))
        await asyncio.sleep(0)
        worker.terminate()
        for fut in queued:
            assert fut.done()
            with pytest.raises(WorkerClosedError):
                fut.result()
        with pytest.raises(WorkerClosedError):
            await lookup
        with pytest.raises(WorkerClosedError):
            worker.store(rig.prompt(1), rig.blocks(1, source=True))
        assert not in_flight.done()  # its memory is in use until the held calls return
        closing = asyncio.ensure_future(worker.wait_closed())
        await asyncio.sleep(0.02)
        assert not closing.done() and not in_flight.done()
    finally:
        release.set()
    await asyncio.wait_for(closing, SAFETY_S)
    assert in_flight.done() and in_flight.result().stored == 1
    assert aiokv_threads() == threads_before and loop_tasks() == set()
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert keys_seen(rig).isdisjoint(k for t in queued_tokens for k in rig.all_keys(t))
