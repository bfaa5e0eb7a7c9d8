"""The lease budget (aiokv/leases.py): the ledger's arithmetic on a clock of the test's own, and a worker
over a real Mooncake client (loopback master) whose lookups stop asking once the budget is spent and ask
again as their leases run out. Under eviction pressure in a real cluster: tests/cluster/test_leases.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import KVLayout, KVWorker, LeaseBudget, MemoryBackend
from aiokv.backends.base import check_backend
from aiokv.backends.mooncake_master import MooncakeMaster
from aiokv.leases import LeaseLedger

CHUNK_TOKENS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_grants_what_the_budget_has_room_for_and_frees_it_after_the_lease() -> None:
    clock = Clock()
    ledger = LeaseLedger(10, lease_s=2.0, clock=clock)
    assert ledger.reserve(6) == 6
    assert ledger.reserve(6) == 4  # asking lookups hold their chunks too: no overshoot when concurrent
    ledger.settle(6, 6)
    ledger.settle(4, 1)  # only the found chunks stay held
    assert ledger.held() == 7
    assert ledger.reserve(5) == 3
    ledger.settle(3, 3)
    assert ledger.reserve(1) == 0
    clock.now += 2.0  # every lease over
    assert ledger.held() == 0
    assert ledger.reserve(12) == 10
    assert ledger.snapshot()["trimmed_lookups"] == 4
    assert ledger.snapshot()["trimmed_chunks"] == 2 + 2 + 1 + 2


def test_the_budget_bounds_bytes_and_chunks_and_refuses_nonsense() -> None:
    assert LeaseBudget().chunk_limit(chunk_bytes=1000, cache_bytes=64_000) == 64  # the cache by default
    assert LeaseBudget(max_bytes=10_000).chunk_limit(1000, 64_000) == 10
    assert LeaseBudget(max_bytes=10_000, max_chunks=3).chunk_limit(1000, 64_000) == 3
    with pytest.raises(ValueError):
        LeaseBudget(max_bytes=-1)
    with pytest.raises(TypeError):
        LeaseBudget(max_chunks=2.5)  # type: ignore[arg-type]


def test_a_backend_with_a_nonsense_lease_is_refused() -> None:
    backend = MemoryBackend()
    for bad in (-1.0, "10", True, float("inf")):
        backend.read_lease_s = bad  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="read_lease_s"):
            check_backend(backend)


def cache_and_layout(blocks: int = 64) -> tuple[np.ndarray[Any, Any], KVLayout]:
    cache = np.zeros((2, blocks, 4096), dtype=np.uint8)
    layout = KVLayout([int(cache[r].ctypes.data) for r in range(2)], [4096], CHUNK_TOKENS, blocks)
    return cache, layout


def prompt(seed: int, chunks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK_TOKENS).tolist()


@pytest.mark.asyncio
async def test_the_embedded_store_leases_nothing_and_its_lookups_are_never_trimmed() -> None:
    cache, layout = cache_and_layout()
    budget = LeaseBudget(max_chunks=1)
    async with KVWorker(
        layout, MemoryBackend(), namespace="m", chunk_tokens=16, lease_budget=budget
    ) as worker:
        assert (await worker.store(prompt(1, 4), [list(range(4))])).stored == 4
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert worker.stats()["leases"] is None
    del cache


@pytest.mark.asyncio
async def test_lookups_past_the_budget_ask_about_fewer_chunks_until_their_leases_run_out(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., Any]
) -> None:
    lease_s = 1.0
    backend = mooncake_backend_factory(mooncake_master.address, default_kv_lease_ttl=int(lease_s * 1000))
    assert backend.read_lease_s == lease_s
    cache, layout = cache_and_layout()
    tag = f"leases-{time.monotonic_ns()}"
    budget = LeaseBudget(max_chunks=6)
    async with KVWorker(layout, backend, namespace=tag, chunk_tokens=16, lease_budget=budget) as worker:
        for seed, first in ((1, 0), (2, 4)):
            assert (await worker.store(prompt(seed, 4), [list(range(first, first + 4))])).stored == 4
        await asyncio.sleep(lease_s * 1.1)  # whatever the stores' own existence checks counted is over
        started = time.monotonic()
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert await worker.lookup(prompt(2, 4)) == 2 * CHUNK_TOKENS  # 2 of 6 left: asked about 2
        assert await worker.lookup(prompt(2, 4)) == 0  # spent: nothing asked, nothing leased
        leases = worker.stats()["leases"]
        assert time.monotonic() - started < lease_s, "too slow a machine: the leases ran out meanwhile"
        assert leases["held_chunks"] == 6 and leases["max_chunks"] == 6
        assert leases["trimmed_lookups"] == 2 and leases["trimmed_chunks"] == 2 + 4
        # A lookup that is never followed by its load (an aborted request) holds nothing past the lease.
        await asyncio.sleep(lease_s * 1.1)
        assert worker.stats()["leases"]["held_chunks"] == 0
        assert await worker.lookup(prompt(2, 4)) == 4 * CHUNK_TOKENS
    del cache
