"""MemoryDiskBackend: a bounded memory level over a DiskBackend. Puts write the disk and copy into
memory; disk hits are promoted; memory evictions never touch the disk; the disk's evictions and removes
drop the memory copy; a restart keeps the disk and starts with an empty memory level; a damaged memory
copy is never answered; concurrent loads and stores. Every loaded byte is compared with what was put.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import aiokv
from aiokv import Code, MemoryDiskBackend, TierEvent, backend_traits, check_backend
from aiokv.backends.disk_format import ALIGN, file_bytes
from aiokv.testing import SENTINEL

from .test_disk_backend import VALUE, Values

OK, NOT_FOUND = int(Code.OK), int(Code.NOT_FOUND)
MEMORY = 3 * VALUE + 2 * ALIGN  # three copies fit (page-aligned in the heap), a fourth does not
FILE = file_bytes(len("key-00"), VALUE)
WAIT_S = 30.0  # a safety bound on waits between threads, never a speed assertion


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def backend(store_dir: Path) -> Iterator[MemoryDiskBackend]:
    b = MemoryDiskBackend(store_dir, 64 << 20, MEMORY)
    yield b
    b.close()


def copies(backend: MemoryDiskBackend, values: Values) -> list[str]:
    """The keys the memory level holds, in the values' order."""
    held = backend.memory.batch_exists(values.keys)
    return [key for key, h in zip(values.keys, held, strict=True) if h]


def test_is_a_backend_exported_at_the_top_level(backend: MemoryDiskBackend) -> None:
    check_backend(backend)
    traits = backend_traits(backend)
    assert traits.exists_in_process and traits.can_remove and traits.can_unregister
    assert aiokv.MemoryDiskBackend is MemoryDiskBackend


def test_a_put_is_on_disk_and_in_memory_and_loads_from_memory(backend: MemoryDiskBackend) -> None:
    values = Values(backend, 2)
    assert values.put() == [OK, OK]
    assert len(backend.disk) == 2 and copies(backend, values) == values.keys
    assert values.get() == [VALUE, VALUE]
    assert all(values.loaded(k) for k in range(2))
    stats = backend.stats()
    assert stats["memory_hits"] == 2 and stats["memory_bytes_read"] == 2 * VALUE
    assert stats["disk_hits"] == 0 and stats["memory_promotions"] == 0


def test_restart_keeps_the_disk_starts_memory_empty_and_promotes_disk_hits(store_dir: Path) -> None:
    with MemoryDiskBackend(store_dir, 64 << 20, MEMORY) as first:
        values = Values(first, 3)
        assert values.put() == [OK] * 3
    with MemoryDiskBackend(store_dir, 64 << 20, MEMORY) as again:
        values.register_with(again)
        assert len(again) == 3 and copies(again, values) == []
        assert again.stats()["memory_values"] == 0
        assert values.get([0, 1]) == [VALUE, VALUE]  # from the disk, then promoted
        assert values.loaded(0) and values.loaded(1)
        stats = again.stats()
        assert stats["disk_hits"] == 2 and stats["memory_hits"] == 0
        assert stats["memory_promotions"] == 2 and stats["memory_promoted_bytes"] == 2 * VALUE
        assert copies(again, values) == values.keys[:2]
        assert values.get() == [VALUE] * 3  # 0 and 1 from memory, 2 from the disk
        assert all(values.loaded(k) for k in range(3))
        stats = again.stats()
        assert stats["memory_hits"] == 2 and stats["disk_hits"] == 3 and stats["memory_promotions"] == 3


def test_memory_evictions_never_remove_the_disk_value(backend: MemoryDiskBackend) -> None:
    values = Values(backend, 6)
    for k in range(6):
        assert values.put([k]) == [OK]
    assert len(backend) == 6  # every value on the disk
    assert copies(backend, values) == values.keys[3:]  # the three most recent in memory
    assert backend.stats()["memory_evictions"] == 3
    assert values.get([0]) == [VALUE] and values.loaded(0)  # evicted from memory, read from the disk
    assert values.get() == [VALUE] * 6
    assert all(values.loaded(k) for k in range(6))
    stats = backend.stats()
    assert stats["memory_used_bytes"] <= MEMORY and stats["disk_evictions"] == 0 and len(backend) == 6


def test_gets_count_as_uses_of_the_memory_level(backend: MemoryDiskBackend) -> None:
    values = Values(backend, 4)
    assert values.put([0, 1, 2]) == [OK] * 3
    assert values.get([0]) == [VALUE]  # key 0 is now the most recently used copy
    assert values.put([3]) == [OK]
    assert copies(backend, values) == [values.keys[k] for k in (0, 2, 3)]


def test_a_disk_eviction_or_remove_drops_the_memory_copy(store_dir: Path) -> None:
    events: list[TierEvent] = []
    with MemoryDiskBackend(
        store_dir, 3 * FILE, 16 * VALUE, high_watermark=1.0, low_watermark=1.0, listener=events.append
    ) as backend:
        values = Values(backend, 4)
        assert values.put([0, 1, 2]) == [OK] * 3
        assert values.put([3]) == [OK]  # the disk evicts key 0
        assert backend.batch_exists(values.keys) == [False, True, True, True]
        assert copies(backend, values) == values.keys[1:]
        assert values.get([0]) == [NOT_FOUND] and values.untouched(0)
        assert backend.batch_remove([values.keys[1]]) == [OK]
        assert copies(backend, values) == values.keys[2:]
        assert values.get([1]) == [NOT_FOUND] and values.untouched(1)
        assert values.get([2, 3]) == [VALUE, VALUE] and values.loaded(2) and values.loaded(3)
        assert backend.stats()["memory_dropped"] == 2
    # The listener hears the disk: what the backend holds.
    assert [(e.key, e.reason) for e in events if e.tier == "disk" and e.kind == "removed"] == [
        ("key-00", "evicted"),
        ("key-01", "removed"),
    ]


def test_a_damaged_memory_copy_is_dropped_and_the_disk_answers(backend: MemoryDiskBackend) -> None:
    values = Values(backend, 2)
    assert values.put() == [OK, OK]
    heap = backend.memory._heap.buffer
    heap[:: ALIGN // 2] ^= 0x5A  # a byte of every copy changes
    assert values.get() == [VALUE, VALUE]
    assert all(values.loaded(k) for k in range(2))
    stats = backend.stats()
    assert stats["memory_verify_failed"] == 2 and stats["memory_hits"] == 0 and stats["disk_hits"] == 2
    assert stats["memory_promotions"] == 2  # the disk's verified bytes replace the damaged copies
    assert values.get() == [VALUE, VALUE] and all(values.loaded(k) for k in range(2))
    assert backend.stats()["memory_hits"] == 2


def test_a_copy_being_read_is_not_evicted(backend: MemoryDiskBackend) -> None:
    values = Values(backend, 4)
    assert values.put([0, 1, 2]) == [OK] * 3
    inside, release = threading.Event(), threading.Event()
    read = backend.memory.batch_get

    def held_read(*args: object) -> list[int]:
        inside.set()
        assert release.wait(WAIT_S)
        return read(*args)  # type: ignore[arg-type]

    backend.memory.batch_get = held_read  # type: ignore[method-assign]
    answers: list[list[int]] = []
    reader = threading.Thread(target=lambda: answers.append(values.get([0])))
    reader.start()
    assert inside.wait(WAIT_S)
    assert values.put([3]) == [OK]  # needs room: the least recently used copy nobody reads goes
    assert copies(backend, values) == [values.keys[k] for k in (0, 2, 3)]
    release.set()
    reader.join(WAIT_S)
    assert answers == [[VALUE]] and values.loaded(0)


def test_concurrent_loads_stores_and_removes_keep_every_byte(store_dir: Path) -> None:
    """Threads store, load and remove overlapping keys with a memory level of a few values (copies
    evicted and promoted all the time); every value loaded is byte-equal to what was put, and the
    memory level ends holding copies of disk values only."""
    count, rounds = 24, 60
    with MemoryDiskBackend(store_dir, 64 << 20, 4 * VALUE + 4 * ALIGN) as backend:
        source = Values(backend, count, seed=5)
        failures: list[str] = []
        buffers = [np.full(count * VALUE, SENTINEL, dtype=np.uint8) for _ in range(4)]
        for buffer in buffers:
            backend.register_buffer(int(buffer.ctypes.data), buffer.nbytes)

        def work(seed: int) -> None:
            try:
                loads(seed)
            except BaseException as exc:
                failures.append(repr(exc))

        def loads(seed: int) -> None:
            rng = np.random.default_rng(seed)
            dst = buffers[seed]
            base = int(dst.ctypes.data)
            for _ in range(rounds):
                rows = sorted(rng.choice(count, size=4, replace=False).tolist())
                keys = [source.keys[k] for k in rows]
                if seed == 0:
                    backend.batch_remove(keys[:1])
                    continue
                source.backend.batch_put(keys, *source.regions(source.src, rows))
                dst[:] = SENTINEL
                codes = backend.batch_get(keys, [[base + k * VALUE] for k in rows], [[VALUE]] * len(rows))
                for k, code in zip(rows, codes, strict=True):
                    got = dst[k * VALUE : (k + 1) * VALUE]
                    if code == VALUE and not np.array_equal(got, source.value(k)):
                        failures.append(f"{source.keys[k]}: wrong bytes")
                    elif code not in (VALUE, NOT_FOUND):
                        failures.append(f"{source.keys[k]}: {code}")

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S * 4)
        assert not failures, failures[:5]
        stats = backend.stats()
        assert stats["memory_hits"] > 0 and stats["memory_evictions"] > 0 and stats["memory_promotions"] > 0
        on_disk = {key for key, _ in backend.listing()}
        assert set(copies(backend, source)) <= on_disk
        assert stats["memory_values"] == len(copies(backend, source))


def test_the_connector_key_and_its_counters(tmp_path: Path) -> None:
    """``memory_cache_capacity`` applies to the disk backends only and defaults to none; the per-level
    counters reach the connector's report next to the tier's."""
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.stats_reporter import connector_counters

    disk = {"backend": "disk", "disk_path": str(tmp_path)}
    assert ConnectorConfig.from_extra_config(disk).memory_cache_capacity == 0
    config = ConnectorConfig.from_extra_config({**disk, "memory_cache_capacity": "2GiB"})
    assert config.memory_cache_capacity == 2 << 30
    with pytest.raises(ValueError, match="memory_cache_capacity"):
        ConnectorConfig.from_extra_config({"backend": "memory", "memory_cache_capacity": "2GiB"})
    stats = {
        "requests": {},
        "chunks": {},
        "bytes": {},
        "backend_errors": {},
        "host_tier": {"hits": 3, "memory_hits": 2, "disk_hits": 1, "memory_promotions": 1, "chunks": 9},
    }
    counters = connector_counters(stats)
    assert counters["host_tier_memory_hits"] == 2 and counters["host_tier_disk_hits"] == 1
    assert counters["host_tier_memory_promotions"] == 1 and "host_tier_chunks" not in counters
