"""Block-major against layer-major KV caches: pairs, GIL, loop lag, in one run.

The long-prompt scenario (289K tokens, block 128, 96 regions; block bytes scaled down to fit memory),
with one cache allocated three ways (layer-major, block-major per-layer views, one cross-layer region;
see :mod:`benchmarks.layout_caches`) and described with :meth:`KVLayout.from_tensors`.

For each: (address, size) pairs per request, the GIL-held pieces of one request on the Mooncake path
(:mod:`benchmarks.layouts_gil`: ``regions_for_chunks``, MooncakeBackend's own Python, and with
``--backend mooncake`` the binding's conversion timed on a raw ``mooncake.store`` client; for the call
form the backend takes and for the multi-buffer form as the baseline), and through
:class:`~aiokv.KVWorker` with ``--concurrency`` concurrent stores and loads: wall time, GB/s, CPU per
request, and per 1 ms tick the loop's lag, its own CPU (busy) and its wait for a core, next to the idle
loop's lag measured just before. Bytes are verified once per layout. A table of ``chunk_tokens``
choices follows (keys, pairs and bytes per pair per request).

Run: ``python -m benchmarks layouts [--backend mooncake]`` (Mooncake in a private network namespace:
``unshare -rn sh -c 'ip link set lo up && python -m benchmarks layouts --backend mooncake'``).
``--cross-process`` adds the prefill -> decode figures of :mod:`benchmarks.layouts_xproc`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np

from aiokv import DEFAULT_REGIONS_PER_CALL, KVWorker
from aiokv.keys import KeyNamespace, chunk_hashes
from aiokv.runner import run

from .layout_caches import KINDS, VOCAB, LayoutCache, Scenario, chunk_token_table, pairs_per_request
from .layouts_gil import ConversionProbe, gil_per_request, request_keys
from .layouts_xproc import XScenario, print_xproc_report, run_xproc_benchmark
from .loop_lag import measure_loop_lag
from .report import finish_suite


class Run(NamedTuple):
    """One timed round: per 1 ms tick the loop's lag, its own CPU and its wait for a core (ms)."""

    lags: list[float]
    busy: list[float]
    core_waits: list[float]
    cpu_s: float
    wall_s: float


async def _measured(work: Callable[[], Awaitable[None]]) -> Run:
    busy: list[float] = []
    core_waits: list[float] = []
    lags, cpu, wall = await measure_loop_lag(work, busy=busy, core_waits=core_waits)
    return Run(lags, busy, core_waits, cpu, wall)


def _summary(runs: list[Run], moved_bytes: int, requests: int) -> dict[str, float | None]:
    walls = [run.wall_s for run in runs]
    lags = np.array([lag for run in runs for lag in run.lags])
    busy = np.array([ms for run in runs for ms in run.busy])
    waits = np.array([ms for run in runs for ms in run.core_waits])
    p99 = float(np.percentile(lags, 99)) if lags.size else 0.0
    worst = lags >= p99  # the ticks at or past the p99: what they were made of
    return {
        "wall_best_ms": min(walls) * 1e3,
        "gbps_best": moved_bytes / min(walls) / 1e9,
        "gbps_median": moved_bytes / statistics.median(walls) / 1e9,
        "lag_p50_ms": float(np.percentile(lags, 50)) if lags.size else 0.0,
        "lag_p99_ms": p99,
        "lag_max_ms": float(lags.max()) if lags.size else 0.0,
        # CPU the loop's own thread used between two 1 ms ticks: what the loop ran (the rest of a
        # lag is waiting for a core or for the GIL).
        "busy_p99_ms": float(np.percentile(busy, 99)) if busy.size else 0.0,
        "worst_lag_ms": float(lags[worst].mean()) if lags.size else 0.0,
        "worst_busy_ms": float(busy[worst].mean()) if busy.size == lags.size and lags.size else None,
        "worst_core_wait_ms": float(waits[worst].mean()) if waits.size == lags.size and lags.size else None,
        "cpu_per_request_ms": statistics.median(run.cpu_s for run in runs) / requests * 1e3,
    }


async def idle_lag_p99_ms(seconds: float = 1.0) -> float:
    """The loop's lag p99 with nothing to do: what the machine's other load alone costs."""
    lags, _, _ = await measure_loop_lag(functools.partial(asyncio.sleep, seconds))
    return float(np.percentile(lags, 99))


async def _through_worker(backend: Any, cache: LayoutCache, s: Scenario, seed: int) -> dict[str, Any]:
    """Verify bytes once, then timed rounds of ``concurrency`` concurrent stores, then loads."""
    namespace = KeyNamespace(f"aiokv-layouts-{uuid.uuid4().hex[:8]}")
    prefix = namespace.prefix(cache.layout.fingerprint, 0)
    source, c = cache.block_sets[0], s.concurrency
    counter = iter(range(1 << 30))

    def prompt() -> np.ndarray:
        return np.random.default_rng((seed, next(counter))).integers(0, VOCAB, size=s.tokens, dtype=np.int64)

    def keys(tokens: np.ndarray) -> list[str]:
        return [prefix + h for h in chunk_hashes(tokens, s.chunk_tokens)]

    def remove(prompts: list[np.ndarray]) -> None:
        all_keys = [k for p in prompts for k in keys(p)]
        try:
            backend.batch_remove(all_keys, force=True)
        except TypeError:
            backend.batch_remove(all_keys)

    async with KVWorker(cache.layout, backend, namespace=namespace, chunk_tokens=s.chunk_tokens) as worker:

        async def store(prompts: list[np.ndarray]) -> None:
            results = await asyncio.gather(*(worker.store(p, [source]) for p in prompts))
            if any(r.stored != s.chunks for r in results):
                raise RuntimeError(f"a store wrote fewer than {s.chunks} chunks: {results}")

        async def load(prompts: list[np.ndarray]) -> None:
            futures = [worker.load(p, [ids]) for p, ids in zip(prompts, cache.block_sets[1:], strict=False)]
            if any(r.loaded_tokens != s.tokens for r in await asyncio.gather(*futures)):
                raise RuntimeError("a load did not load the whole prompt")

        check = [prompt()]
        await store(check)
        await load(check)
        if not cache.same_blocks(source, cache.block_sets[1]):
            raise RuntimeError(f"bytes differ after a store and a load through the {cache.layout} layout")
        cache.clear(cache.block_sets[1])
        remove(check)
        idle_ms = await idle_lag_p99_ms()
        stores: list[Run] = []
        for r in range(s.rounds + 1):
            prompts = [prompt() for _ in range(c)]
            measured = await _measured(functools.partial(store, prompts))
            remove(prompts)
            if r:  # round 0 warms pages, allocator and threads up
                stores.append(measured)
        prompts = [prompt() for _ in range(c)]
        await store(prompts)
        loads = [await _measured(lambda: load(prompts)) for _ in range(s.rounds + 1)][1:]
        remove(prompts)
    moved = c * s.prompt_bytes
    store_figures, load_figures = _summary(stores, moved, c), _summary(loads, moved, c)
    return {"store": store_figures, "load": load_figures, "idle_lag_p99_ms": idle_ms}


@contextlib.contextmanager
def open_backend(
    name: str, master: str | None, capacity: int
) -> Iterator[tuple[Any, ConversionProbe | None]]:
    if name == "memory":
        from aiokv.backends.memory import MemoryBackend

        memory = MemoryBackend(capacity_bytes=capacity)
        try:
            yield memory, None
        finally:
            memory.close()
        return
    from aiokv.backends.mooncake import MooncakeBackend
    from aiokv.backends.mooncake_master import MooncakeMaster

    with contextlib.ExitStack() as stack:
        if master is None:
            master = stack.enter_context(MooncakeMaster()).address
        backend = MooncakeBackend.from_master(master, global_segment_size=capacity)
        stack.callback(backend.close)
        probe = ConversionProbe(master)
        stack.callback(probe.close)
        yield backend, probe


def run_layouts_benchmark(
    s: Scenario,
    *,
    backend: str = "memory",
    master: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both layouts on one backend; returns every figure and the layer-major / block-major ratios."""
    say = progress or (lambda _: None)
    capacity = int(s.concurrency * s.prompt_bytes * 1.3) + (64 << 20)
    result: dict[str, Any] = {"scenario": asdict(s), "backend": backend, "layouts": {}}
    # The loop's lag with nothing to do: what the machine's other load alone costs (a shared box);
    # each layout measures it again just before its rounds.
    result["idle_lag_p99_ms"] = run(idle_lag_p99_ms())
    with open_backend(backend, master, capacity) as (store, probe):
        max_regions = int(getattr(store, "max_regions_per_call", DEFAULT_REGIONS_PER_CALL))
        for kind in KINDS:
            started = time.perf_counter()
            cache = LayoutCache(
                kind, regions=s.regions, block_bytes=s.block_bytes, block_size=s.block_size,
                prompt_blocks=s.prompt_blocks, blocks_per_chunk=s.blocks_per_chunk, sets=1 + s.concurrency,
            )  # fmt: skip
            matrix = cache.block_sets[0].reshape(s.chunks, s.blocks_per_chunk)
            figures: dict[str, Any] = {
                "pairs_per_chunk": cache.layout.pairs_per_chunk(s.blocks_per_chunk),
                "pairs_per_request": pairs_per_request(cache.layout, matrix),
                "gil": gil_per_request(
                    cache, matrix, request_keys(cache, s), max_regions, probe, repeats=max(5, s.rounds)
                ),
            }
            gil_ms = figures["gil"]["total_ms"]
            say(f"{kind}: {figures['pairs_per_request']:,} pairs per request; GIL {gil_ms:.2f} ms")
            figures.update(run(_through_worker(store, cache, s, seed=KINDS.index(kind))))
            say(f"{kind}: worker rounds done in {time.perf_counter() - started:.1f} s")
            result["layouts"][kind] = figures
            del cache
    layer = result["layouts"]["layer_major"]
    result["ratios_layer_major_over"] = {
        kind: {
            "pairs_per_request": layer["pairs_per_request"] / block["pairs_per_request"],
            "gil_total": layer["gil"]["total_ms"] / block["gil"]["total_ms"],
            "gil_multi_over_flat": block["gil"]["multi_total_ms"] / block["gil"]["total_ms"],
            **{
                f"{op}_{figure}": layer[op][figure] / max(block[op][figure], 1e-9)
                for op in ("store", "load")
                for figure in ("lag_p99_ms", "cpu_per_request_ms", "wall_best_ms")
            },
        }
        for kind, block in result["layouts"].items()
        if kind != "layer_major"
    }
    result["chunk_tokens"] = chunk_token_table(s)
    return result


def print_report(result: dict[str, Any], out: TextIO) -> None:
    s = result["scenario"]
    out.write(
        f"layouts on {result['backend']}: {s['tokens']:,} tokens, block {s['block_size']}, "
        f"{s['regions']} regions x {s['block_bytes']} B, chunk {s['chunk_tokens']} tokens, "
        f"{s['concurrency']} concurrent requests; idle loop lag p99 {result['idle_lag_p99_ms']:.2f} ms\n"
    )
    rows = []
    for kind, f in result["layouts"].items():
        g, st, ld = f["gil"], f["store"], f["load"]
        conversion = "-" if g["conversion_ms"] is None else f"{g['conversion_ms']:.2f}"
        rows.append(
            f"  {kind:12} {f['pairs_per_chunk']:>6} {f['pairs_per_request']:>10,} {g['prepare_ms']:>8.2f} "
            f"{g['backend_ms']:>7.2f} {conversion:>8} {g['total_ms']:>7.2f} {g['multi_total_ms']:>7.2f} "
            f"{st['gbps_best']:>6.2f} {st['lag_p99_ms']:>6.2f} {st['busy_p99_ms']:>6.2f} "
            f"{ld['gbps_best']:>6.2f} {ld['lag_p99_ms']:>6.2f} {ld['busy_p99_ms']:>6.2f} "
            f"{f['idle_lag_p99_ms']:>6.2f} {st['cpu_per_request_ms']:>7.1f} {ld['cpu_per_request_ms']:>7.1f}"
        )
    out.write(
        "  layout       pairs/  pairs/req  prepare   aiokv  convert  GIL ms   multi  store  store  store"
        "   load   load   load   idle  st CPU  ld CPU\n"
        "               chunk                   ms      ms       ms   /req  GIL ms   GB/s  lag99 busy99"
        "   GB/s  lag99 busy99  lag99  ms/req  ms/req\n"
    )
    out.write("\n".join(rows) + "\n")
    for kind, f in result["layouts"].items():
        parts = []
        for op in ("store", "load"):
            x = f[op]
            if x["worst_busy_ms"] is not None and x["worst_core_wait_ms"] is not None:
                parts.append(
                    f"{op} {x['worst_lag_ms']:.2f} ms = loop CPU {x['worst_busy_ms']:.2f} + core wait "
                    f"{x['worst_core_wait_ms']:.2f} + the rest (GIL)"
                )
        if parts:
            out.write(f"  {kind}: ticks lagging >= p99, mean: " + "; ".join(parts) + "\n")
    out.write(
        "  GIL: one request's regions_for_chunks + MooncakeBackend's Python (aiokv) + the binding's "
        "conversion; multi: the same through the multi-buffer calls (before). lag99/busy99: the loop's lag "
        "p99 and its own CPU p99 per 1 ms tick (ms); idle: lag p99 of the idle loop just before.\n"
    )
    for kind, ratios in result["ratios_layer_major_over"].items():
        text = ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
        out.write(f"  layer_major / {kind}: {text}\n")
    out.write("  chunk_tokens  keys/req" + "".join(f"  {k + ' pairs (B/pair)':>26}" for k in KINDS) + "\n")
    for row in result["chunk_tokens"]:
        cells = "".join(f"  {row[k]['pairs']:>14,} ({row[k]['pair_bytes']:>9,})" for k in KINDS)
        out.write(f"  {row['chunk_tokens']:>12} {row['keys']:>9,}{cells}\n")


def _parser() -> argparse.ArgumentParser:
    d = Scenario()
    p = argparse.ArgumentParser(prog="python -m benchmarks layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("memory", "mooncake"), default="memory")
    p.add_argument("--master", help="an existing Mooncake master host:port (default: start one)")
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--regions", type=int, default=d.regions)
    p.add_argument("--block-bytes", type=int, default=d.block_bytes, help="bytes per block per region")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--quick", action="store_true", help="32K tokens, 1 round: seconds, for a smoke test")
    p.add_argument("--cross-process", action="store_true", help="also prefill -> decode across processes")
    p.add_argument("--json", metavar="PATH", type=Path, help="write every figure to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    s = Scenario(
        tokens=args.tokens,
        regions=args.regions,
        block_bytes=args.block_bytes,
        chunk_tokens=args.chunk_tokens,
        concurrency=args.concurrency,
        rounds=args.rounds,
    )
    if args.quick:
        s = replace(s, tokens=32 * 1024, rounds=1)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def report() -> dict[str, Any]:
        result = run_layouts_benchmark(s, backend=args.backend, master=args.master, progress=progress)
        if args.cross_process:
            xs = XScenario(rounds=args.rounds) if not args.quick else XScenario(tokens=2048, rounds=1)
            result["cross_process"] = run_xproc_benchmark(xs, master=args.master, progress=progress)
        return result

    def print_all(result: dict[str, Any], out: TextIO) -> None:
        print_report(result, out)
        if "cross_process" in result:
            print_xproc_report(result["cross_process"], out)

    return finish_suite("layouts", report, print_all, args.json)


if __name__ == "__main__":
    sys.exit(main())
