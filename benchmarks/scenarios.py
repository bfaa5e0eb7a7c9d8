"""Scenarios the old-vs-new runner (``benchmarks/compare.py``) measures, each on one revision's ``aiokv``.

Self-contained on purpose: this file is run as a script with ``PYTHONPATH`` pointing at an older
checkout, so it imports only aiokv's public API as commit 6b4e374 already had it, the stdlib and numpy.

``python benchmarks/scenarios.py NAME [NAME ...]`` prints one JSON object: per scenario, its figures.

* ``seed``: the long-prompt store scenario. Four concurrent 289K-token stores, 128-token blocks, one block per
  chunk, 96 cache regions of 16 KiB blocks; a backend whose every batch call releases the GIL for 1 ms
  and remembers what it stored, declaring no ``max_regions_per_call`` (so the worker splits calls at its
  default). A 0.5 ms ticker measures loop lag. Once with token ids in, once with engine block hashes in
  (``HashedPrompt.from_block_hashes`` inside the measured part), plus the chained SHA-256 floor of
  the same blocks.
* ``embedded``: four concurrent stores then loads of 16K-token prompts on the embedded backend
  (``MemoryBackend``), 8 regions of 16 KiB blocks: CPU per request and per byte, GB/s, loop lag.
* ``throughput``: small requests served continuously: concurrent callers each store a
  1,024-token prompt (4 chunks of 256 tokens, 2 regions of 1 KiB blocks) on the embedded backend, then
  load it into other blocks, again and again; requests (stores and loads) per second of wall and per
  second of process CPU.
* ``tiny``: the seed's shape at 2K tokens and 4 regions, one round (a smoke run of the runner).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

import aiokv

Figures = dict[str, float]

SEED_TOKENS = 295_936  # 289K: 2,312 blocks of 128 tokens
SEED_BLOCK = 128
SEED_REGIONS = 96
SEED_BLOCK_BYTES = 16 * 1024
SEED_CONCURRENCY = 4
TICK_S = 0.0005


class SleepingBackend:
    """Every batch call sleeps ``call_s`` (GIL released) and counts itself; puts are remembered, so the
    worker's read-back confirmation sees them. No ``max_regions_per_call``: the worker's default rules.
    ``cpu_s``: the CPU its own calls spent (remembering and checking keys), which is not the
    framework's: process CPU less this is."""

    def __init__(self, call_s: float = 0.001) -> None:
        self.call_s = call_s
        self._lock = threading.Lock()
        self._stored: set[str] = set()
        self.exists_calls = 0
        self.put_calls = 0
        self.get_calls = 0
        self.cpu_s = 0.0

    def register_buffer(self, addr: int, size: int) -> None:
        return None

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        time.sleep(self.call_s)
        start = time.thread_time()
        with self._lock:
            self.exists_calls += 1
            answer = [key in self._stored for key in keys]
            self.cpu_s += time.thread_time() - start
        return answer

    def batch_put(self, keys: Sequence[str], addrs: Any, sizes: Any) -> list[int]:
        time.sleep(self.call_s)
        start = time.thread_time()
        with self._lock:
            self.put_calls += 1
            self._stored.update(keys)
            self.cpu_s += time.thread_time() - start
        return [0] * len(keys)

    def batch_get(self, keys: Sequence[str], addrs: Any, sizes: Any) -> list[int]:
        time.sleep(self.call_s)
        with self._lock:
            self.get_calls += 1
        return [0] * len(keys)

    def close(self) -> None:
        return None


async def _ticker(stop: asyncio.Event, lags: list[float], busy: list[float]) -> None:
    """Wake every TICK_S; record how late each wake was and the loop thread's CPU meanwhile (ms)."""
    while not stop.is_set():
        started, cpu = time.perf_counter(), time.thread_time()
        await asyncio.sleep(TICK_S)
        lags.append((time.perf_counter() - started - TICK_S) * 1e3)
        busy.append((time.thread_time() - cpu) * 1e3)


async def measured(run: Callable[[], Awaitable[None]]) -> tuple[list[float], list[float], float, float]:
    """Run ``run()`` beside the ticker: (lags ms, loop busy per tick ms, process CPU s, wall s).

    The bench's ``measure_loop_lag`` does the same; this file cannot import it, as it runs on
    revisions whose bench differs (or that lack it), and must measure the same way on all of them."""
    lags: list[float] = []
    busy: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(stop, lags, busy))
    await asyncio.sleep(0.005)
    lags.clear()
    busy.clear()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    stop.set()
    await ticker
    return lags, busy, cpu, wall


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _lag_figures(prefix: str, lags: list[float], busy: list[float]) -> Figures:
    return {
        f"{prefix}lag_p50_ms": _percentile(lags, 50),
        f"{prefix}lag_p99_ms": _percentile(lags, 99),
        f"{prefix}lag_max_ms": max(lags, default=0.0),
        f"{prefix}busy_p99_ms": _percentile(busy, 99),
    }


def _address_layout(regions: int, block_bytes: int, block_size: int, num_blocks: int) -> aiokv.KVLayout:
    # Addresses only: the sleeping backend never touches memory.
    span = block_bytes * num_blocks
    return aiokv.KVLayout(
        [(1 << 32) + i * span for i in range(regions)], [block_bytes], block_size, num_blocks
    )


def chained_sha256_floor_s(block_hashes: Sequence[bytes]) -> float:
    """CPU of the least any chained key derivation costs: one SHA-256 per block over (previous, block)."""
    start = time.process_time()
    previous = b"\0" * 32
    for value in block_hashes:
        previous = hashlib.sha256(previous + value).digest()
    return time.process_time() - start


async def seed(rounds: int = 6) -> Figures:
    return await sleeping_stores(SEED_TOKENS, SEED_REGIONS, rounds)


async def tiny() -> Figures:
    """The seed's shape at a tiny size (a smoke run of the runner, not a measurement)."""
    return await sleeping_stores(16 * SEED_BLOCK, 4, 1)


async def sleeping_stores(tokens: int, regions: int, rounds: int) -> Figures:
    blocks = tokens // SEED_BLOCK
    layout = _address_layout(regions, SEED_BLOCK_BYTES, SEED_BLOCK, blocks + 8)
    rng = np.random.default_rng(0)
    block_ids = [rng.permutation(blocks + 8)[:blocks] for _ in range(SEED_CONCURRENCY)]
    out: Figures = {}
    for tokens_as in ("tokens", "hashes"):
        backend = SleepingBackend()
        rows: list[tuple[list[float], list[float], float, float]] = []
        backend_cpu: list[float] = []
        calls = (0, 0)
        async with aiokv.KVWorker(layout, backend, namespace="seed", chunk_tokens=SEED_BLOCK) as worker:
            for r in range(rounds + 1):  # round 0 warms up threads and caches
                prompt_rng = np.random.default_rng((r, 7))
                prompts = [
                    prompt_rng.integers(0, 128_000, size=tokens, dtype=np.int64)
                    for _ in range(SEED_CONCURRENCY)
                ]
                engine_hashes = [
                    [bytes(row) for row in prompt_rng.integers(0, 256, size=(blocks, 32), dtype=np.uint8)]
                    for _ in range(SEED_CONCURRENCY)
                ]
                before = (backend.exists_calls, backend.put_calls)
                backend_cpu_before = backend.cpu_s

                async def run(
                    prompts: list[Any] = prompts,
                    hashes: list[Any] = engine_hashes,
                    tokens_as: str = tokens_as,
                ) -> None:
                    futures = []
                    for index, ids in enumerate(block_ids):
                        if tokens_as == "tokens":
                            futures.append(worker.store(prompts[index], [ids]))
                        else:  # the engine hashes each request as it submits it
                            hashed = aiokv.HashedPrompt.from_block_hashes(
                                hashes[index], SEED_BLOCK, SEED_BLOCK
                            )
                            futures.append(worker.store(hashed, [ids]))
                            await asyncio.sleep(0)
                    for result in await asyncio.gather(*futures):
                        if result.stored != blocks:
                            raise RuntimeError(f"seed store wrote {result.stored} of {blocks} chunks")

                row = await measured(run)
                if r:
                    rows.append(row)
                    backend_cpu.append(backend.cpu_s - backend_cpu_before)
                    calls = (backend.exists_calls - before[0], backend.put_calls - before[1])
                else:
                    floor = min(chained_sha256_floor_s(h) for h in engine_hashes)
        prefix = f"{tokens_as}_"
        out.update(
            _lag_figures(prefix, [x for row in rows for x in row[0]], [x for row in rows for x in row[1]])
        )
        out[f"{prefix}cpu_per_request_ms"] = (
            float(np.median([row[2] for row in rows])) / SEED_CONCURRENCY * 1e3
        )
        out[f"{prefix}backend_cpu_per_request_ms"] = float(np.median(backend_cpu)) / SEED_CONCURRENCY * 1e3
        framework_cpu = float(np.median([row[2] - b for row, b in zip(rows, backend_cpu, strict=True)]))
        out[f"{prefix}framework_cpu_per_request_ms"] = framework_cpu / SEED_CONCURRENCY * 1e3
        out[f"{prefix}wall_ms"] = float(np.median([row[3] for row in rows])) * 1e3
        out[f"{prefix}exists_calls"] = float(calls[0])
        out[f"{prefix}put_calls"] = float(calls[1])
    start = time.process_time()
    aiokv.HashedPrompt.from_block_hashes(engine_hashes[0], SEED_BLOCK, SEED_BLOCK)
    out["hashing_ms"] = (time.process_time() - start) * 1e3
    out["sha256_floor_ms"] = floor * 1e3
    out["hashing_over_floor"] = out["hashing_ms"] / out["sha256_floor_ms"]
    return out


async def embedded(rounds: int = 3) -> Figures:
    """Four concurrent 16K-token stores, then loads of them into other blocks, on the embedded backend;
    8 regions of 16 KiB blocks (128 tokens), one block per chunk."""
    tokens, regions, concurrency = 16_384, 8, 4
    blocks = tokens // SEED_BLOCK
    total_blocks = 2 * concurrency * blocks
    caches = [np.zeros((total_blocks, SEED_BLOCK_BYTES), dtype=np.uint8) for _ in range(regions)]
    for cache in caches:
        cache[:] = np.random.default_rng(1).integers(0, 256, size=SEED_BLOCK_BYTES, dtype=np.uint8)
    layout = aiokv.KVLayout([c.ctypes.data for c in caches], [SEED_BLOCK_BYTES], SEED_BLOCK, total_blocks)
    ids = np.random.default_rng(0).permutation(total_blocks).reshape(2 * concurrency, blocks)
    moved = concurrency * blocks * regions * SEED_BLOCK_BYTES
    out: Figures = {}
    rows: dict[str, list[tuple[list[float], list[float], float, float]]] = {"store": [], "load": []}
    backend = aiokv.MemoryBackend()
    try:
        async with aiokv.KVWorker(layout, backend, namespace="embedded", chunk_tokens=SEED_BLOCK) as worker:
            for r in range(rounds + 1):
                rng = np.random.default_rng((r, 11))
                prompts = [rng.integers(0, 128_000, size=tokens, dtype=np.int64) for _ in range(concurrency)]

                async def store(prompts: list[Any] = prompts) -> None:
                    done = await asyncio.gather(*(worker.store(p, [ids[i]]) for i, p in enumerate(prompts)))
                    if any(result.stored != blocks for result in done):
                        raise RuntimeError("embedded store did not write every chunk")

                async def load(prompts: list[Any] = prompts) -> None:
                    futures = (worker.load(p, [ids[concurrency + i]]) for i, p in enumerate(prompts))
                    done = await asyncio.gather(*futures)
                    if any(result.loaded_tokens != tokens for result in done):
                        raise RuntimeError("embedded load did not read every chunk")

                for op, run in (("store", store), ("load", load)):
                    row = await measured(run)
                    if r:
                        rows[op].append(row)
    finally:
        backend.close()
    for op, measured_rows in rows.items():
        cpu = float(np.median([row[2] for row in measured_rows]))
        wall = float(np.median([row[3] for row in measured_rows]))
        out[f"{op}_cpu_per_request_ms"] = cpu / concurrency * 1e3
        out[f"{op}_cpu_ns_per_byte"] = cpu / moved * 1e9
        out[f"{op}_wall_ms"] = wall * 1e3
        out[f"{op}_gbps"] = moved / wall / 1e9
        out.update(_lag_figures(f"{op}_", [x for row in measured_rows for x in row[0]], []))
    return out


async def throughput(pairs: int = 3000, callers: int = 64, rounds: int = 3) -> Figures:
    """``callers`` tasks share ``pairs`` store-then-load pairs of distinct 1,024-token prompts per round,
    each caller with its own blocks; one warm-up round of a tenth as many."""
    tokens, chunk, regions, block_bytes = 1024, 256, 2, 1024
    chunks = tokens // chunk
    caches = [np.zeros((2 * chunks * callers, block_bytes), dtype=np.uint8) for _ in range(regions)]
    layout = aiokv.KVLayout([c.ctypes.data for c in caches], [block_bytes], chunk, 2 * chunks * callers)
    blocks = np.arange(2 * chunks * callers).reshape(callers, 2, chunks)
    rows: list[tuple[list[float], list[float], float, float]] = []
    backend = aiokv.MemoryBackend()
    try:
        async with aiokv.KVWorker(layout, backend, namespace="throughput", chunk_tokens=chunk) as worker:

            async def caller(index: int, prompts: Any) -> None:
                store_ids, load_ids = blocks[index]
                for prompt in prompts[index::callers]:
                    if (await worker.store(prompt, [store_ids])).stored != chunks:
                        raise RuntimeError("a throughput store did not write every chunk")
                    if (await worker.load(prompt, [load_ids])).loaded_tokens != tokens:
                        raise RuntimeError("a throughput load did not read every chunk")

            for r in range(rounds + 1):
                count = pairs if r else max(callers, pairs // 10)
                prompts = np.random.default_rng((r, 13)).integers(0, 128_000, size=(count, tokens))

                async def run(prompts: Any = prompts) -> None:
                    await asyncio.gather(*(caller(i, prompts) for i in range(callers)))

                row = await measured(run)
                if r:
                    rows.append(row)
    finally:
        backend.close()
    requests = 2 * pairs
    cpu = float(np.median([row[2] for row in rows]))
    wall = float(np.median([row[3] for row in rows]))
    out: Figures = {
        "requests_per_s": requests / wall,
        "stores_per_s": pairs / wall,
        "requests_per_cpu_s": requests / cpu,
        "cpu_per_request_us": cpu / requests * 1e6,
    }
    out.update(_lag_figures("", [x for row in rows for x in row[0]], [x for row in rows for x in row[1]]))
    return out


SCENARIOS: dict[str, Callable[[], Awaitable[Figures]]] = {
    "seed": seed,
    "embedded": embedded,
    "throughput": throughput,
    "tiny": tiny,
}


async def _main(names: list[str]) -> dict[str, Figures]:
    return {name: await SCENARIOS[name]() for name in names}


def main(argv: list[str]) -> int:
    names = argv or ["seed"]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        sys.stderr.write(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}\n")
        return 2
    figures = asyncio.run(_main(names))
    sys.stdout.write(json.dumps({"aiokv": aiokv.__file__, "figures": figures}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
