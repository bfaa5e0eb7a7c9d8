"""aiokv.testing: holding calls, entry events, call counts, region capture and the toy paged cache."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from aiokv import MemoryBackend
from aiokv.testing import (
    SENTINEL,
    FaultInjectingBackend,
    GroupCache,
    HangExpiredError,
    PagedCache,
    chunk_block_ids,
    chunk_value,
    same_blocks,
)
from tests.helpers import same_exception


@pytest.fixture
def backend() -> Iterator[FaultInjectingBackend]:
    wrapped = FaultInjectingBackend(MemoryBackend(capacity_bytes=1 << 20))
    yield wrapped
    wrapped.release()
    wrapped.close()


@pytest.fixture
def buffer(backend: FaultInjectingBackend) -> np.ndarray:
    data = np.arange(256, dtype=np.uint8)
    backend.register_buffer(data.ctypes.data, data.nbytes)
    return data


def regions(buffer: np.ndarray, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Two 16-byte regions per key, key ``i`` at ``32 * i``."""
    starts = buffer.ctypes.data + 32 * np.arange(keys, dtype=np.int64)
    addrs = np.stack([starts, starts + 16], axis=1)
    return addrs, np.full_like(addrs, 16)


def test_a_blocked_op_waits_once_entered_until_released(
    backend: FaultInjectingBackend, buffer: np.ndarray
) -> None:
    addrs, sizes = regions(buffer, 2)
    answers: list[list[int]] = []
    gate = backend.block("put")
    assert not backend.entered("put").is_set()
    putter = threading.Thread(target=lambda: answers.append(backend.batch_put(["a", "b"], addrs, sizes)))
    putter.start()
    assert backend.entered("put").wait(10)
    assert backend.wait_hanging(1, timeout=10)
    # Started but not returned: counted, not yet recorded, nothing stored.
    assert backend.count("put") == 1 and backend.calls_of("put") == [] and len(backend) == 0
    assert backend.batch_exists(["a"]) == [False]  # other ops go through meanwhile
    backend.release("put")
    putter.join(10)
    assert gate.is_set() and answers == [[0, 0]]
    assert backend.keys_seen("put") == ["a", "b"] and len(backend) == 2
    # Released for good: a later put does not wait.
    assert backend.batch_put(["c"], addrs[:1], sizes[:1]) == [0]
    assert backend.count("put") == 2 and backend.count("exists") == 1
    assert backend.count() == 4  # register, exists and two puts


def test_blocked_releases_when_the_body_fails_and_a_forgotten_block_expires(
    backend: FaultInjectingBackend, buffer: np.ndarray
) -> None:
    with pytest.raises(RuntimeError, match="body failed"), backend.blocked("exists"):
        raise RuntimeError("body failed")
    assert backend.batch_exists(["a"]) == [False]  # no longer held
    backend.block("get", max_wait_s=0.05)
    addrs, sizes = regions(buffer, 1)
    with pytest.raises(HangExpiredError):
        backend.batch_get(["a"], addrs, sizes)
    assert isinstance(backend.calls_of("get")[0].error, HangExpiredError)


def test_fail_raises_the_given_exception_for_the_next_calls_only(
    backend: FaultInjectingBackend, buffer: np.ndarray
) -> None:
    addrs, sizes = regions(buffer, 1)
    boom = ConnectionError("master gone")
    backend.fail("put", boom, times=2)
    for _ in range(2):
        with pytest.raises(ConnectionError) as info:
            backend.batch_put(["a"], addrs, sizes)
        assert same_exception(info.value, boom)
    assert backend.batch_put(["a"], addrs, sizes) == [0]
    assert backend.sent_keys("put") == ["a"]  # the failed calls never reached the store
    assert backend.keys_seen("put") == ["a", "a", "a"]  # but they were made


def test_records_keep_region_tables_threads_and_registrations(
    backend: FaultInjectingBackend, buffer: np.ndarray
) -> None:
    addrs, sizes = regions(buffer, 3)
    backend.batch_put(["a", "b", "c"], addrs.tolist(), sizes.tolist())  # lists are captured too
    put = backend.calls_of("put")[0]
    assert put.addrs is not None and put.sizes is not None
    assert np.array_equal(put.addrs, addrs) and np.array_equal(put.sizes, sizes)
    assert put.region_counts == (2, 2, 2) and put.nbytes == (32, 32, 32)
    addrs[:] = 0  # a copy: later changes to the caller's table do not reach the record
    assert put.addrs[0, 0] == buffer.ctypes.data
    assert backend.registered() == [(buffer.ctypes.data, buffer.nbytes)]
    assert backend.threads_seen() == {threading.current_thread().name}
    backend.unregister_buffer(buffer.ctypes.data)
    assert backend.count("unregister") == 1 and backend.registered() == [(buffer.ctypes.data, 256)]
    backend.clear_calls()
    assert backend.calls == [] and backend.count() == 0 and backend.registered() == []


def test_entered_names_one_op_vocabulary(backend: FaultInjectingBackend) -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        backend.entered("batch_put")


SPECS = [
    {"num_regions": 3, "num_blocks": 10, "block_size": 4, "block_lens": [8, 16]},
    {"num_regions": 2, "num_blocks": 6, "block_size": 8, "block_lens": 32},
]


def test_paged_cache_layouts_match_the_arrays() -> None:
    cache = PagedCache.allocate(SPECS, fill="random", seed=3)
    assert len(cache) == 2
    for group, spec in zip(cache.groups, SPECS, strict=True):
        assert len(group.regions) == spec["num_regions"] and group.num_blocks == spec["num_blocks"]
        assert group.layout.base_addrs.tolist() == [r.ctypes.data for r in group.regions]
        assert group.layout.block_size == spec["block_size"]
    assert [r.shape for r in cache[0].regions] == [(10, 8), (10, 16), (10, 8)]
    assert cache[0].nbytes == 10 * (8 + 16 + 8)
    # Seeds differ per group, and the same seed gives the same bytes.
    again = PagedCache.allocate(SPECS, fill="random", seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(cache[1].regions, again[1].regions, strict=True))


def test_chunk_value_is_region_by_region_the_blocks_in_order() -> None:
    group = GroupCache.allocate(num_regions=2, num_blocks=5, block_size=2, block_lens=4, seed=1)
    ids = chunk_block_ids([4, 0, 3, 1], chunk=1, per_chunk=2)
    assert ids == [3, 1]
    a, b = group.regions
    assert chunk_value(group, ids) == a[3].tobytes() + a[1].tobytes() + b[3].tobytes() + b[1].tobytes()


def test_fill_randomize_and_compare_blocks() -> None:
    dst = GroupCache.allocate(num_regions=2, num_blocks=6, block_size=2, block_lens=4, fill=SENTINEL)
    src = GroupCache.allocate(num_regions=2, num_blocks=6, block_size=2, block_lens=4, fill=0)
    assert src.written_blocks(0) == set() and dst.untouched(range(6))
    src.randomize([1, 4], np.random.default_rng(0))
    assert src.written_blocks(0) <= {1, 4} and src.untouched([0, 2, 3, 5], 0)
    for region_src, region_dst in zip(src.regions, dst.regions, strict=True):
        region_dst[[2, 5]] = region_src[[1, 4]]
    assert same_blocks(src, [1, 4], dst, [2, 5]) and not same_blocks(src, [1, 4], dst, [5, 2])
    assert dst.written_blocks() == {2, 5}
    dst.fill(SENTINEL, [2])
    assert dst.written_blocks() == {5}
    with pytest.raises(ValueError, match="destination blocks"):
        same_blocks(src, [1], dst, [1, 2])
