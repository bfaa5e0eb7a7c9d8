"""A load is settled as soon as its own chunks have landed, not when the batch carrying it ends: two
loads in one batch, the second's calls held at the backend, the first answers meanwhile, whole and
right; then the second; a failing call settles its own load with the failure, not its neighbour;
large loads get calls of their own, so one call does not carry two of them; and a load below
``LOAD_ALONE_BYTES`` settles with its batch."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aiokv
from aiokv._engine import call_split
from aiokv.testing import FaultInjectingBackend, FaultRule, GroupCache, same_blocks

CHUNK = 64
PROMPT = 4 * CHUNK  # four chunks a prompt
WAIT_S = 10.0
# Per block: 2 (K, V) x 16 tokens x 8 heads x 64 dims x 2 bytes, in each of the 2 regions.
PROMPT_BYTES = (PROMPT // 16) * 2 * (2 * 16 * 8 * 64 * 2)


def _caches() -> list[np.ndarray]:
    return [np.zeros((2, 64, 16, 8, 64), dtype=np.float16) for _ in range(2)]


def _layout(caches: list[np.ndarray]) -> aiokv.KVLayout:
    return aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)


def _prompt(n: int) -> np.ndarray:
    return np.arange(1000 * n, 1000 * n + PROMPT)


def _blocks(first: int) -> list[np.ndarray]:
    return [np.arange(first, first + PROMPT // 16)]


async def _stored_backend() -> tuple[aiokv.MemoryBackend, list[set[str]], list[np.ndarray]]:
    """Prompts 0 and 1 stored from random blocks; the keys each added, and the caches they came from."""
    backend = aiokv.MemoryBackend()
    recorded = FaultInjectingBackend(backend)
    caches = _caches()
    rng = np.random.default_rng(3)
    for cache in caches:
        cache[:] = rng.standard_normal(cache.shape).astype(np.float16)
    keys_of: list[set[str]] = []
    async with aiokv.KVWorker(_layout(caches), recorded, namespace="early", chunk_tokens=CHUNK) as worker:
        for n in range(2):
            before = set(recorded.sent_keys("put"))
            assert (await worker.store(_prompt(n), _blocks(16 * n))).stored == 4
            keys_of.append(set(recorded.sent_keys("put")) - before)
    assert all(len(keys) == 4 for keys in keys_of)
    return backend, keys_of, caches


def _same_blocks(got: list[np.ndarray], want: list[np.ndarray], got_first: int, want_first: int) -> bool:
    blocks = PROMPT // 16
    return all(
        np.array_equal(g[:, got_first : got_first + blocks], w[:, want_first : want_first + blocks])
        for g, w in zip(got, want, strict=True)
    )


def _holding_prompt_1(
    inner: aiokv.MemoryBackend, keys_of: list[set[str]]
) -> tuple[FaultInjectingBackend, threading.Event]:
    """``inner`` with every get of prompt 1's keys held until the event is set."""
    gate = threading.Event()
    rules = [FaultRule(op="get", keys=keys_of[1], hang=gate, max_hang_s=WAIT_S)]
    return FaultInjectingBackend(inner, rules=rules), gate


def _loading_worker(backend: FaultInjectingBackend, caches: list[np.ndarray]) -> aiokv.KVWorker:
    # One key a call, one transfer thread: the batch's calls run one after another, prompt 0's first.
    return aiokv.KVWorker(
        _layout(caches),
        backend,
        namespace="early",
        chunk_tokens=CHUNK,
        max_regions_per_call=1,
        executor_threads=1,
    )


@pytest.fixture
def loads_count_as_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt here moves 1 MiB: as large as the threshold, so each may settle on its own."""
    monkeypatch.setattr(call_split, "LOAD_ALONE_BYTES", PROMPT_BYTES)


@pytest.mark.asyncio
@pytest.mark.usefixtures("loads_count_as_large")
async def test_a_load_answers_while_its_batch_still_moves_another() -> None:
    inner, keys_of, stored = await _stored_backend()
    backend, gate = _holding_prompt_1(inner, keys_of)
    caches = _caches()
    async with _loading_worker(backend, caches) as worker:
        batches = worker.stats()["batches"]
        first, second = worker.load(_prompt(0), _blocks(0)), worker.load(_prompt(1), _blocks(16))
        try:
            result = await asyncio.wait_for(asyncio.shield(first), WAIT_S)
            assert result.loaded_tokens == PROMPT
            assert _same_blocks(caches, stored, 0, 0)
            assert not second.done()  # its call still holds the blocks it is writing
            assert worker.stats()["batches"] == batches + 1  # both in one batch
        finally:
            gate.set()
        assert (await asyncio.wait_for(second, WAIT_S)).loaded_tokens == PROMPT
        assert _same_blocks(caches, stored, 16, 16)


@pytest.mark.asyncio
@pytest.mark.usefixtures("loads_count_as_large")
async def test_a_failing_call_settles_its_own_load_only() -> None:
    inner, keys_of, stored = await _stored_backend()
    gate = threading.Event()
    rules = [
        FaultRule(op="get", keys=keys_of[0], code=-800),
        FaultRule(op="get", keys=keys_of[1], hang=gate, max_hang_s=WAIT_S),
    ]
    backend = FaultInjectingBackend(inner, rules=rules)
    caches = _caches()
    async with _loading_worker(backend, caches) as worker:
        first, second = worker.load(_prompt(0), _blocks(0)), worker.load(_prompt(1), _blocks(16))
        try:
            result = await asyncio.wait_for(asyncio.shield(first), WAIT_S)
            assert result.loaded_tokens == 0
            assert not second.done()
        finally:
            gate.set()
        assert (await asyncio.wait_for(second, WAIT_S)).loaded_tokens == PROMPT
        assert _same_blocks(caches, stored, 16, 16)


@pytest.mark.asyncio
async def test_large_loads_get_calls_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every load here counts as large; with the default call size one call would carry both.
    monkeypatch.setattr(call_split, "LOAD_ALONE_BYTES", 1)
    inner, keys_of, stored = await _stored_backend()
    backend, gate = _holding_prompt_1(inner, keys_of)
    caches = _caches()
    async with aiokv.KVWorker(_layout(caches), backend, namespace="early", chunk_tokens=CHUNK) as worker:
        first, second = worker.load(_prompt(0), _blocks(0)), worker.load(_prompt(1), _blocks(16))
        try:
            assert (await asyncio.wait_for(asyncio.shield(first), WAIT_S)).loaded_tokens == PROMPT
            assert not second.done()
        finally:
            gate.set()
        assert (await asyncio.wait_for(second, WAIT_S)).loaded_tokens == PROMPT
    assert sorted(sorted(call.keys) for call in backend.calls_of("get")) == sorted(sorted(k) for k in keys_of)
    assert _same_blocks(caches, stored, 0, 0) and _same_blocks(caches, stored, 16, 16)


@pytest.mark.asyncio
async def test_a_small_load_settles_with_its_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # One byte short of large: sharing calls with other loads, it waits for the batch's end.
    monkeypatch.setattr(call_split, "LOAD_ALONE_BYTES", PROMPT_BYTES + 1)
    inner, keys_of, stored = await _stored_backend()
    backend, gate = _holding_prompt_1(inner, keys_of)
    caches = _caches()
    async with _loading_worker(backend, caches) as worker:
        first, second = worker.load(_prompt(0), _blocks(0)), worker.load(_prompt(1), _blocks(16))
        try:
            # One thread, plan order: prompt 1's first call hangs once prompt 0's have all returned.
            assert await asyncio.to_thread(backend.wait_hanging, 1, WAIT_S)
            await asyncio.sleep(0.2)  # time in which a load settled early would have answered
            assert not first.done()
        finally:
            gate.set()
        assert (await asyncio.wait_for(first, WAIT_S)).loaded_tokens == PROMPT
        assert (await asyncio.wait_for(second, WAIT_S)).loaded_tokens == PROMPT
    assert _same_blocks(caches, stored, 0, 0) and _same_blocks(caches, stored, 16, 16)


@pytest.mark.asyncio
async def test_a_large_loads_own_calls_are_spread_over_both_threads() -> None:
    # Two loads of 40 chunks x 4 regions x 64 KiB = 10 MiB in one batch: each gets calls of its own,
    # and those are cut in two, one a transfer thread, so each load lands in half its copy time.
    chunks, regions, block = 40, 4, 64 << 10
    cache = GroupCache.allocate(num_regions=regions, num_blocks=4 * chunks, block_size=16, block_lens=block)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128_000, size=chunks * 16, dtype=np.int64) for _ in range(2)]
    backend = FaultInjectingBackend(aiokv.MemoryBackend())
    async with aiokv.KVWorker(cache.layout, backend, namespace="spread", chunk_tokens=16) as worker:
        for n, prompt in enumerate(prompts):
            assert (await worker.store(prompt, [np.arange(n * chunks, (n + 1) * chunks)])).stored == chunks
        keys_of = [set(backend.sent_keys("put")[n * chunks : (n + 1) * chunks]) for n in range(2)]
        batches = worker.stats()["batches"]
        loads = [
            worker.load(p, [np.arange((2 + n) * chunks, (3 + n) * chunks)]) for n, p in enumerate(prompts)
        ]
        done = await asyncio.wait_for(asyncio.gather(*loads), WAIT_S)
        assert [r.loaded_tokens for r in done] == [chunks * 16] * 2
        assert worker.stats()["batches"] == batches + 1  # both in one batch
    calls = [set(call.keys) for call in backend.calls_of("get")]
    for keys in keys_of:
        mine = [c for c in calls if c & keys]
        assert len(mine) == 2 and all(c <= keys for c in mine) and set().union(*mine) == keys
    for n in range(2):
        stored, loaded = (
            np.arange(n * chunks, (n + 1) * chunks),
            np.arange((2 + n) * chunks, (3 + n) * chunks),
        )
        assert same_blocks(cache, stored, cache, loaded)
