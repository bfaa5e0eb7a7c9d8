"""What the worker must prove under faults: partial failures, exceptions and master loss, cancellation
in the prepare step and behind a busy batch, a failed start, terminate with calls never started, and
store-pressure backoff (cancellation while queued or in a call, deadlines, close and terminate with work
pending are in test_lifecycle.py).

Every test runs a real KVWorker on a real MemoryBackend wrapped in aiokv.testing's
FaultInjectingBackend, and checks bytes in the engine's cache and keys seen by the store.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from aiokv import (
    AiokvError,
    BackendError,
    BackendUnavailableError,
    Code,
    KVLayout,
    LoadResult,
    WorkerClosedError,
)
from aiokv.testing import FaultRule, PagedCache
from tests.helpers import aiokv_threads, same_exception, wait_until
from tests.rig import CHUNK, NAMESPACE, SAFETY_S, SPECS, Rig, fault_keys, loop_tasks

# -- partial failures ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_store_partial_failure_reports_exactly_those_chunks_and_a_retry_puts_only_them() -> None:
    rig = Rig(seed=1)
    tokens = rig.prompt(6)
    src = rig.blocks(6, source=True)
    bad = {
        (1, 0): Code.TRANSFER_FAILED,
        (4, 1): Code.INVALID,
        (5, 0): Code.UNAVAILABLE,
        (5, 1): Code.UNAVAILABLE,
    }
    for (chunk, group), code in bad.items():
        rig.backend.add_rule(FaultRule(op="put", keys=fault_keys(rig, tokens, [(chunk, group)]), code=code))
    async with rig.worker() as worker:
        first = await worker.store(tokens, src)
        assert (first.stored, first.skipped, first.failed) == (3, 0, 3)
        assert first.failed_chunks == (1, 4, 5)
        assert dict(first.errors) == {Code.TRANSFER_FAILED: 1, Code.INVALID: 1, Code.UNAVAILABLE: 2}
        # Exactly the faulted keys are missing; every other key holds its source bytes.
        bad_keys = fault_keys(rig, tokens, list(bad))
        for g in range(2):
            for c, key in enumerate(rig.keys(tokens, g)):
                held = rig.stored_value(key, g, src[g], c)
                assert held == (None if key in bad_keys else rig.value(g, src[g], c)), (c, g)
        assert len(rig.inner) == 12 - len(bad)

        rig.backend.clear_rules()
        rig.backend.clear_calls()
        retry = await worker.store(tokens, src)
        assert (retry.stored, retry.skipped, retry.failed) == (3, 3, 0)
        assert sorted(rig.backend.sent_keys("put")) == sorted(bad_keys)
        assert len(rig.inner) == 12
        for g in range(2):
            for c, key in enumerate(rig.keys(tokens, g)):
                assert rig.stored_value(key, g, src[g], c) == rig.value(g, src[g], c)
        stats = worker.stats()
    assert (
        stats["chunks"]["stored"] == 6 and stats["chunks"]["failed"] == 3 and stats["chunks"]["skipped"] == 3
    )
    assert stats["backend_errors"] == {Code.TRANSFER_FAILED: 1, Code.INVALID: 1, Code.UNAVAILABLE: 2}


@pytest.mark.asyncio
async def test_load_partial_failure_gives_the_longest_prefix_and_exactly_the_blocks_to_recompute() -> None:
    rig = Rig(seed=2)
    tokens = rig.prompt(6, extra_tokens=5)  # a trailing partial chunk is never loaded
    src = rig.blocks(6, source=True)
    dst = rig.blocks(6, source=False, spare=2)  # spare ids past the whole chunks must stay untouched
    async with rig.worker() as worker:
        assert (await worker.store(tokens, src)).stored == 6
        faulted = {(2, 1): Code.TRANSFER_FAILED, (4, 0): Code.NOT_FOUND}
        for (chunk, group), code in faulted.items():
            rig.backend.add_rule(
                FaultRule(op="get", keys=fault_keys(rig, tokens, [(chunk, group)]), code=code)
            )
        result = await worker.load(tokens, dst)
    assert isinstance(result, LoadResult)
    assert result.loaded_tokens == 2 * CHUNK
    assert result.loaded_chunks == 4
    assert dict(result.errors) == {Code.TRANSFER_FAILED: 1, Code.NOT_FOUND: 1}
    for g in range(2):
        expected = np.concatenate([rig.chunk_blocks(g, dst[g], c) for c in (2, 4)]).tolist()
        assert list(result.failed_block_ids[g]) == expected
    for g in range(2):
        for c in range(6):
            d, s = rig.chunk_blocks(g, dst[g], c), rig.chunk_blocks(g, src[g], c)
            if (c, g) in faulted:
                assert rig.cache[g].untouched(d), (c, g)  # the failed read wrote nothing
            else:
                assert rig.same_bytes(g, d, s), (c, g)
        # Nothing outside the request's blocks was written: not the spare ids, not any other block.
        loaded = {int(b) for c in range(6) if (c, g) not in faulted for b in rig.chunk_blocks(g, dst[g], c)}
        assert rig.written_outside_sources(g) == loaded
        assert rig.cache[g].untouched(dst[g][-2:])


@pytest.mark.asyncio
async def test_a_missing_chunk_ends_the_load_prefix_and_later_chunks_are_not_read() -> None:
    rig = Rig(seed=3)
    tokens = rig.prompt(5)
    src = rig.blocks(5, source=True)
    dst = rig.blocks(5, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, src)).stored == 5
        assert rig.inner.batch_remove([rig.keys(tokens, 1)[2]]) == [0]
        rig.backend.clear_calls()
        result = await worker.load(tokens, dst)
        assert await worker.lookup(tokens) == 2 * CHUNK
    assert result.loaded_tokens == 2 * CHUNK and result.loaded_chunks == 2
    assert sorted(rig.backend.sent_keys("get")) == sorted(rig.keys(tokens, 0)[:2] + rig.keys(tokens, 1)[:2])
    for g in range(2):
        assert list(result.failed_block_ids[g]) == dst[g][2 * rig.per_chunk[g] :].tolist()
        assert rig.cache[g].untouched(dst[g][2 * rig.per_chunk[g] :])
        assert rig.same_bytes(g, dst[g][: 2 * rig.per_chunk[g]], src[g][: 2 * rig.per_chunk[g]])


@pytest.mark.asyncio
async def test_two_stores_of_one_chunk_write_it_once_and_both_see_a_writer_failure() -> None:
    rig = Rig(seed=4)
    tokens = rig.prompt(3)
    src_a, src_b = rig.blocks(3, source=False), rig.blocks(3, source=False)
    src_a = rig.blocks(3, source=True)
    for g in range(2):  # both requests hold the same KV (same prompt), in different blocks
        for region in rig.cache[g].regions:
            region[src_b[g]] = region[src_a[g]]
    rig.backend.add_rule(
        FaultRule(op="put", keys=fault_keys(rig, tokens, [(1, 0)]), code=Code.TRANSFER_FAILED)
    )
    async with rig.worker() as worker:
        a, b = worker.store(tokens, src_a), worker.store(tokens, src_b)
        ra, rb = await a, await b
    # The chunk's key reached the store once; its failure is reported to both requests.
    put_keys = rig.backend.sent_keys("put")
    assert len(put_keys) == len(set(put_keys)) == 5
    assert ra.failed_chunks == rb.failed_chunks == (1,)
    assert ra.stored + rb.stored + ra.skipped + rb.skipped == 4


# -- exceptions and master loss -----------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "cause",
    [
        RuntimeError("disk on fire"),
        BackendUnavailableError("master 10.0.0.1:50051 lost", code=Code.UNAVAILABLE),
    ],
    ids=["exception", "master-loss"],
)
async def test_a_put_exception_fails_only_its_batch_and_the_dispatcher_serves_the_next(
    cause: BaseException,
) -> None:
    rig = Rig(seed=5)
    rule = rig.backend.add_rule(FaultRule(op="put", exception=cause, times=1))
    prompts = [rig.prompt(3) for _ in range(3)]
    sources = [rig.blocks(3, source=True) for _ in range(3)]
    async with rig.worker() as worker:
        # Submitted together: one batch, whose group-0 put raises.
        first = [worker.store(prompts[i], sources[i]) for i in range(2)]
        outcomes = await asyncio.gather(*first, return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, BackendError)
            assert isinstance(outcome, BackendUnavailableError) == isinstance(cause, BackendUnavailableError)
            assert same_exception(outcome.__cause__, cause)
        assert rig.backend.fired(rule) == 1
        # The dispatcher lives on: the next store and a load of it succeed, byte for byte.
        third = await worker.store(prompts[2], sources[2])
        assert (third.stored, third.failed) == (3, 0)
        dst = rig.blocks(3, source=False)
        loaded = await worker.load(prompts[2], dst)
        assert loaded.loaded_tokens == 3 * CHUNK
        for g in range(2):
            assert rig.same_bytes(g, dst[g], sources[2][g])
        # A retry of a failed prompt now stores what the failed call did not.
        retry = await worker.store(prompts[0], sources[0])
        assert retry.failed == 0 and retry.stored == 3
        stats = worker.stats()
    assert stats["requests_failed"] == {"store": 2}
    assert stats["backend_exceptions"] == {"put": 1}


@pytest.mark.asyncio
async def test_master_loss_in_exists_fails_the_batch_then_lookups_and_transfers_resume() -> None:
    rig = Rig(seed=6)
    lost = BackendUnavailableError("master unreachable", code=Code.UNAVAILABLE, address="10.0.0.1:50051")
    rule = rig.backend.add_rule(FaultRule(op="exists", exception=lost, times=1))
    tokens, other = rig.prompt(2), rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        store, load = worker.store(tokens, src), worker.load(other, dst)
        for fut in (store, load):
            with pytest.raises(BackendUnavailableError) as info:
                await fut
            assert same_exception(info.value.__cause__, lost) and info.value.address == "10.0.0.1:50051"
        assert rig.backend.fired(rule) == 1
        assert rig.backend.sent_keys("put") == [] and rig.backend.sent_keys("get") == []
        for g in range(2):
            assert rig.cache[g].untouched(dst[g])
        assert (await worker.store(tokens, src)).stored == 2
        assert await worker.lookup(tokens) == 2 * CHUNK
        # A lookup whose exists call raises fails alone; the next one is answered.
        rig.backend.add_rule(FaultRule(op="exists", exception=lost, times=1))
        with pytest.raises(BackendUnavailableError):
            await worker.lookup(tokens)
        assert await worker.lookup(tokens) == 2 * CHUNK


@pytest.mark.asyncio
async def test_a_get_exception_fails_the_load_and_writes_no_block() -> None:
    rig = Rig(seed=7)
    tokens = rig.prompt(3)
    src, dst = rig.blocks(3, source=True), rig.blocks(3, source=False)
    async with rig.worker() as worker:
        await worker.store(tokens, src)
        rig.backend.add_rule(FaultRule(op="get", exception=ConnectionResetError("peer reset"), times=2))
        with pytest.raises(BackendError) as info:
            await worker.load(tokens, dst)
        assert isinstance(info.value.__cause__, ConnectionResetError)
        for g in range(2):
            assert rig.cache[g].untouched(dst[g])
        result = await worker.load(tokens, dst)
    assert result.loaded_tokens == 3 * CHUNK
    for g in range(2):
        assert rig.same_bytes(g, dst[g], src[g])


@pytest.mark.asyncio
async def test_an_error_in_the_prepare_step_fails_the_batch_with_the_cause_chained() -> None:
    class BrokenLayout(KVLayout):
        def regions_for_chunks(self, chunk_blocks: np.ndarray) -> list[Any]:
            raise MemoryError("no memory for regions")

    rig = Rig(seed=8)
    layouts = [
        BrokenLayout(lay.base_addrs, lay.block_lens, lay.block_size, lay.num_blocks) if g == 0 else lay
        for g, lay in enumerate(rig.cache.layouts)
    ]
    rig.layouts = layouts
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        with pytest.raises(AiokvError) as info:
            await worker.store(tokens, rig.blocks(2, source=True))
        assert isinstance(info.value.__cause__, MemoryError)
        assert rig.backend.sent_keys("put") == rig.keys(tokens, 1)  # group 1 went on
        assert await worker.lookup(tokens) == 0


# -- cancellation in every state ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancel_while_queued_behind_a_busy_batch() -> None:
    rig = Rig(seed=13)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S))
    busy, waiting = rig.prompt(1), rig.prompt(2)
    async with rig.worker(max_concurrent_batches=1) as worker:
        running = worker.store(busy, rig.blocks(1, source=True))
        try:
            await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
            queued = worker.load(waiting, rig.blocks(2, source=False))
            await asyncio.sleep(0)
            assert queued.cancel() is True and queued.done() and queued.cancelled()
        finally:
            release.set()
        await running
    seen = {k for c in rig.backend.data_calls() for k in c.keys}
    assert seen.isdisjoint(rig.all_keys(waiting))


class GatedLayout(KVLayout):
    """A layout whose region computation (the batch's prepare step) waits on a shared gate."""

    def __init__(self, layout: KVLayout, gate: threading.Event, entered: threading.Event) -> None:
        super().__init__(layout.base_addrs, layout.block_lens, layout.block_size, layout.num_blocks)
        self.gate, self.entered = gate, entered

    def regions_for_chunks(self, chunk_blocks: np.ndarray) -> list[Any]:
        self.entered.set()
        if not self.gate.wait(SAFETY_S):
            raise AssertionError("the prepare gate was never opened")
        return super().regions_for_chunks(chunk_blocks)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["store", "load"])
async def test_cancel_in_prepare_is_immediate_and_no_backend_call_touches_its_blocks(kind: str) -> None:
    gate, entered = threading.Event(), threading.Event()
    rig = Rig(seed=15)
    rig.layouts = [GatedLayout(lay, gate, entered) for lay in rig.cache.layouts]
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        if kind == "load":
            gate.set()
            await worker.store(tokens, rig.blocks(2, source=True))
            gate.clear()
            entered.clear()
        rig.backend.clear_calls()
        blocks = rig.blocks(2, source=False)
        fut = worker.store(tokens, blocks) if kind == "store" else worker.load(tokens, blocks)
        try:
            assert await asyncio.to_thread(entered.wait, SAFETY_S)
            assert fut.cancel() is True
            assert fut.done() and fut.cancelled()
        finally:
            gate.set()
        await wait_until(lambda: worker.requests_in_flight == 0 and rig.backend.in_flight == 0)
        # Nothing started after the cancel: no put or get, so its blocks stayed as they were.
        assert rig.backend.calls_of("put", "get") == []
        for g in range(2):
            assert rig.cache[g].untouched(blocks[g])
        assert len(rig.inner) == (4 if kind == "load" else 0)


@pytest.mark.asyncio
async def test_a_sibling_of_a_store_cancelled_in_prepare_reports_the_truth() -> None:
    """The cancelled request was to write the shared chunks: the sibling's result matches what the
    store then holds, and a retry stores whatever is missing."""
    gate, entered = threading.Event(), threading.Event()
    rig = Rig(seed=27)
    rig.layouts = [GatedLayout(lay, gate, entered) for lay in rig.cache.layouts]
    tokens = rig.prompt(2)
    first, second = rig.blocks(2, source=True), rig.blocks(2, source=False)
    for g in range(2):  # same prompt, same KV, other blocks
        for region in rig.cache[g].regions:
            region[second[g]] = region[first[g]]
    async with rig.worker() as worker:
        doomed, sibling = worker.store(tokens, first), worker.store(tokens, second)
        try:
            assert await asyncio.to_thread(entered.wait, SAFETY_S)
            assert doomed.cancel() and doomed.done()
        finally:
            gate.set()
        result = await sibling
        held = [all(rig.inner.batch_exists([rig.keys(tokens, g)[c] for g in range(2)])) for c in range(2)]
        assert [c for c in range(2) if not held[c]] == list(result.failed_chunks)
        assert result.stored + result.skipped + result.failed == 2
        retry = await worker.store(tokens, second)
        assert retry.failed == 0 and retry.stored == result.failed
    for g in range(2):
        for c, key in enumerate(rig.keys(tokens, g)):
            assert rig.stored_value(key, g, second[g], c) == rig.value(g, second[g], c)


@pytest.mark.asyncio
async def test_cancel_after_finishing_changes_nothing() -> None:
    rig = Rig(seed=17)
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        fut = worker.store(tokens, rig.blocks(2, source=True))
        result = await fut
        assert fut.cancel() is False
        assert not fut.cancelled() and fut.result() is result and result.stored == 2
        assert worker.stats().get("requests_cancelled", {}) == {}


# -- shutdown --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_terminate_fails_a_transfer_whose_later_calls_never_started() -> None:
    """One executor thread, a request split into several calls: the first hangs, the rest wait in
    the executor queue; terminate() drops those, and the request still finishes (failed)."""
    rig = Rig(seed=20)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S, times=1))
    threads_before = aiokv_threads()
    worker = rig.worker(executor_threads=1, max_regions_per_call=4)  # one chunk per group-0 call
    await worker.start()
    fut = worker.store(rig.prompt(3), rig.blocks(3, source=True))
    try:
        await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
        worker.terminate()
        assert not fut.done()
    finally:
        release.set()
    await asyncio.wait_for(worker.wait_closed(), SAFETY_S)
    assert fut.done()
    with pytest.raises(WorkerClosedError, match="was not run"):
        fut.result()  # the same error as requests terminate() failed while queued
    assert len(rig.backend.calls_of("put")) == 1  # the dropped calls never reached the store
    assert aiokv_threads() == threads_before and loop_tasks() == set()


@pytest.mark.asyncio
async def test_a_failed_start_leaves_no_thread() -> None:
    rig = Rig(seed=22)
    rig.backend.add_rule(FaultRule(op="register", exception=OSError("cannot pin memory"), times=1))
    threads_before = aiokv_threads()
    worker = rig.worker()
    with pytest.raises(OSError, match="cannot pin"):
        await worker.start()
    assert aiokv_threads() == threads_before and loop_tasks() == set()
    with pytest.raises(WorkerClosedError):
        worker.store(rig.prompt(1), rig.blocks(1, source=True))


# -- store pressure -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_no_space_backs_off_stores_but_not_loads() -> None:
    rig = Rig(seed=23)
    early, full, later = rig.prompt(2), rig.prompt(2), rig.prompt(3)
    early_src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    rig.backend.add_rule(FaultRule(op="put", keys=fault_keys(rig, full, [(1, 0)]), code=Code.NO_SPACE))
    async with rig.worker(pressure_backoff_s=60.0) as worker:
        assert (await worker.store(early, early_src)).stored == 2
        hit = await worker.store(full, rig.blocks(2, source=True))
        assert hit.failed_chunks == (1,) and dict(hit.errors) == {Code.NO_SPACE: 1}
        assert worker.stats()["pressure_backoffs"] == 1
        puts_before = len(rig.backend.calls_of("put"))
        # Backing off: a new store is refused without a put; chunks already there still count.
        refused = await worker.store(later, rig.blocks(3, source=True))
        assert (refused.stored, refused.failed) == (0, 3) and dict(refused.errors) == {Code.NO_SPACE: 6}
        again = await worker.store(early, early_src)
        assert (again.skipped, again.failed) == (2, 0)
        assert len(rig.backend.calls_of("put")) == puts_before
        # Loads and lookups are unaffected.
        loaded = await worker.load(early, dst)
        assert loaded.loaded_tokens == 2 * CHUNK
        for g in range(2):
            assert rig.same_bytes(g, dst[g], early_src[g])
        assert await worker.lookup(early) == 2 * CHUNK
        stats = worker.stats()
    assert stats["pressure_backoffs"] == 1
    assert rig.inner.batch_exists(rig.all_keys(later)) == [False] * 6


@pytest.mark.asyncio
async def test_stores_resume_once_the_backoff_has_passed() -> None:
    rig = Rig(seed=24)
    full, later = rig.prompt(1), rig.prompt(2)
    rule = rig.backend.add_rule(FaultRule(op="put", code=Code.NO_SPACE, times=1))
    async with rig.worker(pressure_backoff_s=0.05) as worker:
        assert (await worker.store(full, rig.blocks(1, source=True))).failed == 1
        assert rig.backend.fired(rule) == 1
        await asyncio.sleep(0.1)
        src = rig.blocks(2, source=True)
        assert (await worker.store(later, src)).stored == 2
        assert worker.stats()["pressure_backoffs"] == 1
    for g in range(2):
        for c, key in enumerate(rig.keys(later, g)):
            assert rig.stored_value(key, g, src[g], c) == rig.value(g, src[g], c)


@pytest.mark.asyncio
async def test_a_full_memory_backend_answers_no_space_and_evicts_nothing() -> None:
    # Room for three chunks of both groups.
    per_chunk_bytes = [
        lay.chunk_bytes_per_block * (CHUNK // lay.block_size) for lay in PagedCache.allocate(SPECS).layouts
    ]
    rig = Rig(seed=25, capacity_bytes=3 * sum(per_chunk_bytes))
    first, second = rig.prompt(3), rig.prompt(2)
    src = rig.blocks(3, source=True)
    async with rig.worker(pressure_backoff_s=60.0) as worker:
        assert (await worker.store(first, src)).stored == 3
        refused = await worker.store(second, rig.blocks(2, source=True))
        assert refused.failed == 2 and refused.stored == 0
        assert worker.stats()["pressure_backoffs"] == 1
        dst = rig.blocks(3, source=False)
        assert (await worker.load(first, dst)).loaded_tokens == 3 * CHUNK
    for g in range(2):
        assert rig.same_bytes(g, dst[g], src[g])
    assert len(rig.inner) == 6


# -- logging ----------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_failures_log_counts_and_codes_never_keys(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(seed=26)
    tokens = rig.prompt(4)
    bad = fault_keys(rig, tokens, [(1, 0), (2, 0), (3, 0)])
    rig.backend.add_rule(FaultRule(op="put", keys=set(list(bad)[:2]), code=Code.TRANSFER_FAILED))
    rig.backend.add_rule(FaultRule(op="put", keys=set(list(bad)[2:]), code=Code.INVALID))
    rig.backend.add_rule(FaultRule(op="get", exception=ConnectionError("link down"), times=1))
    caplog.set_level("WARNING", logger="aiokv")
    async with rig.worker() as worker:
        result = await worker.store(tokens, rig.blocks(4, source=True))
        assert result.failed == 3
        with pytest.raises(BackendError):
            await worker.load(tokens[:CHUNK], rig.blocks(1, source=False))
    records = [r for r in caplog.records if r.name == "aiokv"]
    messages = [r.getMessage() for r in records]
    assert "aiokv: batch_put: 3 of 4 keys failed: TRANSFER_FAILED (-800): 2, INVALID (-600): 1" in messages
    assert any("batch_get of 1 keys failed: link down" in m for m in messages)
    digests = [key.rsplit("/", 1)[1] for key in rig.all_keys(tokens)]
    assert not any(d in m for d in digests for m in messages)
    assert not any(NAMESPACE in m for m in messages)
