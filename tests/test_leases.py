"""The lease budget (aiokv/leases.py): the ledger's arithmetic on a clock of the test's own (distinct
chunks: a chunk looked up again holds one lease; a loaded chunk stops counting; "no space" cuts the
limit and puts taken whole give it back), and workers over a real Mooncake store (loopback master):
lookups stop asking about new chunks once the budget is spent and ask again as their leases run out; a
chunk looked up twice holds one lease in the store as in the ledger; under memory pressure, duplicate
lookups keep answering whole and many lookups never starve eviction; a stream of distinct prompts each
half the cache keeps every hit as each is loaded; a put answered "no space" cuts the budget and puts
taken whole give it back. Across nodes in a real cluster: tests/cluster/test_leases.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import Code, HashedPrompt, KVLayout, KVWorker, LeaseBudget, MemoryBackend, ThreadedKVWorker
from aiokv.backends.base import check_backend
from aiokv.backends.mooncake_master import MooncakeMaster
from aiokv.leases import LeaseLedger

from .helpers import chunk_keys

CHUNK_TOKENS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_grants_what_the_budget_has_room_for_and_frees_it_after_the_lease() -> None:
    clock = Clock()
    ledger = LeaseLedger(10, lease_s=2.0, clock=clock)
    first = ledger.reserve(6)
    second = ledger.reserve(6)
    assert (first.granted, second.granted) == (6, 4)  # asking lookups hold theirs: no overshoot
    ledger.settle(first, 6)
    ledger.settle(second, 1)  # only the found chunks stay held
    assert ledger.held() == 7
    third = ledger.reserve(5)
    assert third.granted == 3
    ledger.settle(third, 3)
    assert ledger.reserve(1).granted == 0
    clock.now += 2.0  # every lease over
    assert ledger.held() == 0
    assert ledger.reserve(12).granted == 10
    assert ledger.snapshot()["trimmed_lookups"] == 4
    assert ledger.snapshot()["trimmed_chunks"] == 2 + 2 + 1 + 2


def digests(name: str, chunks: int) -> list[str]:
    return [f"{name}{i}" for i in range(chunks)]


def test_a_chunk_looked_up_again_holds_one_lease_renewed_by_the_last_lookup() -> None:
    clock = Clock()
    ledger = LeaseLedger(8, lease_s=2.0, clock=clock)
    a, b = digests("a", 4), digests("b", 4)
    # Concurrent duplicates: the second lookup of A finds A's chunks reserved and reserves nothing.
    one, two = ledger.reserve(4, a), ledger.reserve(4, a)
    assert (one.granted, two.granted, len(one.reserved), len(two.reserved)) == (4, 4, 4, 0)
    assert ledger.held() == 4
    ledger.settle(one, one.digests or ())
    ledger.settle(two, two.digests or ())
    assert ledger.held() == 4 and ledger.renewed_chunks == 4
    # Re-asked lookups of A, B, A, B...: 8 distinct chunks fill the budget, and never more.
    for _ in range(5):
        for prompt in (a, b):
            claim = ledger.reserve(4, prompt)
            assert claim.granted == 4
            ledger.settle(claim, prompt)
    assert ledger.held() == 8 and ledger.snapshot()["trimmed_lookups"] == 0
    # The budget is full of distinct chunks: a new prompt gets only the chunks it shares with them.
    shared = [*a[:2], "c2", "c3"]
    claim = ledger.reserve(4, shared)
    assert claim.granted == 2 and claim.reserved == ()
    ledger.settle(claim, shared[:2])
    # Each chunk is held until a lease after the last lookup that found it.
    clock.now += 1.5
    ledger.settle(ledger.reserve(4, a), a)  # A renewed at 101.5, B not since 100
    clock.now += 0.5
    assert ledger.held() == 4  # B's leases are over, A's run until 103.5
    assert ledger.reserve(4, b).granted == 4
    clock.now += 1.5
    assert ledger.held() == 4  # only B's reservation: A's leases ended, B has not answered
    assert ledger.snapshot()["trimmed_chunks"] == 2


def test_a_failed_lookup_counts_all_it_asked_about_and_a_lookup_by_count_is_counted_by_count() -> None:
    clock = Clock()
    ledger = LeaseLedger(8, lease_s=2.0, clock=clock)
    by_count = ledger.reserve(5)  # no names: 5 reserved by count
    assert by_count.granted == 5 and ledger.held() == 5
    named = ledger.reserve(4, digests("a", 4))
    assert named.granted == 3
    ledger.settle(by_count, 2)  # it found 2 chunks, unnamed
    ledger.settle(named, named.digests or ())  # failed: the store may have leased all 3 it asked about
    assert ledger.held() == 2 + 3
    clock.now += 2.0
    assert ledger.held() == 0


def test_a_stream_of_distinct_prompts_half_the_budget_each_keeps_every_hit_as_each_is_loaded() -> None:
    clock = Clock()
    ledger = LeaseLedger(8, lease_s=10.0, clock=clock)
    # Twelve distinct prompts of half the budget, four a second: six budgets' worth within one lease.
    for n in range(12):
        found = digests(f"p{n}-", 4)
        claim = ledger.reserve(4, found)
        assert claim.granted == 4, f"prompt {n} was trimmed to {claim.granted} chunks"
        ledger.settle(claim, found)
        ledger.loaded(found)  # the engine loads the hit: its load leases the chunks itself
        clock.now += 0.25
    assert (ledger.held(), ledger.leased(), ledger.loaded_chunks) == (0, 48, 48)
    # A loaded chunk found again (a prompt sharing it) is held for the new lookup until its own load.
    again = digests("p0-", 4)
    claim = ledger.reserve(4, again)
    assert claim.granted == 4 and claim.reserved == tuple(again)
    ledger.settle(claim, again)
    assert ledger.held() == 4 and ledger.renewed_chunks == 4
    ledger.loaded(again)
    # Hits never loaded (requests waiting, or aborted) count for their lease: the budget bounds them.
    waiting = [digests(f"w{n}-", 4) for n in range(3)]
    claims = [ledger.reserve(4, found) for found in waiting]
    assert [claim.granted for claim in claims] == [4, 4, 0]
    for claim, found in zip(claims, waiting, strict=True):
        ledger.settle(claim, found[: claim.granted])
    assert ledger.held() == 8 and ledger.snapshot()["trimmed_lookups"] == 1
    clock.now += 10.0
    assert ledger.held() == ledger.leased() == 0


def test_no_space_answers_cut_the_limit_and_puts_taken_whole_give_it_back() -> None:
    clock = Clock()
    ledger = LeaseLedger(16, lease_s=2.0, clock=clock)
    loaded, waiting = digests("a", 8), digests("b", 4)
    for found in (loaded, waiting):
        ledger.settle(ledger.reserve(len(found), found), found)
    ledger.loaded(loaded)
    assert ledger.held() == 4 and ledger.leased() == 12
    ledger.store_took()  # puts taken while nothing is cut change nothing
    assert ledger.limit == 16

    # "No space": the limit halves once per burst, and loaded chunks count again (loads lease too).
    ledger.store_full()
    ledger.store_full()
    assert (ledger.limit, ledger.limit_cuts, ledger.held()) == (8, 1, 12)
    # Past the cut limit nothing is granted, not even a renewal: the excess runs out within a lease.
    assert ledger.reserve(4, waiting).granted == 0
    assert ledger.reserve(1, digests("c", 1)).granted == 0
    clock.now += 0.5  # a quarter lease: the next answer cuts again, never below a sixteenth
    for _ in range(4):
        ledger.store_full()
        clock.now += 0.5
    assert (ledger.limit, ledger.limit_cuts) == (1, 4)
    assert ledger.held() == 0  # every lease found at 100.0 ran out at 102.0
    fresh = digests("c", 4)
    claim = ledger.reserve(4, fresh)
    assert claim.granted == 1
    ledger.settle(claim, fresh[:1])

    # Each put call the store takes whole gives a sixteenth back, up to the budget.
    limits = []
    for _ in range(16):
        ledger.store_took()
        limits.append(ledger.limit)
    assert limits == [*range(2, 17), 16]
    assert ledger.reserve(4, fresh).granted == 4

    # Without any put, a lease with no "no space" answer gives the whole budget back.
    clock.now += 0.5
    ledger.store_full()
    assert ledger.limit == 8
    clock.now += 1.5
    assert ledger.snapshot()["limit_chunks"] == 8
    clock.now += 0.5
    snapshot = ledger.snapshot()
    assert (snapshot["limit_chunks"], snapshot["max_chunks"], snapshot["limit_cuts"]) == (16, 16, 5)


def test_the_budget_bounds_bytes_and_chunks_and_refuses_nonsense() -> None:
    assert LeaseBudget().chunk_limit(chunk_bytes=1000, cache_bytes=64_000) == 64  # the cache by default
    assert LeaseBudget(max_bytes=10_000).chunk_limit(1000, 64_000) == 10
    assert LeaseBudget(max_bytes=10_000, max_chunks=3).chunk_limit(1000, 64_000) == 3
    with pytest.raises(ValueError):
        LeaseBudget(max_bytes=-1)
    with pytest.raises(TypeError):
        LeaseBudget(max_chunks=2.5)  # type: ignore[arg-type]


def test_a_backend_with_a_nonsense_lease_is_refused() -> None:
    backend = MemoryBackend()
    for bad in (-1.0, "10", True, float("inf")):
        backend.read_lease_s = bad  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="read_lease_s"):
            check_backend(backend)


def cache_and_layout(blocks: int = 64) -> tuple[np.ndarray[Any, Any], KVLayout]:
    cache = np.zeros((2, blocks, 4096), dtype=np.uint8)
    layout = KVLayout([int(cache[r].ctypes.data) for r in range(2)], [4096], CHUNK_TOKENS, blocks)
    return cache, layout


def prompt(seed: int, chunks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK_TOKENS).tolist()


@pytest.mark.asyncio
async def test_the_embedded_store_leases_nothing_and_its_lookups_are_never_trimmed() -> None:
    cache, layout = cache_and_layout()
    budget = LeaseBudget(max_chunks=1)
    async with KVWorker(
        layout, MemoryBackend(), namespace="m", chunk_tokens=16, lease_budget=budget
    ) as worker:
        assert (await worker.store(prompt(1, 4), [list(range(4))])).stored == 4
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert worker.stats()["leases"] is None
    del cache


@pytest.mark.asyncio
async def test_lookups_past_the_budget_ask_about_fewer_chunks_until_their_leases_run_out(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., Any]
) -> None:
    lease_s = 1.0
    backend = mooncake_backend_factory(mooncake_master.address, default_kv_lease_ttl=int(lease_s * 1000))
    assert backend.read_lease_s == lease_s
    cache, layout = cache_and_layout()
    tag = f"leases-{time.monotonic_ns()}"
    budget = LeaseBudget(max_chunks=6)
    async with KVWorker(layout, backend, namespace=tag, chunk_tokens=16, lease_budget=budget) as worker:
        for seed, first in ((1, 0), (2, 4)):
            assert (await worker.store(prompt(seed, 4), [list(range(first, first + 4))])).stored == 4
        await asyncio.sleep(lease_s * 1.1)  # whatever the stores' own existence checks counted is over
        started = time.monotonic()
        assert await worker.lookup(prompt(1, 4)) == 4 * CHUNK_TOKENS
        assert await worker.lookup(prompt(2, 4)) == 2 * CHUNK_TOKENS  # 2 of 6 left: asked about 2
        # Spent: asked about the 2 chunks it holds already (renewed, not counted again), not the rest.
        assert await worker.lookup(prompt(2, 4)) == 2 * CHUNK_TOKENS
        assert await worker.lookup(prompt(3, 4)) == 0  # nothing of it held: nothing asked, nothing leased
        leases = worker.stats()["leases"]
        assert time.monotonic() - started < lease_s, "too slow a machine: the leases ran out meanwhile"
        assert leases["held_chunks"] == 6 and leases["max_chunks"] == 6
        assert leases["trimmed_lookups"] == 3 and leases["trimmed_chunks"] == 2 + 2 + 4
        assert leases["renewed_chunks"] == 2
        # A lookup that is never followed by its load (an aborted request) holds nothing past the lease.
        await asyncio.sleep(lease_s * 1.1)
        assert worker.stats()["leases"]["held_chunks"] == 0
        assert await worker.lookup(prompt(2, 4)) == 4 * CHUNK_TOKENS
    del cache


# -- many lookups of a real Mooncake store under memory pressure --------------------------------------

PRESSURE_LEASE_S = 2.0
PRESSURE_MASTER_ARGS = (
    f"--default_kv_lease_ttl={int(PRESSURE_LEASE_S * 1000)}",
    "--eviction_high_watermark_ratio=0.95",  # no eviction ahead of need: only a full store evicts
    "--eviction_ratio=0.1",
)
PAGE = 64 << 10  # 2 regions x 64 KiB: 128 KiB a chunk (one block)
FILL_CHUNKS = 32  # 4 MiB a prompt; 7 of them fill 28 MiB of the 32 MiB segment
FILL_SEEDS = tuple(range(7000, 7007))
BIG_CHUNKS = 64  # 8 MiB: fits only once at least 4 MiB of the fill is evicted
STORE_BOUND_S = 6.0  # how long a store keeps trying (three lease lengths)
BUDGET_BYTES = 8 << 20  # 64 chunks: two fill prompts


def paged_cache(blocks: int) -> tuple[np.ndarray[Any, Any], KVLayout]:
    cache = np.random.default_rng(blocks).integers(0, 256, (2, blocks, PAGE), dtype=np.uint8)
    layout = KVLayout([int(cache[r].ctypes.data) for r in range(2)], [PAGE], CHUNK_TOKENS, blocks)
    return cache, layout


async def store_whole(
    worker: KVWorker, backend: Any, layout: KVLayout, tag: str, seed: int
) -> tuple[bool, int]:
    """Store the big prompt, again for its failed chunks, until it is whole or STORE_BOUND_S passed;
    (whole, attempts). Whole: the last store failed nothing and every key is present."""
    tokens = prompt(seed, BIG_CHUNKS)
    keys = chunk_keys(tokens, CHUNK_TOKENS, layout, 0, tag)
    deadline = time.monotonic() + STORE_BOUND_S
    attempts = 0
    while True:
        attempts += 1
        result = await worker.store(tokens, [np.arange(BIG_CHUNKS)])
        if result.failed == 0 and all(backend.batch_exists(keys)):
            return True, attempts
        if time.monotonic() > deadline:
            return False, attempts
        await asyncio.sleep(0.2)


class LookupLoop:
    """A reader looking up ``seeds``' prompts round after round (every answer kept per seed), as an
    engine's scheduler asks about waiting and re-asked requests; stopped, it never loads: the requests
    are aborted."""

    def __init__(self, worker: KVWorker, seeds: tuple[int, ...]) -> None:
        self.answers: dict[int, list[int]] = {seed: [] for seed in seeds}
        self._worker = worker
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            for seed, answers in self.answers.items():
                answers.append(await self._worker.lookup(prompt(seed, FILL_CHUNKS)) // CHUNK_TOKENS)
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await self._task

    @property
    def lookups(self) -> int:
        return sum(map(len, self.answers.values()))


@pytest.mark.mooncake
@pytest.mark.asyncio
async def test_many_duplicate_lookups_keep_the_budget_and_never_starve_eviction(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., Any],
    record_property: Callable[[str, object], None],
) -> None:
    master = mooncake_master_factory(extra_args=PRESSURE_MASTER_ARGS)
    backend = mooncake_backend_factory(
        master.address, global_segment_size=32 << 20, default_kv_lease_ttl=int(PRESSURE_LEASE_S * 1000)
    )
    tag = f"pressure-{time.monotonic_ns()}"
    (writer_cache, writer_layout), (cache_b, layout_b), (cache_u, layout_u) = (
        paged_cache(BIG_CHUNKS),
        paged_cache(1),
        paged_cache(1),
    )
    figures: dict[str, Any] = {}

    async def fill(writer: KVWorker) -> None:
        for seed in FILL_SEEDS:
            stored = await writer.store(prompt(seed, FILL_CHUNKS), [np.arange(FILL_CHUNKS)])
            assert stored.stored + stored.skipped == FILL_CHUNKS, f"the fill itself failed: {stored}"
        await asyncio.sleep(PRESSURE_LEASE_S * 1.2)  # the leases of the writer's own existence checks end

    def remove(seeds: tuple[int, ...], chunks: int) -> None:
        for seed in seeds:
            backend.batch_remove(
                chunk_keys(prompt(seed, chunks), CHUNK_TOKENS, writer_layout, 0, tag), force=True
            )

    async with (
        KVWorker(
            writer_layout, backend, namespace=tag, chunk_tokens=CHUNK_TOKENS, lease_budget=None
        ) as writer,
        KVWorker(
            layout_b,
            backend,
            namespace=tag,
            chunk_tokens=CHUNK_TOKENS,
            lease_budget=LeaseBudget(BUDGET_BYTES),
        ) as bounded,
        KVWorker(layout_u, backend, namespace=tag, chunk_tokens=CHUNK_TOKENS, lease_budget=None) as unbounded,
    ):
        # 1. The control: an unbounded reader's lookups pin the whole fill; the big prompt never fits.
        await fill(writer)
        loop = LookupLoop(unbounded, FILL_SEEDS)
        await asyncio.sleep(0.3)  # a round or more: every fill prompt leased
        starved, attempts = await store_whole(writer, backend, writer_layout, tag, 1)
        await loop.stop()
        figures.update(control_lookups=loop.lookups, control_stored=starved, control_attempts=attempts)
        assert min(map(max, loop.answers.values())) == FILL_CHUNKS, "the control's lookups found too little"
        assert not starved, f"the control stored the big prompt: its leases pinned nothing ({figures})"
        # Its requests aborted (nothing loaded): one lease later nothing is pinned any more.
        await asyncio.sleep(PRESSURE_LEASE_S * 1.2)
        released, attempts = await store_whole(writer, backend, writer_layout, tag, 2)
        figures.update(after_abort_stored=released, after_abort_attempts=attempts)
        assert released, f"leases of aborted lookups still blocked eviction after their lease ({figures})"
        remove((*FILL_SEEDS,), FILL_CHUNKS)
        remove((1, 2), BIG_CHUNKS)

        # 2. Duplicates within the budget: two prompts asked again and again, also at once, always
        # answer whole and hold 64 distinct chunks (counted per lookup, the second lookup found none).
        await fill(writer)
        a, b = FILL_SEEDS[:2]
        for _ in range(5):
            answers = await asyncio.gather(*(bounded.lookup(prompt(s, FILL_CHUNKS)) for s in (a, a, b, b, a)))
            assert answers == [FILL_CHUNKS * CHUNK_TOKENS] * 5, answers
        leases = bounded.stats()["leases"]
        assert leases["max_chunks"] == BUDGET_BYTES // (2 * PAGE) == 2 * FILL_CHUNKS
        assert leases["held_chunks"] == 2 * FILL_CHUNKS and leases["trimmed_lookups"] == 0, leases

        # 3. Many lookups of every fill prompt with the budget full: the held prompts still answer
        # whole, the others are trimmed (nothing asked, nothing pinned), and the big prompt is stored.
        loop = LookupLoop(bounded, FILL_SEEDS)
        await asyncio.sleep(0.3)
        stored, attempts = await store_whole(writer, backend, writer_layout, tag, 3)
        await loop.stop()
        leases = bounded.stats()["leases"]
        figures.update(bounded_lookups=loop.lookups, bounded_stored=stored, bounded_attempts=attempts)
        figures.update(bounded_ledger=leases)
        for name, value in figures.items():
            record_property(name, value)
        assert set(loop.answers[a]) == set(loop.answers[b]) == {FILL_CHUNKS}, "a repeat shrank the budget"
        assert all(set(loop.answers[s]) == {0} for s in FILL_SEEDS[2:]), "the budget let more be pinned"
        assert leases["held_chunks"] <= leases["max_chunks"] and leases["trimmed_lookups"] > 0, leases
        assert stored, f"lookups within the budget starved the store ({figures})"
    del writer_cache, cache_b, cache_u


@pytest.mark.mooncake
@pytest.mark.asyncio
async def test_a_chunk_looked_up_twice_holds_one_lease_in_the_store_and_the_ledger_ending_together(
    mooncake_master_factory: Callable[..., MooncakeMaster], mooncake_backend_factory: Callable[..., Any]
) -> None:
    # What the ledger counts is what Mooncake does: a second existence check renews the key's one
    # lease (to a lease after the later check), it does not add another.
    lease_s = 2.0
    master = mooncake_master_factory(extra_args=(f"--default_kv_lease_ttl={int(lease_s * 1000)}",))
    backend = mooncake_backend_factory(master.address, default_kv_lease_ttl=int(lease_s * 1000))
    cache, layout = cache_and_layout()
    tag = f"renew-{time.monotonic_ns()}"
    chunks = 4
    keys = chunk_keys(prompt(1, chunks), CHUNK_TOKENS, layout, 0, tag)
    async with KVWorker(
        layout, backend, namespace=tag, chunk_tokens=16, lease_budget=LeaseBudget(max_chunks=chunks)
    ) as worker:
        assert (await worker.store(prompt(1, chunks), [list(range(chunks))])).stored == chunks
        await asyncio.sleep(lease_s * 1.1)  # the store's own existence checks' leases are over
        started = time.monotonic()
        assert await worker.lookup(prompt(1, chunks)) == chunks * CHUNK_TOKENS
        await asyncio.sleep(lease_s * 0.6)
        assert await worker.lookup(prompt(1, chunks)) == chunks * CHUNK_TOKENS  # not trimmed: a renewal
        await asyncio.sleep(lease_s * 0.6)  # past the first lookup's lease, within the second's
        held_by_store = backend.batch_remove(keys, force=False)
        held_by_ledger = worker.stats()["leases"]["held_chunks"]
        assert time.monotonic() - started < lease_s * 1.55, "too slow a machine: the timeline slipped"
        assert held_by_store == [int(Code.LEASE_HELD)] * chunks, "the second lookup did not renew the lease"
        assert held_by_ledger == chunks and worker.stats()["leases"]["renewed_chunks"] == chunks
        await asyncio.sleep(lease_s * 0.7)  # past the second lookup's lease: both let go
        assert worker.stats()["leases"]["held_chunks"] == 0
        assert backend.batch_remove(keys, force=False) == [0] * chunks
    del cache


# -- the budget follows loads and the store's room (real Mooncake store) ------------------------------

LONG_LEASE_MS = 60_000  # longer than any of these tests: every lease they grant lasts to their end


@pytest.mark.mooncake
@pytest.mark.asyncio
async def test_a_stream_of_distinct_prompts_each_half_the_cache_keeps_every_hit_while_the_store_has_room(
    mooncake_master_factory: Callable[..., MooncakeMaster], mooncake_backend_factory: Callable[..., Any]
) -> None:
    master = mooncake_master_factory(extra_args=(f"--default_kv_lease_ttl={LONG_LEASE_MS}",))
    backend = mooncake_backend_factory(master.address, default_kv_lease_ttl=LONG_LEASE_MS)
    (cache, layout), (other_cache, other_layout) = cache_and_layout(64), cache_and_layout(64)
    tag = f"stream-{time.monotonic_ns()}"
    half = 32  # chunks: half the reader's 64-block cache, its default budget
    stream = tuple(range(100, 108))  # four budgets' worth of distinct prompts, all within one lease
    async with (
        KVWorker(layout, backend, namespace=tag, chunk_tokens=CHUNK_TOKENS) as reader,
        KVWorker(other_layout, backend, namespace=tag, chunk_tokens=CHUNK_TOKENS, lease_budget=None) as other,
    ):
        for seed in stream:
            stored = await other.store(prompt(seed, half), [np.arange(half)])
            assert stored.stored == half and stored.failed == 0, stored
        for n, seed in enumerate(stream):
            tokens = prompt(seed, half)
            assert await reader.lookup(tokens) == half * CHUNK_TOKENS, f"prompt {n} lost its hit"
            if n % 2 == 0:  # the reader loads the hit itself: its load says so to its ledger
                loaded = await reader.load(tokens, [np.arange(half)])
            else:  # another worker loads it (the engine's workers, apart from its scheduler's lookups)
                loaded = await other.load(tokens, [np.arange(half, 2 * half)])
                reader.lookup_loaded(HashedPrompt.from_tokens(tokens, CHUNK_TOKENS))
            assert loaded.loaded_chunks == half, loaded
        leases = reader.stats()["leases"]
        assert leases["max_chunks"] == 64 and leases["trimmed_lookups"] == 0, leases
        assert leases["leased_chunks"] == len(stream) * half and leases["held_chunks"] == 0, leases
        assert leases["loaded_chunks"] == len(stream) * half and leases["limit_cuts"] == 0, leases
        # Hits never loaded (requests waiting, or aborted) still count for their lease: two fill the
        # budget, the third is answered without asking the store.
        answers = [await reader.lookup(prompt(seed, half)) // CHUNK_TOKENS for seed in stream[:3]]
        assert answers == [half, half, 0]
        assert reader.stats()["leases"]["held_chunks"] == 2 * half
    del cache, other_cache


@pytest.mark.mooncake
@pytest.mark.asyncio
async def test_puts_answered_no_space_cut_the_budget_and_puts_taken_whole_give_it_back(
    mooncake_master_factory: Callable[..., MooncakeMaster], mooncake_backend_factory: Callable[..., Any]
) -> None:
    # The store fills up with keys it cannot evict (every stored key is leased by the store's own check
    # that it reads back): the next put answers "no space", deterministically.
    master = mooncake_master_factory(extra_args=(f"--default_kv_lease_ttl={LONG_LEASE_MS}",))
    backend = mooncake_backend_factory(
        master.address, global_segment_size=16 << 20, default_kv_lease_ttl=LONG_LEASE_MS
    )
    cache, layout = paged_cache(16)
    tag = f"room-{time.monotonic_ns()}"
    chunks = 16  # 2 MiB a prompt: about 8 fill the 16 MiB segment (Mooncake's least)
    async with KVWorker(
        layout,
        backend,
        namespace=tag,
        chunk_tokens=CHUNK_TOKENS,
        pressure_backoff_s=0.0,  # every store makes its put call: each one is a signal
        lease_budget=LeaseBudget(max_bytes=64 * 2 * PAGE),  # 64 chunks: half the store
    ) as worker:
        whole: list[int] = []
        for seed in range(200, 216):
            stored = await worker.store(prompt(seed, chunks), [np.arange(chunks)])
            if stored.failed:
                assert stored.errors.get(int(Code.NO_SPACE)), stored
                break
            whole.append(seed)
        else:
            pytest.fail("32 MiB of prompts fit the 16 MiB segment: the store never answered no space")
        assert len(whole) >= 3, f"only {len(whole)} prompts fit: too few to show the cut"
        leases = worker.stats()["leases"]
        assert (leases["limit_chunks"], leases["limit_cuts"]) == (32, 1), leases
        # Lookups now hold at most the cut limit: two prompts, then nothing asked, nothing leased.
        answers = [await worker.lookup(prompt(seed, chunks)) // CHUNK_TOKENS for seed in whole]
        assert answers == [chunks, chunks] + [0] * (len(whole) - 2)
        assert worker.stats()["leases"]["trimmed_lookups"] == len(whole) - 2

        # Room again (the fill removed): every put the store takes whole gives a sixteenth back.
        for seed in whole:
            backend.batch_remove(chunk_keys(prompt(seed, chunks), CHUNK_TOKENS, layout, 0, tag), force=True)
        limits = []
        for seed in range(300, 308):
            stored = await worker.store(prompt(seed, 1), [np.arange(1)])
            assert stored.stored == 1, stored
            limits.append(worker.stats()["leases"]["limit_chunks"])
        assert limits == list(range(36, 65, 4))
        assert await worker.lookup(prompt(whole[2], chunks)) == 0  # removed: found absent, not trimmed
        assert worker.stats()["leases"]["trimmed_lookups"] == len(whole) - 2
    del cache


@pytest.mark.mooncake
def test_a_threaded_worker_told_that_another_worker_loads_its_hit_frees_that_budget(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., Any]
) -> None:
    # The vLLM connector's scheduler looks up on one worker and its engine's workers load: it says so
    # once it orders a load (GroupWorkers.lookup_loaded), from the scheduler's thread.
    backend = mooncake_backend_factory(mooncake_master.address, default_kv_lease_ttl=LONG_LEASE_MS)
    cache, layout = cache_and_layout(64)
    tag = f"threaded-{time.monotonic_ns()}"
    half = 32
    with ThreadedKVWorker(layout, backend, namespace=tag, chunk_tokens=CHUNK_TOKENS) as worker:
        for seed in (1, 2, 3):
            assert worker.store(prompt(seed, half), [np.arange(half)]).result().stored == half
        prompts = [HashedPrompt.from_tokens(prompt(seed, half), CHUNK_TOKENS) for seed in (1, 2, 3)]
        assert [worker.lookup(p) // CHUNK_TOKENS for p in prompts] == [half, half, 0]
        worker.lookup_loaded(prompts[0])
        assert worker.lookup(prompts[2]) // CHUNK_TOKENS == half
        leases = worker.stats()["leases"]
        assert leases["loaded_chunks"] == half and leases["held_chunks"] == 2 * half, leases
    del cache
