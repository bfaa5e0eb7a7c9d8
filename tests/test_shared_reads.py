"""Loads of one batch that share chunks read each key from the backend once; the other requests' blocks
get a copy in the same call: every byte right, a failed read failing each copy, a request that went
away leaving its neighbours' copies right; copies between regions split differently."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

import aiokv
from aiokv._engine.shared_reads import cut_sources, first_readers, read_then_copy
from aiokv.codes import Code
from aiokv.testing import FaultInjectingBackend, FaultRule

CHUNK = 64
PROMPT = 4 * CHUNK
BLOCKS = PROMPT // 16
WAIT_S = 10.0


def _caches() -> list[np.ndarray]:
    return [np.zeros((2, 64, 16, 8, 64), dtype=np.float16) for _ in range(2)]


def _layout(caches: list[np.ndarray]) -> aiokv.KVLayout:
    return aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)


async def _stored(tokens: np.ndarray) -> tuple[aiokv.MemoryBackend, list[np.ndarray]]:
    backend = aiokv.MemoryBackend()
    caches = _caches()
    rng = np.random.default_rng(11)
    for cache in caches:
        cache[:] = rng.standard_normal(cache.shape).astype(np.float16)
    async with aiokv.KVWorker(_layout(caches), backend, namespace="shared", chunk_tokens=CHUNK) as worker:
        assert (await worker.store(tokens, [np.arange(BLOCKS)])).stored == 4
    return backend, caches


def _loaded(got: list[np.ndarray], want: list[np.ndarray], first: int) -> bool:
    return all(
        np.array_equal(g[:, first : first + BLOCKS], w[:, :BLOCKS]) for g, w in zip(got, want, strict=True)
    )


@pytest.mark.asyncio
async def test_loads_of_one_prompt_in_one_batch_read_each_key_once() -> None:
    tokens = np.arange(5000, 5000 + PROMPT)
    inner, stored = await _stored(tokens)
    backend = FaultInjectingBackend(inner)
    caches = _caches()
    async with aiokv.KVWorker(_layout(caches), backend, namespace="shared", chunk_tokens=CHUNK) as worker:
        batches = worker.stats()["batches"]
        futures = [worker.load(tokens, [np.arange(16 * r, 16 * r + BLOCKS)]) for r in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
        assert worker.stats()["batches"] == batches + 1
    assert [r.loaded_tokens for r in results] == [PROMPT] * 3
    assert all(_loaded(caches, stored, 16 * r) for r in range(3))
    sent = Counter(backend.sent_keys("get"))
    assert len(sent) == 4 and set(sent.values()) == {1}


@pytest.mark.asyncio
async def test_a_failed_read_fails_every_copy_of_it() -> None:
    tokens = np.arange(7000, 7000 + PROMPT)
    inner, stored = await _stored(tokens)
    recorder = FaultInjectingBackend(inner)
    async with aiokv.KVWorker(_layout(_caches()), recorder, namespace="shared", chunk_tokens=CHUNK) as worker:
        await worker.load(tokens, [np.arange(BLOCKS)])
    third = recorder.sent_keys("get")[2]  # the third chunk's key
    backend = FaultInjectingBackend(inner, rules=[FaultRule(op="get", keys=[third], code=-800)])
    caches = _caches()
    async with aiokv.KVWorker(_layout(caches), backend, namespace="shared", chunk_tokens=CHUNK) as worker:
        futures = [worker.load(tokens, [np.arange(16 * r, 16 * r + BLOCKS)]) for r in range(2)]
        results = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
    # Both stop at the chunk whose read failed: the two before it are in both requests' blocks.
    assert [r.loaded_tokens for r in results] == [2 * CHUNK] * 2
    for first in (0, 16):
        assert all(
            np.array_equal(c[:, first : first + 8], s[:, :8]) for c, s in zip(caches, stored, strict=True)
        )


def test_first_readers_and_sources() -> None:
    keys = np.array(["a", "b", "a", "c", "b", "a"], dtype=object)
    first, source = first_readers(keys)
    assert first.tolist() == [0, 1, 3]
    assert source.tolist() == [0, 1, 0, 3, 1, 0]
    unique = np.array(["x", "y"], dtype=object)
    assert [a.tolist() for a in first_readers(unique)] == [[0, 1], [0, 1]]


def test_a_cut_call_renumbers_its_sources_and_marks_lost_ones() -> None:
    copy_from = np.array([-1, -1, 0, 1, 0])
    # Row 0 (a source) went away with its request: row 2 and row 4 lose their source; row 3's is row 1.
    kept = cut_sources(copy_from, np.array([1, 2, 3, 4]))
    assert kept[0] == -1 and kept[2] == 0
    assert kept[1] < -1 and kept[3] < -1


def test_copies_move_every_byte_between_regions_split_differently() -> None:
    src = np.random.default_rng(2).integers(0, 256, size=4096, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    # Row 0 is read (3 regions); row 1 is a copy of it into 2 regions split elsewhere, with a gap.
    addrs = np.array([[s, s + 1000, s + 3000], [d + 100, d + 5000, 0]], dtype=np.int64)
    sizes = np.array([[1000, 2000, 1096], [2500, 1596, 0]], dtype=np.int64)
    reads: list[list[str]] = []

    def get(keys: list[str], _addrs: object, _sizes: object) -> list[int]:
        reads.append(keys)
        return [4096]

    codes = read_then_copy(get, np.array(["k", "k"], dtype=object), addrs, sizes, np.array([-1, 0]))
    assert codes == [4096, 4096] and reads == [["k"]]
    assert np.array_equal(np.concatenate([dst[100:2600], dst[5000:6596]]), src)
    assert not dst[:100].any() and not dst[2600:5000].any() and not dst[6596:].any()

    def failing(keys: list[str], _addrs: object, _sizes: object) -> list[int]:
        return [-800]

    dst[:] = 0
    assert read_then_copy(failing, np.array(["k", "k"], dtype=object), addrs, sizes, np.array([-1, 0])) == [
        -800,
        -800,
    ]
    assert not dst.any()
    gone = read_then_copy(get, np.array(["k", "k"], dtype=object), addrs, sizes, np.array([-1, -2]))
    assert gone == [4096, int(Code.WRITER_CANCELLED)]
