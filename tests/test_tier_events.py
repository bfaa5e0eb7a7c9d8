"""A tier's events (aiokv.tier_events): every key stored and removed, once each, in order, so that a
set kept from the events alone equals what the tier holds, through eviction, damage and a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import aiokv
from aiokv import DiskBackend, MemoryBackend, TierEvent, TierEventStream


def _layout() -> tuple[list[np.ndarray], aiokv.KVLayout]:
    caches = [np.zeros((2, 64, 16, 8, 64), dtype=np.float16) for _ in range(2)]
    return caches, aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)


def _replay(events: list[TierEvent]) -> set[str]:
    """The keys held, from the events alone; fails on a key stored twice or removed unheld."""
    held: set[str] = set()
    for event in events:
        if event.kind == "stored":
            assert event.key not in held, event
            held.add(event.key)
        else:
            assert event.key in held, event
            held.discard(event.key)
    return held


def _stored_keys(backend: DiskBackend | MemoryBackend, keys: set[str]) -> set[str]:
    ordered = sorted(keys)
    return {key for key, present in zip(ordered, backend.batch_exists(ordered), strict=True) if present}


@pytest.mark.asyncio
async def test_the_memory_tier_s_events_rebuild_what_it_holds() -> None:
    events: list[TierEvent] = []
    backend = MemoryBackend(listener=events.append)
    _, layout = _layout()
    async with aiokv.KVWorker(layout, backend, namespace="m", chunk_tokens=64) as worker:
        for start in range(4):
            await worker.store(np.arange(start * 1000, start * 1000 + 300), [np.arange(19)])
        await worker.store(np.arange(300), [np.arange(19)])  # present: nothing new
        seen = {event.key for event in events}
        assert len(seen) == 16 and all(event.tier == "memory" for event in events)
        dropped = sorted(seen)[:5]
        assert backend.batch_remove(dropped) == [0] * 5
        assert backend.batch_remove(dropped[:1]) == [-704]  # already gone: no event
        assert _replay(events) == _stored_keys(backend, seen) == seen - set(dropped)
        assert [e.reason for e in events if e.kind == "removed"] == ["removed"] * 5


@pytest.mark.asyncio
async def test_the_disk_tier_s_events_follow_eviction_damage_and_a_restart(tmp_path: Path) -> None:
    events: list[TierEvent] = []
    caches, layout = _layout()
    chunk_file = 4 * 2 * (2 * 16 * 8 * 64 * 2) + 4096  # 4 blocks x 2 layers, and a header page
    backend = DiskBackend(tmp_path, capacity_bytes=6 * chunk_file, listener=events.append)
    async with aiokv.KVWorker(layout, backend, namespace="d", chunk_tokens=64) as worker:
        for start in range(5):
            await worker.store(np.arange(start * 1000, start * 1000 + 300), [np.arange(19)])
        seen = {event.key for event in events}
        assert any(event.reason == "evicted" for event in events)  # 20 chunks, room for about 6
        assert _replay(events) == _stored_keys(backend, seen) == {key for key, _ in backend.listing()}
        # A file damaged behind the tier's back: the load that finds it drops it, and says so.
        victim = backend.listing()[-1][0]
        path = next(p for p in tmp_path.rglob("*.kv") if _holds(backend, p, victim))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        prompt = next(np.arange(s * 1000, s * 1000 + 300) for s in range(5) if _keys_of(worker, s, victim))
        await worker.load(prompt[:256], [np.arange(20, 36)])
        assert events[-1] == TierEvent("removed", victim, "disk", "damaged")
        held = _replay(events)
        assert held == {key for key, _ in backend.listing()}
    backend.close()
    reopened: list[TierEvent] = []
    again = DiskBackend(tmp_path, capacity_bytes=6 * chunk_file, listener=reopened.append)
    try:
        assert {e.reason for e in reopened} == {"restart"}
        assert _replay(reopened) == held == {key for key, _ in again.listing()}
    finally:
        again.close()
    del caches


def _holds(backend: DiskBackend, path: Path, key: str) -> bool:
    from aiokv.backends.disk_format import encode_key

    return encode_key(key) in path.read_bytes()[:4096]


def _keys_of(worker: aiokv.KVWorker, start: int, key: str) -> bool:
    prompt = aiokv.HashedPrompt.from_tokens(np.arange(start * 1000, start * 1000 + 300), 64)
    return any(digest in key for digest in prompt.hashes)


@pytest.mark.asyncio
async def test_a_stream_yields_events_from_any_thread_in_order() -> None:
    stream = TierEventStream()
    backend = MemoryBackend(listener=stream)

    def from_a_thread() -> None:
        stream(TierEvent("stored", "x", "memory", "put"))
        stream(TierEvent("removed", "x", "memory", "removed"))
        stream.close()

    await asyncio.to_thread(from_a_thread)
    got = [event async for event in stream]
    assert [(e.kind, e.key) for e in got] == [("stored", "x"), ("removed", "x")]
    backend.close()


@pytest.mark.asyncio
async def test_a_stream_that_dropped_events_says_so() -> None:
    stream = TierEventStream(max_pending=2)
    for n in range(3):
        stream(TierEvent("stored", str(n), "memory", "put"))
    with pytest.raises(RuntimeError, match="1 tier events were dropped"):
        async for _ in stream:
            pass
