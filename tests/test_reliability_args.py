"""Issue 10, items 1, 2 and 13: arguments are taken at the call, ``HashedPrompt`` values are validated
at the call, and small argument edge cases get consistent, accurate answers.

Every test runs a real KVWorker on a real MemoryBackend and checks real bytes in the store and in the
engine's cache (a Mooncake test checks the zero-width case against a real master).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import (
    AiokvError,
    HashedPrompt,
    InvalidRequestError,
    KVWorker,
    MemoryBackend,
    WorkerClosedError,
)
from aiokv.backends.base import INVALID
from aiokv.testing import FaultInjectingBackend, FaultRule
from aiokv.testing.paged_cache import SENTINEL, PagedCache, chunk_value
from tests.helpers import chunk_keys, read_value
from tests.mooncake_support import registered, unique_keys

CHUNK = 8
NAMESPACE = "rel-args"
SPEC = {"num_regions": 4, "num_blocks": 96, "block_size": 4, "block_lens": 32}
PER_CHUNK = CHUNK // SPEC["block_size"]


@pytest.fixture(autouse=True)
def no_cyclic_gc_until_teardown() -> Iterator[None]:
    """No cyclic garbage collection from the test's start to its teardown, then one collection.

    A test failing on a defect leaves requests whose finalisers log (an asyncio future's "exception
    never retrieved"); run by the cyclic collector inside the ``ast.parse`` pytest uses to format the
    failure, Python 3.11 raises SystemError there and aborts the whole session."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


class Rig:
    """One sentinel-filled single-group cache, a MemoryBackend behind a FaultInjectingBackend."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = PagedCache.allocate([SPEC], fill=SENTINEL)
        self.group = self.cache[0]
        self.inner = MemoryBackend(capacity_bytes=16 << 20)
        self.backend = FaultInjectingBackend(self.inner)
        self._free = list(self.rng.permutation(SPEC["num_blocks"]))

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

    def expected(self, ids: np.ndarray, chunk: int) -> bytes:
        return chunk_value(self.group, ids[chunk * PER_CHUNK : (chunk + 1) * PER_CHUNK])

    def stored(self, key: str, size: int) -> bytes | None:
        return read_value(self.inner, key, size)

    def assert_store_holds(self, tokens: np.ndarray, src: np.ndarray) -> None:
        for c, key in enumerate(self.keys(tokens)):
            want = self.expected(src, c)
            assert self.stored(key, len(want)) == want, f"chunk {c} is not stored with its source bytes"


# -- item 1: arguments are taken at the call --------------------------------------------------------

TOKEN_FORMS = ["list", "int64", "int32", "uint32", "hashed-list"]


def token_argument(form: str, tokens: np.ndarray) -> tuple[Any, Callable[[np.ndarray], None]]:
    """The prompt in the given accepted form, and a function overwriting it in place with another."""
    if form == "list":
        as_list = tokens.tolist()

        def clear(_: np.ndarray) -> None:
            as_list.clear()  # the "clears a token list"

        return as_list, clear
    if form == "hashed-list":
        hashes = list(HashedPrompt.from_tokens(tokens, CHUNK).hashes)

        def rehash(other: np.ndarray) -> None:
            hashes[:] = HashedPrompt.from_tokens(other, CHUNK).hashes

        return HashedPrompt(hashes, CHUNK), rehash  # type: ignore[arg-type]
    array = tokens.astype(form)

    def overwrite(other: np.ndarray) -> None:
        array[:] = other.astype(form)

    return array, overwrite


@pytest.mark.asyncio
@pytest.mark.parametrize("form", TOKEN_FORMS)
async def test_a_token_buffer_reused_right_after_store_does_not_change_the_stored_keys(form: str) -> None:
    """store() takes the prompt at the call: reusing its buffer right after cannot re-key the chunks."""
    rig = Rig(seed=11)
    tokens, other = rig.prompt(4), rig.prompt(4)
    src = rig.blocks(4, source=True)
    argument, reuse = token_argument(form, tokens)
    async with rig.worker() as worker:
        future = worker.store(argument, [src])
        reuse(other)  # the caller's next prompt goes into the same buffer before the dispatcher ran
        result = await future
        assert (result.stored, result.skipped, result.failed) == (4, 0, 0)
        assert await worker.lookup(tokens) == 4 * CHUNK
        assert await worker.lookup(other) == 0
    rig.assert_store_holds(tokens, src)
    assert len(rig.inner) == 4


BLOCK_FORMS = ["list", "int64", "int32", "uint16", "table-row", "list-of-int64"]


def block_argument(form: str, ids: np.ndarray) -> tuple[Any, Callable[[np.ndarray], None]]:
    """``block_ids`` (one group) in the given accepted form, and a function overwriting it in place."""
    if form == "list":
        row = ids.tolist()

        def overwrite_list(new: np.ndarray) -> None:
            row[:] = new.tolist()

        return [row], overwrite_list
    if form == "table-row":
        table = ids.reshape(1, -1).copy()  # a 2-D (groups, blocks) table: block_ids[0] is a row view

        def overwrite_table(new: np.ndarray) -> None:
            table[0, :] = new

        return table, overwrite_table
    dtype = "int64" if form == "list-of-int64" else form
    array = ids.astype(dtype)

    def overwrite(new: np.ndarray) -> None:
        array[:] = new.astype(dtype)

    return [array], overwrite


@pytest.mark.asyncio
@pytest.mark.parametrize("form", BLOCK_FORMS)
async def test_a_block_table_updated_after_load_returns_does_not_redirect_the_load(form: str) -> None:
    """load() takes the block ids at the call: the load fills the blocks named then, never later ones."""
    rig = Rig(seed=12)
    tokens = rig.prompt(3)
    src, dst, reused = rig.blocks(3, source=True), rig.blocks(3, source=False), rig.blocks(3, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src])).stored == 3
        argument, update = block_argument(form, dst)
        future = worker.load(tokens, argument)
        update(reused)  # the engine's block table moves on right after load() returned
        result = await future
    assert result.loaded_tokens == 3 * CHUNK
    for c in range(3):
        assert chunk_value(rig.group, dst[c * PER_CHUNK : (c + 1) * PER_CHUNK]) == rig.expected(src, c)
    assert rig.group.untouched(reused), "the load wrote into blocks named after load() returned"


@pytest.mark.asyncio
@pytest.mark.parametrize("form", BLOCK_FORMS)
async def test_block_ids_changed_after_store_returns_do_not_change_what_is_stored(form: str) -> None:
    """store() takes the block ids at the call: the chunks hold the bytes of the blocks named then."""
    rig = Rig(seed=13)
    tokens = rig.prompt(3)
    src, decoy = rig.blocks(3, source=True), rig.blocks(3, source=True)
    async with rig.worker() as worker:
        argument, update = block_argument(form, src)
        future = worker.store(tokens, argument)
        update(decoy)
        assert (await future).stored == 3
    rig.assert_store_holds(tokens, src)


# -- item 2: HashedPrompt values are validated at the call -------------------------------------------

BAD_HASHES: list[tuple[str, tuple[Any, ...]]] = [
    ("ints", (1, 2)),
    ("none", (None,)),
    ("bytes", (b"ab12",)),
    ("empty", ("",)),
    ("duplicate", ("ab12", "ab12")),
    ("whitespace", ("ab 12",)),
    ("newline", ("ab\n12",)),
    ("non-printable", ("ab\x0012",)),
]


def bad_prompt(hashes: tuple[Any, ...]) -> HashedPrompt:
    return HashedPrompt(hashes, CHUNK)  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "hashes"), BAD_HASHES, ids=[c for c, _ in BAD_HASHES])
async def test_bad_hashed_prompt_values_are_refused_at_the_call_and_fail_no_other_request(
    case: str, hashes: tuple[Any, ...]
) -> None:
    """A HashedPrompt whose digests are not distinct non-empty printable str is refused at the call
    (constructor, store, load or lookup), nothing of it reaches the store, and requests submitted
    alongside it succeed."""
    rig = Rig(seed=14)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    bad_blocks = rig.blocks(len(hashes), source=True)
    async with rig.worker() as worker:
        good_store = worker.store(tokens, [src])  # drained into the same batch as the bad one
        with pytest.raises((TypeError, ValueError)):
            worker.store(bad_prompt(hashes), [bad_blocks])
        assert (await good_store).stored == 2
        good_lookup = asyncio.ensure_future(worker.lookup(tokens))
        with pytest.raises((TypeError, ValueError)):
            await worker.lookup(bad_prompt(hashes))
        assert await good_lookup == 2 * CHUNK
        good_load = worker.load(tokens, [dst])
        with pytest.raises((TypeError, ValueError)):
            worker.load(bad_prompt(hashes), [dst])
        assert (await good_load).loaded_tokens == 2 * CHUNK
    assert len(rig.inner) == 2, "a key of the bad prompt reached the store"
    assert sorted(rig.backend.sent_keys("put")) == sorted(rig.keys(tokens))


# -- item 13: small argument cases ------------------------------------------------------------------


@pytest.mark.parametrize("op", ["put", "get"])
def test_zero_width_region_arrays_answer_invalid_per_key_in_the_memory_backend(op: str) -> None:
    """(n, 0) region arrays answer INVALID (-600) for each key, as the list form with empty rows does."""
    backend = MemoryBackend(capacity_bytes=1 << 20)
    buffer = np.zeros(4096, dtype=np.uint8)
    backend.register_buffer(int(buffer.ctypes.data), buffer.nbytes)
    keys = ["k0", "k1", "k2"]
    call = backend.batch_put if op == "put" else backend.batch_get
    empty = np.zeros((3, 0), dtype=np.int64)
    assert call(keys, empty, empty) == [INVALID] * 3
    assert call(keys, [[], [], []], [[], [], []]) == [INVALID] * 3  # the list form agrees
    assert len(backend) == 0


def test_zero_width_region_arrays_answer_invalid_per_key_in_mooncake(mooncake_backend: Any) -> None:
    """MooncakeBackend answers INVALID (-600) per key for (n, 0) region arrays, before native code."""
    buffer = np.zeros(4096, dtype=np.uint8)
    keys = unique_keys(3, "zero-width")
    empty = np.zeros((3, 0), dtype=np.int64)
    with registered(mooncake_backend, buffer):
        assert mooncake_backend.batch_put(keys, empty, empty) == [INVALID] * 3
        assert mooncake_backend.batch_get(keys, empty, empty) == [INVALID] * 3
        assert mooncake_backend.batch_exists(keys) == [False] * 3


def _traceback_depth(exc: BaseException) -> int:
    depth, tb = 0, exc.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def test_an_exception_instance_rule_raises_a_fresh_exception_each_time() -> None:
    """FaultRule(exception=<instance>) raises a fresh exception (same type and message) per firing, so
    nothing accumulates across firings."""
    template = ConnectionError("master gone")
    backend = FaultInjectingBackend(MemoryBackend(), rules=[FaultRule(op="exists", exception=template)])
    raised: list[BaseException] = []
    for _ in range(200):
        try:
            backend.batch_exists(["k"])
        except ConnectionError as exc:
            raised.append(exc)
    assert len(raised) == 200
    assert all(type(exc) is ConnectionError and str(exc) == "master gone" for exc in raised)
    assert all(exc is not template for exc in raised), "the rule re-raised the one instance it was given"
    assert len({id(exc) for exc in raised}) == 200
    assert _traceback_depth(raised[-1]) == _traceback_depth(raised[0])
    del raised
    gc.collect()


@pytest.mark.asyncio
async def test_a_timeout_of_ten_to_the_400_means_no_deadline_on_every_loop() -> None:
    """An int timeout too large for a float (10**400) means no deadline, like math.inf, on every loop."""
    rig = Rig(seed=15)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src], timeout=10**400)).stored == 2
        assert (await worker.load(tokens, [dst], timeout=10**400)).loaded_tokens == 2 * CHUNK
    rig.assert_store_holds(tokens, src)


@pytest.mark.asyncio
@pytest.mark.parametrize("timeout", [np.float32(5.0), np.float64(5.0), np.int32(5), np.int64(5)])
async def test_numpy_number_timeouts_are_accepted(timeout: Any) -> None:
    """A NumPy float or int timeout (np.float32(5.0), np.int64(5), ...) is a number of seconds like a
    Python float."""
    rig = Rig(seed=16)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src], timeout=timeout)).stored == 2
        assert (await worker.load(tokens, [dst], timeout=timeout)).loaded_tokens == 2 * CHUNK
    for c in range(2):
        assert chunk_value(rig.group, dst[c * PER_CHUNK : (c + 1) * PER_CHUNK]) == rig.expected(src, c)


@pytest.mark.asyncio
@pytest.mark.parametrize("ids", [[0, 2**63, 1, 2], [-1, 2**63, 1, 2], [2**63, 0, 1, 2], [0, 2**70, 1, 2]])
async def test_a_block_id_past_int64_in_a_list_is_reported_as_out_of_range(ids: list[int]) -> None:
    """A block id past int64 in a list is refused naming the argument and the int64 range, not as a
    float dtype that the caller never used."""
    rig = Rig(seed=17)
    async with rig.worker() as worker:
        with pytest.raises(InvalidRequestError) as info:
            worker.load(rig.prompt(2), [ids])
    message = str(info.value)
    assert "block_ids[0]" in message and "int64" in message, message
    assert "float" not in message, message
    assert rig.backend.data_calls() == []


@pytest.mark.asyncio
async def test_start_after_close_says_the_worker_is_closed() -> None:
    """start() on a closed worker raises WorkerClosedError saying it is closed (not "already called")."""
    rig = Rig(seed=18)
    worker = rig.worker()
    await worker.start()
    await worker.close()
    with pytest.raises(WorkerClosedError) as info:
        await worker.start()
    assert "closed" in str(info.value) and "already" not in str(info.value), str(info.value)
    # A second start() of a running worker still says it is already started.
    running = rig.worker()
    async with running:
        with pytest.raises(AiokvError, match="already"):
            await running.start()
