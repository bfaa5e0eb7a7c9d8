"""Bounded loop slices at scale, and one batch's copies on every transfer thread.

Bounded slices are pinned by a stall detector, not a speed assert: while a batch of 10,000 requests or a
500,000-key prompt is handled, a ticker wakes every millisecond and records the CPU the loop's own
thread used between two ticks (``time.thread_time``: a loaded machine descheduling the process, or
a transfer thread holding the GIL, does not count). Without slicing the longest stretch is 0.46-0.69 s
in both cases; the bound is 200 ms, several times the worst stretch with slicing on a loaded machine
(8-29 ms). A garbage collection of objects made before the measurement is kept out: no
slicing bounds it.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import KVWorker, MemoryBackend
from aiokv._engine.call_split import LOAD_ALONE_BYTES, REQUESTS_PER_CALL, call_pieces, load_segments
from aiokv._engine.lanes import EXISTS_PIECE_KEYS
from aiokv._engine.pipeline import INLINE_LOOKUP_CHUNKS
from aiokv._engine.request import Request
from aiokv._engine.slices import LoopSlices
from aiokv.backends.base import (
    MAX_KEYS_PER_CALL,
    MIN_SPLIT_BYTES,
    Regions,
    backend_traits,
    check_backend,
    keys_per_call,
)
from aiokv.errors import BackendError, InvalidRequestError
from aiokv.keys import HashedPrompt
from aiokv.testing import FaultInjectingBackend, FaultRule, GroupCache, same_blocks
from benchmarks import cli as bench_cli

from .helpers import recording_backend, wait_until
from .rig import SAFETY_S

pytestmark = pytest.mark.loop_matters  # also on uvloop (tests/conftest.py)

STALL_BOUND_MS = 200.0  # a stall detector: the fixed code's slices are ~2-15 ms of loop CPU
CHUNK_TOKENS = 16


class LoopCpu:
    """The most CPU the loop's thread used between two 1 ms ticks while ``work`` ran."""

    def __init__(self) -> None:
        self.busy_ms: list[float] = []

    async def measure(self, work: Awaitable[object]) -> object:
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                cpu = time.thread_time()
                await asyncio.sleep(0.001)
                self.busy_ms.append((time.thread_time() - cpu) * 1e3)

        # Collections of what existed before (10,000 requests' futures and arrays) are not the batch's
        # loops, and no slicing bounds them: keep them out of what is measured.
        gc.collect()
        gc.freeze()
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.005)
        try:
            return await asyncio.wait_for(work, 120)
        finally:
            gc.unfreeze()
            stop.set()
            await task

    @property
    def worst_ms(self) -> float:
        return max(self.busy_ms)


def _cache(num_blocks: int) -> tuple[GroupCache, MemoryBackend]:
    cache = GroupCache.allocate(num_regions=1, num_blocks=num_blocks, block_size=CHUNK_TOKENS, block_lens=64)
    return cache, MemoryBackend(capacity_bytes=2 * num_blocks * 64 + (1 << 20))


@pytest.mark.asyncio
async def test_a_batch_of_10000_stores_never_holds_the_loop_long_and_every_byte_is_stored() -> None:
    requests = 10_000
    cache, backend = _cache(requests)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, 128_000, size=(requests, CHUNK_TOKENS), dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="scale", chunk_tokens=CHUNK_TOKENS) as worker:
        # Submitted in one go, outside the measurement: the caller's own loop time is not the batch's.
        futures = [worker.store(prompts[i], [np.array([i])]) for i in range(requests)]
        probe = LoopCpu()

        async def finish() -> list[object]:
            return [await f for f in futures]

        results = await probe.measure(finish())
        assert [r.stored for r in results] == [1] * requests  # type: ignore[attr-defined]
        assert len(backend) == requests
        assert probe.worst_ms < STALL_BOUND_MS, f"the loop ran {probe.worst_ms:.0f} ms without a break"
        # Every stored chunk loads back byte for byte (a sample, into fresh blocks).
        loaded = await worker.load(prompts[123], [np.array([requests - 1])])
        assert loaded.loaded_tokens == CHUNK_TOKENS
        assert same_blocks(cache, [123], cache, [requests - 1])


@pytest.mark.asyncio
async def test_a_500000_key_prompt_never_holds_the_loop_long_and_a_lookup_meanwhile_finishes_first() -> None:
    chunks = 500_000
    cache, backend = _cache(chunks + 1)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
    small = HashedPrompt.from_tokens(rng.integers(0, 128_000, size=CHUNK_TOKENS), CHUNK_TOKENS)
    async with KVWorker(cache.layout, backend, namespace="scale", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(small, [np.array([chunks])])).stored == 1
        order: list[str] = []
        store = worker.store(prompt, [np.arange(chunks)])
        store.add_done_callback(lambda _: order.append("store"))

        async def lookup_meanwhile() -> None:
            await asyncio.sleep(0.05)  # the store's batch is hashing or building keys by now
            assert not store.done()
            assert await worker.lookup(small) == CHUNK_TOKENS
            order.append("lookup")

        probe = LoopCpu()
        lookup = asyncio.create_task(lookup_meanwhile())
        result = await probe.measure(store)
        await lookup
        assert result.stored == chunks  # type: ignore[attr-defined]
        assert order == ["lookup", "store"]
        assert probe.worst_ms < STALL_BOUND_MS, f"the loop ran {probe.worst_ms:.0f} ms without a break"


# Other causes of loop stalls at scale: objects the garbage collector walks per request, lookups behind a
# batch's checks, a thread holding the GIL for a whole 62,500-key check.

# Queued: the request, its TransferFuture, its asyncio future; settled: the two futures and the result
# (the request is gone). The slack is the worker's own few objects.
TRACKED_PER_REQUEST = 3.2


def _requests_alive() -> int:
    return sum(isinstance(o, Request) for o in gc.get_objects())


def _tracked() -> int:
    gc.collect()  # untracks tuples of atomic values, as any collection does
    return len(gc.get_objects())


class HeldPuts(MemoryBackend):
    """Puts wait (on their transfer thread) until released: a batch held mid-flight."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.entered = threading.Event()
        self.release = threading.Event()

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self.entered.set()
        self.release.wait(SAFETY_S)
        return super().batch_put(keys, addrs, sizes)


def _large_containers(least: int, holding: str = "") -> dict[int, str]:
    """Tracked containers of at least ``least`` items, those with a string containing ``holding``
    among their first items (or a dict's first keys or values): another library's large cache built
    meanwhile (one keyed by object ids appeared once vLLM's modules were loaded) is not the batch's."""
    return {
        id(o): type(o).__name__
        for o in gc.get_objects()
        if isinstance(o, (list, tuple, dict, set)) and len(o) >= least and _holds(o, holding)
    }


def _holds(container: Any, text: str) -> bool:
    items = itertools.islice(container, 16)
    if isinstance(container, dict):
        items = itertools.chain(items, itertools.islice(container.values(), 16))
    return any(isinstance(item, str) and text in item for item in items)


@pytest.mark.asyncio
async def test_a_long_prompts_keys_are_never_walked_by_the_garbage_collector() -> None:
    # The collector walks every tracked list, tuple, dict or set at each collection it is young in: a
    # 62,500-key prompt's batch held four of its keys (the request's, the batch's, its group's, the
    # claims), and one young collection of them took 5-8 ms of CPU, on the loop or on a transfer thread
    # holding the GIL. Keys in a batch now live in object arrays, which the collector never tracks.
    chunks = 20_000
    cache = GroupCache.allocate(num_regions=1, num_blocks=chunks, block_size=CHUNK_TOKENS, block_lens=64)
    backend = HeldPuts(capacity_bytes=2 * chunks * 64 + (1 << 20))
    tokens = np.random.default_rng(15).integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="untracked", chunk_tokens=CHUNK_TOKENS) as worker:
        before = _large_containers(chunks // 4, "untracked")
        store = worker.store(tokens, [np.arange(chunks)])
        try:
            await wait_until(backend.entered.is_set)  # keys built, claimed, checked; puts under way
            during = _large_containers(chunks // 4, "untracked")
            grown = {i: kind for i, kind in during.items() if i not in before}
        finally:
            backend.release.set()
        assert (await store).stored == chunks
    assert not grown, (
        f"tracked containers of >= {chunks // 4} items during the batch: {sorted(grown.values())}"
    )


@pytest.mark.asyncio
async def test_a_request_in_flight_costs_the_garbage_collector_a_few_objects() -> None:
    # A full collection walks every tracked object: 12 per queued request and 15 per settled one
    # (lists, closure cells) made one of 10,000 requests in flight cost 15-27 ms of CPU, on the loop.
    requests = 2000
    cache, backend = _cache(requests)
    prompts = np.random.default_rng(4).integers(0, 128_000, size=(requests, CHUNK_TOKENS), dtype=np.int64)
    blocks = [np.array([i]) for i in range(requests)]
    async with KVWorker(cache.layout, backend, namespace="gc", chunk_tokens=CHUNK_TOKENS) as worker:
        await worker.store(prompts[0] + 1, [blocks[0]])  # modules imported on first use are not counted
        before = _tracked()
        requests_before = _requests_alive()
        futures = [worker.store(prompts[i], [blocks[i]]) for i in range(requests)]  # queued: no turn yet
        queued = (_tracked() - before) / requests
        results = [await f for f in futures]
        settled = (_tracked() - before) / requests  # results held by their futures
        assert [r.stored for r in results] == [1] * requests
        # Settled requests are freed (not kept by their futures, nor by the dispatcher until its next batch).
        assert _requests_alive() == requests_before
    assert queued <= TRACKED_PER_REQUEST, f"{queued:.1f} tracked objects per queued request"
    assert settled <= TRACKED_PER_REQUEST, f"{settled:.1f} tracked objects per settled request"


@pytest.mark.asyncio
async def test_a_lookup_answers_while_a_batch_existence_check_hangs() -> None:
    cache, memory = _cache(64)
    rng = np.random.default_rng(5)
    small = HashedPrompt.from_tokens(rng.integers(0, 128_000, size=CHUNK_TOKENS), CHUNK_TOKENS)
    big = HashedPrompt.from_tokens(rng.integers(0, 128_000, size=32 * CHUNK_TOKENS), CHUNK_TOKENS)
    release = threading.Event()
    digests = set(big.hashes)
    backend = FaultInjectingBackend(memory)
    async with KVWorker(cache.layout, backend, namespace="lanes", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(small, [np.array([63])])).stored == 1
        backend.add_rule(
            FaultRule(op="exists", keys=lambda k: k.rsplit("/", 1)[-1] in digests, hang=release, times=1)
        )
        store = worker.store(big, [np.arange(32)])
        await wait_until(lambda: backend.hanging >= 1)  # the batch's check, on the control thread
        try:
            # Before: the lookup's check queued behind the hung one on the one control thread.
            assert await asyncio.wait_for(worker.lookup(small), SAFETY_S) == CHUNK_TOKENS
            assert not store.done()
        finally:
            release.set()
        assert (await asyncio.wait_for(store, SAFETY_S)).stored == 32


@pytest.mark.asyncio
async def test_a_large_batch_checks_existence_in_bounded_pieces() -> None:
    chunks = 20_000
    cache, memory = _cache(chunks)
    backend = FaultInjectingBackend(memory)
    prompt = np.random.default_rng(6).integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="pieces", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(prompt, [np.arange(chunks)])).stored == chunks
    checks = [len(c.keys) for c in backend.calls_of("exists")]
    # Before: one call of 20,000 keys (and one more confirming them), each holding the GIL throughout.
    assert max(checks) <= EXISTS_PIECE_KEYS
    assert sum(checks) == 2 * chunks  # every key checked before the puts and confirmed after


@pytest.mark.asyncio
async def test_lookups_in_flight_are_counted_for_the_loop_and_forgotten_on_terminate() -> None:
    cache, memory = _cache(8)
    release = threading.Event()
    backend = FaultInjectingBackend(memory, rules=[FaultRule(op="exists", hang=release, max_hang_s=SAFETY_S)])
    slices = LoopSlices.of_running_loop()
    assert slices.lookups == 0
    worker = KVWorker(cache.layout, backend, namespace="count", chunk_tokens=CHUNK_TOKENS)
    await worker.start()
    try:
        prompts = np.random.default_rng(7).integers(0, 128_000, size=(3, CHUNK_TOKENS), dtype=np.int64)
        lookups = [asyncio.create_task(worker.lookup(p)) for p in prompts]
        await wait_until(lambda: backend.hanging >= 1)
        assert slices.lookups == 3  # batches of this loop slice finely meanwhile
        worker.terminate()
    finally:
        release.set()
        await worker.wait_closed()
    await asyncio.gather(*lookups, return_exceptions=True)
    assert slices.lookups == 0


@pytest.mark.asyncio
async def test_a_batch_goes_on_while_a_lookup_hangs() -> None:
    # While a lookup is in flight, batches wait for it after each short slice (a thread waiting for the
    # GIL behind a busy loop got it 10-140 ms late), but only for a bounded time each (a lookup may hang).
    requests = 300
    cache, memory = _cache(requests + 1)
    rng = np.random.default_rng(9)
    small = HashedPrompt.from_tokens(rng.integers(0, 128_000, size=CHUNK_TOKENS), CHUNK_TOKENS)
    release = threading.Event()
    backend = FaultInjectingBackend(memory)
    prompts = rng.integers(0, 128_000, size=(requests, CHUNK_TOKENS), dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="wait", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(small, [np.array([requests])])).stored == 1
        digest = small.hashes[0]
        backend.add_rule(FaultRule(op="exists", keys=lambda k: k.endswith(digest), hang=release, times=1))
        lookup = asyncio.create_task(worker.lookup(small))
        await wait_until(lambda: backend.hanging >= 1)
        try:
            assert LoopSlices.of_running_loop().lookups == 1
            stores = [worker.store(prompts[i], [np.array([i])]) for i in range(requests)]
            results = await asyncio.wait_for(asyncio.gather(*stores), SAFETY_S)
            assert [r.stored for r in results] == [1] * requests
            assert not lookup.done()
        finally:
            release.set()
        assert await asyncio.wait_for(lookup, SAFETY_S) == CHUNK_TOKENS


class ThreadRecordingBackend(MemoryBackend):
    """Records the thread of each existence check; the first ``exists_failures`` of them raise."""

    def __init__(self, capacity_bytes: int, exists_failures: int = 0) -> None:
        super().__init__(capacity_bytes)
        self.exists_threads: list[str] = []
        self.exists_failures = exists_failures

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_threads.append(threading.current_thread().name)
        if self.exists_failures:
            self.exists_failures -= 1
            raise RuntimeError("exists failed")
        return super().batch_exists(keys)


@pytest.mark.asyncio
async def test_lookups_on_an_in_process_backend_are_answered_on_the_loop_and_others_on_a_thread() -> None:
    # Each hand-off to a thread costs the lookup the GIL twice, behind whatever holds it: the embedded
    # backend answers from a dict at once, so its lookups skip the thread (p99 during a 10,000-request
    # batch: 8-15 ms with the thread, 4-6 ms without; 0.5 ms idle).
    cache, _ = _cache(4)
    memory = ThreadRecordingBackend(capacity_bytes=1 << 20)
    prompt = np.random.default_rng(11).integers(0, 128_000, size=2 * CHUNK_TOKENS, dtype=np.int64)
    async with KVWorker(cache.layout, memory, namespace="here", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(prompt, [np.array([0, 1])])).stored == 2
        memory.exists_threads.clear()
        assert await worker.lookup(prompt) == 2 * CHUNK_TOKENS
        assert memory.exists_threads == [threading.current_thread().name]
    wrapped = FaultInjectingBackend(ThreadRecordingBackend(capacity_bytes=1 << 20))
    assert not backend_traits(wrapped).exists_in_process  # its rules may delay or hang any call
    async with KVWorker(cache.layout, wrapped, namespace="there", chunk_tokens=CHUNK_TOKENS) as worker:
        assert await worker.lookup(prompt) == 0
        assert wrapped.inner.exists_threads == ["aiokv-lookup_0"]  # type: ignore[attr-defined]


async def _awaited_by_hand(awaitable: Awaitable[int]) -> tuple[int, bool]:
    """``awaitable``'s value, and whether it waited for anything (a turn of the loop) on the way."""
    steps = awaitable.__await__()
    waited = False
    while True:
        try:
            pending = steps.send(None)
        except StopIteration as done:
            return done.value, waited
        waited = True
        await wait_until(pending.done)  # the future it waits for (a Task would do the same)


@pytest.mark.asyncio
async def test_a_short_lookup_on_an_in_process_backend_is_answered_in_the_call() -> None:
    # No queue, no thread, no turn of the loop, so no batch ahead of it can delay it: during a
    # 10,000-request batch a lookup's p99 was 4.5-8 ms through the lookup queue, 6-8x the idle loop's.
    chunks = INLINE_LOOKUP_CHUNKS + 1
    cache, backend = _cache(chunks)
    prompt = np.random.default_rng(13).integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
    short = prompt[: INLINE_LOOKUP_CHUNKS * CHUNK_TOKENS]
    async with KVWorker(cache.layout, backend, namespace="now", chunk_tokens=CHUNK_TOKENS) as worker:
        assert (await worker.store(prompt[: 3 * CHUNK_TOKENS], [np.arange(3)])).stored == 3
        for form in (short, short.tolist(), HashedPrompt.from_tokens(short, CHUNK_TOKENS)):
            assert await _awaited_by_hand(worker.lookup(form)) == (3 * CHUNK_TOKENS, False)
        assert await _awaited_by_hand(worker.lookup(prompt)) == (3 * CHUNK_TOKENS, True)  # a long one queues
        assert (await worker.store(prompt, [np.arange(chunks)])).stored == chunks - 3
        assert await _awaited_by_hand(worker.lookup(short)) == (INLINE_LOOKUP_CHUNKS * CHUNK_TOKENS, False)
        assert await _awaited_by_hand(worker.lookup(prompt)) == (chunks * CHUNK_TOKENS, True)
    wrapped = FaultInjectingBackend(MemoryBackend(capacity_bytes=1 << 20))
    async with KVWorker(cache.layout, wrapped, namespace="now", chunk_tokens=CHUNK_TOKENS) as worker:
        assert await _awaited_by_hand(worker.lookup(short)) == (0, True)  # not in-process: on its thread


@pytest.mark.asyncio
async def test_a_lookup_answered_in_the_call_fails_alone_and_the_worker_keeps_serving() -> None:
    cache, _ = _cache(4)
    backend = ThreadRecordingBackend(capacity_bytes=1 << 20, exists_failures=1)
    prompt = np.random.default_rng(14).integers(0, 128_000, size=2 * CHUNK_TOKENS, dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="alone", chunk_tokens=CHUNK_TOKENS) as worker:
        with pytest.raises(BackendError, match="exists failed"):
            await worker.lookup(prompt)
        with pytest.raises(InvalidRequestError, match=r"token_ids must be in \[0, 2\*\*32\)"):
            await worker.lookup([-1] * CHUNK_TOKENS)
        assert (await worker.store(prompt, [np.array([0, 1])])).stored == 2
        assert await worker.lookup(prompt.tolist()) == 2 * CHUNK_TOKENS
        stats = worker.stats()
    assert stats["backend_exceptions"]["exists"] == 1
    assert stats["requests"]["lookup"] == 3


def test_backend_flags_must_be_bools() -> None:
    for flag in ("exists_in_process", "supports_device_memory"):
        bad = type("BadFlag", (MemoryBackend,), {flag: 1})
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            check_backend(bad())
    assert backend_traits(MemoryBackend()).exists_in_process


@pytest.mark.asyncio
async def test_a_batch_lets_go_of_each_requests_data_as_it_settles() -> None:
    # Freed a slice at a time: all at once as the batch ended, 6,000 requests' keys and arrays held the
    # loop ~10 ms.
    requests = 50
    cache, backend = _cache(requests)
    prompts = np.random.default_rng(12).integers(0, 128_000, size=(requests, CHUNK_TOKENS), dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="drop", chunk_tokens=CHUNK_TOKENS) as worker:
        held: list[Request] = []
        submit = worker._dispatcher.submit  # type: ignore[union-attr]

        def keep(request: Request) -> None:
            held.append(request)
            submit(request)

        worker._dispatcher.submit = keep  # type: ignore[union-attr,method-assign]
        results = await asyncio.gather(*(worker.store(p, [np.array([i])]) for i, p in enumerate(prompts)))
        assert [r.stored for r in results] == [1] * requests
    assert len(held) == requests
    for request in held:
        assert request.finished
        assert (request.keys, request.codes, request.positions, request.blocks) == ((), (), (), ())


@pytest.mark.asyncio
async def test_many_small_stores_go_in_calls_of_at_most_requests_per_call_requests() -> None:
    # A call's go-ahead and its return visit every request it carries on the loop, in one piece: 4,096
    # one-chunk requests in one call held the loop ~10 ms.
    requests = 3 * REQUESTS_PER_CALL + 7
    cache = GroupCache.allocate(num_regions=1, num_blocks=requests, block_size=CHUNK_TOKENS, block_lens=64)
    backend = recording_backend(capacity_bytes=2 * requests * 64 + (1 << 20))
    prompts = np.random.default_rng(10).integers(0, 128_000, size=(requests, CHUNK_TOKENS), dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="cap", chunk_tokens=CHUNK_TOKENS) as worker:
        stores = [worker.store(prompts[i], [np.array([i])]) for i in range(requests)]
        assert [r.stored for r in await asyncio.gather(*stores)] == [1] * requests
    put_keys = [len(call.keys) for call in backend.calls_of("put")]
    assert sum(put_keys) == requests
    assert max(put_keys) <= REQUESTS_PER_CALL  # one key per request here


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    per_call=st.integers(1, 20),
    max_requests=st.integers(1, 6),
)
def test_call_pieces_are_consecutive_and_as_long_as_both_limits_allow(
    runs: list[int], per_call: int, max_requests: int
) -> None:
    plan_of_row = np.repeat(np.arange(len(runs)), runs)
    parts = call_pieces(plan_of_row, per_call, max_requests)
    assert [p.start for p in parts] == [0] + [p.stop for p in parts[:-1]]
    assert parts[-1].stop == plan_of_row.size
    for k, part in enumerate(parts):
        rows = plan_of_row[part]
        assert 0 < rows.size <= per_call
        assert np.unique(rows).size <= max_requests
        if k < len(parts) - 1:  # cut only where one more row would break a limit
            longer = plan_of_row[part.start : part.stop + 1]
            assert longer.size > per_call or np.unique(longer).size > max_requests


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=30))
def test_a_large_load_is_a_segment_of_its_own(runs: list[tuple[int, bool]]) -> None:
    # Each run a request's rows; a large one's rows add up to LOAD_ALONE_BYTES, a small one's stay under.
    plan_of_row = np.repeat(np.arange(len(runs)), [n for n, _ in runs])
    row_bytes = np.concatenate(
        [np.full(n, -(-LOAD_ALONE_BYTES // n) if large else (LOAD_ALONE_BYTES - 1) // 9) for n, large in runs]
    )
    segments = load_segments(plan_of_row, row_bytes)
    assert [p.start for p in segments] == [0] + [p.stop for p in segments[:-1]]
    assert segments[-1].stop == plan_of_row.size
    large = [big for _, big in runs]
    kinds = []
    for segment in segments:
        entries = np.unique(plan_of_row[segment]).tolist()
        assert segment.stop > segment.start
        assert len(entries) == 1 or not any(large[j] for j in entries)  # a large run is alone
        kinds.append(large[entries[0]])
    # As few segments as that allows: two segments of small runs are never neighbours.
    assert not any(not a and not b for a, b in itertools.pairwise(kinds))


# -- one batch's copies on every transfer thread -----------------------------------------------------


def test_keys_per_call_spreads_a_large_move_over_the_threads_in_whole_rounds() -> None:
    big = 64 * MIN_SPLIT_BYTES
    # The region rule alone: at most max_regions_per_call regions, whole keys, at least one key.
    assert keys_per_call(65536, 96) == 682
    assert keys_per_call(10, 96) == 1
    # One call's worth of keys, large: cut into one call per thread.
    assert keys_per_call(65536, 96, keys=40, total_bytes=big, threads=2) == 20
    assert keys_per_call(65536, 96, keys=41, total_bytes=big, threads=4) == 11
    # Three calls by the region rule on two threads: four calls (two full rounds), not three.
    assert keys_per_call(1000, 100, keys=30, total_bytes=big, threads=2) == 8
    # Small moves, one thread, or one key are not split.
    assert keys_per_call(65536, 96, keys=40, total_bytes=2 * MIN_SPLIT_BYTES - 1, threads=2) == 682
    assert keys_per_call(65536, 96, keys=40, total_bytes=big, threads=1) == 682
    assert keys_per_call(65536, 96, keys=1, total_bytes=big, threads=2) == 682


def test_keys_per_call_caps_the_keys_of_a_call_whatever_its_pairs() -> None:
    assert keys_per_call(65536, 1) == MAX_KEYS_PER_CALL
    assert keys_per_call(65536, 1, keys=62_500, total_bytes=1 << 30, threads=2) <= MAX_KEYS_PER_CALL
    assert keys_per_call(2048, 1) == 2048  # the backend's own bound, when lower, still rules


@pytest.mark.asyncio
async def test_a_long_prompt_is_put_in_calls_of_at_most_max_keys_per_call() -> None:
    chunks = 3 * MAX_KEYS_PER_CALL + 5
    cache = GroupCache.allocate(num_regions=1, num_blocks=chunks, block_size=CHUNK_TOKENS, block_lens=64)
    backend = recording_backend(capacity_bytes=2 * chunks * 64 + (1 << 20))
    tokens = np.random.default_rng(8).integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
    async with KVWorker(cache.layout, backend, namespace="cap", chunk_tokens=CHUNK_TOKENS) as worker:
        result = await worker.store(tokens, [np.arange(chunks)])
        assert result.stored == chunks
        assert await worker.lookup(tokens) == chunks * CHUNK_TOKENS
    put_keys = [len(call.keys) for call in backend.calls_of("put")]
    assert sum(put_keys) == chunks
    assert max(put_keys) <= MAX_KEYS_PER_CALL
    assert max(put_keys) > REQUESTS_PER_CALL  # one request's keys are not cut by the request cap


def test_an_embedded_put_allocates_no_tracked_object_per_key() -> None:
    # A tuple per stored key (its heap offset and size) made a 62,500-key put trigger ~90 young
    # collections, each walking whatever large young containers the loop had just built.
    keys_count = 4096
    cache, backend = _cache(keys_count)
    keys = [f"gc/key{i}" for i in range(keys_count)]
    for addr, size in cache.layout.region_spans():
        backend.register_buffer(addr, size)
    regions = cache.layout.regions_for_chunks(np.arange(keys_count).reshape(-1, 1))[0]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = len(gc.get_objects())
        assert backend.batch_put(keys, regions.addrs, regions.sizes) == [0] * keys_count
        grown = len(gc.get_objects()) - before
    finally:
        if was_enabled:
            gc.enable()
    assert grown < 64, f"{grown} more tracked objects after a put of {keys_count} keys"
    assert backend.batch_exists(keys) == [True] * keys_count


class RendezvousBackend(MemoryBackend):
    """The real embedded backend, whose puts wait (up to 10 s) until two of them run at once: a batch
    whose copies ran on one thread breaks the rendezvous and fails its calls."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.rendezvous = threading.Barrier(2, timeout=10)
        self.put_threads: list[str] = []

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self.put_threads.append(threading.current_thread().name)
        self.rendezvous.wait()
        return super().batch_put(keys, addrs, sizes)


@pytest.mark.asyncio
async def test_one_large_store_runs_its_copies_on_both_transfer_threads_and_stores_every_byte() -> None:
    # 40 chunks x 4 regions x 64 KiB = 10 MiB: one call by the region rule, two by the thread rule.
    chunks, regions, block = 40, 4, 64 << 10
    cache = GroupCache.allocate(num_regions=regions, num_blocks=2 * chunks, block_size=16, block_lens=block)
    backend = RendezvousBackend(capacity_bytes=4 * chunks * regions * block)
    tokens = np.random.default_rng(3).integers(0, 128_000, size=chunks * 16, dtype=np.int64)
    async with KVWorker(
        cache.layout, backend, namespace="split", chunk_tokens=16, executor_threads=2
    ) as worker:
        result = await asyncio.wait_for(worker.store(tokens, [np.arange(chunks)]), 30)
        assert result.stored == chunks and result.failed == 0
        assert len(backend.put_threads) == 2 and len(set(backend.put_threads)) == 2
        backend.rendezvous = threading.Barrier(1)  # loads are not split-tested here
        loaded = await asyncio.wait_for(worker.load(tokens, [np.arange(chunks, 2 * chunks)]), 30)
        assert loaded.loaded_chunks == chunks
        assert same_blocks(cache, np.arange(chunks), cache, np.arange(chunks, 2 * chunks))


def test_bench_scale_reports_both_workloads_against_both_baselines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "scale.json"
    argv = ["scale", "--requests", "50", "--prompt-tokens", "1600", "--rounds", "1", "--json", str(json_path)]
    assert bench_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "loop stalls at scale" in out and "lag max / direct" in out
    assert "50 stores of 1 chunk(s)" in out and "process CPU per request" in out
    report = json.loads(json_path.read_text())
    assert report["parameters"]["keys"] == 100
    paths = {(f["workload"], f["path"]) for f in report["figures"]}
    assert paths == {(w, p) for w in ("many requests", "long prompt") for p in ("worker", "direct", "idle")}
    for figures in report["figures"]:
        assert figures["lag_max_ms"] >= figures["lag_p99_ms"] and figures["wall_ms"] > 0
        assert figures["lookups"] >= 1 and figures["lookup_max_ms"] > 0 and figures["cpu_ms"] > 0
    assert set(report["ratios"]) == {"many requests", "long prompt"}
    # 50 stores through the worker cost more CPU than the ticker and prober alone.
    assert report["ratios"]["many requests"]["cpu_per_request_us"] > 0
    collector = report["collector"]
    assert collector["requests"] == 50 and collector["queued_full_collection_ms"] > 0
    # + 1: the batch's own few dozen objects, one per request at 50 (the 2,000-request test above
    # holds the bound itself).
    assert 0 < collector["queued_objects_per_request"] <= TRACKED_PER_REQUEST + 1


def test_bench_scale_stores_requests_of_several_chunks(tmp_path: Path) -> None:
    """The small-request shape (1,024 tokens in 4 chunks a request), small: every chunk is stored."""
    json_path = tmp_path / "scale.json"
    argv = ["scale", "--requests", "40", "--request-chunks", "4", "--chunk-tokens", "256"]
    assert bench_cli.main([*argv, "--prompt-tokens", "2048", "--rounds", "1", "--json", str(json_path)]) == 0
    report = json.loads(json_path.read_text())
    assert report["parameters"]["request_chunks"] == 4
    assert report["ratios"]["many requests"]["cpu_per_request_us"] > 0
