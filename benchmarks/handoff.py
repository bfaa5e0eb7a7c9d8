"""What submitting a step's stores costs an engine's own thread: ``ThreadedKVWorker.store`` per request
(each waits for the worker's loop thread to take its request, so bad arguments raise at the call)
against ``store_many`` per step (hands the step's requests over without waiting), in one run, on the
same worker, while earlier steps' stores are still being moved.

An engine-like thread runs ``steps`` steps: each submits ``per_step`` stores of ``chunks`` chunks, then
spends about ``engine_ms`` in Python of its own (the GIL held, as a step's scheduling does). The figure
is the time each step's submission took on that thread (p50, p90, p99, max).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from aiokv.backends.memory import MemoryBackend
from aiokv.testing.paged_cache import GroupCache
from aiokv.threaded import ThreadedKVWorker

from .report import suite_main, table

CHUNK_TOKENS = 16
REGIONS = 8
BLOCK_BYTES = 4096


def _percentiles(samples_ms: list[float]) -> dict[str, float]:
    p50, p90, p99 = np.percentile(samples_ms, [50, 90, 99]).tolist()
    return {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "max_ms": max(samples_ms)}


def _engine_python(ms: float) -> None:
    """Pure Python for about ``ms`` (the GIL held throughout, as the engine's own step)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        sum(range(200))


def run_handoff_benchmark(
    *, steps: int = 300, per_step: int = 4, chunks: int = 4, engine_ms: float = 1.0, seed: int = 0
) -> dict[str, Any]:
    """Per path (``store`` per request, ``store_many`` per step): the submission time per step, and
    ``store_many`` / ``store`` ratios."""
    if min(steps, per_step, chunks) < 1 or engine_ms < 0:
        raise ValueError("steps, per_step and chunks must be >= 1, and engine_ms >= 0")
    num_blocks = per_step * chunks * 64  # blocks reused round-robin: a few steps' stores in flight
    cache = GroupCache.allocate(
        num_regions=REGIONS, num_blocks=num_blocks, block_size=CHUNK_TOKENS, block_lens=BLOCK_BYTES
    )
    backend = MemoryBackend(capacity_bytes=2 * steps * per_step * chunks * REGIONS * BLOCK_BYTES + (1 << 20))
    rng = np.random.default_rng(seed)
    figures: dict[str, Any] = {}
    with ThreadedKVWorker(
        cache.layout, backend, namespace="aiokv-bench-handoff", chunk_tokens=CHUNK_TOKENS
    ) as w:
        for path in ("store", "store_many"):
            submitted: list[Any] = []
            step_ms: list[float] = []
            block = 0
            for _ in range(steps):
                step = []
                for _ in range(per_step):
                    tokens = rng.integers(0, 128_000, size=chunks * CHUNK_TOKENS, dtype=np.int64)
                    step.append((tokens, [np.arange(block, block + chunks) % num_blocks]))
                    block += chunks
                started = time.perf_counter()
                if path == "store":
                    submitted += [w.store(tokens, blocks) for tokens, blocks in step]
                else:
                    submitted += w.store_many(step)
                step_ms.append((time.perf_counter() - started) * 1e3)
                _engine_python(engine_ms)
            results = [future.result(60) for future in submitted]
            if any(r.stored + r.skipped != chunks for r in results):
                raise RuntimeError(f"a benchmark store through {path} did not store every chunk")
            figures[path] = _percentiles(step_ms)
    backend.close()
    ratios = {key: figures["store_many"][key] / max(figures["store"][key], 1e-9) for key in figures["store"]}
    parameters = {"steps": steps, "per_step": per_step, "chunks": chunks, "engine_ms": engine_ms}
    return {"parameters": parameters, "figures": figures, "store_many_vs_store": ratios}


def print_handoff_report(report: dict[str, Any], out: Any) -> None:
    p = report["parameters"]
    out.write(
        f"\nhanding a step's stores to the worker from an engine's thread: {p['steps']} steps of "
        f"{p['per_step']} stores ({p['chunks']} chunks each), {p['engine_ms']} ms of the engine's own "
        "Python between steps; submission time per step on that thread, ms\n"
    )
    keys = ["p50_ms", "p90_ms", "p99_ms", "max_ms"]
    rows = [[path, *(f"{report['figures'][path][k]:.3f}" for k in keys)] for path in ("store", "store_many")]
    rows.append(["store_many / store", *(f"{report['store_many_vs_store'][k]:.3f}" for k in keys)])
    table(out, ["path", "p50", "p90", "p99", "max"], rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks handoff",
        description="Submission time per engine step: store() per request against store_many() per step.",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-step", type=int, default=4, help="stores per step (default 4)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per store (default 4)")
    parser.add_argument(
        "--engine-ms", type=float, default=1.0, help="engine Python between steps (default 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every figure as JSON")
    return parser


def main(argv: list[str]) -> int:
    return suite_main("handoff", _parser(), argv, run_handoff_benchmark, print_handoff_report)
