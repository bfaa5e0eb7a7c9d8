"""The host-memory tier on its own, in one process: the scheduler's index (capacity, LRU, pins, the
ranks' reports) and real per-rank tier workers (MemoryBackend + aiokv worker) driven through the same
orders and reports the connector passes between vLLM's processes, every loaded byte checked."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import aiokv.backends.memory as memory_module
from aiokv.backends.memory import MemoryBackend
from aiokv.integrations.vllm.common.wire import TierReport
from aiokv.integrations.vllm.scheduler_side.tier_index import SchedulerTier, TierIndex
from aiokv.integrations.vllm.worker_side.tier_worker import TierWorker
from aiokv.keys import HashedPrompt, KeyNamespace
from aiokv.testing.paged_cache import SENTINEL, GroupCache

PAGE = 4096


def ready_index(capacity_chunks: int, ranks: int = 2) -> TierIndex:
    return TierIndex(capacity_chunks * PAGE, ranks)


def admit_ready(index: TierIndex, digest: str) -> bool:
    """Admit ``digest`` and have every rank report it written."""
    if not index.admit(digest, PAGE):
        return False
    index.on_report(TierReport({rank: {digest} for rank in range(index.ranks)}))
    return True


def test_a_chunk_hits_only_once_every_rank_wrote_it() -> None:
    index = ready_index(4)
    assert index.admit("a", PAGE) and not index.admit("a", PAGE)  # known: not admitted twice
    index.on_report(TierReport({0: {"a"}}))
    assert index.leading_ready(["a"]) == 0  # rank 1 has not written it yet
    index.on_report(TierReport({1: {"a"}}))
    assert index.leading_ready(["a", "b"]) == 1


def test_a_chunk_one_rank_could_not_write_is_dropped_everywhere() -> None:
    index = ready_index(4)
    index.admit("a", PAGE)
    index.on_report(TierReport(failed={1: {"a"}}))
    assert index.known("a") and index.take_step() is not None  # waits for rank 0: a drop never races a write
    index.on_report(TierReport(stored={0: {"a"}}))
    assert not index.known("a") and index.used_bytes == 0
    step = index.take_step()
    assert step is not None and step.removes == ("a",)  # rank 0 drops the copy it wrote


def test_capacity_in_bytes_and_least_recently_used_eviction() -> None:
    index = ready_index(3)
    for digest in "abc":
        assert admit_ready(index, digest)
    assert index.used_bytes == 3 * PAGE
    assert index.leading_ready(["a"]) == 1  # a is used: b is now the oldest
    assert admit_ready(index, "d")
    assert [index.ready(d) for d in "abcd"] == [True, False, True, True]
    assert index.used_bytes == 3 * PAGE and index.evictions == 1
    step = index.take_step()
    assert step is not None and "b" in step.removes and step.admits[-1] == "d"
    assert not index.admit("huge", 4 * PAGE)  # larger than the whole tier


def test_pinned_chunks_are_never_evicted() -> None:
    index = ready_index(2)
    admit_ready(index, "a")
    admit_ready(index, "b")
    assert index.pin(["a", "b"]) == ["a", "b"]
    assert not index.admit("c", PAGE)  # everything is pinned: no room, nothing dropped
    assert index.ready("a") and index.ready("b") and index.evictions == 0
    index.unpin(["b"])
    assert admit_ready(index, "c")
    assert index.ready("a") and not index.known("b")


def test_pending_chunks_are_never_evicted() -> None:
    index = ready_index(1)
    index.admit("a", PAGE)  # being written
    assert not index.admit("b", PAGE)
    assert index.known("a")


# -- real tier workers, two ranks, driven as the connector drives them --------------------------------

BLOCK_SIZE, BLOCKS_PER_CHUNK, REGIONS, BLOCK_LEN = 16, 2, 2, 2048
CHUNK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
CHUNK_BYTES = BLOCKS_PER_CHUNK * REGIONS * BLOCK_LEN  # one rank's shard of a chunk: two pages
NUM_BLOCKS = 96


@dataclass
class Spec:
    prompt: HashedPrompt


@dataclass
class Rank:
    cache: GroupCache
    tier: TierWorker


def chunk_bytes(rank: int, digest: str) -> np.ndarray:
    """What rank ``rank`` holds for chunk ``digest``: its own shard, different from every other's."""
    seed = int.from_bytes(digest.encode()[-6:], "little") * 7 + rank
    return np.random.default_rng(seed).integers(
        0, 256, (REGIONS, BLOCKS_PER_CHUNK, BLOCK_LEN), dtype=np.uint8
    )


class World:
    """A scheduler tier and two ranks' tier workers; each step's orders reach every rank, each rank's
    report reaches the scheduler merged, as vLLM's executor does it."""

    def __init__(self, capacity_chunks: int, ranks: int = 2) -> None:
        self.scheduler = SchedulerTier(
            capacity_chunks * CHUNK_BYTES, ranks, REGIONS * BLOCK_LEN, BLOCK_SIZE, behind=False
        )
        self.ranks = []
        for rank in range(ranks):
            cache = GroupCache.allocate(
                num_regions=REGIONS,
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                block_lens=BLOCK_LEN,
                fill=0,
            )
            tier = TierWorker(
                cache.layout,
                KeyNamespace("m", tp_rank=rank),
                CHUNK_TOKENS,
                capacity_chunks * CHUNK_BYTES,
                rank,
            )
            self.ranks.append(Rank(cache, tier))

    def close(self) -> None:
        for rank in self.ranks:
            rank.tier.close(timeout=10)

    def step(self, stores: list[Spec]) -> None:
        step = self.scheduler.on_step(stores)
        for rank in self.ranks:
            rank.tier.apply(step)

    def report(self, finished_loading: list[str] = ()) -> None:  # type: ignore[assignment]
        merged = TierReport()
        for rank in self.ranks:
            report = rank.tier.report()
            if report is not None:
                merged = merged.merge(report)
        self.scheduler.on_output(merged, finished_loading)

    def write_blocks(self, prompt: HashedPrompt, blocks: list[int]) -> None:
        for rank_id, rank in enumerate(self.ranks):
            for i, digest in enumerate(prompt.hashes):
                value = chunk_bytes(rank_id, digest)
                for r in range(REGIONS):
                    rows = blocks[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]
                    rank.cache.regions[r][rows] = value[r]

    def store(self, prompt: HashedPrompt, blocks: list[int]) -> list[concurrent.futures.Future[Any]]:
        """One step storing ``prompt`` from ``blocks``: the futures of every rank."""
        self.write_blocks(prompt, blocks)
        self.step([Spec(prompt)])
        return [f for rank in self.ranks for f in rank.tier.store_many([(prompt, [blocks])], timeout=30)]

    def load(self, req: str, prompt: HashedPrompt, blocks: list[int]) -> list[concurrent.futures.Future[Any]]:
        """One step loading ``prompt`` into ``blocks`` (after the scheduler pinned what it found)."""
        self.scheduler.on_load(req, prompt, asynchronous=True)
        self.step([])
        for rank in self.ranks:
            rank.cache.fill(SENTINEL, blocks)
        return [f for rank in self.ranks for f in rank.tier.load_many([(prompt, [blocks])], timeout=30)]

    def check_loaded(self, prompt: HashedPrompt, blocks: list[int], results: list[Any]) -> int:
        """Every block a load did not report failed holds exactly its chunk's bytes, on every rank;
        the number of failed blocks."""
        failed = 0
        for rank_id, (rank, result) in enumerate(zip(self.ranks, results, strict=True)):
            bad = set(result.failed_block_ids[0])
            failed += len(bad)
            for i, digest in enumerate(prompt.hashes):
                rows = blocks[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]
                if bad & set(rows):
                    continue
                want = chunk_bytes(rank_id, digest)
                for r in range(REGIONS):
                    assert np.array_equal(rank.cache.regions[r][rows], want[r]), (rank_id, digest)
        return failed


@pytest.fixture
def world() -> Any:
    w = World(capacity_chunks=6)
    yield w
    w.close()


def prompt_of(name: str, chunks: int) -> HashedPrompt:
    return HashedPrompt(tuple(f"{name}c{i}" for i in range(chunks)), CHUNK_TOKENS)


def test_stored_chunks_hit_after_the_reports_and_load_whole(world: World) -> None:
    prompt = prompt_of("p", 3)
    blocks = list(range(1, 7))
    futures = world.store(prompt, blocks)
    concurrent.futures.wait(futures)
    (hit,) = world.scheduler.lookup_client(None).lookup_many([prompt])
    assert hit.result() == 0  # not yet reported: not a hit
    world.step([])
    world.report()
    (hit,) = world.scheduler.lookup_client(None).lookup_many([prompt])
    assert hit.result() == 3 * CHUNK_TOKENS  # answered at once, from the index
    target = list(range(10, 16))
    results = [f.result() for f in world.load("r1", prompt, target)]
    assert world.check_loaded(prompt, target, results) == 0
    assert all(rank.tier.stats()["host_tier"]["hits"] == 3 for rank in world.ranks)


def test_eviction_pressure_never_loads_a_wrong_byte() -> None:
    """Many prompts through a tier of 6 chunks, stores and loads in flight across steps (so loads
    read chunks while later steps evict): every block a load fills holds its chunk's bytes, and a
    chunk the scheduler answered as a hit is never lost before its load (pins)."""
    world = World(capacity_chunks=6)
    rng = np.random.default_rng(5)
    prompts = [prompt_of(f"p{n}", int(rng.integers(1, 4))) for n in range(12)]
    in_flight: list[tuple[str, HashedPrompt, list[int], list[concurrent.futures.Future[Any]]]] = []
    stores: list[concurrent.futures.Future[Any]] = []
    free = list(range(1, NUM_BLOCKS))
    loads = hits = 0
    try:
        for step_no in range(150):
            prompt = prompts[int(rng.integers(len(prompts)))]
            blocks = [free.pop(0) for _ in range(len(prompt.hashes) * BLOCKS_PER_CHUNK)]
            (answer,) = world.scheduler.lookup_client(None).lookup_many([prompt])
            found = answer.result() // CHUNK_TOKENS
            if found:
                hit = HashedPrompt(prompt.hashes[:found], CHUNK_TOKENS)
                req = f"r{step_no}"
                futures = world.load(req, hit, blocks[: found * BLOCKS_PER_CHUNK])
                in_flight.append((req, hit, blocks[: found * BLOCKS_PER_CHUNK], futures))
                hits += found
            else:
                stores += world.store(prompt, blocks)
            # Finish the oldest load only two steps later: later steps' orders meet it in flight.
            finished = []
            while len(in_flight) > 2 or (in_flight and step_no == 149):
                req, hit, target, futures = in_flight.pop(0)
                assert world.check_loaded(hit, target, [f.result(timeout=30) for f in futures]) == 0
                finished.append(req)
                loads += 1
                free += target
            concurrent.futures.wait(stores, timeout=30)
            stores = []
            world.report(finished)
            if not found:
                free += blocks
        evictions = sum(rank.tier.stats()["host_tier"]["evictions"] for rank in world.ranks)
        assert loads > 20 and hits > 20 and evictions > 20
        assert world.scheduler.index.used_bytes <= 6 * CHUNK_BYTES
        assert all(rank.tier.store.used_bytes <= 6 * CHUNK_BYTES for rank in world.ranks)
    finally:
        world.close()


def test_a_removed_value_keeps_its_space_while_a_get_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryBackend frees a removed value's space at once unless a get is copying it out; then the
    space is reused only once that get is done, and it read the value's bytes."""
    backend = MemoryBackend(capacity_bytes=2 * PAGE)
    source = np.arange(2 * PAGE, dtype=np.uint64).astype(np.uint8)
    target = np.zeros(PAGE, dtype=np.uint8)
    backend.register_buffer(source.ctypes.data, source.nbytes)
    backend.register_buffer(target.ctypes.data, target.nbytes)
    base = source.ctypes.data
    assert backend.batch_put(["a", "b"], [[base], [base + PAGE]], [[PAGE], [PAGE]]) == [0, 0]
    copying, release = threading.Event(), threading.Event()
    real_scatter = memory_module._scatter

    def held_scatter(*args: Any) -> None:
        copying.set()
        assert release.wait(10)
        real_scatter(*args)

    monkeypatch.setattr(memory_module, "_scatter", held_scatter)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        read = pool.submit(backend.batch_get, ["a"], [[target.ctypes.data]], [[PAGE]])
        assert copying.wait(10)
        monkeypatch.setattr(memory_module, "_scatter", real_scatter)
        assert backend.batch_remove(["a", "b"]) == [0, 0]
        overwrite = np.full(2 * PAGE, 0xEE, dtype=np.uint8)
        backend.register_buffer(overwrite.ctypes.data, overwrite.nbytes)
        # b's space is free at once; a's is not while the get copies it.
        assert backend.batch_put(["c"], [[overwrite.ctypes.data]], [[PAGE]]) == [0]
        assert backend.batch_put(["d"], [[overwrite.ctypes.data + PAGE]], [[PAGE]]) == [
            memory_module.NO_SPACE
        ]
        release.set()
        assert read.result(10) == [PAGE]
    assert np.array_equal(target, source[:PAGE])  # the get read a's bytes, not c's or d's
    assert backend.batch_put(["d"], [[overwrite.ctypes.data + PAGE]], [[PAGE]]) == [0]  # freed after the get
    backend.close()


def test_a_tier_in_front_of_a_store_reads_local_first_and_promotes() -> None:
    """A tier of 4 chunks per rank in front of a store holding a 6-chunk prompt (both real: the store
    behind is a MemoryBackend of its own, as Mooncake would be): the first load reads every chunk from
    behind and promotes the 4 the scheduler admitted; the second reads those 4 from the tier and the
    rest from behind; every byte is the chunk's."""
    from aiokv.integrations.vllm.common.stats_reporter import connector_counters
    from aiokv.threaded import ThreadedKVWorker

    world = World(capacity_chunks=4, ranks=1)
    world.scheduler.behind = True
    rank = world.ranks[0]
    behind_store = MemoryBackend(1 << 20)
    behind = ThreadedKVWorker(
        rank.cache.layout, behind_store, namespace=KeyNamespace("m"), chunk_tokens=CHUNK_TOKENS
    )
    rank.tier.behind = behind
    try:
        prompt = prompt_of("b", 6)
        blocks = list(range(1, 13))
        world.write_blocks(prompt, blocks)
        assert behind.store(prompt, [blocks]).result(10).stored == 6  # written by another engine
        target = list(range(20, 32))
        for round_no in range(2):
            (answer,) = world.scheduler.lookup_client(behind).lookup_many([prompt])
            assert answer.result(10) == 6 * CHUNK_TOKENS  # the tier's chunks, then the store's
            results = [f.result(10) for f in world.load(f"r{round_no}", prompt, target)]
            assert world.check_loaded(prompt, target, results) == 0
            world.report([f"r{round_no}"])
        stats = rank.tier.stats()
        assert stats["host_tier"]["promotions"] == 4 and stats["host_tier"]["hits"] == 4
        assert stats["chunks"]["loaded"] == 6 + 2  # the store behind's counters: both rounds' misses
        counters = connector_counters(stats)
        assert counters["host_tier_hits"] == 4 and counters["host_tier_promotions"] == 4
        assert counters["chunks_loaded"] == 8
    finally:
        world.close()  # closes the worker behind too
        behind_store.close()


def test_the_tier_backends_and_their_capacity_are_checked() -> None:
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig, tier_capacity_per_rank

    tiered = ConnectorConfig.from_extra_config({"backend": "tiered", "memory_capacity": "2GiB"})
    assert tiered.host_tier and tiered.remote
    memory = ConnectorConfig.from_extra_config({"backend": "memory"})
    assert memory.host_tier and not memory.remote
    assert not ConnectorConfig.from_extra_config({}).host_tier
    assert tier_capacity_per_rank(tiered, 2) == 1 << 30  # the engine's whole tier, split over its ranks
    with pytest.raises(ValueError, match="memory_capacity"):
        ConnectorConfig.from_extra_config({"backend": "memory", "memory_capacity": 0})
