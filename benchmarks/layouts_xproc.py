"""Prefill -> decode across processes on Mooncake's TCP path, per cache layout and chunk size.

The store's memory is a segment mounted by another process (a holder), so every put and get crosses
processes over Mooncake's TCP transport, as between a prefill and a decode engine. One prompt
(default 16K tokens; blocks of 16 tokens x ``heads`` x 128 dims bf16 per region, 32 layers x K/V) is
stored from a source block set and loaded into a destination set, through :class:`~aiokv.KVWorker`
and by direct ``batch_put``/``batch_get`` calls over the very same keys and pairs, for:

* layer-major, one-block chunks (64 pairs per key);
* layer-major, multi-block chunks (64 pairs per key, each ``chunk_tokens / 16`` blocks long);
* block-major per-layer views, one-block chunks (one pair per key, coalesced);
* cross-layer (one region), multi-block chunks (one pair per key).

The direct calls on the last one are the raw Mooncake figure for the same bytes in one large region
per key. Bytes are verified once per configuration. Run in a private network namespace:
``unshare -rn sh -c 'ip link set lo up && python -m benchmarks layouts --cross-process'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aiokv import KVWorker
from aiokv._arrays import IntArray
from aiokv.keys import KeyNamespace, chunk_hashes
from aiokv.runner import run

from .layout_caches import LayoutCache
from .report import suite_main

_VOCAB = 128_000


@dataclass(frozen=True, slots=True)
class XScenario:
    tokens: int = 16 * 1024
    block_size: int = 16
    layers: int = 32
    heads: int = 2  # a Llama-3.1-8B-like model has 8: 4x the bytes (2 GiB per prompt)
    head_dim: int = 128
    itemsize: int = 2
    multi_chunk_tokens: int = 256
    layer_major_chunks: tuple[int, ...] = (16, 64, 256, 1024)  # chunk_tokens of the layer-major runs
    rounds: int = 2

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.heads * self.head_dim * self.itemsize

    @property
    def prompt_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def prompt_bytes(self) -> int:
        return self.prompt_blocks * self.regions * self.block_bytes

    def configurations(self) -> list[tuple[str, str, int]]:
        one, multi = self.block_size, self.multi_chunk_tokens
        return [
            *((f"layer-major, {c // one}-block chunks", "layer_major", c) for c in self.layer_major_chunks),
            ("block-major views, 1-block chunks", "block_major", one),
            (f"cross-layer, {multi // one}-block chunks", "cross_layer", multi),
        ]


def _best(walls: list[float], nbytes: int) -> dict[str, float]:
    return {"wall_best_ms": min(walls) * 1e3, "gbps_best": nbytes / min(walls) / 1e9}


async def _configuration(
    backend: Any, xs: XScenario, kind: str, chunk_tokens: int, seed: int
) -> dict[str, Any]:
    per_chunk = chunk_tokens // xs.block_size
    cache = LayoutCache(
        kind, regions=xs.regions, block_bytes=xs.block_bytes, block_size=xs.block_size,
        prompt_blocks=xs.prompt_blocks, blocks_per_chunk=per_chunk, sets=2, seed=seed,
    )  # fmt: skip
    source, dest = cache.block_sets
    namespace = KeyNamespace(f"aiokv-xproc-{uuid.uuid4().hex[:8]}")
    prefix = namespace.prefix(cache.layout.fingerprint, 0)
    counter = iter(range(1 << 30))
    max_regions = int(backend.max_regions_per_call)

    def prompt() -> np.ndarray:
        return np.random.default_rng((seed, next(counter))).integers(
            0, _VOCAB, size=xs.tokens, dtype=np.int64
        )

    def calls(tokens: np.ndarray, ids: IntArray) -> list[tuple[list[str], IntArray, IntArray]]:
        """The keys and pairs the worker passes, split as it splits them: what a direct caller sends."""
        keys = [prefix + h for h in chunk_hashes(tokens, chunk_tokens)]
        out = []
        for batch in cache.layout.regions_for_chunks(ids.reshape(-1, per_chunk)):
            step = max(1, max_regions // batch.addrs.shape[1])
            rows = batch.rows.tolist()
            for s in range(0, len(rows), step):
                out.append(
                    (
                        [keys[r] for r in rows[s : s + step]],
                        batch.addrs[s : s + step],
                        batch.sizes[s : s + step],
                    )
                )
        return out

    def direct(op: str, requests: list[tuple[list[str], IntArray, IntArray]]) -> None:
        method = backend.batch_put if op == "put" else backend.batch_get
        for keys, addrs, sizes in requests:
            codes = method(keys, addrs, sizes)
            if min(codes) < 0:
                raise RuntimeError(f"direct {op} failed: {sorted(set(codes))[:4]}")

    def remove(tokens: np.ndarray) -> None:
        backend.batch_remove([prefix + h for h in chunk_hashes(tokens, chunk_tokens)], force=True)

    async def timed(fn: Callable[[], Awaitable[None]]) -> float:
        started = time.perf_counter()
        await fn()
        return time.perf_counter() - started

    walls: dict[str, list[float]] = {
        "worker_store": [],
        "direct_put": [],
        "worker_load": [],
        "direct_get": [],
    }
    async with KVWorker(cache.layout, backend, namespace=namespace, chunk_tokens=chunk_tokens) as worker:

        async def worker_store(tokens: np.ndarray) -> None:
            stored = await worker.store(tokens, [source])
            if stored.stored != xs.tokens // chunk_tokens:
                raise RuntimeError(f"a store wrote {stored.stored} of {xs.tokens // chunk_tokens} chunks")

        async def worker_load(tokens: np.ndarray) -> None:
            loaded = await worker.load(tokens, [dest])
            if loaded.loaded_tokens != xs.tokens:
                raise RuntimeError(f"a load got {loaded.loaded_tokens} of {xs.tokens} tokens")

        check = prompt()
        await worker_store(check)
        await worker_load(check)
        if not cache.same_blocks(source, dest):
            raise RuntimeError(f"bytes differ after a cross-process store and load ({kind}, {chunk_tokens})")
        cache.clear(dest)
        await asyncio.to_thread(direct, "get", calls(check, dest))
        if not cache.same_blocks(source, dest):
            raise RuntimeError("bytes differ after a direct get of the worker's keys")
        remove(check)
        for r in range(xs.rounds + 1):
            tokens = prompt()
            order = ("worker", "direct") if r % 2 == 0 else ("direct", "worker")
            for path in order:
                if path == "worker":
                    wall = await timed(functools.partial(worker_store, tokens))
                else:
                    requests = calls(tokens, source)
                    wall = await timed(functools.partial(asyncio.to_thread, direct, "put", requests))
                remove(tokens)
                if r:
                    walls["worker_store" if path == "worker" else "direct_put"].append(wall)
        tokens = prompt()
        await worker_store(tokens)
        requests = calls(tokens, dest)
        paths = {
            "worker_load": functools.partial(worker_load, tokens),
            "direct_get": functools.partial(asyncio.to_thread, direct, "get", requests),
        }
        for r in range(xs.rounds + 1):
            for name in sorted(paths, reverse=r % 2 == 1):  # alternate which path goes first
                wall = await timed(paths[name])
                if r:
                    walls[name].append(wall)
        remove(tokens)
    keys = xs.tokens // chunk_tokens
    pairs = cache.layout.pairs_per_chunk(per_chunk)
    return {
        "kind": kind,
        "chunk_tokens": chunk_tokens,
        "keys": keys,
        "pairs_per_key": pairs,
        "pair_bytes": per_chunk * xs.regions * xs.block_bytes // pairs,
        **{name: _best(w, xs.prompt_bytes) for name, w in walls.items()},
    }


def run_xproc_benchmark(
    xs: XScenario, *, master: str | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every configuration on one master and one holder; returns figures and the goal ratios."""
    from aiokv.backends.mooncake import MooncakeBackend
    from aiokv.backends.mooncake_master import MooncakeMaster, segment_holder

    say = progress or (lambda _: None)
    result: dict[str, Any] = {"scenario": asdict(xs), "prompt_bytes": xs.prompt_bytes, "configurations": []}
    with contextlib.ExitStack() as stack:
        if master is None:
            # A get's read lease (10 s by default) can run out while a loaded box moves a prompt
            # slice by slice; the transfer then fails -707 (lease expired).
            master = stack.enter_context(MooncakeMaster(extra_args=["--default_kv_lease_ttl=60000"])).address
        stack.enter_context(segment_holder(master, int(xs.prompt_bytes * 1.3) + (64 << 20), graceful=True))
        backend = MooncakeBackend.from_master(master, global_segment_size=0)
        stack.callback(backend.close)
        for seed, (label, kind, chunk_tokens) in enumerate(xs.configurations()):
            started = time.perf_counter()
            figures = run(_configuration(backend, xs, kind, chunk_tokens, seed))
            figures["label"] = label
            result["configurations"].append(figures)
            say(f"cross-process {label}: {time.perf_counter() - started:.1f} s")
    configs = result["configurations"]
    raw = configs[-1]  # cross-layer: its direct calls move one large region per key
    one_block = next(
        (c for c in configs if (c["kind"], c["chunk_tokens"]) == ("layer_major", xs.block_size)), None
    )
    for op, worker_key, raw_key in (
        ("store", "worker_store", "direct_put"),
        ("load", "worker_load", "direct_get"),
    ):
        best = max(configs, key=lambda c: c[worker_key]["gbps_best"])
        result[f"{op}_best"] = {
            "label": best["label"],
            "gbps": best[worker_key]["gbps_best"],
            "over_raw_one_region": best[worker_key]["gbps_best"] / raw[raw_key]["gbps_best"],
            "over_layer_major_one_block": None
            if one_block is None
            else best[worker_key]["gbps_best"] / one_block[worker_key]["gbps_best"],
        }
    return result


def print_xproc_report(result: dict[str, Any], out: TextIO) -> None:
    xs = result["scenario"]
    out.write(
        f"cross-process prefill -> decode: {xs['tokens']:,} tokens, {2 * xs['layers']} regions, "
        f"{result['prompt_bytes'] / 2**20:,.0f} MiB per prompt, best of {xs['rounds']} (GB/s)\n"
        "  configuration                       keys  pairs/key  bytes/pair   store  direct    load  direct\n"
    )
    for c in result["configurations"]:
        out.write(
            f"  {c['label']:34} {c['keys']:>5} {c['pairs_per_key']:>10} {c['pair_bytes']:>11,} "
            f"{c['worker_store']['gbps_best']:>7.2f} {c['direct_put']['gbps_best']:>7.2f} "
            f"{c['worker_load']['gbps_best']:>7.2f} {c['direct_get']['gbps_best']:>7.2f}\n"
        )
    for op in ("store", "load"):
        b = result[f"{op}_best"]
        vs_one_block = b["over_layer_major_one_block"]
        tail = "" if vs_one_block is None else f", {vs_one_block:.1f}x layer-major one-block chunks"
        out.write(
            f"  best {op}: {b['label']} {b['gbps']:.2f} GB/s = {b['over_raw_one_region']:.2f}x raw Mooncake "
            f"(one region per key){tail}\n"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks layouts-xproc", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--master", help="an existing Mooncake master host:port (default: start one)")
    defaults = XScenario()
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--heads", type=int, default=defaults.heads, help="KV heads (bytes per block)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every figure to this file")

    def run_suite(master: str | None, tokens: int, heads: int, rounds: int) -> dict[str, Any]:
        xs = XScenario(tokens=tokens, heads=heads, rounds=rounds)
        return run_xproc_benchmark(xs, master=master, progress=lambda line: print(line, file=sys.stderr))

    return suite_main("layouts-xproc", parser, argv, run_suite, print_xproc_report)


if __name__ == "__main__":
    sys.exit(main())
