"""Event-loop stalls at scale, through the worker with real bytes on the embedded
backend, against baselines measured in the same run.

Two workloads:

* ``many requests``: ``requests`` one-chunk stores submitted as an engine does (a few at a time, the
  loop free in between), then awaited: one batch of thousands of requests to build, move and settle;
* ``long prompt``: one store of ``prompt_tokens`` tokens at ``chunk_tokens`` (1,000,000 tokens at 16 is
  62,500 keys): per-key work inside one request.

While each runs, a ticker asks the loop to wake every millisecond and records how late it wakes (loop
lag) and how much CPU the loop's own thread used since the last tick (loop busy: what the loop ran,
excluding time it waited for the GIL or for a core, so it stays meaningful on a loaded machine), and a
prober issues a one-chunk ``lookup`` of a stored prompt again and again and records its latency.
Objects that exist before a run are frozen out of the garbage collector (``gc.freeze``) while it
runs; collections of what the run creates count, and the CPU time of the longest is reported (the
collecting thread's: a GC callback may wait for the GIL, which wall time would count).

Baselines, same run, same ticker and prober:

* ``idle``: nothing else runs (the machine's noise floor);
* ``direct``: the same keys and regions moved by direct ``batch_exists`` / ``batch_put`` calls on a
  thread, split as the worker splits them: the backend's own cost, with none of the worker's
  bookkeeping on the loop.

Before both, the garbage collector's share (:mod:`.scale_gc`): the objects it tracks per request in
flight and the CPU of one full collection of them. The stalls the worker had before its loop work was
sliced are :data:`SEED_FIGURES`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aiokv import KVWorker
from aiokv._arrays import IntArray
from aiokv.backends.base import keys_per_call
from aiokv.backends.memory import MemoryBackend
from aiokv.keys import HashedPrompt, KeyNamespace
from aiokv.testing.paged_cache import GroupCache

from .loop_lag import tick
from .report import suite_main, table
from .scale_gc import CollectorFigures, collector_figures

# The stalls before the worker sliced its loop work (kept for comparison, not rerun): max loop lag and
# lookup latency, ms.
SEED_FIGURES: dict[str, dict[str, float | None]] = {
    "many requests": {"lag_max_ms": 625.0, "lookup_max_ms": None},  # 10,000 requests
    "long prompt": {"lag_max_ms": 54.0, "lookup_max_ms": 69.0},  # 62,500 keys
}
GOAL_LAG_MAX_MS = 10.0
GOAL_CPU_PER_REQUEST_US = 100.0  # the worker's process CPU per small request
SUBMIT_SLICE = 32  # stores an engine submits between two turns of its loop
BLOCK_BYTES = 64  # real bytes per block: the workload is bookkeeping, not copying


@dataclass(frozen=True)
class ScaleFigures:
    workload: str
    path: str  # "worker", "direct" or "idle"
    lag_p99_ms: float
    lag_max_ms: float
    busy_max_ms: float  # most CPU the loop's thread used between two ticks
    gc_max_ms: float  # CPU of the longest garbage collection meanwhile (on whichever thread allocates)
    lookup_p50_ms: float
    lookup_p99_ms: float
    lookup_max_ms: float
    lookups: int
    wall_ms: float
    cpu_ms: float  # process CPU of the run (median of rounds): the ticker's and prober's too


class _Probe:
    """Loop lag and loop-thread CPU per tick, and lookup latencies, while something runs."""

    def __init__(self, worker: KVWorker, prompt: HashedPrompt, tick_s: float = 0.001) -> None:
        self._worker, self._prompt, self._tick_s = worker, prompt, tick_s
        self.lags: list[float] = []
        self.busy: list[float] = []
        self.lookups: list[float] = []
        self.gc_pauses: list[float] = [0.0]
        self._gc_started: dict[int, float] = {}
        self._issued = asyncio.Event()  # set as each probe lookup starts

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # CPU time of the collecting thread, not wall time: a callback is Python code, so the thread
        # may hand the GIL over inside it, and that wait is no part of the collection's cost.
        thread = threading.get_ident()
        if phase == "start":
            self._gc_started[thread] = time.thread_time()
        elif thread in self._gc_started:
            self.gc_pauses.append((time.thread_time() - self._gc_started.pop(thread)) * 1e3)

    async def _prober(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            self._issued.set()
            length = await self._worker.lookup(self._prompt)
            self.lookups.append((time.perf_counter() - started) * 1e3)
            if length != self._prompt.chunk_tokens:
                raise RuntimeError(f"the probe lookup answered {length}")
            await asyncio.sleep(0.002)

    async def measure(self, run: Callable[[], Awaitable[None]]) -> tuple[float, float]:
        stop = asyncio.Event()
        # What exists before the run (the workload's prompts, earlier rounds) is frozen out of the
        # collector: a collection of it is not the run's, and no slicing bounds it. Collections of
        # what the run creates still count (the GC column).
        gc.collect()
        gc.freeze()
        ticker = tick(stop, self.lags, self.busy, tick_s=self._tick_s)
        tasks = [asyncio.create_task(ticker), asyncio.create_task(self._prober(stop))]
        await asyncio.sleep(0.01)
        self.lags.clear()
        self.busy.clear()
        self.lookups.clear()
        self._issued.clear()
        await self._issued.wait()  # the run starts with a lookup in flight: even a short one has one
        started, cpu = time.perf_counter(), time.process_time()
        gc.callbacks.append(self._on_gc)
        try:
            await run()
        finally:
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            gc.callbacks.remove(self._on_gc)
            stop.set()
            await asyncio.gather(*tasks)
            gc.unfreeze()
        return wall, cpu


def _figures(workload: str, path: str, probes: list[tuple[_Probe, tuple[float, float]]]) -> ScaleFigures:
    lags = [x for p, _ in probes for x in p.lags]
    lookups = [x for p, _ in probes for x in p.lookups] or [0.0]
    return ScaleFigures(
        workload=workload,
        path=path,
        lag_p99_ms=float(np.percentile(lags, 99)),
        lag_max_ms=max(lags),
        busy_max_ms=max(x for p, _ in probes for x in p.busy),
        gc_max_ms=max(x for p, _ in probes for x in p.gc_pauses),
        lookup_p50_ms=float(np.percentile(lookups, 50)),
        lookup_p99_ms=float(np.percentile(lookups, 99)),
        lookup_max_ms=max(lookups),
        lookups=sum(len(p.lookups) for p, _ in probes),
        wall_ms=statistics.median(wall for _, (wall, _) in probes) * 1e3,
        cpu_ms=statistics.median(cpu for _, (_, cpu) in probes) * 1e3,
    )


@dataclass
class _Workload:
    name: str
    prompts: list[np.ndarray]  # token ids, one per store
    blocks: list[IntArray]  # block ids, one per chunk, per store
    keys: list[str]  # every chunk's key, in order (computed before the clock)


class _Bench:
    def __init__(
        self, requests: int, request_chunks: int, prompt_tokens: int, chunk_tokens: int, seed: int
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.requests = requests
        self.request_chunks = request_chunks
        self.prompt_chunks = prompt_tokens // chunk_tokens
        self.num_blocks = max(requests * request_chunks, self.prompt_chunks) + 1
        self.cache = GroupCache.allocate(
            num_regions=1, num_blocks=self.num_blocks, block_size=chunk_tokens, block_lens=BLOCK_BYTES
        )
        self.backend = MemoryBackend(capacity_bytes=4 * self.num_blocks * BLOCK_BYTES + (1 << 20))
        self.namespace = KeyNamespace("aiokv-bench-scale")
        self.rng = np.random.default_rng(seed)

    def workload(self, name: str) -> _Workload:
        c = self.chunk_tokens
        if name == "many requests":
            k = self.request_chunks
            prompts = list(self.rng.integers(0, 128_000, size=(self.requests, k * c), dtype=np.int64))
            blocks = [np.arange(i * k, (i + 1) * k) for i in range(self.requests)]
        else:
            prompts = [self.rng.integers(0, 128_000, size=self.prompt_chunks * c, dtype=np.int64)]
            blocks = [np.arange(self.prompt_chunks)]
        prefix = self.namespace.prefix(self.cache.layout.fingerprint, 0)
        keys = [prefix + h for p in prompts for h in HashedPrompt.from_tokens(p, c).hashes]
        return _Workload(name, prompts, blocks, keys)

    async def through_worker(self, worker: KVWorker, work: _Workload) -> None:
        futures = []
        for i, (prompt, blocks) in enumerate(zip(work.prompts, work.blocks, strict=True)):
            futures.append(worker.store(prompt, [blocks]))
            if i % SUBMIT_SLICE == SUBMIT_SLICE - 1:
                await asyncio.sleep(0)
        expected = [len(b) for b in work.blocks]
        for i, (future, chunks) in enumerate(zip(futures, expected, strict=True)):
            result = await future  # a done future answers without a turn of the loop
            if result.stored != chunks:
                raise RuntimeError(f"a benchmark store wrote {result.stored} of {chunks} chunks")
            if i % SUBMIT_SLICE == SUBMIT_SLICE - 1:
                await asyncio.sleep(0)  # the engine's turn, as when it submitted

    def direct_calls(self, worker: KVWorker, work: _Workload) -> None:
        """The same keys and regions, moved by direct calls split as the worker splits them."""
        keys = work.keys
        regions = self.cache.layout.regions_for_chunks(np.concatenate(work.blocks).reshape(-1, 1))
        if any(self.backend.batch_exists(keys)):
            raise RuntimeError("the direct baseline found its keys already stored")
        for batch in regions:
            per_call = keys_per_call(worker.max_regions_per_call, batch.addrs.shape[1])
            for start in range(0, batch.rows.size, per_call):
                rows = batch.rows[start : start + per_call]
                part = slice(start, start + per_call)
                codes = self.backend.batch_put(
                    [keys[r] for r in rows.tolist()], batch.addrs[part], batch.sizes[part]
                )
                if min(codes) < 0:
                    raise RuntimeError(f"a direct put failed: {sorted(set(codes))[:3]}")

    def remove(self, keys: list[str]) -> None:
        codes = self.backend.batch_remove(keys, force=True)
        if min(codes, default=0) < 0:
            raise RuntimeError("a benchmark key was not stored")


async def _run(
    requests: int, request_chunks: int, prompt_tokens: int, chunk_tokens: int, rounds: int, seed: int
) -> tuple[list[ScaleFigures], CollectorFigures]:
    bench = _Bench(requests, request_chunks, prompt_tokens, chunk_tokens, seed)
    layout = bench.cache.layout
    figures: list[ScaleFigures] = []
    async with KVWorker(
        layout, bench.backend, namespace=bench.namespace, chunk_tokens=chunk_tokens
    ) as worker:
        probe_tokens = bench.rng.integers(0, 128_000, size=chunk_tokens, dtype=np.int64)
        probe_prompt = HashedPrompt.from_tokens(probe_tokens, chunk_tokens)
        await worker.store(probe_prompt, [np.array([bench.num_blocks - 1])])
        work = bench.workload("many requests")
        collector = await collector_figures(
            lambda: [worker.store(p, [b]) for p, b in zip(work.prompts, work.blocks, strict=True)], requests
        )
        await asyncio.to_thread(bench.remove, work.keys)
        for name in ("many requests", "long prompt"):
            runs: dict[str, list[tuple[_Probe, tuple[float, float]]]] = {
                "worker": [],
                "direct": [],
                "idle": [],
            }
            for r in range(rounds + 1):  # round 0 warms up
                work = bench.workload(name)
                measured: dict[str, tuple[_Probe, tuple[float, float]]] = {}
                for path in ("worker", "direct", "idle"):

                    async def run(
                        path: str = path,
                        work: _Workload = work,
                        measured: dict[str, tuple[_Probe, tuple[float, float]]] = measured,
                    ) -> None:
                        if path == "worker":
                            await bench.through_worker(worker, work)
                        elif path == "direct":
                            await asyncio.to_thread(bench.direct_calls, worker, work)
                        else:  # as long as the worker took, nothing running
                            await asyncio.sleep(measured["worker"][1][0])

                    probe = _Probe(worker, probe_prompt)
                    measured[path] = (probe, await probe.measure(run))
                    if path != "idle":
                        await asyncio.to_thread(bench.remove, work.keys)
                if r:
                    for path, one in measured.items():
                        runs[path].append(one)
            figures += [_figures(name, path, probes) for path, probes in runs.items()]
    bench.backend.close()
    return figures, collector


def _request_cpu_us(run: ScaleFigures, idle: ScaleFigures, requests: int) -> float:
    """Process CPU per request of ``run``, less what the ticker and prober cost over as long a time
    (the idle run's CPU rate)."""
    probes_ms = idle.cpu_ms / max(idle.wall_ms, 1e-9) * run.wall_ms
    return (run.cpu_ms - probes_ms) * 1e3 / requests


def run_scale_benchmark(
    *,
    requests: int = 10_000,
    request_chunks: int = 1,
    prompt_tokens: int = 1_000_000,
    chunk_tokens: int = 16,
    rounds: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Figures per workload and path (worker, direct, idle) as dicts, the worker's ratios to each
    baseline, and the seed figures; see the module docstring."""
    from aiokv.runner import run

    if min(requests, request_chunks, rounds, chunk_tokens) < 1 or prompt_tokens < chunk_tokens:
        raise ValueError(
            "requests, request_chunks, rounds and chunk_tokens must be >= 1, "
            "and prompt_tokens >= chunk_tokens"
        )
    figures, collector = run(_run(requests, request_chunks, prompt_tokens, chunk_tokens, rounds, seed))
    by = {(f.workload, f.path): f for f in figures}
    ratios = {}
    for name in ("many requests", "long prompt"):
        w, d, idle = by[(name, "worker")], by[(name, "direct")], by[(name, "idle")]
        per_run = requests if name == "many requests" else 1
        ratios[name] = {
            "lag_max_vs_direct": w.lag_max_ms / max(d.lag_max_ms, 1e-9),
            "lag_max_vs_seed": w.lag_max_ms / (SEED_FIGURES[name]["lag_max_ms"] or 1.0),
            "lookup_p99_vs_idle": w.lookup_p99_ms / max(idle.lookup_p99_ms, 1e-9),
            "cpu_per_request_us": _request_cpu_us(w, idle, per_run),
            "direct_cpu_per_request_us": _request_cpu_us(d, idle, per_run),
        }
    parameters = {"requests": requests, "request_chunks": request_chunks, "prompt_tokens": prompt_tokens,
                  "chunk_tokens": chunk_tokens, "keys": prompt_tokens // chunk_tokens,
                  "rounds": rounds}  # fmt: skip
    return {"parameters": parameters, "figures": [asdict(f) for f in figures], "ratios": ratios,
            "collector": asdict(collector), "seed": SEED_FIGURES,
            "goal_lag_max_ms": GOAL_LAG_MAX_MS,
            "goal_cpu_per_request_us": GOAL_CPU_PER_REQUEST_US}  # fmt: skip


def print_scale_report(report: dict[str, Any], out: TextIO) -> None:
    p = report["parameters"]
    out.write(
        f"\nloop stalls at scale: {p['requests']:,} stores of {p['request_chunks']} chunk(s) in one batch; "
        "one "
        f"{p['prompt_tokens']:,}-token prompt at chunk {p['chunk_tokens']} ({p['keys']:,} keys); "
        f"embedded backend, real bytes; pooled over {p['rounds']} rounds\n"
        "  lag: how late a 1 ms timer fires; busy: CPU the loop's thread used between two ticks; GC: CPU of "
        "the longest garbage collection; lookup: a one-chunk lookup issued again and again meanwhile\n"
    )
    headers = ["workload", "path", "lag p99 ms", "lag max", "busy max", "GC max", "lookup p50", "lookup p99"]
    headers += ["lookup max", "wall ms", "CPU ms"]
    rows = [
        [f["workload"], f["path"], *(f"{f[k]:.1f}" for k in
         ("lag_p99_ms", "lag_max_ms", "busy_max_ms", "gc_max_ms", "lookup_p50_ms", "lookup_p99_ms",
          "lookup_max_ms", "wall_ms", "cpu_ms"))]
        for f in report["figures"]
    ]  # fmt: skip
    table(out, headers, rows)
    out.write("\n  worker vs baselines (ratios) and the stalls before the loop work was sliced\n")
    rows = []
    for name, r in report["ratios"].items():
        seed = report["seed"][name]
        worker = next(f for f in report["figures"] if f["workload"] == name and f["path"] == "worker")
        met = "met" if worker["lag_max_ms"] <= report["goal_lag_max_ms"] else "MISSED"
        rows.append([name, f"{r['lag_max_vs_direct']:.2f}", f"{r['lookup_p99_vs_idle']:.2f}",
                     f"{seed['lag_max_ms']:g}", f"{r['lag_max_vs_seed']:.3f}",
                     f"<= {report['goal_lag_max_ms']:g} ms: {met}"])  # fmt: skip
    headers = ["workload", "lag max / direct", "lookup p99 / idle", "seed lag max ms", "/ seed", "goal"]
    table(out, headers, rows)
    many = report["ratios"]["many requests"]
    goal = report["goal_cpu_per_request_us"]
    out.write(
        f"\n  many requests, process CPU per request less the idle run's (ticker, prober): worker "
        f"{many['cpu_per_request_us']:.1f} us (goal <= {goal:g}: "
        f"{'met' if many['cpu_per_request_us'] <= goal else 'MISSED'}), direct calls "
        f"{many['direct_cpu_per_request_us']:.1f} us\n"
    )
    c = report["collector"]
    out.write(
        f"\n  garbage collector, {c['requests']:,} stores in flight (CPython 3.11's full collection is one "
        f"stall): queued {c['queued_objects_per_request']:.1f} tracked objects per request, a full "
        f"collection {c['queued_full_collection_ms']:.1f} ms CPU; settled, results held "
        f"{c['settled_objects_per_request']:.1f} per request, {c['settled_full_collection_ms']:.1f} ms\n"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks scale",
        description="Event-loop lag and lookup latency while the worker handles one batch of many "
        "requests and one very long prompt, against direct backend calls and an idle loop.",
    )
    parser.add_argument("--requests", type=int, default=10_000, help="stores in the batch (default 10,000)")
    parser.add_argument(
        "--request-chunks", type=int, default=1, help="chunks per store of the batch (default 1)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=1_000_000, help="tokens of the long prompt (default 1,000,000)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=16, help="tokens per chunk (default 16)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after a warm-up (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every figure as JSON")
    return parser


def main(argv: list[str]) -> int:
    return suite_main("scale", _parser(), argv, run_scale_benchmark, print_scale_report)
