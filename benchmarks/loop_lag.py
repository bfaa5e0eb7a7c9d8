"""Event-loop lag and framework CPU of concurrent long-prompt stores: aiokv versus a thread per request.

The backend sleeps in every call (releasing the GIL, like a real transfer), so what is measured is the
framework: hashing, keys, bookkeeping, ``prepare_values``. A ticker task asks the loop to wake every
millisecond and records how late it wakes while the stores run.

* ``aiokv``: four ``KVWorker.store`` calls submitted at once on the loop.
* ``baseline``: one thread per request that hashes, checks existence, calls the list-returning
  ``prepare_values`` and puts, while the loop only waits.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from aiokv import KVWorker
from aiokv.backends.base import Regions
from aiokv.keys import HashedPrompt, KeyNamespace, chunk_hashes
from aiokv.layout import KVLayout

from .reference import writeup_prepare_values


class SleepingBackend:
    """Stores no bytes; every batch call sleeps ``call_s`` plus ``region_s`` per region, GIL released.

    A key put is present afterwards (the worker confirms its puts with ``batch_exists``); prompts are
    fresh every round, so every store still moves every chunk.
    """

    # Nothing is converted while holding the GIL, so there is no reason to split calls.
    max_regions_per_call = 1 << 20

    def __init__(self, *, call_s: float = 0.001, region_s: float = 2e-9) -> None:
        self.call_s = call_s
        self.region_s = region_s
        self._lock = threading.Lock()
        self.calls = 0
        self.regions = 0
        self._put: set[str] = set()

    def register_buffer(self, addr: int, size: int) -> None:
        return None

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        time.sleep(self.call_s)
        with self._lock:
            return [key in self._put for key in keys]

    def _transfer(self, keys: Sequence[str], addrs: Regions) -> list[int]:
        regions = sum(len(row) for row in addrs) if isinstance(addrs, list) else int(np.size(addrs))
        with self._lock:
            self.calls += 1
            self.regions += regions
        time.sleep(self.call_s + regions * self.region_s)
        return [0] * len(keys)

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        codes = self._transfer(keys, addrs)
        with self._lock:
            self._put.update(keys)
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._transfer(keys, addrs)

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class LagFigures:
    design: str
    tokens_as: str
    concurrency: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    cpu_per_request_ms: float
    wall_ms: float


def _layout(regions: int, block_size: int, num_blocks: int) -> KVLayout:
    # Addresses only: the sleeping backend never touches memory.
    block_len = 16 * 1024
    span = block_len * num_blocks
    return KVLayout([(1 << 32) + i * span for i in range(regions)], [block_len], block_size, num_blocks)


def _core_wait_clock() -> tuple[Callable[[], float], Callable[[], None]] | None:
    """A clock of how long the calling thread has waited for a core (ms; Linux's schedstat run-queue
    time) and its closer, or None where the kernel does not say."""
    try:
        stat = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115 (closed by the caller)
    except OSError:
        return None

    def waited_ms() -> float:
        stat.seek(0)
        return int(stat.read().split()[1]) / 1e6

    return waited_ms, stat.close


async def tick(
    stop: asyncio.Event,
    lags: list[float],
    busy: list[float] | None = None,
    core_waits: list[float] | None = None,
    *,
    tick_s: float = 0.001,
) -> None:
    """Until ``stop``: wake every ``tick_s`` and append how late each wake was (loop lag, ms) to ``lags``,
    to ``busy`` the CPU the loop's own thread used meanwhile (ms): what the loop ran, excluding the
    time it waited for the GIL or for a core, so it stays meaningful on a loaded machine; and to
    ``core_waits`` the time it waited for a core meanwhile (ms; Linux only, else nothing is added).
    A lag is roughly busy + core wait + GIL wait."""
    clock = _core_wait_clock() if core_waits is not None else None
    try:
        while not stop.is_set():
            started, cpu = time.perf_counter(), time.thread_time()
            waited = clock[0]() if clock is not None else 0.0
            await asyncio.sleep(tick_s)
            lags.append((time.perf_counter() - started - tick_s) * 1e3)
            if busy is not None:
                busy.append((time.thread_time() - cpu) * 1e3)
            if clock is not None and core_waits is not None:
                core_waits.append(clock[0]() - waited)
    finally:
        if clock is not None:
            clock[1]()


async def measure_loop_lag(
    run: Callable[[], Awaitable[None]],
    *,
    tick_s: float = 0.001,
    busy: list[float] | None = None,
    core_waits: list[float] | None = None,
) -> tuple[list[float], float, float]:
    """Run ``run()`` while a ticker records loop lag; returns (lags in ms, CPU s, wall s). ``busy`` and
    ``core_waits``, when given, receive the loop thread's CPU and core waits per tick (:func:`tick`)."""
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(tick(stop, lags, busy, core_waits, tick_s=tick_s))
    await asyncio.sleep(0.01)  # ticker running before the work starts
    for figures in (lags, busy, core_waits):
        if figures is not None:
            figures.clear()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    stop.set()
    await ticker
    return lags, cpu, wall


def _summarise(
    design: str, tokens_as: str, concurrency: int, rounds: list[tuple[list[float], float, float]]
) -> LagFigures:
    p99s = [float(np.percentile(lags, 99)) for lags, _, _ in rounds if lags]
    p50s = [float(np.percentile(lags, 50)) for lags, _, _ in rounds if lags]
    return LagFigures(
        design=design,
        tokens_as=tokens_as,
        concurrency=concurrency,
        lag_p50_ms=statistics.median(p50s),
        lag_p99_ms=statistics.median(p99s),
        lag_max_ms=max(max(lags) for lags, _, _ in rounds if lags),
        cpu_per_request_ms=statistics.median(cpu for _, cpu, _ in rounds) / concurrency * 1e3,
        wall_ms=statistics.median(wall for _, _, wall in rounds) * 1e3,
    )


async def _bench(
    *, tokens: int, block_size: int, regions: int, chunk_tokens: int, concurrency: int, rounds: int
) -> list[LagFigures]:
    blocks = tokens // block_size
    layout = _layout(regions, block_size, num_blocks=blocks + 8)
    rng = np.random.default_rng(0)
    block_ids = [rng.permutation(blocks + 8)[:blocks] for _ in range(concurrency)]
    namespace = KeyNamespace("bench")
    prefix = namespace.prefix(layout.fingerprint, 0)
    results = []

    def prompts(round_index: int) -> list[np.ndarray]:
        # Fresh prompts per round: nothing is ever deduplicated.
        return [
            np.random.default_rng((round_index, i)).integers(0, 128_000, size=tokens, dtype=np.int64)
            for i in range(concurrency)
        ]

    # "HashedPrompt": hashed before the clock starts, as an engine that hashes once per request and
    # reuses it for lookup, load and store; what remains is keys, bookkeeping and prepare.
    for tokens_as in ("int64 array", "list", "HashedPrompt"):
        backend = SleepingBackend()
        collected = []
        async with KVWorker(layout, backend, namespace=namespace, chunk_tokens=chunk_tokens) as worker:
            for r in range(rounds + 1):
                batch = prompts(r)
                inputs: list[Any]
                if tokens_as == "int64 array":
                    inputs = list(batch)
                elif tokens_as == "list":
                    inputs = [p.tolist() for p in batch]
                else:
                    inputs = [HashedPrompt.from_tokens(p, chunk_tokens) for p in batch]

                async def run_aiokv(inputs: list[Any] = inputs) -> None:
                    futures = [worker.store(p, [ids]) for p, ids in zip(inputs, block_ids, strict=True)]
                    for result in await asyncio.gather(*futures):
                        if result.stored != tokens // chunk_tokens:
                            raise RuntimeError(f"benchmark store wrote {result.stored} chunks")

                measured = await measure_loop_lag(run_aiokv)
                if r:  # the first round warms up caches and the executor's threads
                    collected.append(measured)
        results.append(_summarise("aiokv", tokens_as, concurrency, collected))

    backend = SleepingBackend()
    loop = asyncio.get_running_loop()

    def writeup_request(prompt: list[int], ids: list[int]) -> None:
        keys = [prefix + h for h in chunk_hashes(prompt, chunk_tokens)]
        present = backend.batch_exists(keys)
        chunks = [(i * chunk_tokens, (i + 1) * chunk_tokens) for i, p in enumerate(present) if not p]
        addrs, sizes, _ = writeup_prepare_values(layout, chunks, ids)
        backend.batch_put([k for k, p in zip(keys, present, strict=True) if not p], addrs, sizes)

    collected = []
    for r in range(rounds + 1):
        lists = [p.tolist() for p in prompts(r)]
        id_lists = [ids.tolist() for ids in block_ids]

        async def run_writeup(lists: list[list[int]] = lists, id_lists: list[list[int]] = id_lists) -> None:
            threads = [
                loop.run_in_executor(None, writeup_request, p, ids)
                for p, ids in zip(lists, id_lists, strict=True)
            ]
            await asyncio.gather(*threads)

        measured = await measure_loop_lag(run_writeup)
        if r:
            collected.append(measured)
    results.append(_summarise("baseline (thread per request)", "list", concurrency, collected))
    return results


def run_loop_lag_benchmark(
    *,
    tokens: int = 289 * 1024,
    block_size: int = 128,
    regions: int = 96,
    chunk_tokens: int = 128,
    concurrency: int = 4,
    rounds: int = 5,
) -> list[dict[str, Any]]:
    """Figures per design, as plain dicts (see :class:`LagFigures`)."""
    from aiokv.runner import run

    figures = run(
        _bench(
            tokens=tokens,
            block_size=block_size,
            regions=regions,
            chunk_tokens=chunk_tokens,
            concurrency=concurrency,
            rounds=rounds,
        )
    )
    return [asdict(f) for f in figures]
