"""Issue 10, items 1-4 (data and results): arguments are owned at the call, ``HashedPrompt`` values are
validated at the call, a store result counts only readable chunks when two writers store one prompt,
and a dead writer's keys are rewritten.

Real backends and real bytes: a real MemoryBackend (in aiokv.testing's recording wrapper) and, for
items 3 and 4, real Mooncake clients of a real master (those need a private network namespace).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import HashedPrompt, InvalidRequestError, KVWorker, MemoryBackend, StoreResult
from aiokv._engine import confirm as confirm_module
from aiokv._engine.unreadable import UnreadableKeys
from aiokv.backends import memory as memory_backend
from aiokv.backends.base import NOT_FOUND, TRANSFER_FAILED, backend_traits, check_backend
from aiokv.codes import Code
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache, chunk_value
from tests.helpers import chunk_keys, read_value, wait_until
from tests.mooncake_support import segment_holder

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


# -- item 3: two writers of one prompt --------------------------------------------------------------------

WRITERS_CHUNKS = 6


class PausedCopy:
    """Pauses the next MemoryBackend copy once armed: a put then holds its keys "being written" (space
    reserved, bytes not yet copied) until :meth:`release`, with the real backend around it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self._release = threading.Event()
        self._armed = False
        for name in ("_gather", "_scatter"):
            monkeypatch.setattr(memory_backend, name, self._wrap(getattr(memory_backend, name)))

    def arm(self) -> None:
        self._armed = True

    def release(self) -> None:
        self._release.set()

    def _wrap(self, copy: Callable[..., Any]) -> Callable[..., Any]:
        def paused(*args: Any, **kwargs: Any) -> Any:
            if self._armed:
                self._armed = False
                self.entered.set()
                assert self._release.wait(30), "the paused copy was never released"
            return copy(*args, **kwargs)

        return paused


class TwoEngines:
    """Two engines holding the same prompt's KV, each with a worker on one shared backend."""

    def __init__(self, backend: Any, namespace: str = NAMESPACE, spec: dict[str, Any] | None = None) -> None:
        self.spec = spec or SPEC
        self.per_chunk = CHUNK // self.spec["block_size"]
        self.caches = [PagedCache.allocate([self.spec], fill=SENTINEL) for _ in range(2)]
        self.backend = backend
        self.namespace = namespace
        count = WRITERS_CHUNKS * self.per_chunk
        self.src = np.arange(0, 2 * count, 2, dtype=np.int64)  # every other block: one region per block
        self.dst = np.arange(1, 2 * count, 2, dtype=np.int64)
        rng = np.random.default_rng(31)
        for first, second in zip(self.caches[0][0].regions, self.caches[1][0].regions, strict=True):
            first[self.src] = rng.integers(0, 256, size=(self.src.size, first.shape[1]), dtype=np.uint8)
            second[self.src] = first[self.src]
        self.tokens = rng.integers(0, 50_000, size=WRITERS_CHUNKS * CHUNK, dtype=np.int64)

    def worker(self, engine: int, backend: Any = None) -> KVWorker:
        return KVWorker(
            self.caches[engine].layouts,
            self.backend if backend is None else backend,
            namespace=self.namespace,
            chunk_tokens=CHUNK,
            pressure_backoff_s=0,
        )

    def keys(self) -> list[str]:
        return chunk_keys(self.tokens, CHUNK, self.caches[0][0].layout, 0, self.namespace)

    def chunk_bytes(self, chunk: int) -> bytes:
        return chunk_value(self.caches[0][0], self.src[chunk * self.per_chunk : (chunk + 1) * self.per_chunk])

    def readable(self, backend: Any) -> list[bool]:
        """Per chunk, whether a read through ``backend`` gives its bytes now."""
        return [
            read_value(backend, key, len(self.chunk_bytes(c))) == self.chunk_bytes(c)
            for c, key in enumerate(self.keys())
        ]


def counted(result: StoreResult) -> list[int]:
    """The chunks a store result counts stored or skipped: the ones that must be readable."""
    return [c for c in range(WRITERS_CHUNKS) if c not in result.failed_chunks]


def test_a_memory_backend_key_exists_only_once_its_bytes_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryBackend's visibility: while a put copies, its keys are absent to exists and get; a second
    put of them answers success at once (the first value wins, as Mooncake answers); once the copy
    ends they exist with the first put's bytes."""
    pause = PausedCopy(monkeypatch)
    backend = MemoryBackend(capacity_bytes=1 << 20)
    first, second, out = (np.full(4096, v, dtype=np.uint8) for v in (1, 2, 0))
    for buffer in (first, second, out):
        backend.register_buffer(int(buffer.ctypes.data), buffer.nbytes)
    keys = ["k0", "k1"]

    def regions(buffer: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        return [[int(buffer.ctypes.data)], [int(buffer.ctypes.data) + 2048]], [[2048], [2048]]

    pause.arm()
    writer = threading.Thread(target=backend.batch_put, args=(keys, *regions(first)))
    writer.start()
    try:
        assert pause.entered.wait(30)
        assert backend.batch_exists(keys) == [False, False]
        assert backend.batch_get(keys, *regions(out)) == [NOT_FOUND, NOT_FOUND]
        assert backend.batch_put(keys, *regions(second)) == [0, 0]  # being written: success, no copy
        assert backend.batch_exists(keys) == [False, False]
    finally:
        pause.release()
        writer.join(30)
    assert backend.batch_exists(keys) == [True, True]
    assert backend.batch_get(keys, *regions(out)) == [2048, 2048]
    assert (out == 1).all(), "the first put's bytes were not the ones kept"


@pytest.mark.asyncio
async def test_a_second_writer_on_one_memory_backend_counts_only_readable_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers on one MemoryBackend store one prompt: while the first one's put is still copying,
    the second's store is not reported done; it is once the bytes are readable, all counted."""
    pause = PausedCopy(monkeypatch)
    engines = TwoEngines(MemoryBackend(capacity_bytes=16 << 20))
    async with engines.worker(0) as first, engines.worker(1) as second:
        pause.arm()
        store_a = first.store(engines.tokens, [engines.src])
        try:
            assert await asyncio.to_thread(pause.entered.wait, 30)
            store_b = second.store(engines.tokens, [engines.src])
            await asyncio.sleep(0.3)  # the second store's put has answered; its chunks are not readable
            assert not store_b.done(), f"reported {store_b.result()} while the first writer was still copying"
            assert await second.lookup(engines.tokens) == 0
        finally:
            pause.release()
        result_b = await asyncio.wait_for(store_b, 30)
        readable = engines.readable(engines.backend)  # at the moment the result arrived
        assert counted(result_b) == list(range(WRITERS_CHUNKS)), result_b
        assert all(readable[c] for c in counted(result_b)), (result_b, readable)
        assert (await store_a).stored == WRITERS_CHUNKS


@pytest.mark.asyncio
async def test_a_second_writer_reports_write_in_progress_when_the_other_write_outlasts_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the other writer's write lasts past the wait, the second store counts none of those chunks:
    each is failed with WRITE_IN_PROGRESS (-12). A retry once the write ended counts them skipped."""
    monkeypatch.setattr(confirm_module, "OTHER_WRITER_WAIT_S", 0.2)
    pause = PausedCopy(monkeypatch)
    engines = TwoEngines(MemoryBackend(capacity_bytes=16 << 20))
    async with engines.worker(0) as first, engines.worker(1) as second:
        pause.arm()
        store_a = first.store(engines.tokens, [engines.src])
        try:
            assert await asyncio.to_thread(pause.entered.wait, 30)
            result_b = await asyncio.wait_for(second.store(engines.tokens, [engines.src]), 30)
            assert not any(engines.readable(engines.backend))
        finally:
            pause.release()
        assert result_b.failed == WRITERS_CHUNKS and counted(result_b) == [], result_b
        assert result_b.errors == {int(Code.WRITE_IN_PROGRESS): WRITERS_CHUNKS}, result_b
        assert (await store_a).stored == WRITERS_CHUNKS
        retry = await second.store(engines.tokens, [engines.src])
        assert (retry.stored, retry.skipped, retry.failed) == (0, WRITERS_CHUNKS, 0), retry
    assert all(engines.readable(engines.backend))


@pytest.mark.asyncio
async def test_a_store_waiting_for_another_writer_ends_when_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store waiting for another writer's write is cancelled: it ends within seconds (its next poll),
    not after the whole wait, and the other writer's store is unaffected."""
    monkeypatch.setattr(confirm_module, "OTHER_WRITER_WAIT_S", 60.0)
    pause = PausedCopy(monkeypatch)
    engines = TwoEngines(FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20)))
    async with engines.worker(0) as first, engines.worker(1) as second:
        pause.arm()
        store_a = first.store(engines.tokens, [engines.src])
        try:
            assert await asyncio.to_thread(pause.entered.wait, 30)
            store_b = second.store(engines.tokens, [engines.src])
            await wait_until(lambda: len(engines.backend.calls_of("exists")) >= 3)  # a, b, b's confirmation
            assert not store_b.done()
            assert store_b.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(store_b, 5)  # not the 60 s wait
        finally:
            pause.release()
        assert (await store_a).stored == WRITERS_CHUNKS
    assert all(engines.readable(engines.backend))


# Many small regions: a put from a pure client to another process's segment moves ~37k slices/s over
# TCP, so the first writer's put of these lasts tens of milliseconds, long enough to be overtaken.
MOONCAKE_SPEC = {"num_regions": 64, "num_blocks": 64, "block_size": 4, "block_lens": 2048}


class PutObserver:
    """A real backend seen through: records, as each put returns, how many calls ``other`` has in
    flight (so the test knows its put answered while the other writer was still writing)."""

    def __init__(self, inner: Any, other: FaultInjectingBackend) -> None:
        self.inner = inner
        self.other = other
        self.other_in_flight_after_put: list[int] = []

    def batch_put(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        codes: list[int] = self.inner.batch_put(keys, addrs, sizes)
        self.other_in_flight_after_put.append(self.other.in_flight)
        return codes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.asyncio
async def test_a_second_mooncake_writer_counts_only_readable_chunks(
    mooncake_master_factory: Any, mooncake_backend_factory: Any
) -> None:
    """Two real Mooncake clients store one prompt at once (both pure clients; the bytes go to another
    process's segment): the second's put answers success while the first is still writing, yet its
    result counts a chunk stored only when a read through it gives the chunk's bytes."""
    master = mooncake_master_factory()
    with segment_holder(master.address):
        client_a = FaultInjectingBackend(mooncake_backend_factory(master.address, global_segment_size=0))
        client_b = PutObserver(mooncake_backend_factory(master.address, global_segment_size=0), client_a)
        engines = TwoEngines(client_a, namespace=f"writers-{uuid.uuid4().hex[:8]}", spec=MOONCAKE_SPEC)
        async with engines.worker(0) as first, engines.worker(1, client_b) as second:
            store_a = first.store(engines.tokens, [engines.src])
            await wait_until(lambda: bool(client_a.calls_of("exists")) and client_a.in_flight == 1)
            await asyncio.sleep(0.002)  # the first put has reached the master
            result_b = await asyncio.wait_for(second.store(engines.tokens, [engines.src]), 30)
            readable = await asyncio.to_thread(engines.readable, client_b)
            assert client_b.other_in_flight_after_put[:1] == [1], "the first writer finished too soon"
            assert all(readable[c] for c in counted(result_b)), (result_b, readable)
            assert counted(result_b) == list(range(WRITERS_CHUNKS)), result_b
            assert (await store_a).stored == WRITERS_CHUNKS


# -- item 4: a dead writer's keys ------------------------------------------------------------------------


class TwoPrompts(TwoEngines):
    """Two engines holding different bytes for one prompt (the dead writer's and the live writer's),
    so the store shows whose bytes a key holds."""

    def __init__(self, backend: Any, namespace: str = NAMESPACE, spec: dict[str, Any] | None = None) -> None:
        super().__init__(backend, namespace, spec)
        rng = np.random.default_rng(47)
        for region in self.caches[1][0].regions:
            region[self.src] = rng.integers(0, 256, size=(self.src.size, region.shape[1]), dtype=np.uint8)

    def live_bytes(self, chunk: int) -> bytes:
        return chunk_value(self.caches[1][0], self.src[chunk * self.per_chunk : (chunk + 1) * self.per_chunk])

    def loaded_live_bytes(self) -> bool:
        dst = self.caches[1][0]
        return all(
            chunk_value(dst, self.dst[c * self.per_chunk : (c + 1) * self.per_chunk]) == self.live_bytes(c)
            for c in range(WRITERS_CHUNKS)
        )


@pytest.mark.asyncio
async def test_keys_whose_reads_failed_are_rewritten_by_the_next_store_faults() -> None:
    """(Injected faults.) Keys that exist but whose gets answer -800 (a dead writer's) are not skipped
    by the next store: it removes them (force) and puts its own bytes, reports them stored, and a load
    then reads those bytes; once rewritten, a store skips them again."""
    engines = TwoPrompts(FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20)))
    backend = engines.backend
    keys = engines.keys()
    async with engines.worker(0) as dead, engines.worker(1) as live:
        assert (await dead.store(engines.tokens, [engines.src])).stored == WRITERS_CHUNKS
        backend.add_rule(FaultRule(op="get", keys=set(keys), code=TRANSFER_FAILED, times=1))  # one call
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 0 and before.errors == {TRANSFER_FAILED: WRITERS_CHUNKS}, before
        backend.clear_calls()
        result = await live.store(engines.tokens, [engines.src])
        assert (result.stored, result.skipped, result.failed) == (WRITERS_CHUNKS, 0, 0), result
        assert sorted(backend.sent_keys("put")) == sorted(keys)
        after = await live.load(engines.tokens, [engines.dst])
        assert after.loaded_tokens == WRITERS_CHUNKS * CHUNK, after
        assert engines.loaded_live_bytes(), "the load did not read the live writer's bytes"
        again = await live.store(engines.tokens, [engines.src])  # rewritten once: now a plain skip
        assert (again.stored, again.skipped) == (0, WRITERS_CHUNKS), again


class NoRemoveBackend:
    """A real MemoryBackend offering only the required protocol (no ``batch_remove``)."""

    def __init__(self, inner: FaultInjectingBackend) -> None:
        self.register_buffer = inner.register_buffer
        self.batch_exists = inner.batch_exists
        self.batch_put = inner.batch_put
        self.batch_get = inner.batch_get
        self.close = inner.close


@pytest.mark.asyncio
async def test_without_batch_remove_unreadable_keys_are_reported_failed_not_skipped() -> None:
    """The documented default: a backend without ``batch_remove`` cannot drop a dead value, so a store
    reports those chunks failed (TRANSFER_FAILED), and skips only the chunks reads did not fail on."""
    recorded = FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20))
    engines = TwoPrompts(NoRemoveBackend(recorded))
    keys = engines.keys()
    async with engines.worker(0) as dead, engines.worker(1) as live:
        assert (await dead.store(engines.tokens, [engines.src])).stored == WRITERS_CHUNKS
        recorded.add_rule(FaultRule(op="get", keys={keys[2]}, code=TRANSFER_FAILED, times=1))
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 2 * CHUNK, before
        result = await live.store(engines.tokens, [engines.src])
    assert result.failed_chunks == (2,) and result.skipped == WRITERS_CHUNKS - 1, result
    assert result.errors == {TRANSFER_FAILED: 1}, result


_DEAD_WRITER = """
import asyncio, sys
import numpy as np
from aiokv import KVWorker, MooncakeBackend
from aiokv.testing import PagedCache

master, namespace = sys.argv[1], sys.argv[2]
tokens, ids, spec = eval(sys.argv[3]), eval(sys.argv[4]), eval(sys.argv[5])
cache = PagedCache.allocate([spec], seed=5)  # other bytes than the live writer's
backend = MooncakeBackend.from_master(master, global_segment_size="64MiB")

async def main():
    async with KVWorker(cache.layouts, backend, namespace=namespace, chunk_tokens=int(sys.argv[6])) as worker:
        result = await worker.store(tokens, [np.asarray(ids)])
        print("stored", result.stored, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_a_live_writer_rewrites_a_sigkilled_writers_keys_and_reports_what_is_readable(
    mooncake_master_factory: Any, mooncake_backend_factory: Any
) -> None:
    """(Real SIGKILL.) A writer process stores a prompt into its own segment and is SIGKILLed: the master
    still lists its keys while gets fail. A live writer's load fails (-800/-704); its store then
    rewrites every key (remove + put; puts placed on the dead segment are retried), skips none, and
    counts only chunks a read gives back at once; at most two more stores make the prompt whole, and a
    load reads the live writer's bytes."""
    master = mooncake_master_factory()
    namespace = f"dead-{uuid.uuid4().hex[:8]}"
    engines = TwoPrompts(None, namespace=namespace)
    args = [repr(engines.tokens.tolist()), repr(engines.src.tolist()), repr(engines.spec), str(CHUNK)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    writer = subprocess.Popen(
        [sys.executable, "-c", _DEAD_WRITER, master.address, namespace, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert writer.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(writer.stdout.readline), 60)
        assert line.split() == ["stored", str(WRITERS_CHUNKS)], line
        os.kill(writer.pid, signal.SIGKILL)  # its segment, holding every chunk, dies with it
        await asyncio.to_thread(writer.wait, 30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(30)
    # Connected after the kill, so every chunk the dead writer stored lies on its own (dead) segment.
    live_backend = engines.backend = mooncake_backend_factory(master.address)  # a segment of its own
    keys = engines.keys()
    assert all(await asyncio.to_thread(live_backend.batch_exists, keys)), "the master forgot the keys at once"
    size = len(engines.live_bytes(0))
    async with engines.worker(1) as live:
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 0 and set(before.errors) <= {-800, -704}, before
        results: list[StoreResult] = []
        for _ in range(3):  # puts still placed on the dead segment fail, honestly; a retry stores them
            result = await asyncio.wait_for(live.store(engines.tokens, [engines.src]), 60)
            readable = await asyncio.to_thread(lambda: [read_value(live_backend, k, size) for k in keys])
            for c in counted(result):
                assert readable[c] == engines.live_bytes(c), f"{result} counts unreadable chunk {c}"
            results.append(result)
            if not result.failed:
                break
        assert results[0].skipped == 0, f"{results[0]}: skipped chunks only a dead writer's segment held"
        assert results[-1].failed == 0, results
        after = await live.load(engines.tokens, [engines.dst])
        assert after.loaded_tokens == WRITERS_CHUNKS * CHUNK, after
        assert engines.loaded_live_bytes()


def test_the_unreadable_keys_are_bounded_and_batch_remove_is_checked_as_an_optional_method() -> None:
    """The worker remembers at most its capacity of unreadable keys (the oldest go first), and
    check_backend refuses a ``batch_remove`` that is not a method."""
    remembered = UnreadableKeys(capacity=3)
    remembered.add(["a", "b", "c"])
    remembered.add(["d", "b"])
    assert len(remembered) == 3
    assert remembered.contains(["a", "b", "c", "d"]).tolist() == [False, True, True, True]
    remembered.discard(["b", "zz"])
    assert remembered.contains(["b", "c", "d"]).tolist() == [False, True, True]

    class BadRemove(MemoryBackend):
        batch_remove = 3  # type: ignore[assignment]

    with pytest.raises(TypeError, match="batch_remove must be a method"):
        check_backend(BadRemove())
    assert backend_traits(MemoryBackend()).can_remove
    assert not backend_traits(NoRemoveBackend(FaultInjectingBackend(MemoryBackend()))).can_remove  # type: ignore[arg-type]
