"""``max_batch_chunks``: a transfer batch takes at most that many chunks of what is queued (a request
of more goes alone), so under many large requests the first finish first; the rest wait for the next
batch, in order, none lost."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiokv


def _layout() -> aiokv.KVLayout:
    caches = [np.zeros((2, 128, 16, 8, 64), dtype=np.float16) for _ in range(2)]
    return aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)


async def _store_five(worker: aiokv.KVWorker) -> list[aiokv.StoreResult]:
    futures = [
        worker.store(np.arange(1000 * n, 1000 * n + 256), [np.arange(16 * n, 16 * n + 16)]) for n in range(5)
    ]
    return list(await asyncio.gather(*futures))


@pytest.mark.asyncio
@pytest.mark.parametrize(("cap", "batches"), [(None, 1), (8, 3), (4, 5), (1, 5)])
async def test_a_batch_takes_at_most_the_cap_of_what_is_queued(cap: int | None, batches: int) -> None:
    backend = aiokv.MemoryBackend()
    async with aiokv.KVWorker(
        _layout(), backend, namespace="m", chunk_tokens=64, max_batch_chunks=cap
    ) as worker:
        results = await _store_five(worker)  # five requests of 4 chunks, queued at once
        assert [r.stored for r in results] == [4] * 5
        assert worker.stats()["batches"] == batches
        loaded = await worker.load(np.arange(4000, 4256), [np.arange(100, 116)])
        assert loaded.loaded_tokens == 256


@pytest.mark.asyncio
async def test_the_cap_is_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_chunks"):
        aiokv.KVWorker(_layout(), aiokv.MemoryBackend(), namespace="m", chunk_tokens=64, max_batch_chunks=0)
