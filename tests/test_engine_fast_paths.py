"""The engine's shortcuts for the usual answers (every key written or read, one group, bools from
``batch_exists``) give what the general conversions give, and leave every other answer to them."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv._engine.answers import PressureBackoff, answer_codes
from aiokv._engine.exists import _presence
from aiokv._engine.guard import _failure_codes
from aiokv._engine.summary import load_result, store_result
from aiokv.codes import WRITTEN, Code
from aiokv.errors import BackendError
from aiokv.stats import ChunkOutcome, Op, WorkerStats


def _sizes(keys: int, row: list[int], broadcast: bool) -> np.ndarray:
    one = np.array(row, dtype=np.int64)
    return np.broadcast_to(one, (keys, one.size)) if broadcast else np.tile(one, (keys, 1))


@pytest.mark.parametrize(
    ("op", "answer"),
    [
        (Op.PUT, [0, 0, 0]),
        (Op.PUT, [0, -200, 0]),
        (Op.GET, [48, 48, 48]),
        (Op.GET, [48, 16, 48]),  # a short read
        (Op.GET, [48, -704, 48]),
    ],
)
def test_answer_codes_are_the_same_with_broadcast_sizes_as_without(op: Op, answer: list[int]) -> None:
    keys = ["a", "b", "c"]
    results = []
    for broadcast in (True, False):  # broadcast sizes take the shortcut when every key succeeded
        stats = WorkerStats()
        codes, error = answer_codes(
            op, keys, _sizes(3, [16, 32], broadcast), answer, stats, PressureBackoff(0.0, stats)
        )
        assert error is None
        results.append((codes.tolist(), stats.bytes[op], dict(stats.backend_errors)))
    assert results[0] == results[1]
    codes = results[0][0]
    if op is Op.PUT:
        assert codes == [WRITTEN if a >= 0 else a for a in answer]
    else:
        assert codes == [a if a in (48, -704) else Code.TRANSFER_FAILED for a in answer]


def test_presence_of_bools_ints_and_numpy_bools() -> None:
    assert _presence([True, False, True], "abc").tolist() == [True, False, True]
    assert _presence([np.True_, np.False_], "ab").tolist() == [True, False]
    assert _presence([1, 0, 2], "abc").tolist() == [True, False, True]
    assert _presence([True, 7, -1], "abc").tolist() == [True, True, True]  # as np.asarray(bool) reads them
    with pytest.raises(BackendError, match="answered 1 values for 2 keys"):
        _presence([True], "ab")


@pytest.mark.parametrize(
    "codes",
    [[WRITTEN, Code.PRESENT, WRITTEN], [WRITTEN, Code.TRANSFER_FAILED, Code.PRESENT], [Code.PRESENT] * 3],
)
def test_store_result_of_one_group_matches_the_general_path(codes: list[int]) -> None:
    one, two = WorkerStats(), WorkerStats()
    array = np.array(codes, dtype=np.int64)
    fast = store_result([array], one)
    general = store_result([array, array], two)  # two equal groups: the general path, same chunks
    assert (fast.stored, fast.skipped, fast.failed_chunks) == (
        general.stored,
        general.skipped,
        general.failed_chunks,
    )
    assert {code: 2 * n for code, n in fast.errors.items()} == general.errors  # counted per (chunk, group)
    assert one.chunks[ChunkOutcome.STORED] == two.chunks[ChunkOutcome.STORED] == fast.stored


@pytest.mark.parametrize("codes", [[48, 48, 48], [48, Code.NOT_FOUND, 48], [Code.TRANSFER_FAILED, 48, 48]])
def test_load_result_of_one_group_matches_the_general_path(codes: list[int]) -> None:
    array = np.array(codes, dtype=np.int64)
    blocks = np.arange(3).reshape(3, 1)
    fast = load_result([array], [blocks], 16, WorkerStats())
    general = load_result([array, array], [blocks, blocks], 16, WorkerStats())
    assert fast.loaded_tokens == general.loaded_tokens and fast.loaded_chunks == general.loaded_chunks
    assert {code: 2 * n for code, n in fast.errors.items()} == general.errors  # counted per (chunk, group)
    assert fast.failed_block_ids == general.failed_block_ids[:1]


@pytest.mark.parametrize(
    "answer",
    [[0] * 170, [0, -200, 3], [-1, -704], [], [0.5, -0.5], [True, False], ["x"], [[0, -1]], [0, None]],
)
def test_the_breakers_failure_codes_of_a_list_are_the_vectorised_conversions(answer: list[object]) -> None:
    """A list answer with no negative code skips the conversion; every other answer gets it."""
    try:
        codes = np.asarray(answer, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        expected: list[int] = []
    else:
        expected = codes[codes < 0].tolist() if codes.ndim == 1 else []
    assert _failure_codes(answer) == expected
    assert _failure_codes(np.asarray(answer, dtype=object)) == expected  # not a list: the conversion
