"""Soak: many concurrent stores and loads over prompts that share prefixes, with injected faults
(probabilistic error codes, a few exceptions, small delays), against the embedded MemoryBackend.

It proves that every future resolves; that every chunk a load reports loaded holds exactly the bytes
stored for its key (checked per chunk and group against the source); that no block outside the
requests is written; and that the store holds no key whose bytes differ from its source.

N=100 runs in the normal suite; N=1,000 is marked ``soak`` (run by default, skipped with
``-m "not soak"``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from aiokv import (
    BackendError,
    Code,
    KeyNamespace,
    KVWorker,
    LoadResult,
    MemoryBackend,
    StoreResult,
    chunk_hashes,
)
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache

CHUNK = 16
NAMESPACE = KeyNamespace("soak-model")
GROUPS = [
    {"num_regions": 3, "block_size": 8, "block_lens": 32},  # 2 blocks per chunk
    {"num_regions": 2, "block_size": 16, "block_lens": [24, 8]},  # 1 block per chunk
]
PER_CHUNK = [CHUNK // g["block_size"] for g in GROUPS]


def fault_rules() -> list[FaultRule]:
    return [
        FaultRule(op="put", per_key=True, probability=0.04, code=Code.TRANSFER_FAILED),
        FaultRule(op="put", per_key=True, probability=0.005, code=Code.NO_SPACE),
        FaultRule(op="put", probability=0.03, exception=RuntimeError, times=4),
        FaultRule(op="get", per_key=True, probability=0.04, code=Code.NOT_FOUND),
        FaultRule(op="get", per_key=True, probability=0.02, code=Code.TRANSFER_FAILED),
        FaultRule(op="get", probability=0.03, exception=ConnectionError, times=3),
        FaultRule(op="exists", probability=0.02, exception=ConnectionError, times=2),
        FaultRule(op="*", probability=0.2, delay_s=0.0005),
    ]


@dataclass
class Job:
    kind: str  # "store" | "load"
    tokens: np.ndarray
    digests: list[str]
    blocks: list[np.ndarray]  # per group
    future: Any = None
    task: asyncio.Future[Any] | None = None  # awaits the future, for asyncio.wait


@dataclass
class Soak:
    rng: np.random.Generator
    prompts: list[np.ndarray]
    jobs: list[Job]
    cache: PagedCache
    patterns: dict[tuple[str, int], list[np.ndarray]] = field(default_factory=dict)

    def pattern(self, digest: str, group: int) -> list[np.ndarray]:
        """The KV of a chunk in a group: a function of the chunk's digest alone (as an engine's KV is
        a function of the prefix), one ``(blocks per chunk, block_len)`` array per region."""
        found = self.patterns.get((digest, group))
        if found is None:
            rng = np.random.default_rng([int(digest[:16], 16), group])
            found = [
                rng.integers(0, 256, size=(PER_CHUNK[group], region.shape[1]), dtype=np.uint8)
                for region in self.cache[group].regions
            ]
            self.patterns[(digest, group)] = found
        return found

    def value(self, digest: str, group: int) -> bytes:
        return b"".join(part.tobytes() for part in self.pattern(digest, group))

    def chunk_ids(self, job: Job, group: int, chunk: int) -> np.ndarray:
        n = PER_CHUNK[group]
        return job.blocks[group][chunk * n : (chunk + 1) * n]

    def holds(self, job: Job, group: int, chunk: int) -> bool:
        ids = self.chunk_ids(job, group, chunk)
        return all(
            np.array_equal(region[ids], part)
            for region, part in zip(
                self.cache[group].regions, self.pattern(job.digests[chunk], group), strict=True
            )
        )

    def untouched(self, job: Job, group: int, chunk: int) -> bool:
        return self.cache[group].untouched(self.chunk_ids(job, group, chunk))


def build(n: int, seed: int) -> Soak:
    """Prompts on a tree (roots, branches, tails) so that many share prefixes; ``n`` jobs over them,
    each with its own never-reused blocks (sources filled with their chunks' KV)."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 30_000, size=2 * CHUNK) for _ in range(5)]
    branches = [rng.integers(0, 30_000, size=rng.integers(1, 3) * CHUNK) for _ in range(12)]
    prompts = []
    for _ in range(30):
        root, branch = roots[rng.integers(len(roots))], branches[rng.integers(len(branches))]
        tail = rng.integers(0, 30_000, size=int(rng.integers(0, 3)) * CHUNK + int(rng.integers(0, CHUNK)))
        prompts.append(np.concatenate([root, branch, tail]).astype(np.int64))
    prompts += roots  # bare prefixes of the others
    picks = [prompts[i] for i in rng.integers(len(prompts), size=n)]
    kinds = ["store" if rng.random() < 0.6 else "load" for _ in range(n)]
    chunks = [len(p) // CHUNK for p in picks]
    need = [sum(c * per for c in chunks) + 8 for per in PER_CHUNK]
    cache = PagedCache.allocate(
        [{**g, "num_blocks": blocks} for g, blocks in zip(GROUPS, need, strict=True)], fill=SENTINEL
    )
    free = [rng.permutation(blocks) for blocks in need]  # scattered, so chunks span non-adjacent blocks
    used = [0] * len(GROUPS)
    soak = Soak(rng, prompts, [], cache)
    for tokens, kind, count in zip(picks, kinds, chunks, strict=True):
        blocks = []
        for g in range(len(GROUPS)):
            size = count * PER_CHUNK[g]
            blocks.append(free[g][used[g] : used[g] + size].astype(np.int64))
            used[g] += size
        job = Job(kind, tokens, chunk_hashes(tokens, CHUNK), blocks)
        if kind == "store":
            for g in range(len(GROUPS)):
                for c, digest in enumerate(job.digests):
                    ids = soak.chunk_ids(job, g, c)
                    for region, part in zip(cache[g].regions, soak.pattern(digest, g), strict=True):
                        region[ids] = part
        soak.jobs.append(job)
    return soak


def keys_of(soak: Soak, digests: list[str], group: int) -> list[str]:
    return NAMESPACE.keys(digests, soak.cache[group].layout.fingerprint, group)


def read_all(inner: MemoryBackend, keys: list[str], sizes: list[int]) -> list[bytes | None]:
    """Every key's value, read back through the backend protocol in one batch."""
    scratch = np.zeros(max(1, sum(sizes)), dtype=np.uint8)
    base = int(scratch.ctypes.data)
    inner.register_buffer(base, scratch.nbytes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    try:
        codes = inner.batch_get(keys, [[base + int(s)] for s in starts], [[z] for z in sizes])
    finally:
        inner.unregister_buffer(base)
    return [
        scratch[s : s + z].tobytes() if code >= 0 else None
        for code, s, z in zip(codes, starts.tolist(), sizes, strict=True)
    ]


async def run_soak(n: int, seed: int) -> None:
    soak = build(n, seed)
    inner = MemoryBackend(capacity_bytes=64 << 20)
    # The worker removes a key only to rewrite it after a read of it failed (an injected -800/-704);
    # if that rewrite's put then fails, the key is gone although an earlier store counted it.
    removed: set[str] = set()
    remove = inner.batch_remove

    def recording_remove(keys: Any, *, force: bool = False) -> list[int]:
        removed.update(keys)
        return remove(keys, force=force)

    inner.batch_remove = recording_remove  # type: ignore[method-assign]
    rules = fault_rules()
    backend = FaultInjectingBackend(inner, rules=rules, seed=seed)
    async with KVWorker(
        soak.cache.layouts,
        backend,
        namespace=NAMESPACE,
        chunk_tokens=CHUNK,
        pressure_backoff_s=0.002,
        max_regions_per_call=256,  # several calls per group per batch
    ) as worker:
        # Bursts of submissions, at most ``window`` in flight, so many batches of various sizes
        # overlap (and store keys are claimed across batches) instead of one batch taking everything.
        index, window = 0, 24
        in_flight: set[asyncio.Future[Any]] = set()
        while index < n:
            burst = int(soak.rng.integers(1, 16))
            for job in soak.jobs[index : index + burst]:
                submit = worker.store if job.kind == "store" else worker.load
                job.future = submit(job.tokens, job.blocks)
                job.task = asyncio.ensure_future(job.future)
                in_flight.add(job.task)
            index += burst
            if len(in_flight) >= window:
                _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0)
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(job.task for job in soak.jobs), return_exceptions=True), 120
        )
        assert all(job.future.done() for job in soak.jobs)

        # Quiescent now, and without faults: lookups agree with what the store holds.
        backend.clear_rules()
        present = {}
        for prompt in soak.prompts:
            digests = chunk_hashes(prompt, CHUNK)
            there = np.array([inner.batch_exists(keys_of(soak, digests, g)) for g in range(len(GROUPS))])
            holes = np.flatnonzero(~there.all(axis=0))
            present[id(prompt)] = (int(holes[0]) if holes.size else len(digests)) * CHUNK
            assert await worker.lookup(prompt) == present[id(prompt)]
        stats = worker.stats()

    # Every outcome is a result or an aiokv error chaining an injected exception.
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    for error in errors:
        assert isinstance(error, BackendError), repr(error)
        assert "injected" in str(error.__cause__), repr(error.__cause__)
    # Each failure traces back to one injected exception, raised by a call that carried one of the
    # failed request's keys: a fault fails only the requests it touched, however batches formed.
    raised = {id(call.error): call for call in backend.calls if call.error is not None}
    for job, outcome in zip(soak.jobs, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            call = raised[id(outcome.__cause__)]
            mine = {key for g in range(len(GROUPS)) for key in keys_of(soak, job.digests, g)}
            assert mine.intersection(call.keys), (job.kind, call.op)
    assert len(raised) <= sum(backend.fired(rule) for rule in rules if rule.exception is not None)
    stores = [(j, o) for j, o in zip(soak.jobs, outcomes, strict=True) if isinstance(o, StoreResult)]
    loads = [(j, o) for j, o in zip(soak.jobs, outcomes, strict=True) if isinstance(o, LoadResult)]
    assert len(stores) + len(loads) + len(errors) == n
    assert stores and loads

    for job, result in stores:
        assert result.stored + result.skipped + result.failed == len(job.digests)
        assert len(result.failed_chunks) == result.failed
        for g in range(len(GROUPS)):  # a store never writes into its own blocks
            for c in range(len(job.digests)):
                assert soak.holds(job, g, c)
        # Nothing is ever evicted: every chunk a store did not report failed is in the store, unless
        # the worker removed it to rewrite it after a failed read.
        kept = [d for c, d in enumerate(job.digests) if c not in set(result.failed_chunks)]
        for g in range(len(GROUPS)):
            keys = keys_of(soak, kept, g)
            assert all(
                there or key in removed for key, there in zip(keys, inner.batch_exists(keys), strict=True)
            )

    loaded_chunks = 0
    for job, result in loads:
        failed = set(result.failed_block_ids[0])
        ok = [not failed.intersection(soak.chunk_ids(job, 0, c).tolist()) for c in range(len(job.digests))]
        assert sum(ok) == result.loaded_chunks
        prefix = ok.index(False) if False in ok else len(ok)
        assert result.loaded_tokens == prefix * CHUNK
        for g in range(len(GROUPS)):
            expected_failed = [
                b for c in range(len(ok)) if not ok[c] for b in soak.chunk_ids(job, g, c).tolist()
            ]
            assert list(result.failed_block_ids[g]) == expected_failed
            for c in range(len(ok)):
                if ok[c]:
                    assert soak.holds(job, g, c), (job.digests[c], g)  # the stored bytes, exactly
                else:  # a failed chunk: untouched in the group whose read failed, exact in any other
                    assert soak.holds(job, g, c) or soak.untouched(job, g, c)
        loaded_chunks += result.loaded_chunks
    assert loaded_chunks > 0

    for job, error in zip(soak.jobs, outcomes, strict=True):
        if isinstance(error, BaseException) and job.kind == "load":
            for g in range(len(GROUPS)):
                for c in range(len(job.digests)):
                    assert soak.holds(job, g, c) or soak.untouched(job, g, c)

    # No block outside the jobs was written.
    for g in range(len(GROUPS)):
        used = {int(b) for job in soak.jobs for b in job.blocks[g]}
        assert soak.cache[g].written_blocks() <= used

    # The store holds no key whose bytes differ from its source, and no key we do not know.
    candidates = [
        (key, digest, g)
        for prompt in soak.prompts
        for g in range(len(GROUPS))
        for key, digest in zip(
            keys_of(soak, chunk_hashes(prompt, CHUNK), g), chunk_hashes(prompt, CHUNK), strict=True
        )
    ]
    unique = {key: (digest, g) for key, digest, g in candidates}
    keys = list(unique)
    there = inner.batch_exists(keys)
    held = [k for k, yes in zip(keys, there, strict=True) if yes]
    assert len(held) == len(inner)
    values = read_all(inner, held, [len(soak.value(*unique[k])) for k in held])
    for key, value in zip(held, values, strict=True):
        assert value == soak.value(*unique[key]), key
    assert len(held) > 0

    # The worker's counters agree with what the backend saw and what the futures said.
    assert stats["requests"]["store"] + stats["requests"]["load"] == n
    assert stats["backend_calls"].get("put", 0) == len(backend.calls_of("put"))
    assert stats["backend_calls"].get("get", 0) == len(backend.calls_of("get"))
    assert stats["backend_calls"]["exists"] == len(backend.calls_of("exists"))
    assert stats["chunks"].get("stored", 0) == sum(r.stored for _, r in stores)
    assert stats["chunks"].get("failed", 0) == sum(r.failed for _, r in stores)
    assert stats["chunks"].get("loaded", 0) == loaded_chunks
    assert sum(stats["requests_failed"].values()) == len(errors)


@pytest.mark.asyncio
async def test_soak_100() -> None:
    await run_soak(100, seed=11)


@pytest.mark.soak
@pytest.mark.asyncio
async def test_soak_1000() -> None:
    await run_soak(1000, seed=12)
