"""Arguments are owned at the call, ``HashedPrompt`` values are validated at the call, and small
argument edge cases get consistent, accurate answers.

Every test runs a real KVWorker on a real MemoryBackend (in aiokv.testing's recording wrapper) and
checks real bytes in the store and in the engine's cache (one test checks the zero-width case against
a real Mooncake master).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import AiokvError, Code, HashedPrompt, InvalidRequestError, MemoryBackend, WorkerClosedError
from aiokv.testing import FaultInjectingBackend, FaultRule
from tests.mooncake_support import registered, unique_keys
from tests.rig import CHUNK, OneGroupRig

pytestmark = pytest.mark.usefixtures("no_cyclic_gc_until_teardown")

# -- arguments are owned at the call ---------------------------------------------------------------------

TOKEN_FORMS = ["list", "cleared-list", "tuple", "int64", "int32", "uint32", "uint16-row", "hashed-list"]


def token_argument(form: str, tokens: np.ndarray) -> tuple[Any, Callable[[np.ndarray], None]]:
    """The prompt in an accepted form, and what reusing its buffer for another prompt does to it."""
    if form in ("list", "cleared-list"):
        as_list = tokens.tolist()

        def reuse_list(other: np.ndarray) -> None:
            if form == "cleared-list":
                as_list.clear()  # a caller that clears its token list after the call
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
    """A token buffer reused or cleared right after store() leaves exactly the original chunks stored."""
    rig = OneGroupRig(seed=11)
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


# "table-row" is an int32 row view of a 2-D table; "table-int64" passes the whole 2-D int64 table.
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
    """A block table updated right after load() returns: the load fills the blocks named at the call only."""
    rig = OneGroupRig(seed=12)
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
    """A block table updated right after store() returns: the chunks hold the blocks named at the call."""
    rig = OneGroupRig(seed=13)
    tokens = rig.prompt(3)
    src, decoy = rig.blocks(3, source=True), rig.blocks(3, source=True)
    async with rig.worker() as worker:
        argument, update = block_argument(form, src)
        future = worker.store(tokens, argument)
        update(decoy)
        assert (await future).stored == 3
    rig.assert_store_holds(tokens, src)


# -- HashedPrompt values validated at the call -----------------------------------------------------------

BAD_HASHES: list[tuple[str, tuple[Any, ...]]] = [
    ("ints", (1, 2)),
    ("none", (None,)),
    ("bytes", (b"ab12",)),
    ("empty", ("",)),
    ("duplicate-adjacent", ("ab12", "ab12")),
    ("duplicate", ("ab12", "cd34", "ab12")),
    ("space", ("ab 12",)),
    ("newline", ("ab\n12",)),
    ("nul", ("ab\x0012",)),
    ("unicode-separator", ("ab\u202812",)),
]


@pytest.mark.parametrize(("case", "hashes"), BAD_HASHES, ids=[c for c, _ in BAD_HASHES])
def test_a_hashed_prompt_refuses_bad_digests_naming_the_index(case: str, hashes: tuple[Any, ...]) -> None:
    """HashedPrompt's constructor refuses any digest that is not a distinct non-empty printable str."""
    with pytest.raises((TypeError, InvalidRequestError), match=r"hashes\[\d\]"):
        HashedPrompt(hashes, CHUNK)  # type: ignore[arg-type]


def test_a_hashed_prompt_owns_its_digests_and_keeps_the_built_ones() -> None:
    """HashedPrompt copies a given list; from_tokens and from_block_hashes build digests that pass."""
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
    """A bad HashedPrompt for store, load or lookup is refused at the call; requests around it succeed."""
    rig = OneGroupRig(seed=14)
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
    rig.assert_store_holds(tokens, src)


# -- small argument cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["put", "get"])
def test_zero_width_region_arrays_answer_invalid_per_key_in_the_memory_backend(op: str) -> None:
    """MemoryBackend answers (n, 0) region arrays INVALID (-600) per key, as the list form does."""
    backend = MemoryBackend(capacity_bytes=1 << 20)
    buffer = np.zeros(4096, dtype=np.uint8)
    backend.register_buffer(int(buffer.ctypes.data), buffer.nbytes)
    keys = ["k0", "k1", "k2"]
    call = backend.batch_put if op == "put" else backend.batch_get
    empty = np.zeros((3, 0), dtype=np.int64)
    assert call(keys, empty, empty) == [Code.INVALID] * 3
    assert call(keys, [[], [], []], [[], [], []]) == [Code.INVALID] * 3  # the list form agrees
    assert len(backend) == 0


def test_zero_width_region_arrays_answer_invalid_per_key_in_mooncake(mooncake_backend: Any) -> None:
    """MooncakeBackend answers (n, 0) region arrays INVALID (-600) per key, before native code."""
    buffer = np.zeros(4096, dtype=np.uint8)
    keys = unique_keys(3, "zero-width")
    empty = np.zeros((3, 0), dtype=np.int64)
    with registered(mooncake_backend, buffer):
        assert mooncake_backend.batch_put(keys, empty, empty) == [Code.INVALID] * 3
        assert mooncake_backend.batch_get(keys, empty, empty) == [Code.INVALID] * 3
        assert mooncake_backend.batch_exists(keys) == [False] * 3


def _traceback_depth(exc: BaseException) -> int:
    depth, tb = 0, exc.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def test_an_exception_instance_rule_raises_a_fresh_exception_each_time() -> None:
    """FaultRule(exception=<instance>) raises a fresh copy per firing, so no traceback accumulates."""
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
    rig = OneGroupRig(seed=15)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src], timeout=10**400)).stored == 2
        assert (await worker.load(tokens, [dst], timeout=10**400)).loaded_tokens == 2 * CHUNK
    rig.assert_store_holds(tokens, src)


@pytest.mark.asyncio
@pytest.mark.parametrize("timeout", [np.float32(5.0), np.float64(5.0), np.int32(5), np.int64(5)])
async def test_numpy_number_timeouts_are_accepted(timeout: Any) -> None:
    """A NumPy float or int timeout is a number of seconds like a Python float."""
    rig = OneGroupRig(seed=16)
    tokens = rig.prompt(2)
    src, dst = rig.blocks(2, source=True), rig.blocks(2, source=False)
    async with rig.worker() as worker:
        assert (await worker.store(tokens, [src], timeout=timeout)).stored == 2
        assert (await worker.load(tokens, [dst], timeout=timeout)).loaded_tokens == 2 * CHUNK
    for c in range(2):
        assert rig.chunk_bytes(dst, c) == rig.chunk_bytes(src, c), c


@pytest.mark.asyncio
@pytest.mark.parametrize("ids", [[0, 2**63, 1, 2], [-1, 2**63, 1, 2], [2**63, 0, 1, 2], [0, 2**70, 1, 2]])
async def test_a_block_id_past_int64_in_a_list_is_reported_as_out_of_range(ids: list[int]) -> None:
    """A block id past int64 in a list is refused naming the argument and int64, never as a float."""
    rig = OneGroupRig(seed=17)
    async with rig.worker() as worker:
        with pytest.raises(InvalidRequestError) as info:
            worker.load(rig.prompt(2), [ids])
    message = str(info.value)
    assert "block_ids[0]" in message and "int64" in message, message
    assert "float" not in message, message
    assert rig.backend.data_calls() == []


@pytest.mark.asyncio
async def test_start_after_close_says_the_worker_is_closed() -> None:
    """start() after close() raises WorkerClosedError saying so; start() twice says "already"."""
    rig = OneGroupRig(seed=18)
    worker = rig.worker()
    await worker.start()
    await worker.close()
    with pytest.raises(WorkerClosedError) as info:
        await worker.start()
    assert "closed" in str(info.value) and "already" not in str(info.value), str(info.value)
    async with rig.worker() as running:
        with pytest.raises(AiokvError, match="already"):
            await running.start()
