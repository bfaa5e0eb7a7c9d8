"""Where a transfer's time goes inside the worker (``stats()["phases"]``), and what the vLLM connector
reports of it: every phase of a batch counted, per kind, with non-negative seconds."""

from __future__ import annotations

import numpy as np
import pytest

import aiokv
from aiokv.integrations.vllm.common.stats_reporter import connector_counters


def _layout() -> aiokv.KVLayout:
    caches = [np.zeros((2, 64, 16, 8, 64), dtype=np.float16) for _ in range(2)]
    return aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)


@pytest.mark.asyncio
async def test_stores_and_loads_count_every_phase_of_their_batches() -> None:
    async with aiokv.KVWorker(_layout(), aiokv.MemoryBackend(), namespace="m", chunk_tokens=64) as worker:
        for start in range(3):
            prompt = np.arange(start * 1000, start * 1000 + 300)
            stored = await worker.store(prompt, [np.arange(19)])
            loaded = await worker.load(prompt[:256], [np.arange(20, 36)])
            assert stored.stored == 4 and loaded.loaded_tokens == 256
    # Read once the worker has closed: a load settles as its own calls return, before its batch ends
    # and records its last phases.
    phases = worker.stats()["phases"]
    assert set(phases) == {"store", "load"}
    assert set(phases["store"]) == {"queue", "prepare", "transfer", "confirm", "settle"}
    assert set(phases["load"]) == {"queue", "prepare", "transfer", "settle"}  # loads confirm nothing
    for kind in ("store", "load"):
        assert phases[kind]["queue"]["count"] == 3  # per request
        for figures in phases[kind].values():
            assert figures["count"] >= 3 and figures["seconds"] >= 0.0
    counters = connector_counters({**_empty_stats(), "phases": phases})
    assert counters["load_transfer_count"] == phases["load"]["transfer"]["count"]
    assert counters["store_confirm_seconds"] == phases["store"]["confirm"]["seconds"]


def _empty_stats() -> dict[str, object]:
    return {"requests": {}, "chunks": {}, "bytes": {}, "backend_errors": {}}
