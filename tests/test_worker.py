"""KVWorker on MemoryBackend: real bytes through two KV-cache groups, dedupe, lookup and load semantics,
one prepare_values per group per cycle, bad input, backend faults, starting and terminating early
(cancellation, deadlines, close and terminate with work pending: test_lifecycle.py).

Backend behaviour that a test must control (a call that blocks, a call that raises) comes from
aiokv.testing's ``FaultInjectingBackend``, which delegates to a real MemoryBackend.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aiokv
import aiokv._engine.slices
from aiokv import (
    AiokvError,
    BackendError,
    Code,
    HashedPrompt,
    InvalidRequestError,
    KVLayout,
    KVWorker,
    LoadResult,
    MemoryBackend,
    StoreResult,
    WorkerClosedError,
)
from aiokv.testing import (
    SENTINEL,
    FaultInjectingBackend,
    PagedCache,
    chunk_block_ids,
    chunk_value,
)

from .helpers import (
    TWO_GROUP_SPECS,
    TWO_GROUPS_CHUNK_TOKENS,
    aiokv_threads,
    assert_loaded,
    chunk_keys,
    covers,
    prompt,
    read_value,
    recording_backend,
    same_exception,
    scattered,
    wait_until,
)

C = TWO_GROUPS_CHUNK_TOKENS
SPECS = TWO_GROUP_SPECS
PER_CHUNK = [C // spec["block_size"] for spec in SPECS]  # blocks per chunk: [4, 2]
NS = "test-model"


# -- fixtures and small builders ----------------------------------------------------------------------


@pytest.fixture
def src() -> PagedCache:
    return PagedCache.allocate(SPECS, fill="random", seed=1)


@pytest.fixture
def dst() -> PagedCache:
    return PagedCache.allocate(SPECS, fill=SENTINEL)


@pytest.fixture
def backend() -> Iterator[FaultInjectingBackend]:
    b = recording_backend()
    yield b
    b.release()  # never leave an executor thread blocked behind a failed test


def make_worker(cache: PagedCache, backend: FaultInjectingBackend, **options: Any) -> KVWorker:
    return KVWorker(cache.layouts, backend, namespace=NS, chunk_tokens=C, **options)


def consecutive(chunks: int, start: int = 0) -> list[np.ndarray]:
    """Block tables whose chunks lie on consecutive physical blocks, from block ``start``."""
    return [np.arange(start, start + chunks * per, dtype=np.int64) for per in PER_CHUNK]


def fragmented_chunks(ids: np.ndarray, per: int) -> int:
    blocks = ids[: ids.size // per * per].reshape(-1, per)
    return int((np.diff(blocks, axis=1) != 1).any(axis=1).sum())


def keys_of(tokens: list[int] | np.ndarray, cache: PagedCache) -> list[list[str]]:
    return [chunk_keys(tokens, C, layout, g, NS) for g, layout in enumerate(cache.layouts)]


def all_keys(tokens: list[int] | np.ndarray, cache: PagedCache) -> set[str]:
    return {key for keys in keys_of(tokens, cache) for key in keys}


def chunk_bytes(cache: PagedCache) -> int:
    """Bytes of one chunk over every group."""
    return sum(
        layout.chunk_bytes_per_block * per for layout, per in zip(cache.layouts, PER_CHUNK, strict=True)
    )


async def yield_loop(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


# -- round trip ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trip_two_groups_scattered_blocks(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend
) -> None:
    chunks = 6
    tokens = prompt(1, chunks, extra=C // 2 + 3)  # plus a partial chunk that is never stored
    src_ids = scattered(src, chunks, seed=2, extra_blocks=2)
    dst_ids = scattered(dst, chunks, seed=3, extra_blocks=2)
    for g, per in enumerate(PER_CHUNK):  # both placements are exercised, in both caches
        assert 1 <= fragmented_chunks(src_ids[g][: chunks * per], per) < chunks
        assert 1 <= fragmented_chunks(dst_ids[g][: chunks * per], per) < chunks

    async with make_worker(src, backend) as worker:
        for layout in src.layouts:  # every region of every group is registered
            assert all(covers(backend.registered(), addr, size) for addr, size in layout.region_spans())
        stored = await worker.store(tokens, src_ids)
    assert isinstance(stored, StoreResult)
    assert (stored.stored, stored.skipped, stored.failed) == (chunks, 0, 0)
    assert stored.ok and stored.failed_chunks == ()

    # The store holds, per group and chunk, the chunk's bytes region by region, whatever the placement.
    for g, keys in enumerate(keys_of(tokens, src)):
        size = src.layouts[g].chunk_bytes_per_block * PER_CHUNK[g]
        for i, key in enumerate(keys):
            value = read_value(backend.inner, key, size)
            assert value == chunk_value(src[g], chunk_block_ids(src_ids[g], i, PER_CHUNK[g]))
    assert len(backend.inner) == chunks * len(SPECS)

    async with make_worker(dst, backend) as worker:
        assert await worker.lookup(tokens) == chunks * C
        loaded = await worker.load(tokens, dst_ids)
    assert isinstance(loaded, LoadResult)
    assert loaded.loaded_tokens == chunks * C
    assert loaded.loaded_chunks == chunks
    assert loaded.failed_block_ids == ((), ())
    assert loaded.ok
    assert_loaded(src, src_ids, dst, dst_ids, chunks)
    for g, per in enumerate(PER_CHUNK):  # nothing else was written, not even the partial chunk's blocks
        assert dst[g].written_blocks() == set(dst_ids[g][: chunks * per].tolist())

    # Backends are called from the worker's executor threads, never on the event loop's thread.
    assert backend.count("put") >= 2 and backend.count("get") >= 2
    threads = backend.threads_seen("register", "exists", "put", "get")
    assert threads and all(name.startswith("aiokv") for name in threads)
    assert threading.current_thread().name not in threads
    # Closing unregistered the memory, so the same cache can be opened again on the same backend.
    assert backend.count("unregister") == backend.count("register")
    async with make_worker(src, backend) as worker:
        assert await worker.lookup(tokens) == chunks * C


# -- dedupe -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_second_store_skips_and_writes_nothing(src: PagedCache, backend: FaultInjectingBackend) -> None:
    tokens = prompt(4, 3)
    async with make_worker(src, backend) as worker:
        first = await worker.store(tokens, consecutive(3))
        put_keys = backend.keys_seen("put")
        second = await worker.store(tokens, consecutive(3, start=12))
        assert backend.keys_seen("put") == put_keys  # no put at all
        longer = prompt(4, 3) + prompt(5, 2)  # same first 3 chunks, 2 new ones
        third = await worker.store(longer, consecutive(5))
    assert (first.stored, first.skipped, first.failed) == (3, 0, 0)
    assert (second.stored, second.skipped, second.failed) == (0, 3, 0)
    assert (third.stored, third.skipped, third.failed) == (2, 3, 0)
    assert sorted(put_keys) == sorted(all_keys(tokens, src))
    assert Counter(backend.keys_seen("put")) == Counter(all_keys(longer, src))  # each key once


@pytest.mark.asyncio
async def test_concurrent_stores_in_one_batch_write_each_chunk_once(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(6, 4)
    async with make_worker(src, backend) as worker:
        futures = [worker.store(tokens, consecutive(4)), worker.store(tokens, scattered(src, 4, seed=7))]
        results = [await f for f in futures]
        assert worker.stats()["batches"] == 1
    assert sorted((r.stored, r.skipped, r.failed) for r in results) == [(0, 4, 0), (4, 0, 0)]
    put = Counter(backend.keys_seen("put"))
    assert set(put) == all_keys(tokens, src) and set(put.values()) == {1}


@pytest.mark.asyncio
async def test_concurrent_stores_in_overlapping_batches_write_each_chunk_once(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(8, 4)
    async with make_worker(src, backend) as worker:
        with backend.blocked("put"):
            first = worker.store(tokens, consecutive(4))
            await wait_until(backend.entered("put").is_set)
            second = worker.store(tokens, consecutive(4, start=16))  # a second batch, same chunks
            await wait_until(lambda: backend.count("exists") == 2)
            await yield_loop()
            # The second request cannot report the chunks as stored before the writer has written them.
            assert not second.done() and not first.done()
            backend.release()
        results = [await first, await second]
    assert [(r.stored, r.skipped, r.failed) for r in results] == [(4, 0, 0), (0, 4, 0)]
    put = Counter(backend.keys_seen("put"))
    assert set(put) == all_keys(tokens, src) and set(put.values()) == {1}


# -- lookup -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_lookup_is_the_prefix_present_in_every_group(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(9, 4)
    async with make_worker(src, backend) as worker:
        assert await worker.lookup(tokens) == 0
        await worker.store(tokens, consecutive(4))
        assert await worker.lookup(tokens) == 4 * C
        assert await worker.lookup(np.asarray(tokens, dtype=np.int64)) == 4 * C
        # A trailing partial chunk is never counted.
        assert await worker.lookup(tokens + prompt(10, 0, extra=C - 1)) == 4 * C
        assert await worker.lookup(tokens[: 2 * C + 5]) == 2 * C
        assert await worker.lookup(tokens[: C - 1]) == 0
        # A prompt diverging inside chunk 2 shares chunks 0 and 1 only (keys chain on the prefix).
        diverging = list(tokens)
        diverging[2 * C + 7] += 1
        assert await worker.lookup(diverging) == 2 * C
        assert await worker.lookup(prompt(11, 4)) == 0
        # A hole in one group ends the prefix, though later chunks are still present.
        hole = keys_of(tokens, src)[1][1]
        assert backend.inner.batch_remove([hole]) == [0]
        assert await worker.lookup(tokens) == 1 * C
        assert backend.inner.batch_exists(keys_of(tokens, src)[1]) == [True, False, True, True]


# -- load ---------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_load_with_a_missing_chunk_fails_exactly_its_blocks_and_later_ones(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend
) -> None:
    chunks = 5
    tokens = prompt(12, chunks)
    src_ids = scattered(src, chunks, seed=13)
    dst_ids = scattered(dst, chunks + 1, seed=14, extra_blocks=1)  # more blocks than the request needs
    async with make_worker(src, backend) as worker:
        await worker.store(tokens, src_ids)
    missing = keys_of(tokens, src)[0][2]  # chunk 2, group 0 only
    assert backend.inner.batch_remove([missing]) == [0]
    backend.clear_calls()
    async with make_worker(dst, backend) as worker:
        result = await worker.load(tokens + prompt(15, 0, extra=10), dst_ids)
    assert result.loaded_tokens == 2 * C
    assert result.loaded_chunks == 2
    assert not result.ok
    # Per group: every block of chunks 2, 3 and 4 (2 missing in group 0; 3 and 4 after the hole).
    assert result.failed_block_ids == tuple(
        tuple(dst_ids[g][2 * per : chunks * per].tolist()) for g, per in enumerate(PER_CHUNK)
    )
    assert result.errors == {Code.NOT_FOUND: 1}
    assert_loaded(src, src_ids, dst, dst_ids, 2)
    for g, per in enumerate(PER_CHUNK):
        # No block outside the request's blocks is written.
        outside = sorted(set(range(dst[g].num_blocks)) - set(dst_ids[g][: chunks * per].tolist()))
        assert dst[g].untouched(outside)
        assert set(dst_ids[g][chunks * per :].tolist()) <= set(outside)
    loaded_keys = {k for keys in keys_of(tokens, src) for k in keys[:2]}
    assert set(backend.keys_seen("get")) == loaded_keys


@pytest.mark.asyncio
async def test_load_of_an_unknown_prompt_fails_every_block_and_moves_nothing(
    dst: PagedCache, backend: FaultInjectingBackend
) -> None:
    dst_ids = scattered(dst, 3, seed=16)
    async with make_worker(dst, backend) as worker:
        result = await worker.load(prompt(17, 3), dst_ids)
        empty = await worker.load(prompt(17, 0, extra=C - 1), [[], []])  # no whole chunk
    assert result.loaded_tokens == 0 and result.loaded_chunks == 0
    assert result.failed_block_ids == tuple(tuple(ids.tolist()) for ids in dst_ids)
    assert (empty.loaded_tokens, empty.failed_block_ids) == (0, ((), ()))
    assert backend.count("get") == 0
    assert all(dst[g].written_blocks() == set() for g in range(len(SPECS)))


# -- one prepare_values per group per cycle -------------------------------------------------------------


@pytest.mark.asyncio
async def test_region_planning_runs_once_per_group_per_cycle(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[int] = Counter()
    lock = threading.Lock()
    original = KVLayout.regions_for_chunks

    def spy(self: KVLayout, chunk_blocks: Any) -> Any:
        with lock:
            calls[id(self)] += 1
        return original(self, chunk_blocks)

    monkeypatch.setattr(KVLayout, "regions_for_chunks", spy)
    requests, chunks = 4, 3
    tokens = [prompt(100 + r, chunks) for r in range(requests)]
    src_ids = [scattered(src, chunks, seed=200 + r) for r in range(requests)]
    dst_all = scattered(dst, requests * chunks, seed=300)  # disjoint destinations for the loads
    dst_ids = [
        [ids[r * chunks * per : (r + 1) * chunks * per] for ids, per in zip(dst_all, PER_CHUNK, strict=True)]
        for r in range(requests)
    ]

    async with make_worker(src, backend) as worker:
        # Submitted back to back: all queued before the dispatcher wakes, so one cycle takes them all.
        futures = [worker.store(t, ids) for t, ids in zip(tokens, src_ids, strict=True)]
        results = [await f for f in futures]
        assert worker.stats()["batches"] == 1
    assert [(r.stored, r.failed) for r in results] == [(chunks, 0)] * requests
    assert len(backend.keys_seen("put")) == requests * chunks * len(SPECS)
    assert calls == Counter({id(layout): 1 for layout in src.layouts})

    calls.clear()
    async with make_worker(dst, backend) as worker:
        futures = [worker.load(t, ids) for t, ids in zip(tokens, dst_ids, strict=True)]
        loaded = [await f for f in futures]
        assert worker.stats()["batches"] == 1
        calls_after_loads = Counter(calls)
        # A cycle with nothing to move computes no regions at all.
        skipped = await worker.store(tokens[0], dst_ids[0])
    assert calls_after_loads == Counter({id(layout): 1 for layout in dst.layouts})
    assert calls == calls_after_loads
    assert (skipped.stored, skipped.skipped) == (0, chunks)
    assert [r.loaded_tokens for r in loaded] == [chunks * C] * requests
    for r in range(requests):
        assert_loaded(src, src_ids[r], dst, dst_ids[r], chunks)


# -- bad input ------------------------------------------------------------------------------------------


def test_misaligned_chunk_tokens_are_refused_at_construction(src: PagedCache) -> None:
    backend = recording_backend()
    for chunk_tokens in (48, 16, 0, -64):  # 48 and 16 are not multiples of group 1's 32-token blocks
        with pytest.raises(ValueError):
            KVWorker(src.layouts, backend, namespace=NS, chunk_tokens=chunk_tokens)
    KVWorker(src.layouts, backend, namespace=NS, chunk_tokens=96)  # 96 = 6 x 16 = 3 x 32
    assert backend.count() == 0


def _bad_block_tables() -> dict[str, Any]:
    good = consecutive(2)  # 2 chunks: 8 blocks of group 0, 4 of group 1
    return {
        "one group only": [good[0]],
        "three groups": [*good, good[1]],
        "too few in group 0": [good[0][:7], good[1]],
        "too few in group 1": [good[0], good[1][:3]],
        "past the cache": [good[0], np.array([0, 1, 2, SPECS[1]["num_blocks"]])],
        "negative": [np.array([0, 1, 2, 3, -1, 5, 6, 7]), good[1]],
        "floats": [[float(b) for b in good[0]], good[1]],
        "strings": [[str(b) for b in good[0]], good[1]],
        "int64 overflow": [[2**63, *good[0][1:].tolist()], good[1]],
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(_bad_block_tables()))
async def test_bad_block_ids_raise_before_anything_reaches_the_backend(
    src: PagedCache, backend: FaultInjectingBackend, case: str
) -> None:
    tokens = prompt(40, 2)
    table = _bad_block_tables()[case]
    async with make_worker(src, backend) as worker:
        backend.clear_calls()
        for submit in (worker.store, worker.load):
            with pytest.raises(ValueError):
                submit(tokens, table)
        assert backend.count() == 0
        assert worker.stats()["requests"] == {}
        result = await worker.store(tokens, consecutive(2))  # the worker keeps serving
    assert (result.stored, result.failed) == (2, 0)


@pytest.mark.asyncio
async def test_bad_token_values_fail_the_future_and_nothing_reaches_the_backend(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    good = prompt(41, 2)
    bad_prompts = [
        [*good[:-1], -1],
        [*good[:-1], 2**40],
        np.array([*good[:-1], 2**40], dtype=np.int64),
        [*good[:-1], 2**70],
        [float(t) for t in good],
    ]
    async with make_worker(src, backend) as worker:
        backend.clear_calls()
        failing = [worker.store(t, consecutive(2)) for t in bad_prompts]
        failing += [worker.load(t, consecutive(2, start=20)) for t in bad_prompts]
        fine = worker.store(good, consecutive(2))  # in the same batch as the bad ones
        for future in failing:
            with pytest.raises(ValueError):
                await future
            assert isinstance(future.exception(), InvalidRequestError)
        for tokens in bad_prompts:
            with pytest.raises(ValueError):
                await worker.lookup(tokens)
        assert (await fine).stored == 2
        assert worker.stats()["requests_failed"] == {
            "store": len(bad_prompts),
            "load": len(bad_prompts),
            "lookup": len(bad_prompts),
        }
    assert set(backend.keys_seen()) == all_keys(good, src)


@pytest.mark.asyncio
async def test_bad_arguments_of_other_kinds_raise_at_submit(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(42, 2)
    async with make_worker(src, backend) as worker:
        backend.clear_calls()
        with pytest.raises(ValueError):
            worker.store(HashedPrompt.from_tokens(tokens, 2 * C), consecutive(1))  # chunked otherwise
        with pytest.raises(ValueError):
            worker.store(np.array(tokens, dtype=np.float32), consecutive(2))
        with pytest.raises(ValueError):
            worker.store(np.array([tokens, tokens]), consecutive(2))
        with pytest.raises(ValueError):
            worker.store(tokens, consecutive(2), timeout=0)
        with pytest.raises(TypeError):
            worker.store("not tokens", consecutive(2))
        with pytest.raises(TypeError):
            worker.store(tokens, None)  # type: ignore[arg-type]
        assert backend.count() == 0
        assert (await worker.store(tokens, consecutive(2))).stored == 2


# -- backend faults -------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["exists", "put", "get"])
async def test_a_backend_exception_fails_only_its_batch_with_a_chained_aiokv_error(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend, op: str
) -> None:
    tokens, other = prompt(50, 2), prompt(51, 2)
    src_ids, dst_ids = consecutive(2), consecutive(2, start=10)
    boom = RuntimeError(f"{op} exploded")
    async with make_worker(src, backend) as source, make_worker(dst, backend) as target:
        if op == "get":
            await source.store(tokens, src_ids)
            await source.store(other, src_ids)
        # Consecutive blocks: one call per group per batch, both requests in each; fail both calls.
        backend.fail(op, boom, times=1 if op == "exists" else len(SPECS))
        calls_before = backend.count(op)
        worker = target if op == "get" else source
        submit = worker.load if op == "get" else worker.store
        ids = dst_ids if op == "get" else src_ids
        failed = [submit(tokens, ids), submit(other, consecutive(2, start=20))]
        for future in failed:
            with pytest.raises(BackendError) as info:
                await future
            assert same_exception(info.value.__cause__, boom)
            assert isinstance(info.value, AiokvError)
        assert backend.count(op) - calls_before == (1 if op == "exists" else len(SPECS))
        assert worker.stats()["backend_exceptions"] == {op: backend.count(op) - calls_before}
        # The next request succeeds (no stale claim or state from the failed batch).
        if op == "get":
            assert dst[0].written_blocks() == set()  # the failed reads wrote nothing
            result = await target.load(tokens, dst_ids)
            assert result.loaded_tokens == 2 * C
            assert_loaded(src, src_ids, dst, dst_ids, 2)
        else:
            result = await source.store(tokens, src_ids)
            assert (result.stored, result.failed) == (2, 0)
            assert await source.lookup(tokens) == 2 * C


# -- lifecycle ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_terminate_before_the_dispatcher_runs_fails_everything_at_once(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    before = aiokv_threads()
    worker = make_worker(src, backend)
    await worker.start()
    futures = [worker.store(prompt(82 + i, 2), consecutive(2)) for i in range(3)]
    worker.terminate()
    assert all(isinstance(f.exception(), WorkerClosedError) for f in futures)
    await worker.wait_closed()
    assert worker.closed
    assert backend.count("exists") == 0 and backend.count("put") == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert not aiokv_threads() - before


@pytest.mark.asyncio
async def test_submit_before_start_or_after_close_raises(
    src: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(90, 1)
    worker = make_worker(src, backend)
    with pytest.raises(WorkerClosedError):
        worker.store(tokens, consecutive(1))
    async with worker:
        assert (await worker.store(tokens, consecutive(1))).stored == 1
    for submit in (worker.store, worker.load):
        with pytest.raises(WorkerClosedError):
            submit(tokens, consecutive(1))
    with pytest.raises(WorkerClosedError):
        await worker.lookup(tokens)
    await worker.close()  # a second close is a no-op
    assert worker.closed


# -- inputs and stats -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_hashed_prompt_is_the_same_as_token_ids(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(91, 3, extra=5)
    hashed = HashedPrompt.from_tokens(tokens, C)
    assert hashed.num_tokens == 3 * C
    async with make_worker(src, backend) as worker:
        first = await worker.store(hashed, consecutive(3))
        assert sorted(backend.keys_seen("put")) == sorted(all_keys(tokens, src))
        same = [
            await worker.store(tokens, consecutive(3)),
            await worker.store(np.asarray(tokens, dtype=np.int64), consecutive(3)),
            await worker.store(np.asarray(tokens, dtype=np.uint32), consecutive(3)),
        ]
        assert await worker.lookup(hashed) == await worker.lookup(tokens) == 3 * C
    assert (first.stored, first.skipped) == (3, 0)
    assert [(r.stored, r.skipped) for r in same] == [(0, 3)] * 3
    dst_ids = scattered(dst, 3, seed=92)
    async with make_worker(dst, backend) as worker:
        loaded = await worker.load(hashed, dst_ids)
    assert loaded.loaded_tokens == 3 * C
    assert_loaded(src, consecutive(3), dst, dst_ids, 3)


@pytest.mark.asyncio
async def test_stats_count_what_happened(
    src: PagedCache, dst: PagedCache, backend: FaultInjectingBackend
) -> None:
    tokens = prompt(93, 3)
    async with make_worker(src, backend) as worker:
        await worker.store(tokens, scattered(src, 3, seed=94))
        await worker.store(tokens, consecutive(3))
        cancelled = worker.store(prompt(95, 3), consecutive(3))
        cancelled.cancel()
        with pytest.raises(ValueError):
            await worker.store([-1] * C, consecutive(1))
        assert await worker.lookup(tokens) == 3 * C
        loaded = await worker.load(tokens, consecutive(3, start=30))
        stats = worker.stats()
    assert loaded.loaded_chunks == 3
    assert stats["requests"] == {"store": 4, "lookup": 1, "load": 1}
    assert stats["requests_cancelled"] == {"store": 1}
    assert stats["requests_failed"] == {"store": 1}
    assert stats["chunks"] == {"stored": 3, "skipped": 3, "failed": 0, "loaded": 3, "load_failed": 0}
    assert stats["bytes"] == {"put": 3 * chunk_bytes(src), "get": 3 * chunk_bytes(src)}
    assert stats["backend_calls"] == {
        "exists": backend.count("exists"),
        "put": backend.count("put"),
        "get": backend.count("get"),
    }
    # Two stores, one lookup, one load; and the confirmation that the first store's puts are readable.
    assert backend.count("exists") == 5
    assert stats["backend_errors"] == {} and stats["backend_exceptions"] == {}
    assert stats["latency"]["store"].count == 4 and stats["latency"]["load"].count == 1


@pytest.mark.asyncio
async def test_a_full_store_fails_the_chunks_that_do_not_fit_and_backs_off(src: PagedCache) -> None:
    layout = src.layouts[0]  # one group, so the order in which chunks reach the store is fixed
    chunk = layout.chunk_bytes_per_block * PER_CHUNK[0]
    backend = FaultInjectingBackend(MemoryBackend(capacity_bytes=3 * chunk))
    tokens = prompt(96, 5)
    async with KVWorker(layout, backend, namespace=NS, chunk_tokens=C, pressure_backoff_s=60) as worker:
        full = await worker.store(tokens, consecutive(5)[:1])
        puts = backend.count("put")
        during_backoff = await worker.store(prompt(97, 2), consecutive(2)[:1])
        assert backend.count("put") == puts  # no put while backing off
        assert await worker.lookup(tokens) == 3 * C  # nothing already stored was evicted
        stats = worker.stats()
    assert (full.stored, full.skipped, full.failed) == (3, 0, 2)
    assert full.failed_chunks == (3, 4) and full.errors == {Code.NO_SPACE: 2} and not full.ok
    assert (during_backoff.stored, during_backoff.failed, during_backoff.errors) == (0, 2, {Code.NO_SPACE: 2})
    assert stats["backend_errors"] == {Code.NO_SPACE: 2}
    assert stats["pressure_backoffs"] == 1
    assert stats["chunks"]["failed"] == 4


def test_aiokv_run_uses_uvloop_when_installed(src: PagedCache) -> None:
    pytest.importorskip("uvloop")
    tokens = prompt(98, 2)

    async def main() -> tuple[str, int, int]:
        async with make_worker(src, recording_backend()) as worker:
            stored = await worker.store(tokens, consecutive(2))
            return type(asyncio.get_running_loop()).__module__, stored.stored, await worker.lookup(tokens)

    module, stored, hit = aiokv.run(main())
    assert module.startswith("uvloop")
    assert (stored, hit) == (2, 2 * C)


class _GarbageThenBlockingBackend(aiokv.MemoryBackend):
    """Answers group 0's puts with garbage at once and holds group 1's puts until ``release``."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=64 << 20)
        self.release = threading.Event()
        self.holding = threading.Event()

    def batch_put(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        if ".g0." in keys[0]:
            return ["not a code"] * len(keys)  # type: ignore[list-item]
        self.holding.set()
        self.release.wait(30)
        return super().batch_put(keys, addrs, sizes)


@pytest.mark.asyncio
async def test_a_garbage_answer_fails_the_request_only_after_every_call_on_its_memory_returned(
    src: PagedCache,
) -> None:
    backend = _GarbageThenBlockingBackend()
    async with KVWorker(src.layouts, backend, namespace=NS, chunk_tokens=C) as worker:
        future = worker.store(prompt(90, 2), consecutive(2))
        try:
            await wait_until(backend.holding.is_set)
            await yield_loop()
            assert not future.done()  # group 0 failed, but group 1's put still reads the blocks
        finally:
            backend.release.set()
        with pytest.raises(BackendError, match="other than one int code per key"):
            await future
        # The worker keeps serving.
        assert await worker.lookup(prompt(90, 2)) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("slice_s", [None, 0.0], ids=["default-slices", "a-slice-per-request"])
async def test_callers_resubmitting_as_their_batch_ends_make_one_batch_a_round(
    slice_s: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many callers, each storing again as soon as its store returns: each round of their requests is
    one batch, not split between the batch slots. A batch settles its requests in slices of the loop,
    and their callers submit two turns after theirs; a batch drained while another settles would take
    only the first slices' callers, and the two groups would stay apart round after round. How many
    slices a settle spans depends on the machine, so the test also runs the slowest case: a slice per
    request (before the dispatcher waited for settling to end: 14-21 batches for 6 rounds there, and
    10-11 now and then with default slices on a busy 2-core machine)."""
    if slice_s is not None:
        monkeypatch.setattr(aiokv._engine.slices, "SLICE_S", slice_s)
    callers, rounds, chunk = 64, 6, 256
    caches = [np.zeros((callers * 4, 1024), dtype=np.uint8) for _ in range(2)]
    layout = KVLayout([c.ctypes.data for c in caches], [1024], chunk, callers * 4)
    rng = np.random.default_rng(5)
    backend = MemoryBackend()
    try:
        async with KVWorker(layout, backend, namespace=NS, chunk_tokens=chunk) as worker:

            async def caller(index: int) -> None:
                ids = np.arange(index * 4, index * 4 + 4, dtype=np.int64)
                for _ in range(rounds):
                    assert (await worker.store(rng.integers(0, 1000, 4 * chunk), [ids])).stored == 4

            await asyncio.gather(*(caller(i) for i in range(callers)))
            assert worker.stats()["batches"] == rounds
    finally:
        backend.close()


class _FirstPutHeldBackend(aiokv.MemoryBackend):
    """Holds the first put until ``release``; counts existence checks."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=16 << 20)
        self.release = threading.Event()
        self.holding = threading.Event()
        self.exists_calls = 0

    def batch_exists(self, keys: Any) -> list[bool]:
        self.exists_calls += 1
        return super().batch_exists(keys)

    def batch_put(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        if not self.holding.is_set():
            self.holding.set()
            self.release.wait(30)
        return super().batch_put(keys, addrs, sizes)


@pytest.mark.asyncio
async def test_a_store_waiting_for_another_batchs_write_does_not_hold_up_the_next_batch() -> None:
    """A store of keys another batch is writing waits, as its batch settles, for that writer's outcome,
    which waits on the store. The dispatcher starts its next batch once no batch is settling, but that
    wait is not settling: an unrelated store goes through while the writer is held."""
    chunk = 256
    cache = np.zeros((8, 1024), dtype=np.uint8)
    layout = KVLayout([cache.ctypes.data], [1024], chunk, 8)
    rng = np.random.default_rng(11)
    shared, other = rng.integers(0, 1000, 2 * chunk), rng.integers(0, 1000, 2 * chunk)
    backend = _FirstPutHeldBackend()
    try:
        async with KVWorker(
            layout, backend, namespace=NS, chunk_tokens=chunk, max_concurrent_batches=3
        ) as worker:
            writer = worker.store(shared, [np.array([0, 1])])
            await wait_until(backend.holding.is_set)
            checks = backend.exists_calls
            sharer = worker.store(shared, [np.array([2, 3])])
            await wait_until(lambda: backend.exists_calls > checks)  # its batch is past its check
            for _ in range(20):  # and waits on the writer's outcome
                await asyncio.sleep(0)
            assert not sharer.done()
            try:
                assert (await asyncio.wait_for(worker.store(other, [np.array([4, 5])]), 10)).stored == 2
                assert not writer.done() and not sharer.done()
            finally:
                backend.release.set()
            assert (await writer).stored == 2
            assert (await sharer).skipped == 2  # written by the writer
    finally:
        backend.release.set()
        backend.close()
