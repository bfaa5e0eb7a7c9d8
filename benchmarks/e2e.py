"""End to end through :class:`~aiokv.KVWorker` with real bytes, against direct backend batch calls.

One engine-like paged cache (``regions`` arrays of ``num_blocks`` blocks of ``block_bytes``) holds the
prompt's source blocks and one destination set per concurrent load. For each concurrency level:

* store rounds: fresh prompts are stored through the worker, then removed; the very same keys and
  regions (computed once, before timing) are put by direct ``batch_put`` calls, one per request on
  its own thread, then removed again;
* load rounds: the prompts are stored once, then loaded through the worker and by direct
  ``batch_get`` calls into each request's own destination blocks.

A ticker task measures event-loop lag during every timed run; CPU is the process's CPU time per
request. Bytes are checked once before anything is timed (worker store -> worker load and direct get
reproduce the source blocks), and every timed call's result is checked (all chunks moved).

On the Mooncake backend, the GIL-held time of one request is also bounded, on the exact calls the
worker makes (see :mod:`benchmarks.gil`).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from aiokv import KVWorker
from aiokv._arrays import IntArray
from aiokv.backends.base import Backend
from aiokv.keys import HashedPrompt, KeyNamespace, chunk_hashes
from aiokv.layout import KVLayout
from aiokv.testing.paged_cache import GroupCache, same_blocks

from .geometry import Geometry
from .gil import mooncake_gil_breakdown
from .loop_lag import measure_loop_lag

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
Run = tuple[list[float], float, float]  # one measured run: loop lags (ms), CPU s, wall s

_VOCAB = 128_000


@dataclass(frozen=True, slots=True)
class PathFigures:
    """One path (worker or direct) of one operation at one concurrency, over the timed rounds."""

    wall_best_ms: float
    wall_median_ms: float
    gbps_best: float
    gbps_median: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    lag_samples: int
    cpu_per_request_ms: float


class _Cache:
    """The engine's paged KV cache (one group of ``regions``), with the source block set and one
    destination set per concurrent load."""

    def __init__(self, geometry: Geometry, seed: int) -> None:
        g = geometry
        rng = np.random.default_rng(seed)
        self.blocks = GroupCache.allocate(
            num_regions=g.regions,
            num_blocks=g.num_blocks,
            block_size=g.block_size,
            block_lens=g.block_bytes,
            fill=0,
            dtype="uint8",
        )
        # Only the source set holds data; destination pages are touched by the warm-up round.
        self.blocks.randomize(np.arange(g.prompt_blocks, dtype=np.int64), rng)
        self.layout = self.blocks.layout
        per_chunk = g.blocks_per_chunk

        def block_set(index: int) -> IntArray:
            # A chunk's blocks are physically consecutive (so they coalesce into one region per cache
            # region); chunks lie in random order, as after an allocator has churned for a while.
            slots = rng.permutation(g.chunks).astype(np.int64)
            first = index * g.prompt_blocks + slots * per_chunk
            return (first[:, None] + np.arange(per_chunk, dtype=np.int64)).ravel()

        self.source_ids = block_set(0)
        self.dest_ids = [block_set(1 + i) for i in range(g.concurrency)]

    def same_blocks(self, ids_a: IntArray, ids_b: IntArray) -> bool:
        return same_blocks(self.blocks, ids_a, self.blocks, ids_b)

    def clear(self, ids: IntArray) -> None:
        self.blocks.fill(0, ids)


@dataclass(slots=True)
class _Prepared:
    """One request's keys and regions, computed once, as a direct caller would pass them."""

    tokens: np.ndarray
    keys: list[str]
    calls: list[tuple[list[str], IntArray, IntArray]]  # one (keys, addrs, sizes) per region batch
    expected: list[IntArray]  # bytes per key of each call (what a get answers)


def _prepare(
    layout: KVLayout, prefix: str, tokens: np.ndarray, ids: IntArray, geometry: Geometry
) -> _Prepared:
    keys = [prefix + h for h in chunk_hashes(tokens, geometry.chunk_tokens)]
    matrix = ids.reshape(geometry.chunks, geometry.blocks_per_chunk)
    calls = []
    expected = []
    for batch in layout.regions_for_chunks(matrix):
        calls.append(([keys[i] for i in batch.rows.tolist()], batch.addrs, batch.sizes))
        expected.append(batch.sizes.sum(axis=1))
    return _Prepared(tokens, keys, calls, expected)


def _remove_fn(backend: Backend) -> Callable[[list[str]], object]:
    remove = getattr(backend, "batch_remove", None)
    if not callable(remove):
        raise TypeError(
            f"the e2e benchmark needs {type(backend).__name__}.batch_remove() to reuse keys across rounds"
        )
    # Mooncake holds a read lease for ~10 s after a get; force drops the keys anyway.
    return lambda keys: remove(keys, force=True)


def _summarise(
    runs: list[tuple[list[float], float, float]], concurrency: int, prompt_bytes: int
) -> PathFigures:
    walls = [wall for _, _, wall in runs]
    lags = [lag for run_lags, _, _ in runs for lag in run_lags]  # pooled: a round is only ~100 ticks
    moved = concurrency * prompt_bytes
    best, median = min(walls), statistics.median(walls)
    return PathFigures(
        wall_best_ms=best * 1e3,
        wall_median_ms=median * 1e3,
        gbps_best=moved / best / 1e9,
        gbps_median=moved / median / 1e9,
        lag_p50_ms=float(np.percentile(lags, 50)) if lags else 0.0,
        lag_p99_ms=float(np.percentile(lags, 99)) if lags else 0.0,
        lag_max_ms=max(lags) if lags else 0.0,
        lag_samples=len(lags),
        cpu_per_request_ms=statistics.median(cpu for _, cpu, _ in runs) / concurrency * 1e3,
    )


class _Bench:
    """The scenario's state: the cache, the key namespace, and the threads of the direct path."""

    def __init__(self, backend: Backend, geometry: Geometry, rounds: int, seed: int) -> None:
        self.backend = backend
        self.g = geometry
        self.rounds = rounds
        self.seed = seed
        self.cache = _Cache(geometry, seed)
        self.namespace = KeyNamespace(f"aiokv-bench-{uuid.uuid4().hex[:8]}")  # never meets older runs
        self.prefix = self.namespace.prefix(self.cache.layout.fingerprint, 0)
        self.remove = _remove_fn(backend)
        self.threads = ThreadPoolExecutor(
            max(geometry.concurrency, 1), thread_name_prefix="aiokv-bench-direct"
        )
        self._prompts = 0

    def fresh_prompt(self) -> np.ndarray:
        self._prompts += 1
        rng = np.random.default_rng((self.seed, self._prompts))
        return rng.integers(0, _VOCAB, size=self.g.tokens, dtype=np.int64)

    def prepared(self, ids: IntArray) -> _Prepared:
        return _prepare(self.cache.layout, self.prefix, self.fresh_prompt(), ids, self.g)

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    # -- direct calls ---------------------------------------------------------------------------

    def direct_put(self, request: _Prepared) -> None:
        for keys, addrs, sizes in request.calls:
            codes = self.backend.batch_put(keys, addrs, sizes)
            if len(codes) != len(keys) or min(codes) < 0:
                raise RuntimeError(f"direct batch_put failed: codes {sorted(set(codes))[:5]}")

    def direct_get(self, request: _Prepared) -> None:
        for (keys, addrs, sizes), expected in zip(request.calls, request.expected, strict=True):
            codes = np.asarray(self.backend.batch_get(keys, addrs, sizes), dtype=np.int64)
            if codes.shape != expected.shape or not np.array_equal(codes, expected):
                raise RuntimeError(f"direct batch_get failed: codes {sorted(set(codes.tolist()))[:5]}")

    # -- worker calls ---------------------------------------------------------------------------

    async def worker_store(self, worker: KVWorker, requests: Sequence[_Prepared]) -> None:
        futures = [worker.store(r.tokens, [self.cache.source_ids]) for r in requests]
        for result in await asyncio.gather(*futures):
            if result.stored != self.g.chunks:
                raise RuntimeError(f"worker store wrote {result.stored} of {self.g.chunks} chunks: {result}")

    async def worker_load(self, worker: KVWorker, requests: Sequence[_Prepared]) -> None:
        futures = [
            worker.load(r.tokens, [ids]) for r, ids in zip(requests, self.cache.dest_ids, strict=False)
        ]
        for result in await asyncio.gather(*futures):
            if result.loaded_tokens != self.g.tokens:
                raise RuntimeError(f"worker load got {result.loaded_tokens} of {self.g.tokens} tokens")

    # -- phases ---------------------------------------------------------------------------------

    async def verify(self, worker: KVWorker) -> int:
        """Worker store -> worker load, then direct get: each must reproduce the source blocks."""
        cache, dest = self.cache, self.cache.dest_ids[0]
        request = self.prepared(cache.source_ids)
        await self.worker_store(worker, [request])
        await self.worker_load(worker, [request])
        if not cache.same_blocks(cache.source_ids, dest):
            raise RuntimeError(
                "bytes differ: a worker load after a worker store did not reproduce the source"
            )
        cache.clear(dest)
        direct = _prepare(cache.layout, self.prefix, request.tokens, dest, self.g)
        await self.in_thread(self.direct_get, direct)
        if not cache.same_blocks(cache.source_ids, dest):
            raise RuntimeError("bytes differ: a direct get of the worker's keys did not reproduce the source")
        await self.in_thread(self.remove, request.keys)
        return 2 * self.g.prompt_bytes

    async def stores(self, worker: KVWorker, concurrency: int) -> dict[str, PathFigures]:
        worker_runs: list[Run] = []
        direct_runs: list[Run] = []
        for r in range(self.rounds + 1):
            requests = [self.prepared(self.cache.source_ids) for _ in range(concurrency)]
            keys = [k for req in requests for k in req.keys]

            async def through_worker(requests: list[_Prepared] = requests) -> None:
                await self.worker_store(worker, requests)

            async def direct(requests: list[_Prepared] = requests) -> None:
                await asyncio.gather(*(self.in_thread(self.direct_put, req) for req in requests))

            # Alternate which path goes first, so neither always meets a just-emptied store.
            for path in ("worker", "direct") if r % 2 == 0 else ("direct", "worker"):
                run = await measure_loop_lag(through_worker if path == "worker" else direct)
                await self.in_thread(self.remove, keys)
                if r:  # round 0 warms up pages, allocator and threads
                    (worker_runs if path == "worker" else direct_runs).append(run)
        return {
            "worker": _summarise(worker_runs, concurrency, self.g.prompt_bytes),
            "direct": _summarise(direct_runs, concurrency, self.g.prompt_bytes),
        }

    async def loads(self, worker: KVWorker, concurrency: int) -> dict[str, PathFigures]:
        sources = [self.prepared(self.cache.source_ids) for _ in range(concurrency)]
        await self.worker_store(worker, sources)
        requests = [
            _prepare(self.cache.layout, self.prefix, src.tokens, ids, self.g)
            for src, ids in zip(sources, self.cache.dest_ids, strict=False)
        ]

        async def through_worker() -> None:
            await self.worker_load(worker, requests)

        async def direct() -> None:
            await asyncio.gather(*(self.in_thread(self.direct_get, req) for req in requests))

        worker_runs: list[Run] = []
        direct_runs: list[Run] = []
        for r in range(self.rounds + 1):
            for path in ("worker", "direct") if r % 2 == 0 else ("direct", "worker"):
                run = await measure_loop_lag(through_worker if path == "worker" else direct)
                if r:
                    (worker_runs if path == "worker" else direct_runs).append(run)
        await self.in_thread(self.remove, [k for req in sources for k in req.keys])
        return {
            "worker": _summarise(worker_runs, concurrency, self.g.prompt_bytes),
            "direct": _summarise(direct_runs, concurrency, self.g.prompt_bytes),
        }


async def _run(
    backend: Backend,
    geometry: Geometry,
    rounds: int,
    progress: Progress,
    seed: int,
    worker_options: dict[str, Any],
) -> dict[str, Any]:
    started = time.perf_counter()
    bench = _Bench(backend, geometry, rounds, seed)
    g = geometry
    levels = sorted({1, g.concurrency})
    results: dict[str, Any] = {
        "geometry": {**asdict(g), "chunks": g.chunks, "prompt_bytes": g.prompt_bytes,
                     "cache_bytes": g.cache_bytes, "store_bytes": g.store_bytes,
                     "working_set_bytes": g.working_set_bytes},
        "rounds": rounds,
        "worker_options": dict(worker_options),
        "levels": [],
    }  # fmt: skip
    progress(f"e2e: cache of {g.cache_bytes / 1e6:,.1f} MB ready in {time.perf_counter() - started:.1f} s")
    try:
        async with KVWorker(
            bench.cache.layout,
            backend,
            namespace=bench.namespace,
            chunk_tokens=g.chunk_tokens,
            **worker_options,
        ) as worker:
            results["max_regions_per_call"] = worker.max_regions_per_call
            results["verified_bytes"] = await bench.verify(worker)
            progress(f"e2e: bytes verified ({results['verified_bytes'] / 1e6:,.1f} MB compared)")
            for concurrency in levels:
                for op, phase in (("store", bench.stores), ("load", bench.loads)):
                    progress(f"e2e: {op} x{concurrency}, {rounds} rounds + 1 warm-up, worker and direct")
                    figures = await phase(worker, concurrency)
                    w, d = figures["worker"], figures["direct"]
                    results["levels"].append(
                        {
                            "op": op,
                            "concurrency": concurrency,
                            "worker": asdict(w),
                            "direct": asdict(d),
                            "ratio_best": w.gbps_best / d.gbps_best,
                            "ratio_median": w.gbps_median / d.gbps_median,
                        }
                    )
        results["gil"] = None
        if type(backend).__name__ == "MooncakeBackend":
            progress("e2e: GIL-held time of one request on the Mooncake path")
            request = bench.prepared(bench.cache.source_ids)
            results["gil"], written = await mooncake_gil_breakdown(
                backend,
                bench.cache.layout,
                HashedPrompt.from_tokens(request.tokens, g.chunk_tokens),
                bench.cache.source_ids,
                namespace=bench.namespace,
                worker_options=worker_options,
                repeats=max(3, rounds),
            )
            await bench.in_thread(bench.remove, written)
    finally:
        bench.threads.shutdown(wait=True)
    results["seconds"] = time.perf_counter() - started
    return results


def run_e2e_benchmark(
    backend: Backend,
    geometry: Geometry,
    *,
    rounds: int = 5,
    progress: Progress | None = None,
    seed: int = 0,
    worker_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the end-to-end comparison on ``backend`` (which must offer ``batch_remove``).

    Returns ``geometry``, ``verified_bytes``, ``max_regions_per_call``, ``levels`` (per operation and
    concurrency: worker and direct :class:`PathFigures` as dicts and the worker/direct throughput
    ratios) and ``gil`` (Mooncake only, see :func:`mooncake_gil_breakdown`). ``worker_options`` go
    to :class:`~aiokv.KVWorker` (e.g. ``max_regions_per_call``).
    """
    from aiokv.runner import run

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if geometry.chunks < 1:
        raise ValueError(f"{geometry.tokens} tokens hold no whole chunk of {geometry.chunk_tokens}")
    return run(_run(backend, geometry, rounds, progress or (lambda _: None), seed, worker_options or {}))
