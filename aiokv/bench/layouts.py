"""Block-major against layer-major KV caches (issue 11): pairs, GIL, loop lag, in one run.

The write-up's scenario (289K tokens, block 128, 96 regions; block bytes scaled down to fit memory),
with one cache allocated three ways (layer-major, block-major per-layer views, one cross-layer region;
see :mod:`aiokv.bench.layout_caches`) and described with :meth:`KVLayout.from_tensors`.

For each: (address, size) pairs per request, the GIL-held pieces of one request on the Mooncake path
(``regions_for_chunks``, building the int lists the binding takes, and with ``--backend mooncake`` the
binding's own argument conversion, timed on a raw ``mooncake.store`` client), and through
:class:`~aiokv.KVWorker` with ``--concurrency`` concurrent stores and loads: wall time, GB/s, loop lag
and CPU per request. Bytes are verified once per layout. A table of ``chunk_tokens`` choices follows
(keys, pairs and bytes per pair per request).

Run: ``python -m aiokv.bench.layouts [--backend mooncake]`` (Mooncake in a private network namespace:
``unshare -rn sh -c 'ip link set lo up && python -m aiokv.bench.layouts --backend mooncake'``).
``--cross-process`` adds the prefill -> decode figures of :mod:`aiokv.bench.layouts_xproc`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, replace
from typing import Any, TextIO

import numpy as np

from .._arrays import IntArray
from ..backends._regions import RegisteredMemory
from ..backends.mooncake_calls import CallForm, call_form, prove
from ..keys import KeyNamespace, chunk_hashes
from ..runner import run
from ..worker import DEFAULT_REGIONS_PER_CALL, KVWorker
from .gil import best_ms as _best_ms
from .layout_caches import KINDS, VOCAB, LayoutCache, Scenario, chunk_token_table, pairs_per_request
from .loop_lag import measure_loop_lag


class ConversionProbe:
    """A raw ``mooncake.store`` client: ``convert(form, keys)`` hands the binding a call's argument lists
    with one key more than they have, which it converts (holding the GIL) and then refuses with -600
    per key for the length mismatch, moving nothing and asking nothing of the master."""

    def __init__(self, master_address: str) -> None:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address)
        if rc != 0:
            raise RuntimeError(f"mooncake setup for the conversion probe failed: {rc}")

    def convert(self, form: CallForm, keys_and_one: list[str]) -> None:
        codes = list(form.get(self.store, keys_and_one, False))
        if codes != [-600] * len(keys_and_one):
            raise RuntimeError(f"the conversion probe answered {sorted(set(codes))}, expected only -600")

    def close(self) -> None:
        self.store.close()


def _memory_of(cache: LayoutCache) -> RegisteredMemory:
    memory = RegisteredMemory()
    for array in cache.arrays:
        memory.add(array.ctypes.data, array.nbytes)
    return memory


def gil_per_request(
    cache: LayoutCache,
    matrix: IntArray,
    keys: list[str],
    max_regions_per_call: int,
    probe: ConversionProbe | None,
    repeats: int,
) -> dict[str, Any]:
    """GIL-held pieces of one request on the Mooncake path in ms (best of ``repeats``, summed over the
    request's calls, split as the worker splits them): ``prepare`` (``regions_for_chunks``),
    ``backend`` (MooncakeBackend's own Python: the keys' checks, the memory proof, the lists of the form
    it calls, the answers; :mod:`aiokv.backends.mooncake_calls`), and ``conversion`` (the binding
    converting keys and lists; Mooncake only). The ``multi_`` figures: the same with the multi-buffer
    form every call took before (the baseline, same run)."""
    layout = cache.layout
    prepare_ms = _best_ms(lambda: layout.regions_for_chunks(matrix), repeats)
    memory = _memory_of(cache)
    calls: list[tuple[list[str], IntArray, IntArray]] = []
    for batch in layout.regions_for_chunks(matrix):
        per_call = max(1, max_regions_per_call // batch.addrs.shape[1])
        calls.extend(
            (
                [keys[r] for r in batch.rows[s : s + per_call].tolist()],
                batch.addrs[s : s + per_call],
                batch.sizes[s : s + per_call],
            )
            for s in range(0, batch.rows.size, per_call)
        )

    def backend_part(
        call_keys: list[str], addrs: IntArray, sizes: IntArray, answers: list[int], multi: bool
    ) -> CallForm:
        proven = prove(memory, "put", call_keys, addrs, sizes)
        form = call_form(proven, "put", prefer_same_node=multi)  # the option rules the flat form out
        form.get_answers(answers)
        return form

    figures: dict[str, Any] = {"prepare_ms": prepare_ms, "calls": len(calls)}
    for prefix, multi in (("", False), ("multi_", True)):
        backend_ms, conversion_ms, flat = 0.0, 0.0, True
        for call_keys, addrs, sizes in calls:
            answers = sizes.sum(axis=1).tolist()  # a get's answers as the store gives them
            part = functools.partial(backend_part, call_keys, addrs, sizes, answers, multi)
            backend_ms += _best_ms(part, repeats)
            form = part()
            flat = flat and form.flat
            if probe is not None:
                convert = functools.partial(probe.convert, form, [*call_keys, "aiokv-probe-one-more"])
                conversion_ms += _best_ms(convert, repeats)
        figures[f"{prefix}backend_ms"] = backend_ms
        figures[f"{prefix}conversion_ms"] = conversion_ms if probe is not None else None
        figures[f"{prefix}total_ms"] = prepare_ms + backend_ms + conversion_ms
        figures[f"{prefix}flat"] = flat
    return figures


Run = tuple[list[float], list[float], float, float]  # lags, loop busy per tick (ms), CPU s, wall s


async def _measured(work: Callable[[], Awaitable[None]]) -> Run:
    busy: list[float] = []
    lags, cpu, wall = await measure_loop_lag(work, busy=busy)
    return lags, busy, cpu, wall


def _summary(runs: list[Run], moved_bytes: int, requests: int) -> dict[str, float]:
    walls = [wall for *_, wall in runs]
    lags = [lag for run in runs for lag in run[0]]
    busy = [ms for run in runs for ms in run[1]]
    return {
        "wall_best_ms": min(walls) * 1e3,
        "gbps_best": moved_bytes / min(walls) / 1e9,
        "gbps_median": moved_bytes / statistics.median(walls) / 1e9,
        "lag_p50_ms": float(np.percentile(lags, 50)) if lags else 0.0,
        "lag_p99_ms": float(np.percentile(lags, 99)) if lags else 0.0,
        "lag_max_ms": max(lags, default=0.0),
        # CPU the loop's own thread used between two 1 ms ticks: what the loop ran (the rest of a
        # lag is waiting for the GIL, held by transfer threads, or for a core).
        "busy_p99_ms": float(np.percentile(busy, 99)) if busy else 0.0,
        "busy_max_ms": max(busy, default=0.0),
        "cpu_per_request_ms": statistics.median(run[2] for run in runs) / requests * 1e3,
    }


def request_keys(cache: LayoutCache, s: Scenario) -> list[str]:
    """One request's keys as the worker names them (namespace prefix, chunk hashes)."""
    prefix = KeyNamespace("aiokv-layouts-gil").prefix(cache.layout.fingerprint, 0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=s.tokens, dtype=np.int64)
    return [prefix + h for h in chunk_hashes(tokens, s.chunk_tokens)]


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
        from ..backends.memory import MemoryBackend

        memory = MemoryBackend(capacity_bytes=capacity)
        try:
            yield memory, None
        finally:
            memory.close()
        return
    from ..backends.mooncake import MooncakeBackend
    from ..backends.mooncake_master import MooncakeMaster

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
    p = argparse.ArgumentParser(prog="python -m aiokv.bench.layouts", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--json", help="write every figure to this file")
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

    result = run_layouts_benchmark(s, backend=args.backend, master=args.master, progress=progress)
    print_report(result, sys.stdout)
    if args.cross_process:
        from .layouts_xproc import XScenario, print_xproc_report, run_xproc_benchmark

        xs = XScenario(rounds=args.rounds) if not args.quick else XScenario(tokens=2048, rounds=1)
        result["cross_process"] = run_xproc_benchmark(xs, master=args.master, progress=progress)
        print_xproc_report(result["cross_process"], sys.stdout)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
