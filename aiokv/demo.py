"""``python -m aiokv demo``: a prefill cache stores a long prompt, a second cache loads it back.

Two engine-like paged KV caches are built in NumPy (aiokv.testing's toy cache: layers x K/V regions of
fixed-size blocks). The first stores a prompt through :class:`KVWorker` on the embedded backend; the
second, with other block ids, looks the prompt up, loads it, and every byte is compared. Output goes
to ``out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import numpy as np

from .backends.memory import MemoryBackend
from .keys import HashedPrompt
from .runner import run
from .testing.paged_cache import GroupCache, same_blocks
from .worker import KVWorker


def _write(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


async def demo(
    out: TextIO,
    *,
    tokens: int = 16384,
    layers: int = 8,
    block_size: int = 16,
    chunk_tokens: int = 256,
    heads: int = 8,
    head_dim: int = 64,
) -> bool:
    num_blocks = 2 * (tokens // block_size) + 16
    # One region per (layer, K/V), a block holding block_size x heads x head_dim float16 values.
    prefill, decode = (
        GroupCache.allocate(
            num_regions=2 * layers,
            num_blocks=num_blocks,
            block_size=block_size,
            block_lens=block_size * heads * head_dim * 2,
            fill=fill,
            dtype="float16",
        )
        for fill in ("random", 0)
    )
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 128_000, size=tokens + block_size // 2, dtype=np.int64)  # + a partial block
    needed = tokens // block_size
    # Scattered physical blocks, as after an engine's allocator has churned for a while.
    prefill_ids = rng.permutation(num_blocks)[:needed]
    decode_ids = rng.permutation(num_blocks)[:needed]
    chunk_bytes = prefill.layout.chunk_bytes_per_block * (chunk_tokens // block_size)
    _write(
        out,
        f"aiokv demo: {tokens} tokens, {2 * layers} regions, block {block_size} tokens "
        f"({prefill.layout.region_block_lens[0] // 1024} KiB), chunk {chunk_tokens} tokens "
        f"({chunk_bytes / 2**20:.1f} MiB)",
    )
    backend = MemoryBackend(capacity_bytes=4 << 30)
    hashed = HashedPrompt.from_tokens(prompt, chunk_tokens)
    async with KVWorker(prefill.layout, backend, namespace="demo-model", chunk_tokens=chunk_tokens) as worker:
        started = time.perf_counter()
        stored = await worker.store(hashed, [prefill_ids])
        elapsed = time.perf_counter() - started
        moved = stored.stored * chunk_bytes
        _write(
            out,
            f"store   : {stored.stored} chunks written, {stored.skipped} skipped, {stored.failed} failed "
            f"in {elapsed * 1e3:.1f} ms ({moved / elapsed / 1e9:.2f} GB/s)",
        )
        again = await worker.store(hashed, [prefill_ids])
        _write(out, f"store x2: {again.stored} written, {again.skipped} skipped (already in the store)")
    async with KVWorker(decode.layout, backend, namespace="demo-model", chunk_tokens=chunk_tokens) as worker:
        hit = await worker.lookup(prompt)
        diverging = prompt.copy()
        diverging[tokens // 2 + 1] += 1
        partial_hit = await worker.lookup(diverging)
        _write(out, f"lookup  : {hit} of {prompt.size} tokens hit; a prompt changed at token "
               f"{tokens // 2 + 1} hits {partial_hit}")  # fmt: skip
        started = time.perf_counter()
        loaded = await worker.load(prompt, [decode_ids])
        elapsed = time.perf_counter() - started
        _write(
            out,
            f"load    : {loaded.loaded_tokens} tokens in {elapsed * 1e3:.1f} ms "
            f"({loaded.loaded_chunks * chunk_bytes / elapsed / 1e9:.2f} GB/s), "
            f"{sum(map(len, loaded.failed_block_ids))} blocks to recompute",
        )
        stats = worker.stats()
    compared = hit // block_size
    same = same_blocks(prefill, prefill_ids[:compared], decode, decode_ids[:compared])
    verified = compared * prefill.layout.chunk_bytes_per_block
    _write(
        out, f"verify  : {verified / 2**20:.1f} MiB compared byte for byte: {'OK' if same else 'MISMATCH'}"
    )
    _write(out, f"stats   : backend calls {stats['backend_calls']}, bytes {stats['bytes']}")
    ok = same and hit == tokens and partial_hit == (tokens // 2) // chunk_tokens * chunk_tokens
    ok = ok and loaded.loaded_tokens == tokens and stored.failed == 0 and again.stored == 0
    return ok


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiokv demo", description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    stream = out or sys.stdout
    ok = run(
        demo(stream, tokens=args.tokens, layers=args.layers, block_size=args.block_size,
             chunk_tokens=args.chunk_tokens)
    )  # fmt: skip
    _write(stream, "demo OK" if ok else "demo FAILED")
    return 0 if ok else 1
