"""Issue 10, items 1-4 (data and results): arguments are owned at the call, ``HashedPrompt`` values are
validated at the call, a store result counts only readable chunks when two writers store one prompt,
and a dead writer's keys are rewritten.

Real backends and real bytes: a real MemoryBackend (in aiokv.testing's recording wrapper) and, for
items 3 and 4, real Mooncake clients of a real master (those need a private network namespace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import HashedPrompt, InvalidRequestError, KVWorker, MemoryBackend
from aiokv.testing import SENTINEL, FaultInjectingBackend, PagedCache, chunk_value
from tests.helpers import chunk_keys, read_value

CHUNK = 8
NAMESPACE = "data-fix"
SPEC = {"num_regions": 4, "num_blocks": 96, "block_size": 4, "block_lens": 32}
PER_CHUNK = CHUNK // SPEC["block_size"]


class Rig:
    """One sentinel-filled single-group cache and a MemoryBackend in the recording wrapper."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate([SPEC], fill=SENTINEL)
        self.group = self.cache[0]
        self.inner = MemoryBackend(capacity_bytes=16 << 20)
        self.backend = FaultInjectingBackend(self.inner)
        self._free = [int(b) for b in self.rng.permutation(SPEC["num_blocks"])]

    def worker(self) -> KVWorker:
        return KVWorker(
            self.cache.layouts, self.backend, namespace=NAMESPACE, chunk_tokens=CHUNK, pressure_backoff_s=0
        )

    def prompt(self, chunks: int) -> np.ndarray:
        return self.rng.integers(0, 50_000, size=chunks * CHUNK, dtype=np.int64)

    def blocks(self, chunks: int, *, source: bool) -> np.ndarray:
        ids = np.array([self._free.pop() for _ in range(chunks * PER_CHUNK)], dtype=np.int64)
        if source:
            for region in self.group.regions:
                region[ids] = self.rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)
        return ids

    def keys(self, tokens: Any) -> list[str]:
        return chunk_keys(np.asarray(tokens), CHUNK, self.group.layout, 0, NAMESPACE)

    def chunk_bytes(self, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.group, ids[chunk * PER_CHUNK : (chunk + 1) * PER_CHUNK])

    def assert_store_holds(self, tokens: np.ndarray, src: np.ndarray) -> None:
        for c, key in enumerate(self.keys(tokens)):
            want = self.chunk_bytes(src, c)
            assert read_value(self.inner, key, len(want)) == want, f"chunk {c} lacks its source bytes"


# -- item 1: arguments are owned at the call -------------------------------------------------------------

TOKEN_FORMS = ["list", "cleared-list", "tuple", "int64", "int32", "uint32", "uint16-row", "hashed-list"]


def token_argument(form: str, tokens: np.ndarray) -> tuple[Any, Callable[[np.ndarray], None]]:
    """The prompt in an accepted form, and what reusing its buffer for another prompt does to it."""
    if form in ("list", "cleared-list"):
        as_list = tokens.tolist()

        def reuse_list(other: np.ndarray) -> None:
            if form == "cleared-list":
                as_list.clear()
            else:
                as_list[:] = other.tolist()

        return as_list, reuse_list
    if form == "tuple":
        return tuple(tokens.tolist()), lambda other: None  # immutable: nothing to reuse
    if form == "hashed-list":
        hashes = list(HashedPrompt.from_tokens(tokens, CHUNK).hashes)

        def rehash(other: np.ndarray) -> None:
            hashes[:] = HashedPrompt.from_tokens(other, CHUNK).hashes

        return HashedPrompt(hashes, CHUNK), rehash  # type: ignore[arg-type]
    if form == "uint16-row":
        table = np.stack([tokens, tokens]).astype(np.uint16)  # a row of a 2-D token table

        def reuse_row(other: np.ndarray) -> None:
            table[0] = other.astype(np.uint16)

        return table[0], reuse_row
    array = tokens.astype(form)

    def reuse_array(other: np.ndarray) -> None:
        array[:] = other.astype(form)

    return array, reuse_array


@pytest.mark.asyncio
@pytest.mark.parametrize("form", TOKEN_FORMS)
async def test_a_token_buffer_reused_right_after_store_keeps_the_original_keys(form: str) -> None:
    """store() owns the prompt from the call: a caller reusing (or clearing) its token buffer right
    after gets its chunks under the original prompt's keys, with their bytes, and nothing else."""
    rig = Rig(seed=11)
    tokens, other = rig.prompt(4) % 60_000, rig.prompt(4) % 60_000  # uint16 holds them
    src = rig.blocks(4, source=True)
    argument, reuse = token_argument(form, tokens)
    async with rig.worker() as worker:
        future = worker.store(argument, [src])
        reuse(other)  # before the dispatcher ran: nothing was hashed yet
        result = await future
        assert (result.stored, result.skipped, result.failed) == (4, 0, 0), result
        assert await worker.lookup(tokens) == 4 * CHUNK
        assert await worker.lookup(other) == 0
    assert sorted(rig.backend.sent_keys("put")) == sorted(rig.keys(tokens))
    assert len(rig.inner) == 4, "phantom or foreign chunks reached the store"
    rig.assert_store_holds(tokens, src)


BLOCK_FORMS = ["list", "tuple", "int64", "int32", "uint16", "table-row", "table-int64"]


def block_argument(form: str, ids: np.ndarray) -> tuple[Any, Callable[[np.ndarray], None]]:
    """``block_ids`` of one group in an accepted form, and the engine updating it in place."""
    if form in ("list", "tuple"):
        row = ids.tolist()

        def update_list(new: np.ndarray) -> None:
            row[:] = new.tolist()

        return ([row] if form == "list" else (row,)), update_list
    if form in ("table-row", "table-int64"):
        table = ids.reshape(1, -1).astype(np.int64 if form == "table-int64" else np.int32)

        def update_table(new: np.ndarray) -> None:
            table[0, :] = new

        return (table if form == "table-int64" else [table[0]]), update_table
    array = ids.astype(form)

    def update_array(new: np.ndarray) -> None:
        array[:] = new.astype(form)

    return [array], update_array


@pytest.mark.asyncio
@pytest.mark.parametrize("form", BLOCK_FORMS)
async def test_a_block_table_updated_after_load_returns_gets_the_original_blocks_written(form: str) -> None:
    """load() owns the block ids from the call: the load writes the blocks named then, never the
    blocks the table names afterwards."""
    rig = Rig(seed=12)
    tokens = rig.prompt(3)
    src, dst, later = rig.blocks(3, source=True), rig.blocks(3, source=False), rig.blocks(3, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src])).stored == 3
        argument, update = block_argument(form, dst)
        future = worker.load(tokens, argument)
        update(later)  # the engine's block table moves on right after load() returned
        result = await future
    assert result.loaded_tokens == 3 * CHUNK, result
    for c in range(3):
        assert rig.chunk_bytes(dst, c) == rig.chunk_bytes(src, c), c
    assert rig.group.untouched(later), "the load wrote into blocks named after load() returned"


@pytest.mark.asyncio
@pytest.mark.parametrize("form", BLOCK_FORMS)
async def test_a_block_table_updated_after_store_returns_stores_the_original_blocks(form: str) -> None:
    """store() owns the block ids from the call: the chunks hold the bytes of the blocks named then."""
    rig = Rig(seed=13)
    tokens = rig.prompt(3)
    src, decoy = rig.blocks(3, source=True), rig.blocks(3, source=True)
    async with rig.worker() as worker:
        argument, update = block_argument(form, src)
        future = worker.store(tokens, argument)
        update(decoy)
        assert (await future).stored == 3
    rig.assert_store_holds(tokens, src)


# -- item 2: HashedPrompt values validated at the call ---------------------------------------------------

BAD_HASHES: list[tuple[str, tuple[Any, ...]]] = [
    ("ints", (1, 2)),
    ("none", (None,)),
    ("bytes", (b"ab12",)),
    ("empty", ("",)),
    ("duplicate", ("ab12", "cd34", "ab12")),
    ("space", ("ab 12",)),
    ("newline", ("ab\n12",)),
    ("nul", ("ab\x0012",)),
    ("unicode-separator", ("ab\u202812",)),
]


@pytest.mark.parametrize(("case", "hashes"), BAD_HASHES, ids=[c for c, _ in BAD_HASHES])
def test_a_hashed_prompt_refuses_bad_digests_naming_the_index(case: str, hashes: tuple[Any, ...]) -> None:
    """The constructor is the one check of a prompt's digests, with the rules every key needs."""
    with pytest.raises((TypeError, InvalidRequestError), match=r"hashes\[\d\]"):
        HashedPrompt(hashes, CHUNK)  # type: ignore[arg-type]


def test_a_hashed_prompt_owns_its_digests_and_keeps_the_built_ones() -> None:
    """A list given to the constructor is copied into the prompt's own tuple; the digests that
    from_tokens and from_block_hashes build pass the same check."""
    digests = ["ab12", "cd34"]
    prompt = HashedPrompt(digests, CHUNK)  # type: ignore[arg-type]
    digests[0] = "zz99"
    assert prompt.hashes == ("ab12", "cd34")
    tokens = np.arange(5 * CHUNK)
    assert len(HashedPrompt.from_tokens(tokens, CHUNK).hashes) == 5
    assert len(HashedPrompt.from_block_hashes(list(range(10)), 4, CHUNK).hashes) == 5
    with pytest.raises(InvalidRequestError):
        HashedPrompt(("ab12",), 0)


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "hashes"), BAD_HASHES, ids=[c for c, _ in BAD_HASHES])
async def test_bad_hashed_prompt_values_fail_alone_and_never_reach_the_store(
    case: str, hashes: tuple[Any, ...]
) -> None:
    """Bad digests are refused at the call of store, load and lookup (by the prompt's constructor, so
    no bad prompt exists to reach a batch); requests submitted alongside succeed, nothing of the bad
    ones is stored."""
    rig = Rig(seed=14)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    bad_blocks = rig.blocks(len(hashes), source=True)
    async with rig.worker() as worker:
        good_store = worker.store(tokens, [src])  # queued: drained with whatever follows
        with pytest.raises((TypeError, ValueError)):
            worker.store(HashedPrompt(hashes, CHUNK), [bad_blocks])
        assert (await good_store).stored == 2
        good_lookup = asyncio.ensure_future(worker.lookup(tokens))
        with pytest.raises((TypeError, ValueError)):
            await worker.lookup(HashedPrompt(hashes, CHUNK))
        assert await good_lookup == 2 * CHUNK
        good_load = worker.load(tokens, [dst])
        with pytest.raises((TypeError, ValueError)):
            worker.load(HashedPrompt(hashes, CHUNK), [dst])
        assert (await good_load).loaded_tokens == 2 * CHUNK
    assert len(rig.inner) == 2, "a key of the bad prompt reached the store"
    assert sorted(rig.backend.sent_keys("put")) == sorted(rig.keys(tokens))
