"""``python -m benchmarks verify-cost``: what verified values cost a store and a load, on and off in one run.

The vLLM benchmark's KV geometry (16 layers, 128-token blocks, 128 KiB per layer and block: 2 MiB a
key) through :class:`~aiokv.KVWorker`, one key per block, as the connector stores it. Per round, each
variant (``on``: :class:`~aiokv.VerifiedBackend` over the store; ``off``: the bare store) stores one
prompt of ``--tokens`` tokens and loads it into other blocks, the order alternating between rounds.
Per request: wall time and this process's CPU time (every thread: the worker's, the store client's).
``--backend mooncake`` (default) moves every byte to another process's segment over TCP, as the vLLM
benchmark's standalone store; run it in a private network namespace::

    unshare -rn sh -c 'ip link set lo up && python -m benchmarks verify-cost'

``--wrapper-keys N`` also times what the wrapper itself adds to one get of N small keys over the
embedded store (this thread's CPU, the inner store's call excluded): header framing, checksums and
answers, the per-key work that a few large values hide.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from aiokv import KVLayout, KVWorker, MemoryBackend, VerifiedBackend
from aiokv.backends.base import Backend

from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE

VARIANTS = ("on", "off")


class Cache:
    """One engine's KV cache in the connector's layout: a region per layer, blocks outermost."""

    def __init__(self, layers: int, num_blocks: int, page_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.tensors = [rng.integers(0, 256, num_blocks * page_bytes, dtype=np.uint8) for _ in range(layers)]
        self.layout = KVLayout(
            [int(t.ctypes.data) for t in self.tensors],
            [page_bytes],
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
        )


@contextlib.contextmanager
def stores(kind: str, segment_bytes: int) -> Iterator[dict[str, Backend]]:
    """One store client per variant (each registers its own caches)."""
    if kind == "memory":
        with MemoryBackend(segment_bytes) as on, MemoryBackend(segment_bytes) as off:
            yield {"on": on, "off": off}
        return
    from aiokv import MooncakeBackend, MooncakeMaster, segment_holder

    with MooncakeMaster() as master, segment_holder(master.address, segment_bytes):
        clients: dict[str, Backend] = {
            name: MooncakeBackend.from_master(
                master.address, global_segment_size=0, local_buffer_size=64 << 20
            )
            for name in VARIANTS
        }
        try:
            yield clients
        finally:
            for client in clients.values():
                client.close()


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    layers = args.layers
    page_bytes = BLOCK_SIZE * 2 * MODEL_SHAPE["num_kv_heads"] * MODEL_SHAPE["head_dim"] * 2
    blocks = args.tokens // BLOCK_SIZE
    figures: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    segment = 2 * args.rounds * blocks * layers * page_bytes + (256 << 20)
    with stores(args.backend, segment) as clients:
        async with contextlib.AsyncExitStack() as stack:
            workers = {}
            caches: list[Cache] = []  # kept alive while the workers use their memory
            verified = stack.enter_context(VerifiedBackend(clients["on"], b"verify-cost", close_inner=False))
            backends: dict[str, Backend] = {"on": verified, "off": clients["off"]}
            for name, backend in backends.items():
                src, dst = Cache(layers, blocks, page_bytes, 1), Cache(layers, blocks, page_bytes, 2)
                caches += [src, dst]
                workers[name] = [
                    await stack.enter_async_context(
                        KVWorker(cache.layout, backend, namespace=f"cost-{name}", chunk_tokens=BLOCK_SIZE)
                    )
                    for cache in (src, dst)
                ]
            ids = [np.arange(blocks, dtype=np.int64)]
            for number in range(args.rounds):
                order = VARIANTS if number % 2 == 0 else VARIANTS[::-1]
                for name in order:
                    tokens = np.random.default_rng(1000 + number).integers(0, 32000, blocks * BLOCK_SIZE)
                    store_worker, load_worker = workers[name]
                    for op, call in (("store", store_worker.store), ("load", load_worker.load)):
                        cpu, wall = time.process_time(), time.perf_counter()
                        result = await call(tokens, ids)
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                        assert result.ok, (name, op, result)
                        figures[name].setdefault(f"{op}_wall_s", []).append(wall)
                        figures[name].setdefault(f"{op}_cpu_s", []).append(cpu)
            hashing_s = verified.verification_stats()["checksum_cpu_ns"] / 1e9  # puts and gets
            figures["on"]["hashing_cpu_s"] = [hashing_s / args.rounds]
    return figures


def wrapper_cpu_s(keys: int, regions: int, region_bytes: int, rounds: int) -> float:
    """Median CPU of :class:`VerifiedBackend` around one get of ``keys`` keys (``regions`` regions of
    ``region_bytes`` each, a key's regions back to back) over the embedded store, less the store's call."""
    data = np.random.default_rng(0).integers(0, 256, keys * regions * region_bytes, dtype=np.uint8)
    target = np.zeros_like(data)
    inner = MemoryBackend(2 * data.nbytes + (16 << 20))
    inner_cpu: list[float] = []
    read = inner.batch_get

    def timed_read(*args: Any) -> list[int]:
        started = time.process_time()
        try:
            return read(*args)
        finally:
            inner_cpu.append(time.process_time() - started)

    with VerifiedBackend(inner, b"verify-cost") as verified:
        for buffer in (data, target):
            verified.register_buffer(int(buffer.ctypes.data), buffer.nbytes)
        offsets = (np.arange(keys)[:, None] * regions + np.arange(regions)[None, :]) * region_bytes
        sizes = np.full((keys, regions), region_bytes, dtype=np.int64)
        names = [f"wrapper-cost/{k:08d}" for k in range(keys)]
        assert verified.batch_put(names, offsets + int(data.ctypes.data), sizes) == [0] * keys
        inner.batch_get = timed_read  # type: ignore[method-assign,assignment]
        spent = []
        for _ in range(rounds):
            inner_cpu.clear()
            started = time.process_time()
            codes = verified.batch_get(names, offsets + int(target.ctypes.data), sizes)
            spent.append(time.process_time() - started - sum(inner_cpu))
            assert codes == [regions * region_bytes] * keys and np.array_equal(data, target), "wrong bytes"
    return statistics.median(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks verify-cost", description=__doc__)
    parser.add_argument("--backend", choices=("mooncake", "memory"), default="mooncake")
    parser.add_argument("--tokens", type=int, default=6016, help="tokens per request (default 6016: 47 keys)")
    parser.add_argument("--layers", type=int, default=MODEL_SHAPE["num_layers"])
    parser.add_argument("--rounds", type=int, default=10, help="requests per variant (default 10)")
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument(
        "--wrapper-keys", type=int, default=0, help="also time the wrapper alone on a get of this many keys"
    )
    parser.add_argument("--wrapper-regions", type=int, default=2, help="regions per key there (default 2)")
    parser.add_argument("--wrapper-region-bytes", type=int, default=1024, help="bytes per region (1024)")
    args = parser.parse_args(argv)
    figures = asyncio.run(measure(args))
    print(f"{'figure':<14} {'on (median)':>12} {'off (median)':>12} {'on / off':>9}")
    summary: dict[str, Any] = {}
    for key in figures["off"]:
        on, off = statistics.median(figures["on"][key]), statistics.median(figures["off"][key])
        summary[key] = {"on": on, "off": off, "ratio": on / off}
        print(f"{key:<14} {on:>12.4f} {off:>12.4f} {on / off:>9.3f}")
    hashing = figures["on"]["hashing_cpu_s"][0]
    print(f"hashing (store + load), thread CPU per request: {hashing:.4f} s")
    summary["hashing_cpu_s_per_request"] = hashing
    if args.wrapper_keys > 0:
        spent = wrapper_cpu_s(args.wrapper_keys, args.wrapper_regions, args.wrapper_region_bytes, args.rounds)
        per_key_us = spent / args.wrapper_keys * 1e6
        print(
            f"wrapper alone, one get of {args.wrapper_keys} keys x {args.wrapper_regions} x "
            f"{args.wrapper_region_bytes} B: {spent * 1e3:.2f} ms CPU ({per_key_us:.2f} us a key)"
        )
        summary["wrapper_cpu_s_per_get"] = spent
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "summary": summary, "raw": figures}, out, indent=1)
    return 0
