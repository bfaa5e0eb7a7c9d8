"""Chunks keyed per layer group (``layer_groups``) on their own: real aiokv workers over one
``MemoryBackend``, a four-layer paged cache cut into two layer groups, driven as the connector's
worker side drives them during a forward; every loaded byte checked."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokv.backends.memory import MemoryBackend
from aiokv.integrations.vllm.common.group_workers import GroupWorkers
from aiokv.integrations.vllm.worker_side.layerwise_mover import LayerwiseMover
from aiokv.keys import HashedPrompt, KeyNamespace
from aiokv.layout import KVLayout
from aiokv.testing import FaultInjectingBackend
from aiokv.testing.paged_cache import GroupCache

PAGE = 4096
BLOCK = 16
LAYERS = ("l0", "l1", "l2", "l3")
GROUPS = (("l0", "l1"), ("l2", "l3"))


def layer_group_layouts(cache: GroupCache) -> list[KVLayout]:
    """The layouts of the two layer groups: regions 0-1 and 2-3 of ``cache``."""
    addrs = [region.ctypes.data for region in cache.regions]
    return [KVLayout(addrs[start : start + 2], [PAGE], BLOCK, cache.num_blocks) for start in (0, 2)]


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    backend = FaultInjectingBackend(MemoryBackend(64 << 20))
    cache = GroupCache.allocate(
        num_regions=len(LAYERS), num_blocks=32, block_size=BLOCK, block_lens=PAGE, seed=3
    )
    namespaces = [KeyNamespace(f"tiny@layers{index}of2") for index in range(2)]
    groups = GroupWorkers(
        layer_group_layouts(cache), backend, namespaces, chunk_tokens=BLOCK, executor_threads=1
    )
    try:
        yield {
            "backend": backend,
            "cache": cache,
            "groups": groups,
            "mover": LayerwiseMover(groups.workers, GROUPS),
        }
    finally:
        groups.close()
        backend.close()


def request(seed: int, blocks: list[int]) -> tuple[HashedPrompt, list[list[int]]]:
    rng = np.random.default_rng(seed)
    digests = tuple(f"{seed:04d}{int(value):016x}" for value in rng.integers(0, 2**62, size=len(blocks)))
    return HashedPrompt(digests, BLOCK), [blocks]


def test_stores_leave_once_every_layer_of_a_group_is_written(rig: dict[str, Any]) -> None:
    mover, backend = rig["mover"], rig["backend"]
    requests = [request(1, [1, 2, 3]), request(2, [4, 5])]
    asked: list[int] = []

    def step_requests() -> list[Any]:
        asked.append(1)
        return requests

    mover.layer_written("l1", step_requests)  # written out of order: l0 is still missing
    assert not backend.calls_of("put")
    mover.layer_written("l0", step_requests)
    assert mover.counters["layer_stores_during_forward"] == 1
    futures = mover.store_many(requests)  # the end of the forward: the second layer group leaves now
    results = [future.result(timeout=30) for future in futures]
    assert [(r.stored, r.failed) for r in results] == [(3, 0), (2, 0)]
    assert len(asked) == 1  # the step's requests are built once
    assert len(set(backend.sent_keys("put"))) == 2 * 5  # two keys per chunk
    with pytest.raises(RuntimeError, match="changed during its forward"):
        mover.layer_written("l0", lambda: requests)
        mover.store_many(requests[:1])


def test_a_load_is_waited_for_per_layer_group_and_fills_every_byte(rig: dict[str, Any]) -> None:
    mover, cache = rig["mover"], rig["cache"]
    stored = request(7, [1, 2, 3, 4])
    for future in mover.store_many([stored]):
        assert future.result(timeout=30).ok
    expected = [block.copy() for block in cache.blocks([1, 2, 3, 4])]
    cache.fill(0, [10, 11, 12, 13])
    mover.new_step()
    (load,) = mover.load_many([(stored[0], [[10, 11, 12, 13]])])
    mover.wait_for_layer("l0")
    assert mover.wait_for_layer("l1") == 0.0  # its group was waited for by l0
    mover.wait_for_layer("l2")
    assert mover.wait_for_layer("not-a-layer-of-this-group") == 0.0
    assert mover.counters["layer_loads_waited"] == 2
    result = load.result(timeout=30)
    assert result.ok and result.loaded_chunks == 4
    for got, want in zip(cache.blocks([10, 11, 12, 13]), expected, strict=True):
        assert np.array_equal(got, want)


def test_a_chunk_missing_from_one_layer_group_fails_its_blocks(rig: dict[str, Any]) -> None:
    mover, backend = rig["mover"], rig["backend"]
    stored = request(9, [1, 2])
    for future in mover.store_many([stored]):
        assert future.result(timeout=30).ok
    second_group = sorted(key for key in backend.sent_keys("put") if "layers1of2" in key)
    assert len(second_group) == 2
    assert backend.inner.batch_remove(second_group[:1], force=True) == [0]
    mover.new_step()
    (load,) = mover.load_many([(stored[0], [[20, 21]])])
    result = load.result(timeout=30)
    assert not result.ok and result.failed_block_ids[0]  # recomputed, never half-loaded


def test_a_refused_layer_group_fails_the_request_after_the_others_finish(rig: dict[str, Any]) -> None:
    mover, groups = rig["mover"], rig["groups"]
    groups.workers[1].close(timeout=30)  # the second layer group refuses every call from now on
    stored = request(11, [1, 2])
    (future,) = mover.store_many([stored])
    with pytest.raises(Exception):  # noqa: B017 - whatever the closed worker raises reaches the caller
        future.result(timeout=30)
    mover.new_step()
    (load,) = mover.load_many([(stored[0], [[5, 6]])])
    with pytest.raises(Exception):  # noqa: B017
        load.result(timeout=30)
    done, _ = concurrent.futures.wait([future, load], timeout=30)
    assert len(done) == 2


def test_layer_groups_load_one_after_another_in_the_forwards_order(rig: dict[str, Any]) -> None:
    """Sharing the store, concurrent loads would all land near the end: the second group's get starts
    only once the first group's is done, so the first layers can compute meanwhile."""
    mover, backend = rig["mover"], rig["backend"]
    stored = request(13, [1, 2, 3])
    for future in mover.store_many([stored]):
        assert future.result(timeout=30).ok
    mover.new_step()
    with backend.blocked("get"):
        (load,) = mover.load_many([(stored[0], [[7, 8, 9]])])
        assert backend.entered("get").wait(30)
        assert backend.count("get") == 1  # the first layer group's, held: the second waits for it
        assert not load.done()
    mover.wait_for_layer("l0")
    mover.wait_for_layer("l3")
    assert backend.count("get") == 2
    keys = backend.sent_keys("get")
    assert all("layers0of2" in key for key in keys[:3]) and all("layers1of2" in key for key in keys[3:])
    assert load.result(timeout=30).ok


def test_stores_of_a_forward_that_never_ended_are_waited_for_at_the_next_step(rig: dict[str, Any]) -> None:
    mover = rig["mover"]
    requests = [request(17, [1, 2])]
    mover.layer_written("l0", lambda: requests)
    mover.layer_written("l1", lambda: requests)  # the first group's stores leave; no store_many follows
    mover.new_step()
    assert mover.counters["layer_stores_unfinished_steps"] == 1
    (future,) = mover.store_many(requests)  # a fresh step: every group submitted anew
    assert future.result(timeout=30).failed == 0
