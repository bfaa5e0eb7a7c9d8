"""Issue 5's "behaviour it must prove": partial failures, exceptions and master loss, deadlines,
cancellation in every state, shutdown with work pending, and store-pressure backoff.

Every test runs a real KVWorker on a real MemoryBackend wrapped in aiokv.testing's
FaultInjectingBackend, and checks bytes in the engine's cache and keys seen by the store.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from aiokv import (
    AiokvError,
    BackendError,
    BackendUnavailableError,
    KVLayout,
    KVWorker,
    LoadResult,
    MemoryBackend,
    StoreResult,
    TransferTimeoutError,
    WorkerClosedError,
)
from aiokv.backends.base import INVALID, NO_SPACE, NOT_FOUND, TRANSFER_FAILED, UNAVAILABLE
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache, chunk_value
from tests.helpers import aiokv_threads, chunk_keys, read_value, wait_until

CHUNK = 8
NAMESPACE = "reliability-model"
# Two groups: 2 blocks per chunk in group 0, 1 in group 1; unequal block lengths in group 1.
SPECS = [
    {"num_regions": 4, "num_blocks": 96, "block_size": 4, "block_lens": 32},
    {"num_regions": 2, "num_blocks": 48, "block_size": 8, "block_lens": [48, 16]},
]
SAFETY_S = 20.0  # bound on every wait; never reached when the code works


class Rig:
    """One cache (sentinel-filled), a MemoryBackend behind a FaultInjectingBackend, and a block
    allocator handing out scattered block ids that are never reused within a test."""

    def __init__(
        self, *, seed: int = 0, capacity_bytes: int = 64 << 20, layouts: list[KVLayout] | None = None
    ):
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate(SPECS, fill=SENTINEL)
        self.inner = MemoryBackend(capacity_bytes=capacity_bytes)
        self.backend = FaultInjectingBackend(self.inner, seed=seed)
        self.layouts = layouts or self.cache.layouts
        self.per_chunk = [CHUNK // g.block_size for g in self.cache.groups]
        self._free = [list(self.rng.permutation(g.num_blocks)) for g in self.cache.groups]
        self._source: list[set[int]] = [set() for _ in self.cache.groups]

    def worker(self, **options: Any) -> KVWorker:
        options.setdefault("pressure_backoff_s", 0.0)
        return KVWorker(self.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options)

    def prompt(self, chunks: int, extra_tokens: int = 0) -> np.ndarray:
        return self.rng.integers(0, 50_000, size=chunks * CHUNK + extra_tokens, dtype=np.int64)

    def blocks(self, chunks: int, *, source: bool, spare: int = 0) -> list[np.ndarray]:
        """Block ids for ``chunks`` chunks per group (+ ``spare`` unused ids after them); source
        blocks get random bytes, the others keep the sentinel."""
        out = []
        for g, group in enumerate(self.cache.groups):
            count = chunks * self.per_chunk[g] + spare
            ids = np.array([self._free[g].pop() for _ in range(count)], dtype=np.int64)
            if source:
                for region in group.regions:
                    region[ids] = self.rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)
                self._source[g] |= set(ids.tolist())
            out.append(ids)
        return out

    def keys(self, tokens: np.ndarray, group: int) -> list[str]:
        return chunk_keys(tokens, CHUNK, self.cache[group].layout, group, NAMESPACE)

    def all_keys(self, tokens: np.ndarray) -> list[str]:
        return [k for g in range(len(SPECS)) for k in self.keys(tokens, g)]

    def chunk_blocks(self, group: int, ids: np.ndarray, chunk: int) -> np.ndarray:
        n = self.per_chunk[group]
        return ids[chunk * n : (chunk + 1) * n]

    def value(self, group: int, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.cache[group], self.chunk_blocks(group, ids, chunk))

    def stored_value(self, key: str, group: int, ids: np.ndarray, chunk: int) -> bytes | None:
        return read_value(self.inner, key, len(self.value(group, ids, chunk)))

    def same_bytes(self, group: int, a: np.ndarray, b: np.ndarray) -> bool:
        return all(np.array_equal(region[a], region[b]) for region in self.cache[group].regions)

    def written_outside_sources(self, group: int) -> set[int]:
        return self.cache[group].written_blocks() - self._source[group]


def fault_keys(rig: Rig, tokens: np.ndarray, picks: Sequence[tuple[int, int]]) -> set[str]:
    """The keys of (chunk, group) pairs."""
    return {rig.keys(tokens, g)[c] for c, g in picks}


def loop_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("aiokv")}


# -- partial failures ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_store_partial_failure_reports_exactly_those_chunks_and_a_retry_puts_only_them() -> None:
    rig = Rig(seed=1)
    tokens = rig.prompt(6)
    src = rig.blocks(6, source=True)
    bad = {(1, 0): TRANSFER_FAILED, (4, 1): INVALID, (5, 0): UNAVAILABLE, (5, 1): UNAVAILABLE}
    for (chunk, group), code in bad.items():
        rig.backend.add_rule(FaultRule(op="put", keys=fault_keys(rig, tokens, [(chunk, group)]), code=code))
    async with rig.worker() as worker:
        first = await worker.store(tokens, src)
        assert (first.stored, first.skipped, first.failed) == (3, 0, 3)
        assert first.failed_chunks == (1, 4, 5)
        assert dict(first.errors) == {TRANSFER_FAILED: 1, INVALID: 1, UNAVAILABLE: 2}
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
    assert stats["backend_errors"] == {TRANSFER_FAILED: 1, INVALID: 1, UNAVAILABLE: 2}


@pytest.mark.asyncio
async def test_load_partial_failure_gives_the_longest_prefix_and_exactly_the_blocks_to_recompute() -> None:
    rig = Rig(seed=2)
    tokens = rig.prompt(6, extra_tokens=5)  # a trailing partial chunk is never loaded
    src = rig.blocks(6, source=True)
    dst = rig.blocks(6, source=False, spare=2)  # spare ids past the whole chunks must stay untouched
    async with rig.worker() as worker:
        assert (await worker.store(tokens, src)).stored == 6
        faulted = {(2, 1): TRANSFER_FAILED, (4, 0): NOT_FOUND}
        for (chunk, group), code in faulted.items():
            rig.backend.add_rule(
                FaultRule(op="get", keys=fault_keys(rig, tokens, [(chunk, group)]), code=code)
            )
        result = await worker.load(tokens, dst)
    assert isinstance(result, LoadResult)
    assert result.loaded_tokens == 2 * CHUNK
    assert result.loaded_chunks == 4
    assert dict(result.errors) == {TRANSFER_FAILED: 1, NOT_FOUND: 1}
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
    rig.backend.add_rule(FaultRule(op="put", keys=fault_keys(rig, tokens, [(1, 0)]), code=TRANSFER_FAILED))
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
    [RuntimeError("disk on fire"), BackendUnavailableError("master 10.0.0.1:50051 lost", code=UNAVAILABLE)],
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
            assert outcome.__cause__ is cause
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
    lost = BackendUnavailableError("master unreachable", code=UNAVAILABLE, address="10.0.0.1:50051")
    rule = rig.backend.add_rule(FaultRule(op="exists", exception=lost, times=1))
    tokens, other = rig.prompt(2), rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        store, load = worker.store(tokens, src), worker.load(other, dst)
        for fut in (store, load):
            with pytest.raises(BackendUnavailableError) as info:
                await fut
            assert info.value.__cause__ is lost and info.value.address == "10.0.0.1:50051"
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


# -- deadlines ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_deadline_in_a_hung_call_is_reported_only_once_the_call_returns() -> None:
    rig = Rig(seed=9)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S))
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
            assert not running.done()
        finally:
            release.set()
        assert (await running).stored == 1
    seen = {k for c in rig.backend.data_calls() for k in c.keys}
    assert seen.isdisjoint(rig.all_keys(second))


@pytest.mark.asyncio
async def test_wait_for_timing_out_does_not_cancel_the_transfer() -> None:
    rig = Rig(seed=11)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="get", hang=release, max_hang_s=SAFETY_S))
    tokens, src, dst = rig.prompt(2), rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        await worker.store(tokens, src)
        fut = worker.load(tokens, dst)
        try:
            await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fut, 0.01)
            assert not fut.done()
        finally:
            release.set()
        result = await fut
    assert result.loaded_tokens == 2 * CHUNK
    for g in range(2):
        assert rig.same_bytes(g, dst[g], src[g])


# -- cancellation in every state ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancel_while_queued_is_immediate_and_nothing_reaches_the_store() -> None:
    rig = Rig(seed=12)
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        fut = worker.store(tokens, rig.blocks(2, source=True))
        assert fut.cancel() is True
        assert fut.done() and fut.cancelled()
        with pytest.raises(asyncio.CancelledError):
            fut.result()
        assert fut.cancel() is False
        other = rig.prompt(1)
        assert (await worker.store(other, rig.blocks(1, source=True))).stored == 1
        stats = worker.stats()
    assert stats["requests_cancelled"] == {"store": 1}
    seen = {k for c in rig.backend.data_calls() for k in c.keys}
    assert seen.isdisjoint(rig.all_keys(tokens))


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


@pytest.mark.asyncio
async def test_cancel_during_the_existence_check_is_immediate_and_its_chunks_are_never_written() -> None:
    rig = Rig(seed=14)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="exists", hang=release, max_hang_s=SAFETY_S, times=1))
    doomed, kept = rig.prompt(2), rig.prompt(2)
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
    assert set(rig.backend.sent_keys("put")) == set(rig.all_keys(kept))


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
        await wait_until(lambda: not worker._active and rig.backend.in_flight == 0)
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
@pytest.mark.parametrize("kind", ["store", "load"])
async def test_cancel_inside_the_backend_call_is_done_only_after_the_call_returns(kind: str) -> None:
    rig = Rig(seed=16)
    release = threading.Event()
    tokens, src, dst = rig.prompt(2), rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        if kind == "load":
            await worker.store(tokens, src)
        rig.backend.add_rule(
            FaultRule(op="put" if kind == "store" else "get", hang=release, max_hang_s=SAFETY_S)
        )
        fut = worker.store(tokens, src) if kind == "store" else worker.load(tokens, dst)
        try:
            await rig.backend.wait_hanging_async(2, timeout=SAFETY_S)
            assert fut.cancel() is True
            for _ in range(5):
                await asyncio.sleep(0.01)
                assert not fut.done()  # the store may still read / write these blocks
        finally:
            release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(fut, SAFETY_S)
        assert fut.done() and fut.cancelled()
        assert worker.stats()["requests_cancelled"] == {kind: 1}
    # The call ran to completion: its bytes were moved in full.
    if kind == "store":
        for g in range(2):
            for c, key in enumerate(rig.keys(tokens, g)):
                assert rig.stored_value(key, g, src[g], c) == rig.value(g, src[g], c)
    else:
        for g in range(2):
            assert rig.same_bytes(g, dst[g], src[g])


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
async def test_graceful_close_finishes_every_pending_request_and_leaves_no_thread_or_task() -> None:
    rig = Rig(seed=18)
    rig.backend.add_rule(FaultRule(op="*", delay_s=0.002))
    threads_before = aiokv_threads()
    worker = rig.worker(executor_threads=3)
    await worker.start()
    prompts = [rig.prompt(2) for _ in range(12)]
    stores = [worker.store(p, rig.blocks(2, source=True)) for p in prompts]
    loads = [worker.load(p, rig.blocks(2, source=False)) for p in prompts[:6]]
    await worker.close()
    assert all(f.done() for f in stores + loads)
    results = [f.result() for f in stores + loads]  # none failed or was cancelled
    assert all(isinstance(r, StoreResult) and r.failed == 0 for r in results[:12])
    assert all(isinstance(r, LoadResult) for r in results[12:])
    assert sum(r.stored + r.skipped for r in results[:12]) == 24
    assert aiokv_threads() == threads_before
    assert loop_tasks() == set()
    with pytest.raises(WorkerClosedError):
        worker.store(prompts[0], rig.blocks(2, source=True))
    with pytest.raises(WorkerClosedError):
        await worker.lookup(prompts[0])
    assert rig.backend.calls_of("unregister")  # our memory was released


@pytest.mark.asyncio
async def test_terminate_fails_queued_work_at_once_and_waits_for_the_call_in_flight() -> None:
    rig = Rig(seed=19)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, max_hang_s=SAFETY_S, times=2))
    threads_before = aiokv_threads()
    worker = rig.worker(max_concurrent_batches=1)
    await worker.start()
    in_flight = worker.store(rig.prompt(1), rig.blocks(1, source=True))
    try:
        await rig.backend.wait_hanging_async(2, timeout=SAFETY_S)
        queued = [worker.store(rig.prompt(1), rig.blocks(1, source=True)) for _ in range(3)]
        queued.append(worker.load(rig.prompt(1), rig.blocks(1, source=False)))
        lookup = asyncio.ensure_future(worker.lookup(rig.prompt(1)))
        await asyncio.sleep(0)
        worker.terminate()
        for fut in queued:
            assert fut.done()
            with pytest.raises(WorkerClosedError):
                fut.result()
        with pytest.raises(WorkerClosedError):
            await lookup
        assert not in_flight.done()
        closing = asyncio.ensure_future(worker.wait_closed())
        await asyncio.sleep(0.02)
        assert not closing.done() and not in_flight.done()
    finally:
        release.set()
    await asyncio.wait_for(closing, SAFETY_S)
    assert in_flight.done() and in_flight.result().stored == 1
    assert aiokv_threads() == threads_before and loop_tasks() == set()


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
async def test_close_with_a_timeout_terminates_but_still_waits_for_the_hung_call() -> None:
    rig = Rig(seed=21)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="get", hang=release, max_hang_s=SAFETY_S))
    tokens, src, dst = rig.prompt(2), rig.blocks(2, source=True), rig.blocks(2, source=False)
    threads_before = aiokv_threads()
    worker = rig.worker()
    await worker.start()
    await worker.store(tokens, src)
    load = worker.load(tokens, dst)
    try:
        await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
        closing = asyncio.ensure_future(worker.close(timeout=0.02))
        await asyncio.sleep(0.1)
        assert not closing.done() and not load.done()
    finally:
        release.set()
    await asyncio.wait_for(closing, SAFETY_S)
    assert load.done() and load.result().loaded_tokens == 2 * CHUNK
    assert aiokv_threads() == threads_before and loop_tasks() == set()
    assert worker.closed


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
    rig.backend.add_rule(FaultRule(op="put", keys=fault_keys(rig, full, [(1, 0)]), code=NO_SPACE))
    async with rig.worker(pressure_backoff_s=60.0) as worker:
        assert (await worker.store(early, early_src)).stored == 2
        hit = await worker.store(full, rig.blocks(2, source=True))
        assert hit.failed_chunks == (1,) and dict(hit.errors) == {NO_SPACE: 1}
        assert worker.stats()["pressure_backoffs"] == 1
        puts_before = len(rig.backend.calls_of("put"))
        # Backing off: a new store is refused without a put; chunks already there still count.
        refused = await worker.store(later, rig.blocks(3, source=True))
        assert (refused.stored, refused.failed) == (0, 3) and dict(refused.errors) == {NO_SPACE: 6}
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
    rule = rig.backend.add_rule(FaultRule(op="put", code=NO_SPACE, times=1))
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
    rig.backend.add_rule(FaultRule(op="put", keys=set(list(bad)[:2]), code=TRANSFER_FAILED))
    rig.backend.add_rule(FaultRule(op="put", keys=set(list(bad)[2:]), code=INVALID))
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
