"""The reliability tests' rig: one sentinel-filled two-group cache (or, :class:`OneGroupRig`, a
single-group one), a real MemoryBackend behind aiokv.testing's FaultInjectingBackend, and a block
allocator that never reuses a block in a test."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiokv import KVLayout, KVWorker, MemoryBackend, ThreadedKVWorker
from aiokv.testing import SENTINEL, FaultInjectingBackend, PagedCache, chunk_value
from tests.helpers import chunk_keys, read_value

CHUNK = 8
NAMESPACE = "reliability-model"
# Two groups: 2 blocks per chunk in group 0, 1 in group 1; unequal block lengths in group 1.
SPECS: list[dict[str, Any]] = [
    {"num_regions": 4, "num_blocks": 96, "block_size": 4, "block_lens": 32},
    {"num_regions": 2, "num_blocks": 48, "block_size": 8, "block_lens": [48, 16]},
]
SAFETY_S = 20.0  # bound on every wait; never reached when the code works


class Rig:
    """One cache (sentinel-filled), a MemoryBackend behind a FaultInjectingBackend, and a block
    allocator handing out scattered block ids that are never reused within a test."""

    def __init__(
        self, *, seed: int = 0, capacity_bytes: int = 64 << 20, layouts: list[KVLayout] | None = None
    ):
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate(SPECS, fill=SENTINEL)
        self.inner = MemoryBackend(capacity_bytes=capacity_bytes)
        self.backend = FaultInjectingBackend(self.inner, seed=seed)
        self.layouts = layouts or self.cache.layouts
        self.per_chunk = [CHUNK // g.block_size for g in self.cache.groups]
        self._free = [list(self.rng.permutation(g.num_blocks)) for g in self.cache.groups]
        self._source: list[set[int]] = [set() for _ in self.cache.groups]

    def worker(self, **options: Any) -> KVWorker:
        options.setdefault("pressure_backoff_s", 0.0)
        return KVWorker(self.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options)

    def prompt(self, chunks: int, extra_tokens: int = 0) -> np.ndarray:
        return self.rng.integers(0, 50_000, size=chunks * CHUNK + extra_tokens, dtype=np.int64)

    def blocks(self, chunks: int, *, source: bool, spare: int = 0) -> list[np.ndarray]:
        """Block ids for ``chunks`` chunks per group (+ ``spare`` unused ids after them); source
        blocks get random bytes, the others keep the sentinel."""
        out = []
        for g, group in enumerate(self.cache.groups):
            count = chunks * self.per_chunk[g] + spare
            ids = np.array([self._free[g].pop() for _ in range(count)], dtype=np.int64)
            if source:
                for region in group.regions:
                    region[ids] = self.rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)
                self._source[g] |= set(ids.tolist())
            out.append(ids)
        return out

    def keys(self, tokens: np.ndarray, group: int) -> list[str]:
        return chunk_keys(tokens, CHUNK, self.cache[group].layout, group, NAMESPACE)

    def all_keys(self, tokens: np.ndarray) -> list[str]:
        return [k for g in range(len(SPECS)) for k in self.keys(tokens, g)]

    def chunk_blocks(self, group: int, ids: np.ndarray, chunk: int) -> np.ndarray:
        n = self.per_chunk[group]
        return ids[chunk * n : (chunk + 1) * n]

    def value(self, group: int, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.cache[group], self.chunk_blocks(group, ids, chunk))

    def stored_value(self, key: str, group: int, ids: np.ndarray, chunk: int) -> bytes | None:
        return read_value(self.inner, key, len(self.value(group, ids, chunk)))

    def same_bytes(self, group: int, a: np.ndarray, b: np.ndarray) -> bool:
        return all(np.array_equal(region[a], region[b]) for region in self.cache[group].regions)

    def written_outside_sources(self, group: int) -> set[int]:
        return self.cache[group].written_blocks() - self._source[group]


def fault_keys(rig: Rig, tokens: np.ndarray, picks: Sequence[tuple[int, int]]) -> set[str]:
    """The keys of (chunk, group) pairs."""
    return {rig.keys(tokens, g)[c] for c, g in picks}


def loop_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("aiokv")}


# The single-group rig of the argument and shutdown reliability tests.
ONE_GROUP_SPEC: dict[str, Any] = {"num_regions": 4, "num_blocks": 128, "block_size": 4, "block_lens": 32}
ONE_GROUP_PER_CHUNK = CHUNK // ONE_GROUP_SPEC["block_size"]


class OneGroupRig:
    """One sentinel-filled single-group cache, a MemoryBackend behind a FaultInjectingBackend, and
    block ids handed out once each (source blocks get random bytes, the others keep the sentinel)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate([ONE_GROUP_SPEC], fill=SENTINEL)
        self.group = self.cache[0]
        self.inner = MemoryBackend(capacity_bytes=16 << 20)
        self.backend = FaultInjectingBackend(self.inner)
        self._free = [int(b) for b in self.rng.permutation(ONE_GROUP_SPEC["num_blocks"])]

    def worker(self, **options: Any) -> KVWorker:
        options.setdefault("pressure_backoff_s", 0)
        return KVWorker(self.cache.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options)

    def threaded(self, **options: Any) -> ThreadedKVWorker:
        options.setdefault("pressure_backoff_s", 0)
        return ThreadedKVWorker(
            self.cache.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, **options
        )

    def prompt(self, chunks: int) -> np.ndarray:
        return self.rng.integers(0, 50_000, size=chunks * CHUNK, dtype=np.int64)

    def blocks(self, chunks: int, *, source: bool) -> np.ndarray:
        ids = np.array([self._free.pop() for _ in range(chunks * ONE_GROUP_PER_CHUNK)], dtype=np.int64)
        if source:
            for region in self.group.regions:
                region[ids] = self.rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)
        return ids

    def keys(self, tokens: Any) -> list[str]:
        return chunk_keys(np.asarray(tokens), CHUNK, self.group.layout, 0, NAMESPACE)

    def chunk_bytes(self, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.group, ids[chunk * ONE_GROUP_PER_CHUNK : (chunk + 1) * ONE_GROUP_PER_CHUNK])

    def assert_store_holds(self, tokens: Any, src: np.ndarray) -> None:
        for c, key in enumerate(self.keys(tokens)):
            want = self.chunk_bytes(src, c)
            assert read_value(self.inner, key, len(want)) == want, f"chunk {c} lacks its source bytes"

    def sent(self, op: str, tokens: np.ndarray) -> list[str]:
        """The keys of ``tokens`` that reached the store in calls of ``op``."""
        wanted = set(self.keys(tokens))
        return [k for k in self.backend.sent_keys(op) if k in wanted]
