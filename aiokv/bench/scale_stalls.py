"""Event-loop stalls at scale (issue 10, item 10): how long the loop is blocked while the worker
finishes very many requests at once, or handles one prompt of very many keys, and how late a small
lookup submitted meanwhile answers.

A ticker task asks the loop to wake every millisecond and records how late each wake-up is; the
maximum is the longest stall. Real bytes move through the embedded :class:`MemoryBackend`.

* ``many_requests``: ``requests`` one-chunk stores submitted at once, awaited together (each with its
  own ``await``, and with one ``asyncio.gather``).
* ``long_prompt``: one store of a ``prompt_tokens``-token prompt at ``chunk_tokens`` tokens per chunk
  (one key per chunk), with a small lookup submitted while it runs; the lookup's latency is reported.

Goal (the issue's aim): max lag <= 10 ms in both, the lookup unaffected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..backends.memory import MemoryBackend
from ..layout import KVLayout
from ..worker import KVWorker

TICK_S = 0.001
GOAL_MAX_LAG_MS = 10.0


@dataclass(frozen=True)
class StallFigures:
    case: str
    max_lag_ms: float
    p99_lag_ms: float
    wall_ms: float
    lookup_ms: float | None = None


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + TICK_S
        await asyncio.sleep(TICK_S)
        lags.append(max(0.0, loop.time() - due))


async def _with_ticker(case: str, work: Callable[[], Awaitable[float | None]]) -> StallFigures:
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(lags, stop))
    started = time.perf_counter()
    lookup_s = await work()
    wall = time.perf_counter() - started
    stop.set()
    await ticker
    values = np.asarray(lags or [0.0]) * 1000
    return StallFigures(
        case=case,
        max_lag_ms=float(values.max()),
        p99_lag_ms=float(np.percentile(values, 99)),
        wall_ms=wall * 1000,
        lookup_ms=None if lookup_s is None else lookup_s * 1000,
    )


def _cache(num_blocks: int, block_bytes: int) -> tuple[np.ndarray, KVLayout]:
    region = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
    return region, KVLayout([int(region.ctypes.data)], [block_bytes], 16, num_blocks)


async def _many_requests(requests: int, gather: bool) -> StallFigures:
    region, layout = _cache(num_blocks=requests, block_bytes=64)
    backend = MemoryBackend(capacity_bytes=max(1 << 20, requests * 64 * 2))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 50_000, size=(requests, 16), dtype=np.int64)
    async with KVWorker(layout, backend, namespace="stall-many", chunk_tokens=16) as worker:
        # Submitted before measuring: the caller's own loop of 10,000 calls is not the worker's stall.
        futures = [worker.store(prompts[i], [[i]]) for i in range(requests)]

        async def work() -> None:
            if gather:
                await asyncio.gather(*futures)
            else:
                for future in futures:
                    await future

        figures = await _with_ticker(f"{requests} requests ({'gather' if gather else 'await each'})", work)
    del region
    return figures


async def _long_prompt(prompt_tokens: int, chunk_tokens: int) -> StallFigures:
    chunks = prompt_tokens // chunk_tokens
    region, layout = _cache(num_blocks=chunks + 1, block_bytes=32)
    backend = MemoryBackend(capacity_bytes=max(1 << 20, chunks * 32 * 2))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, size=chunks * chunk_tokens, dtype=np.int64)
    small = rng.integers(0, 50_000, size=4 * chunk_tokens, dtype=np.int64)
    async with KVWorker(layout, backend, namespace="stall-long", chunk_tokens=chunk_tokens) as worker:
        await worker.store(small, [np.arange(4)])

        async def work() -> float:
            store = worker.store(tokens, [np.arange(chunks)])
            await asyncio.sleep(0.005)  # the store is being processed when the lookup arrives
            started = time.perf_counter()
            await worker.lookup(small)
            lookup_s = time.perf_counter() - started
            await store
            return lookup_s

        figures = await _with_ticker(f"{prompt_tokens:,}-token prompt at chunk_tokens={chunk_tokens}", work)
    del region
    return figures


def run_scale_stall_benchmark(
    *,
    requests: int = 10_000,
    prompt_tokens: int = 1_000_000,
    chunk_tokens: int = 16,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> dict[str, Any]:
    """The figures of item 10, as plain data: one entry per case, with the goal and whether it is met."""

    async def main() -> list[StallFigures]:
        return [
            await _many_requests(requests, gather=False),
            await _many_requests(requests, gather=True),
            await _long_prompt(prompt_tokens, chunk_tokens),
        ]

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        figures = runner.run(main())
    return {
        "goal_max_lag_ms": GOAL_MAX_LAG_MS,
        "cases": [{**asdict(f), "meets_goal": f.max_lag_ms <= GOAL_MAX_LAG_MS} for f in figures],
    }
