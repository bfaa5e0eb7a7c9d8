"""An asyncio "engine" on aiokv: it admits many requests with shared prefixes, loads cached prefixes,
prefills the rest, stores finished prefills, and never waits on a transfer while it schedules.

The engine is one scheduling loop that runs a step every millisecond, as a serving engine's scheduler
does. A request goes through:

    waiting -> (blocks allocated) lookup -> load of the hit prefix -> prefill of the rest
            -> store of the prompt -> a few decode steps -> finished (blocks freed)

Transfers are submitted with ``worker.load``/``worker.store``, which return at once; each step only
polls ``future.done()``. A request's blocks are freed only once its store future is done: until
then the store may still read them.

The "model" is a stand-in that runs on a "GPU" (one thread, as a real forward pass runs off the
event loop): each step launches one forward pass over the prefill work the scheduler picked. A
block's KV is a deterministic function of the tokens up to the end of that block (as real attention
KV is; here a chained hash), so every loaded block is checked against what a prefill would write.
Prompts are a few shared system prompts plus user turns; half of the requests continue an earlier
conversation, so their history is a prefix hit.

    python examples/async_server.py [--requests 300] [--duration 20] [--arrival-ms 1.0]

Prints the hit rate, what moved, the event loop's lag while it all ran, and the byte check; exits
non-zero if any loaded block differs from a fresh prefill or a transfer failed.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import hashlib
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aiokv

LAYERS, HEADS, HEAD_DIM = 4, 4, 32
REGIONS = 2 * LAYERS  # one K and one V region per layer
BLOCK_SIZE = 16  # tokens per block
CHUNK_TOKENS = 64  # tokens per stored chunk (4 blocks)
BLOCK_BYTES = BLOCK_SIZE * HEADS * HEAD_DIM * 2  # one region's bytes of one block (float16)
PREFILL_BLOCKS_PER_STEP = 256  # the "GPU" budget of one forward pass
DECODE_STEPS = 3
VOCAB = 32_000


class Stage(enum.Enum):
    LOOKUP = "lookup"
    LOADING = "loading"
    PREFILL = "prefill"
    STORING = "storing"
    DECODE = "decode"


@dataclass(eq=False)
class Request:
    prompt: np.ndarray
    blocks: np.ndarray  # physical block ids, one per (partial) block of the prompt
    seeds: np.ndarray  # the stand-in model's value of each block
    lookup: asyncio.Task[int]
    stage: Stage = Stage.LOOKUP
    transfer: Any = None  # the TransferFuture in flight
    computed_blocks: int = 0  # blocks holding their KV (loaded or prefilled)
    scheduled_blocks: int = 0  # blocks handed to the forward pass in flight, or done
    decode_left: int = DECODE_STEPS


@dataclass
class Totals:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    finished: int = 0
    chunks_written: int = 0
    chunks_skipped: int = 0
    failed_transfers: int = 0
    checked_blocks: int = 0
    bad_blocks: int = 0
    steps: int = 0
    forward_passes: int = 0
    lags_ms: list[float] = field(default_factory=list)


# -- the stand-in model ---------------------------------------------------------------------------


def block_seeds(prompt: np.ndarray) -> np.ndarray:
    """One 64-bit value per (partial) block, from every token up to the end of that block."""
    digests = aiokv.chunk_hashes(prompt, BLOCK_SIZE)  # chained: block i covers tokens [0, end_i)
    tail = prompt[len(digests) * BLOCK_SIZE :]
    if tail.size:
        previous = digests[-1] if digests else ""
        digests.append(hashlib.sha256(previous.encode() + tail.astype("<u4").tobytes()).hexdigest())
    return np.array([int(d[:16], 16) for d in digests], dtype=np.uint64)


def block_kv(seeds: np.ndarray, region: int) -> np.ndarray:
    """What the model writes into ``region`` for blocks with these seeds: ``(blocks, BLOCK_BYTES)``."""
    words = np.broadcast_to((seeds ^ np.uint64(region + 1))[:, None], (seeds.size, BLOCK_BYTES // 8))
    return np.ascontiguousarray(words).view(np.uint8)


class Engine:
    def __init__(self, worker: aiokv.KVWorker, cache: list[np.ndarray], num_blocks: int) -> None:
        self.worker = worker
        self.cache = cache  # REGIONS arrays of (num_blocks, BLOCK_BYTES) bytes
        self.free: deque[int] = deque(np.random.default_rng(1).permutation(num_blocks).tolist())
        self.waiting: deque[np.ndarray] = deque()
        self.running: list[Request] = []
        self.totals = Totals()
        self.gpu = ThreadPoolExecutor(1, thread_name_prefix="gpu")
        self.forward: asyncio.Future[int] | None = None
        self.checks: list[tuple[Request, int]] = []  # loaded prefixes to verify in the next pass
        self.ranges: list[tuple[Request, int, int]] = []  # prefill work of the pass in flight

    # -- the forward pass (on the "GPU" thread) -------------------------------------------------

    def forward_pass(self, ranges: list[tuple[Request, int, int]], checks: list[tuple[Request, int]]) -> int:
        """Compare loaded blocks with what the model computes, then prefill; returns mismatches."""
        bad = 0
        for request, count in checks:
            blocks, seeds = request.blocks[:count], request.seeds[:count]
            wrong = np.zeros(count, dtype=bool)
            for r, region in enumerate(self.cache):
                wrong |= (region[blocks] != block_kv(seeds, r)).any(axis=1)
            bad += int(wrong.sum())
        for request, first, end in ranges:
            for r, region in enumerate(self.cache):
                region[request.blocks[first:end]] = block_kv(request.seeds[first:end], r)
        return bad

    # -- scheduling (on the event loop) ---------------------------------------------------------

    def step(self) -> None:
        """One engine step: advance every request as far as it can go without waiting."""
        self.totals.steps += 1
        self.admit()
        for request in list(self.running):
            if request.stage is Stage.LOOKUP and request.lookup.done():
                self.start_load(request)
            if request.stage is Stage.LOADING and request.transfer.done():
                self.finish_load(request)
            if request.stage is Stage.STORING and request.transfer.done():
                self.finish_store(request)
            elif request.stage is Stage.DECODE:
                request.decode_left -= 1
                if request.decode_left <= 0:
                    self.finish(request)
        if self.forward is None or self.forward.done():
            self.finish_forward()
            self.launch_forward()

    def admit(self) -> None:
        while self.waiting:
            prompt = self.waiting[0]
            needed = -(-prompt.size // BLOCK_SIZE)
            if needed > len(self.free):
                return  # no room: it waits for running requests to free their blocks
            self.waiting.popleft()
            blocks = np.array([self.free.popleft() for _ in range(needed)], dtype=np.int64)
            # lookup is a coroutine; as a task it runs while the engine keeps stepping.
            lookup = asyncio.ensure_future(self.worker.lookup(prompt))
            self.running.append(Request(prompt, blocks, block_seeds(prompt), lookup))
            self.totals.prompt_tokens += prompt.size

    def start_load(self, request: Request) -> None:
        failed = request.lookup.cancelled() or request.lookup.exception() is not None
        self.totals.failed_transfers += failed
        hit = 0 if failed else request.lookup.result()
        # Keep at least the last token to compute: the engine needs its logits.
        hit = min(hit, (request.prompt.size - 1) // CHUNK_TOKENS * CHUNK_TOKENS)
        if hit == 0:
            request.stage = Stage.PREFILL
            return
        request.transfer = self.worker.load(request.prompt[:hit], [request.blocks[: hit // BLOCK_SIZE]])
        request.stage = Stage.LOADING

    def finish_load(self, request: Request) -> None:
        try:
            loaded = request.transfer.result().loaded_tokens
        except aiokv.AiokvError:
            self.totals.failed_transfers += 1
            loaded = 0
        # Blocks past the loaded prefix (missing or failed chunks) are simply recomputed.
        request.computed_blocks = request.scheduled_blocks = loaded // BLOCK_SIZE
        if loaded:
            self.totals.hit_requests += 1
            self.totals.hit_tokens += loaded
            self.checks.append((request, request.computed_blocks))
        request.stage = Stage.PREFILL

    def launch_forward(self) -> None:
        budget = PREFILL_BLOCKS_PER_STEP
        ranges = []
        for request in self.running:
            if request.stage is not Stage.PREFILL or budget == 0:
                continue
            first = request.scheduled_blocks
            end = min(request.blocks.size, first + budget)
            if end > first:
                ranges.append((request, first, end))
                request.scheduled_blocks = end
                budget -= end - first
        if not ranges and not self.checks:
            return
        checks, self.checks = self.checks, []
        self.totals.checked_blocks += sum(count for _, count in checks)
        self.ranges = ranges
        self.forward = asyncio.get_running_loop().run_in_executor(self.gpu, self.forward_pass, ranges, checks)
        self.totals.forward_passes += 1

    def finish_forward(self) -> None:
        if self.forward is None:
            return
        self.totals.bad_blocks += self.forward.result()
        self.forward = None
        for request, _, end in self.ranges:
            request.computed_blocks = end
            if end == request.blocks.size:
                # The prefill is done: store its whole chunks (a trailing partial chunk is not stored).
                request.transfer = self.worker.store(request.prompt, [request.blocks])
                request.stage = Stage.STORING
        self.ranges = []

    def finish_store(self, request: Request) -> None:
        try:
            result = request.transfer.result()
            self.totals.chunks_written += result.stored
            self.totals.chunks_skipped += result.skipped
        except aiokv.AiokvError:
            self.totals.failed_transfers += 1
        request.stage = Stage.DECODE

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.free.extend(request.blocks.tolist())  # the store is done: the blocks may be reused
        self.totals.finished += 1

    async def drain(self) -> None:
        """Wait for whatever is still in flight (after --duration cut the run short)."""
        if self.forward is not None:
            self.totals.bad_blocks += await self.forward
            self.forward = None
        pending: list[Any] = []
        for request in self.running:
            pending.append(request.lookup)
            if request.transfer is not None:
                pending.append(request.transfer)
        await asyncio.gather(*pending, return_exceptions=True)
        self.gpu.shutdown(wait=True)


def workload(requests: int, seed: int) -> list[np.ndarray]:
    """System prompts shared by many requests, and conversations that come back for another turn."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, size=int(rng.integers(256, 768))) for _ in range(4)]
    conversations: list[np.ndarray] = []
    prompts = []
    for _ in range(requests):
        turn = rng.integers(0, VOCAB, size=int(rng.integers(32, 384)))
        index = int(rng.integers(len(conversations))) if conversations else -1
        if index >= 0 and rng.random() < 0.5 and conversations[index].size + turn.size <= 4096:
            prompt = np.concatenate([conversations[index], turn])  # the whole history, then a new turn
            conversations[index] = prompt
        else:
            prompt = np.concatenate([systems[int(rng.integers(len(systems)))], turn])
            conversations.append(prompt)
        prompts.append(prompt)
    return prompts


async def serve(args: argparse.Namespace) -> int:
    num_blocks = args.blocks
    cache = [np.zeros((num_blocks, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    layout = aiokv.KVLayout(
        [region.ctypes.data for region in cache], [BLOCK_BYTES], BLOCK_SIZE, num_blocks, dtype="float16"
    )
    prompts = workload(args.requests, args.seed)
    backend = aiokv.MemoryBackend(capacity_bytes=2 << 30)
    async with aiokv.KVWorker(layout, backend, namespace="async-server", chunk_tokens=CHUNK_TOKENS) as worker:
        engine = Engine(worker, cache, num_blocks)
        totals = engine.totals
        stop = asyncio.Event()

        async def ticker() -> None:  # how late the loop wakes from a 1 ms sleep: its lag
            while not stop.is_set():
                started = time.perf_counter()
                await asyncio.sleep(0.001)
                totals.lags_ms.append((time.perf_counter() - started - 0.001) * 1e3)

        async def arrivals() -> None:  # requests keep arriving while the engine runs
            rng = np.random.default_rng(args.seed + 1)
            for prompt in prompts:
                engine.waiting.append(prompt)
                await asyncio.sleep(float(rng.exponential(args.arrival_ms / 1e3)))

        tick = asyncio.create_task(ticker())
        feed = asyncio.create_task(arrivals())
        started = time.perf_counter()
        deadline = started + args.duration
        while (not feed.done() or engine.waiting or engine.running) and time.perf_counter() < deadline:
            engine.step()
            await asyncio.sleep(0.001)  # the next step; transfers, lookups and the GPU progress meanwhile
        elapsed = time.perf_counter() - started
        stop.set()
        feed.cancel()
        await asyncio.gather(tick, feed, return_exceptions=True)
        await engine.drain()
        stats = worker.stats()

    lags = np.array(totals.lags_ms or [0.0])
    p50, p99 = np.percentile(lags, [50, 99]).tolist()
    admitted = totals.finished + len(engine.running)
    hit_rate = totals.hit_tokens / max(totals.prompt_tokens, 1)
    print(
        f"async_server: {len(prompts)} requests, {LAYERS} layers x K/V, block {BLOCK_SIZE} tokens, "
        f"chunk {CHUNK_TOKENS} tokens, cache of {num_blocks} blocks"
    )
    print(
        f"done     : {totals.finished} finished in {elapsed:.2f} s ({totals.steps} engine steps, "
        f"{totals.forward_passes} forward passes), {len(engine.running)} running, "
        f"{len(engine.waiting)} waiting"
    )
    print(
        f"hits     : {totals.hit_requests} of {admitted} requests hit; {totals.hit_tokens:,} of "
        f"{totals.prompt_tokens:,} prompt tokens loaded (token hit rate {hit_rate:.1%})"
    )
    print(
        f"transfers: {totals.chunks_written} chunks written, {totals.chunks_skipped} already stored, "
        f"{totals.failed_transfers} failed; {stats['bytes'].get('put', 0) / 1e6:.1f} MB put, "
        f"{stats['bytes'].get('get', 0) / 1e6:.1f} MB loaded, in {stats['batches']} batches"
    )
    print(f"loop lag : p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {lags.max():.2f} ms over {lags.size} ticks")
    verdict = "OK" if totals.bad_blocks == 0 else f"{totals.bad_blocks} MISMATCHED"
    print(f"verify   : {totals.checked_blocks} loaded blocks compared with the model's prefill: {verdict}")
    return 0 if totals.bad_blocks == 0 and totals.failed_transfers == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="requests to serve (default 300)")
    parser.add_argument("--duration", type=float, default=20.0, help="stop after this many seconds")
    parser.add_argument("--arrival-ms", type=float, default=1.0, help="mean time between arrivals")
    parser.add_argument("--blocks", type=int, default=4096, help="blocks in the KV cache (default 4096)")
    parser.add_argument("--seed", type=int, default=0)
    return aiokv.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
