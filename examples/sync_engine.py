"""aiokv from plain synchronous code: ``ThreadedKVWorker``, as an engine's worker thread uses it.

Many serving engines run their scheduler in a synchronous loop on a worker thread. There is no event
loop to await on, so ``ThreadedKVWorker`` runs aiokv's loop in a background thread: ``lookup`` blocks
(briefly), ``store`` and ``load`` return ``concurrent.futures.Future``s at once. The loop below is
such an engine: each step admits a request, looks up its prefix, loads the hit, "prefills" the rest,
and hands the store to aiokv without waiting; finished stores are reaped at the start of later steps
and only then are their blocks reused.

    python examples/sync_engine.py [--requests 40] [--timeout 30]

Prints hits and what moved; exits non-zero if a loaded block differs from the prefill that stored it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time

import numpy as np

import aiokv

REGIONS = 8  # 4 layers x K/V
BLOCK_SIZE = 16
CHUNK_TOKENS = 32
BLOCK_BYTES = 4096  # one region's bytes of one block
NUM_BLOCKS = 2048


def block_values(prompt: np.ndarray) -> np.ndarray:
    """The stand-in model: block ``i``'s KV is a function of the tokens up to the end of block ``i``
    (causal, like attention KV), here a byte per (block, region)."""
    ends = np.minimum(np.arange(1, -(-prompt.size // BLOCK_SIZE) + 1) * BLOCK_SIZE, prompt.size)
    prefix_sums = np.cumsum(prompt)[ends - 1]
    return ((prefix_sums[:, None] * 7 + np.arange(REGIONS)) % 251 + 1).astype(np.uint8)


def prefill(cache: list[np.ndarray], prompt: np.ndarray, blocks: np.ndarray, first: int) -> None:
    values = block_values(prompt)
    for r, region in enumerate(cache):
        region[blocks[first:]] = values[first:, r, None]


def count_bad_blocks(cache: list[np.ndarray], prompt: np.ndarray, blocks: np.ndarray) -> int:
    """Loaded blocks that differ from what a prefill of ``prompt`` would have written."""
    values = block_values(prompt)[: blocks.size]
    bad = np.zeros(blocks.size, dtype=bool)
    for r, region in enumerate(cache):
        bad |= (region[blocks] != values[:, r, None]).any(axis=1)
    return int(bad.sum())


def engine(worker: aiokv.ThreadedKVWorker, cache: list[np.ndarray], requests: int, timeout: float) -> int:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32_000, size=256)  # a system prompt every request starts with
    free = list(rng.permutation(NUM_BLOCKS))
    storing: list[tuple[concurrent.futures.Future[aiokv.StoreResult], np.ndarray]] = []
    hits = hit_tokens = prompt_tokens = written = bad = 0
    previous = system
    for _ in range(requests):
        # 1. Reap finished stores: only now may their blocks be given to another request.
        for future, blocks in [item for item in storing if item[0].done()]:
            written += future.result().stored
            free.extend(blocks.tolist())
            storing.remove((future, blocks))
        # 2. Admit a request: half of them continue the previous conversation.
        turn = rng.integers(0, 32_000, size=int(rng.integers(16, 200)))
        prompt = np.concatenate([previous if rng.random() < 0.5 else system, turn])
        previous = prompt if prompt.size < 1500 else system
        needed = -(-prompt.size // BLOCK_SIZE)
        while len(free) < needed:  # cache full: wait for the oldest store, as an engine would
            future, blocks = storing.pop(0)
            written += future.result(timeout).stored
            free.extend(blocks.tolist())
        blocks = np.array([free.pop() for _ in range(needed)], dtype=np.int64)
        prompt_tokens += prompt.size

        # 3. Look up the cached prefix (keeping the last token to compute) and load it.
        whole = (prompt.size - 1) // CHUNK_TOKENS * CHUNK_TOKENS
        hit = min(worker.lookup(prompt, timeout=timeout), whole)
        loaded = 0
        if hit:
            result = worker.load(prompt[:hit], [blocks[: hit // BLOCK_SIZE]]).result(timeout)
            loaded = result.loaded_tokens
            hits += loaded > 0
            hit_tokens += loaded
            # Check what the load wrote against what a prefill would have written.
            bad += count_bad_blocks(cache, prompt, blocks[: loaded // BLOCK_SIZE])

        # 4. Prefill the rest and store the prompt's whole chunks without waiting for it.
        prefill(cache, prompt, blocks, loaded // BLOCK_SIZE)
        storing.append((worker.store(prompt, [blocks]), blocks))

    done, not_done = concurrent.futures.wait([future for future, _ in storing], timeout=timeout)
    written += sum(future.result().stored for future in done)
    stats = worker.stats()
    print(f"sync_engine: {requests} requests, block {BLOCK_SIZE} tokens, chunk {CHUNK_TOKENS} tokens")
    print(
        f"hits     : {hits} of {requests} requests hit; {hit_tokens:,} of {prompt_tokens:,} prompt tokens "
        f"loaded ({hit_tokens / prompt_tokens:.1%})"
    )
    print(
        f"transfers: {written} chunks written; {stats['bytes'].get('put', 0) / 1e6:.1f} MB put, "
        f"{stats['bytes'].get('get', 0) / 1e6:.1f} MB loaded; {len(not_done)} stores unfinished"
    )
    print(f"verify   : loaded blocks equal a fresh prefill: {'OK' if bad == 0 else f'{bad} MISMATCHED'}")
    return 0 if bad == 0 and not not_done else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds any one wait may take")
    args = parser.parse_args(argv)
    cache = [np.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    layout = aiokv.KVLayout([r.ctypes.data for r in cache], [BLOCK_BYTES], BLOCK_SIZE, NUM_BLOCKS)
    started = time.perf_counter()
    # Plain blocking calls, safe from any thread; the context manager closes it gracefully.
    backend = aiokv.MemoryBackend()
    with aiokv.ThreadedKVWorker(
        layout, backend, namespace="sync-engine", chunk_tokens=CHUNK_TOKENS
    ) as worker:
        code = engine(worker, cache, args.requests, args.timeout)
    print(f"ran in {time.perf_counter() - started:.2f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
