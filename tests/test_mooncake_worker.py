"""KVWorker over a real MooncakeBackend against a real mooncake_master (no mocks).

Real bytes through two KV-cache groups with scattered block ids, dedupe, lookup prefixes, missing
keys on load, a full store (-200) and its backoff, and a master killed under pending work. Tests
that need a master of their own (a full store, a killed one) start it with ``mooncake_master_factory``.

They skip (fail under CI) outside a private network namespace; run them with
    unshare -rn sh -c 'ip link set lo up && python -m pytest tests/test_mooncake_worker.py'
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import (
    BackendUnavailableError,
    Code,
    KeyNamespace,
    KVWorker,
    LoadResult,
    StoreResult,
)
from aiokv.backends.mooncake import MooncakeBackend
from aiokv.backends.mooncake_master import MooncakeMaster, segment_holder
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
    assert_loaded,
    blocks_per_chunk,
    chunk_keys,
    prompt,
    read_value,
    scattered,
    wait_until,
)

C = TWO_GROUPS_CHUNK_TOKENS
SPECS = TWO_GROUP_SPECS
HANG_GUARD_S = 60.0  # bounds awaits that must not hang; generous, not a timing assertion
MiB = 1 << 20


# -- builders -----------------------------------------------------------------------------------------


def namespace() -> KeyNamespace:
    """A model name of the test's own: tests (and each event-loop run of a test) share a master."""
    return KeyNamespace(f"mc-{uuid.uuid4().hex[:12]}")


def make_worker(cache: PagedCache, backend: Any, ns: KeyNamespace, **options: Any) -> KVWorker:
    return KVWorker(cache.layouts, backend, namespace=ns, chunk_tokens=C, **options)


def chunk_blocks(
    cache: PagedCache, ids: list[np.ndarray], start: int, stop: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Per group, the block ids of chunks ``[start, stop)`` (to the end when ``stop`` is None)."""
    return tuple(
        tuple(group_ids[start * per : None if stop is None else stop * per].tolist())
        for group_ids, per in zip(ids, blocks_per_chunk(cache), strict=True)
    )


def keys_of(tokens: list[int], cache: PagedCache, ns: KeyNamespace) -> list[list[str]]:
    return [chunk_keys(tokens, C, layout, g, ns) for g, layout in enumerate(cache.layouts)]


def chunk_nbytes(cache: PagedCache) -> list[int]:
    """Bytes of one chunk's value, per group."""
    return [layout.chunk_bytes_per_block * C // layout.block_size for layout in cache.layouts]


def assert_store_holds(backend: Any, cache: PagedCache, ids: list[np.ndarray], keys: list[list[str]]) -> None:
    """Every key's value, read back with exactly its stored size, is its chunk's bytes region by region."""
    sizes, pers = chunk_nbytes(cache), blocks_per_chunk(cache)
    for g, group_keys in enumerate(keys):
        for i, key in enumerate(group_keys):
            value = read_value(backend, key, sizes[g])
            assert value == chunk_value(cache[g], chunk_block_ids(ids[g], i, pers[g])), (g, i)


@pytest.fixture
def src() -> PagedCache:
    return PagedCache.allocate(SPECS, fill="random", seed=1)


@pytest.fixture
def dst() -> PagedCache:
    return PagedCache.allocate(SPECS, fill=SENTINEL)


# -- round trip, dedupe, lookup, missing keys (the session master and a shared client) ---------------


@pytest.mark.asyncio
async def test_round_trip_two_groups_scattered_blocks(
    mooncake_backend: MooncakeBackend, src: PagedCache, dst: PagedCache
) -> None:
    ns, chunks = namespace(), 7
    tokens = prompt(1, chunks, extra=C // 2 + 3)  # plus a partial chunk that is never stored
    src_ids = scattered(src, chunks, seed=2, extra_blocks=2)
    dst_ids = scattered(dst, chunks, seed=3, extra_blocks=2)
    for g, per in enumerate(
        blocks_per_chunk(src)
    ):  # multi-block chunks on non-consecutive blocks, both sides
        for ids in (src_ids[g], dst_ids[g]):
            blocks = ids[: chunks * per].reshape(chunks, per)
            assert 1 <= int((np.diff(blocks, axis=1) != 1).any(axis=1).sum()) < chunks
    keys = keys_of(tokens, src, ns)

    async with make_worker(src, mooncake_backend, ns) as worker:
        stored = await worker.store(tokens, src_ids)
        stats = worker.stats()
    assert isinstance(stored, StoreResult)
    assert (stored.stored, stored.skipped, stored.failed, stored.errors) == (chunks, 0, 0, {})
    assert stats["bytes"]["put"] == chunks * sum(chunk_nbytes(src))
    assert mooncake_backend.batch_exists([k for group in keys for k in group]) == [True] * (2 * chunks)
    assert_store_holds(mooncake_backend, src, src_ids, keys)

    async with make_worker(dst, mooncake_backend, ns) as worker:
        assert await worker.lookup(tokens) == chunks * C
        loaded = await worker.load(tokens, dst_ids)
        stats = worker.stats()
    assert isinstance(loaded, LoadResult)
    assert (loaded.loaded_tokens, loaded.loaded_chunks) == (chunks * C, chunks)
    assert loaded.failed_block_ids == ((), ())
    assert loaded.ok and loaded.errors == {}
    assert stats["bytes"]["get"] == chunks * sum(chunk_nbytes(dst))
    assert_loaded(src, src_ids, dst, dst_ids, chunks)
    for g, per in enumerate(
        blocks_per_chunk(dst)
    ):  # nothing else written, not even the partial chunk's blocks
        assert dst[g].written_blocks() == set(dst_ids[g][: chunks * per].tolist())


@pytest.mark.asyncio
async def test_concurrent_loads_of_one_prompt_into_different_blocks_each_get_every_byte(
    mooncake_backend: MooncakeBackend, src: PagedCache, dst: PagedCache
) -> None:
    """Loads of the same prompt into other blocks, in one batch, each get the stored bytes (Mooncake
    fills only the last buffer of a key repeated within one batch get, answering success for all)."""
    ns, chunks, copies = namespace(), 3, 3
    tokens = prompt(7, chunks)
    src_ids = scattered(src, chunks, seed=8)
    everything = scattered(dst, copies * chunks, seed=9)  # disjoint destinations
    dst_ids = [
        [
            ids[r * chunks * per : (r + 1) * chunks * per]
            for ids, per in zip(everything, blocks_per_chunk(dst), strict=True)
        ]
        for r in range(copies)
    ]
    async with make_worker(src, mooncake_backend, ns) as worker:
        assert (await worker.store(tokens, src_ids)).stored == chunks
    async with make_worker(dst, mooncake_backend, ns) as worker:
        futures = [worker.load(tokens, ids) for ids in dst_ids]  # queued together: one batch
        results = await asyncio.wait_for(asyncio.gather(*futures), HANG_GUARD_S)
        assert worker.stats()["batches"] == 1
    for result, ids in zip(results, dst_ids, strict=True):
        assert (result.loaded_tokens, result.failed_block_ids) == (chunks * C, ((), ()))
        assert_loaded(src, src_ids, dst, ids, chunks)


@pytest.mark.asyncio
async def test_second_store_writes_nothing_and_a_shared_prefix_stores_only_new_chunks(
    mooncake_backend: MooncakeBackend, src: PagedCache
) -> None:
    ns, chunks = namespace(), 4
    tokens = prompt(4, chunks)
    first_ids, other_ids = scattered(src, chunks, seed=5), scattered(src, chunks, seed=6)
    async with make_worker(src, mooncake_backend, ns) as worker:
        first = await worker.store(tokens, first_ids)
        before = worker.stats()
        # Other blocks (other bytes): Mooncake would report a put of an existing key as a success
        # and keep the old value, so the worker must not call put, nor claim it stored anything.
        second = await worker.store(tokens, other_ids)
        after_second = worker.stats()
        longer = tokens + prompt(7, 3)  # the same first 4 chunks, then 3 new ones
        longer_ids = scattered(src, chunks + 3, seed=8)
        new_keys = [group[chunks:] for group in keys_of(longer, src, ns)]
        assert mooncake_backend.batch_exists(new_keys[0] + new_keys[1]) == [False] * 6
        third = await worker.store(longer, longer_ids)
        after_third = worker.stats()
        # Two concurrent stores of one new prompt: each chunk is written once, by one of them.
        fresh = prompt(9, 3)
        both = [worker.store(fresh, scattered(src, 3, seed=seed)) for seed in (10, 11)]
        concurrent = [await future for future in both]
        after_concurrent = worker.stats()

    assert (first.stored, first.skipped, first.failed) == (chunks, 0, 0)
    assert (second.stored, second.skipped, second.failed) == (0, chunks, 0)
    assert after_second["backend_calls"].get("put") == before["backend_calls"].get("put")
    assert after_second["bytes"]["put"] == before["bytes"]["put"]
    assert_store_holds(mooncake_backend, src, first_ids, keys_of(tokens, src, ns))  # the first bytes stay

    assert (third.stored, third.skipped, third.failed) == (3, chunks, 0)
    assert after_third["bytes"]["put"] - after_second["bytes"]["put"] == 3 * sum(chunk_nbytes(src))
    shifted = [ids[chunks * per :] for ids, per in zip(longer_ids, blocks_per_chunk(src), strict=True)]
    assert_store_holds(mooncake_backend, src, shifted, new_keys)

    assert sorted((r.stored, r.skipped, r.failed) for r in concurrent) == [(0, 3, 0), (3, 0, 0)]
    assert after_concurrent["bytes"]["put"] - after_third["bytes"]["put"] == 3 * sum(chunk_nbytes(src))


@pytest.mark.asyncio
async def test_lookup_is_the_prefix_present_in_every_group(
    mooncake_backend: MooncakeBackend, src: PagedCache
) -> None:
    ns, chunks = namespace(), 4
    tokens = prompt(12, chunks)
    async with make_worker(src, mooncake_backend, ns) as worker:
        assert await worker.lookup(tokens) == 0
        assert (await worker.store(tokens, scattered(src, chunks, seed=13))).stored == chunks
        assert await worker.lookup(tokens) == chunks * C
        assert await worker.lookup(np.asarray(tokens, dtype=np.int64)) == chunks * C
        assert await worker.lookup(tokens + prompt(14, 0, extra=C - 1)) == chunks * C  # partial chunk
        assert await worker.lookup(tokens[: 2 * C + 5]) == 2 * C
        assert await worker.lookup(tokens[: C - 1]) == 0
        # A prompt diverging inside chunk 2 shares chunks 0 and 1 only (keys chain on the prefix).
        diverging = list(tokens)
        diverging[2 * C + 7] += 1
        assert await worker.lookup(diverging) == 2 * C
        assert await worker.lookup(prompt(15, chunks)) == 0
        # A hole in one group ends the prefix, though later chunks are still present.
        group1 = keys_of(tokens, src, ns)[1]
        assert mooncake_backend.batch_remove([group1[1]], force=True) == [0]
        assert await worker.lookup(tokens) == 1 * C
        assert mooncake_backend.batch_exists(group1) == [True, False, True, True]
    # The same cache under another model name sees nothing.
    async with make_worker(src, mooncake_backend, namespace()) as other:
        assert await other.lookup(tokens) == 0


@pytest.mark.asyncio
async def test_load_with_missing_keys_fails_exactly_their_blocks(
    mooncake_backend: MooncakeBackend, src: PagedCache, dst: PagedCache
) -> None:
    ns, chunks = namespace(), 5
    tokens = prompt(16, chunks)
    src_ids = scattered(src, chunks, seed=17)
    dst_ids = scattered(dst, chunks + 1, seed=18, extra_blocks=1)  # more blocks than the load needs
    per = blocks_per_chunk(src)
    keys = keys_of(tokens, src, ns)
    async with make_worker(src, mooncake_backend, ns) as worker:
        assert (await worker.store(tokens, src_ids)).stored == chunks
    # The last chunk of group 1 goes: exactly that chunk's blocks fail, in both groups.
    assert mooncake_backend.batch_remove([keys[1][4]], force=True) == [0]
    async with make_worker(dst, mooncake_backend, ns) as worker:
        last = await worker.load(tokens, dst_ids)
        assert last.loaded_tokens == 4 * C and last.loaded_chunks == 4
        assert last.failed_block_ids == chunk_blocks(dst, dst_ids, 4, 5)
        assert last.errors == {Code.NOT_FOUND: 1}
        assert_loaded(src, src_ids, dst, dst_ids, 4)
        for g, p in enumerate(per):
            assert dst[g].untouched(dst_ids[g][4 * p : 5 * p])

        # Chunk 2 of group 0 goes too: the prefix ends there; chunks 2-4 fail (3 is present but lies
        # after the hole, so it is not read: the engine recomputes from the first hole on).
        dst.fill(SENTINEL)
        assert mooncake_backend.batch_remove([keys[0][2]], force=True) == [0]
        calls_before = worker.stats()["backend_calls"].get("get", 0)
        middle = await worker.load(tokens + prompt(19, 0, extra=10), dst_ids)
        stats = worker.stats()
    assert middle.loaded_tokens == 2 * C and middle.loaded_chunks == 2
    assert middle.failed_block_ids == chunk_blocks(dst, dst_ids, 2, 5)
    assert middle.errors == {Code.NOT_FOUND: 2}  # (chunk 2, group 0) and (chunk 4, group 1)
    assert not middle.ok
    assert_loaded(src, src_ids, dst, dst_ids, 2)
    for g, p in enumerate(per):
        assert dst[g].written_blocks() == set(dst_ids[g][: 2 * p].tolist())
    assert stats["backend_calls"]["get"] > calls_before
    assert stats["bytes"]["get"] == (4 + 2) * sum(chunk_nbytes(dst))  # the loaded prefixes, nothing more


# -- a full store (a master and a 16 MiB segment of the test's own) --------------------------------

# Chunks of 256 KiB per group, so 64 keys fill Mooncake's smallest segment.
BIG_SPECS: list[dict[str, Any]] = [
    {"num_regions": 2, "num_blocks": 192, "block_size": 16, "block_lens": 32 << 10},
    {"num_regions": 2, "num_blocks": 96, "block_size": 32, "block_lens": 64 << 10},
]
# No eviction: Mooncake's background eviction would otherwise drop older keys once the store is full,
# and the test checks exactly which keys are in the store.
NO_EVICTION = ("--eviction_ratio=0", "--eviction_high_watermark_ratio=1.0")


@pytest.mark.asyncio
async def test_full_store_fails_chunks_backs_off_stores_and_loads_still_work(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., MooncakeBackend],
) -> None:
    master = mooncake_master_factory(extra_args=NO_EVICTION)
    backend = mooncake_backend_factory(master.address, global_segment_size="16MiB")
    src = PagedCache.allocate(BIG_SPECS, fill="random", seed=20)
    dst = PagedCache.allocate(BIG_SPECS, fill=SENTINEL)
    assert chunk_nbytes(src) == [256 << 10, 256 << 10]
    ns = namespace()
    small, big, later = prompt(21, 4), prompt(22, 40), prompt(23, 2)  # 2 MiB, 20 MiB, 1 MiB
    small_ids, big_ids = scattered(src, 4, seed=24), scattered(src, 40, seed=25)
    async with make_worker(src, backend, ns, pressure_backoff_s=30.0) as writer:
        fits = await writer.store(small, small_ids)
        assert (fits.stored, fits.failed) == (4, 0)
        assert writer.stats()["pressure_backoffs"] == 0

        full = await writer.store(big, big_ids)
        stats = writer.stats()
        big_keys = keys_of(big, src, ns)
        present = np.array([backend.batch_exists(group) for group in big_keys])  # (groups, chunks)
        assert 0 < present.sum() < present.size  # some fitted, some did not
        assert full.failed == int((~present.all(axis=0)).sum())
        assert full.failed_chunks == tuple(np.flatnonzero(~present.all(axis=0)).tolist())
        assert full.errors == {Code.NO_SPACE: int((~present).sum())}  # one per (chunk, group) refused
        assert (full.stored, full.skipped) == (40 - full.failed, 0)
        assert not full.ok
        assert stats["pressure_backoffs"] >= 1
        assert stats["backend_errors"] == {Code.NO_SPACE: int((~present).sum())}

        # Inside the backoff window: a new prompt fails without any put, and a stored one is skipped.
        puts = stats["backend_calls"]["put"]
        refused = await writer.store(later, scattered(src, 2, seed=26))
        again = await writer.store(small, small_ids)
        stats = writer.stats()
        assert (refused.stored, refused.skipped, refused.failed) == (0, 0, 2)
        assert refused.errors == {Code.NO_SPACE: 2 * len(BIG_SPECS)}
        assert (again.stored, again.skipped, again.failed) == (0, 4, 0)
        assert stats["backend_calls"]["put"] == puts
        assert backend.batch_exists(keys_of(later, src, ns)[0]) == [False, False]

    # Loads are not held back: the small prompt reads in full, the big one up to its first hole.
    small_dst, big_dst = scattered(dst, 4, seed=27), scattered(dst, 40, seed=28)
    async with make_worker(dst, backend, ns, pressure_backoff_s=30.0) as reader:
        loaded = await reader.load(small, small_dst)
        assert (loaded.loaded_tokens, loaded.failed_block_ids) == (4 * C, ((), ()))
        assert_loaded(src, small_ids, dst, small_dst, 4)  # before the next load reuses some blocks
        partial = await reader.load(big, big_dst)
        assert reader.stats()["backend_calls"]["get"] >= 2
    hole = full.failed_chunks[0]
    assert partial.loaded_tokens == hole * C
    assert partial.failed_block_ids == chunk_blocks(dst, big_dst, hole)
    assert_loaded(src, big_ids, dst, big_dst, hole)


# -- the master dies under pending work ---------------------------------------------------------------


# A storage node in another process: it mounts the global segment, so the test's own client can be a
# pure client (its close after the master's death is quick; a client with a segment takes 8-17 s).
@pytest.fixture
def storage_node(mooncake_master_factory: Callable[..., MooncakeMaster]) -> Iterator[MooncakeMaster]:
    """A master of the test's own, with another process serving the store's memory."""
    master = mooncake_master_factory()
    with segment_holder(master.address, graceful=False):
        yield master


@pytest.mark.asyncio
async def test_master_killed_fails_every_pending_future_and_the_worker_closes(
    storage_node: MooncakeMaster,
    mooncake_backend_factory: Callable[..., MooncakeBackend],
    src: PagedCache,
    dst: PagedCache,
) -> None:
    master = storage_node
    backend = mooncake_backend_factory(master.address, global_segment_size=0)
    # The real backend behind a gate: it holds a put and a get at the door of Mooncake while the
    # master dies, so that calls already past the exists check are covered, deterministically.
    gated = FaultInjectingBackend(backend)
    ns = namespace()
    stored = [prompt(30 + i, 3) for i in range(3)]
    # Without the circuit breaker: this is the error path it replaces (with it, requests after the trip
    # are answered "unavailable" results instead: tests/cluster/test_breaker_cluster.py).
    writer = make_worker(src, gated, ns, breaker=None)
    reader = make_worker(dst, gated, ns, breaker=None)
    await writer.start()
    await reader.start()
    try:
        for i, tokens in enumerate(stored):
            assert (await writer.store(tokens, scattered(src, 3, seed=40 + i))).stored == 3
        before = await reader.load(stored[0], scattered(dst, 3, seed=50))
        assert before.loaded_tokens == 3 * C  # the store works across processes before the crash

        gets_before, puts_before = gated.count("get"), gated.count("put")
        gated.block("get")
        in_get = reader.load(stored[1], scattered(dst, 3, seed=51))
        await wait_until(gated.entered("get").is_set)
        gated.block("put")
        in_put = writer.store(prompt(60, 2), scattered(src, 2, seed=61))
        await wait_until(gated.entered("put").is_set)
        # Queued behind them, and some that reach the dispatcher after the crash.
        queued: list[Any] = [
            reader.load(stored[2], scattered(dst, 3, seed=52)),
            writer.store(prompt(62, 4), scattered(src, 4, seed=63)),
            writer.store(stored[0], scattered(src, 3, seed=64)),
            asyncio.ensure_future(reader.lookup(stored[1])),
        ]
        master.kill()
        queued += [
            reader.load(stored[0], scattered(dst, 3, seed=53)),
            writer.store(prompt(65, 1), scattered(src, 1, seed=66)),
            asyncio.ensure_future(writer.lookup(stored[2])),
        ]
        gated.release()
        pending = [in_get, in_put, *queued]

        async def settle(future: Any) -> BaseException | None:
            try:
                await future
            except Exception as exc:
                return exc
            return None

        outcomes = await asyncio.wait_for(asyncio.gather(*map(settle, pending)), HANG_GUARD_S)
        for i, error in enumerate(outcomes):
            assert isinstance(error, BackendUnavailableError), (i, error)
            assert error.address == master.address, (i, error)
            assert master.address in str(error), (i, error)
        assert all(f.done() for f in (in_get, in_put))
        assert writer.stats()["requests_failed"]["store"] == 4
        assert reader.stats()["requests_failed"]["load"] == 3
        # The gated put and get calls went on into Mooncake after the crash, and each one raised.
        assert writer.stats()["backend_exceptions"]["put"] == gated.count("put") - puts_before > 0
        assert reader.stats()["backend_exceptions"]["get"] == gated.count("get") - gets_before > 0
    finally:
        gated.release()
        await asyncio.wait_for(asyncio.gather(writer.close(), reader.close()), HANG_GUARD_S)
    assert writer.closed and reader.closed
    await asyncio.wait_for(asyncio.to_thread(backend.close), HANG_GUARD_S)
    assert backend.closed
