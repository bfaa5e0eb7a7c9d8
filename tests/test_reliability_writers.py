"""A store result counts a chunk stored or skipped only when its bytes are readable at that moment, with
two writers of one prompt (two workers on one MemoryBackend; two Mooncake clients), and keys whose reads
failed (a SIGKILLed Mooncake writer's) are rewritten.

The choice for two writers of one prompt: the second writer's store waits (for at most
``OTHER_WRITER_WAIT_S``) for the other writer's write of a shared chunk to end, and reports
WRITE_IN_PROGRESS (-12) for what is still unreadable then. Real backends and real bytes: a MemoryBackend
in this process, and real Mooncake clients of a real master (those tests need a private network
namespace).
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

from aiokv import Code, KVWorker, MemoryBackend, StoreResult
from aiokv._engine import confirm as confirm_module
from aiokv._engine.rewrite import UnreadableKeys
from aiokv.backends import memory as memory_backend
from aiokv.backends.base import backend_traits, check_backend
from aiokv.backends.mooncake_master import segment_holder
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache, chunk_value
from tests.helpers import chunk_keys, read_value, wait_until

pytestmark = pytest.mark.usefixtures("no_cyclic_gc_until_teardown")

CHUNK = 8
NAMESPACE = "writers"
SPEC = {"num_regions": 4, "num_blocks": 96, "block_size": 4, "block_lens": 32}

# -- two writers of one prompt ----------------------------------------------------------------------------

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

    def chunk_bytes(self, chunk: int, engine: int = 0, *, loaded: bool = False) -> bytes:
        """A chunk's bytes in an engine's source blocks (or, ``loaded``, in its load target blocks)."""
        ids = self.dst if loaded else self.src
        return chunk_value(self.caches[engine][0], ids[chunk * self.per_chunk : (chunk + 1) * self.per_chunk])

    def loaded_own_bytes(self, engine: int) -> bool:
        """Whether a load gave every chunk of ``engine``'s target blocks its own source bytes."""
        return all(
            self.chunk_bytes(c, engine, loaded=True) == self.chunk_bytes(c, engine)
            for c in range(WRITERS_CHUNKS)
        )

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
    """MemoryBackend lists and reads a key only once its copy ended; a put meanwhile keeps the first bytes."""
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
        assert backend.batch_get(keys, *regions(out)) == [Code.NOT_FOUND, Code.NOT_FOUND]
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
    """A second writer on one MemoryBackend is done only once the first's bytes are readable, all counted."""
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
        assert await second.lookup(engines.tokens) == WRITERS_CHUNKS * CHUNK
        assert (await store_a).stored == WRITERS_CHUNKS
        loaded = await second.load(engines.tokens, [engines.dst])
        assert loaded.loaded_tokens == WRITERS_CHUNKS * CHUNK and engines.loaded_own_bytes(1), loaded


@pytest.mark.asyncio
async def test_a_second_writer_reports_write_in_progress_when_the_other_write_outlasts_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks another writer still writes after the wait fail WRITE_IN_PROGRESS (-12); a retry skips them."""
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
    """A store waiting for another writer ends at its next poll when cancelled; the other store completes."""
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
    """Of two Mooncake clients storing one prompt, the second counts only chunks that read back at once."""
    master = mooncake_master_factory()
    with segment_holder(master.address, graceful=True):
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
            loaded = await second.load(engines.tokens, [engines.dst])
            assert loaded.loaded_tokens == WRITERS_CHUNKS * CHUNK and engines.loaded_own_bytes(1), loaded


# -- a dead writer's keys --------------------------------------------------------------------------------


class TwoPrompts(TwoEngines):
    """Two engines holding different bytes for one prompt (the dead writer's and the live writer's),
    so the store shows whose bytes a key holds."""

    def __init__(self, backend: Any, namespace: str = NAMESPACE, spec: dict[str, Any] | None = None) -> None:
        super().__init__(backend, namespace, spec)
        rng = np.random.default_rng(47)
        for region in self.caches[1][0].regions:
            region[self.src] = rng.integers(0, 256, size=(self.src.size, region.shape[1]), dtype=np.uint8)


@pytest.mark.asyncio
async def test_keys_whose_reads_failed_are_rewritten_by_the_next_store_faults() -> None:
    """Keys whose gets failed -800 (injected) are removed and rewritten by the next store, not skipped."""
    engines = TwoPrompts(FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20)))
    backend = engines.backend
    keys = engines.keys()
    async with engines.worker(0) as dead, engines.worker(1) as live:
        assert (await dead.store(engines.tokens, [engines.src])).stored == WRITERS_CHUNKS
        backend.add_rule(FaultRule(op="get", keys=set(keys), code=Code.TRANSFER_FAILED, times=1))  # one call
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 0 and before.errors == {Code.TRANSFER_FAILED: WRITERS_CHUNKS}, before
        backend.clear_calls()
        result = await live.store(engines.tokens, [engines.src])
        assert (result.stored, result.skipped, result.failed) == (WRITERS_CHUNKS, 0, 0), result
        assert sorted(backend.sent_keys("put")) == sorted(keys)
        after = await live.load(engines.tokens, [engines.dst])
        assert after.loaded_tokens == WRITERS_CHUNKS * CHUNK, after
        assert engines.loaded_own_bytes(1), "the load did not read the live writer's bytes"
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
    """Without batch_remove, keys whose gets failed are reported failed (-800) by a store, not skipped."""
    recorded = FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20))
    engines = TwoPrompts(NoRemoveBackend(recorded))
    keys = engines.keys()
    async with engines.worker(0) as dead, engines.worker(1) as live:
        assert (await dead.store(engines.tokens, [engines.src])).stored == WRITERS_CHUNKS
        recorded.add_rule(FaultRule(op="get", keys={keys[2]}, code=Code.TRANSFER_FAILED, times=1))
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 2 * CHUNK, before
        result = await live.store(engines.tokens, [engines.src])
    assert result.failed_chunks == (2,) and result.skipped == WRITERS_CHUNKS - 1, result
    assert result.errors == {Code.TRANSFER_FAILED: 1}, result


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
    """A store rewrites a SIGKILLed writer's keys, counts only chunks that read back; <= 3 make it whole."""
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
    size = len(engines.chunk_bytes(0, 1))
    async with engines.worker(1) as live:
        before = await live.load(engines.tokens, [engines.dst])
        assert before.loaded_tokens == 0 and set(before.errors) <= {-800, -704}, before
        results: list[StoreResult] = []
        for _ in range(3):  # puts still placed on the dead segment fail, honestly; a retry stores them
            result = await asyncio.wait_for(live.store(engines.tokens, [engines.src]), 60)
            readable = await asyncio.to_thread(lambda: [read_value(live_backend, k, size) for k in keys])
            for c in counted(result):
                assert readable[c] == engines.chunk_bytes(c, 1), f"{result} counts unreadable chunk {c}"
            results.append(result)
            if not result.failed:
                break
        assert results[0].skipped == 0, f"{results[0]}: skipped chunks only a dead writer's segment held"
        assert results[-1].failed == 0, results
        after = await live.load(engines.tokens, [engines.dst])
        assert after.loaded_tokens == WRITERS_CHUNKS * CHUNK, after
        assert engines.loaded_own_bytes(1)


def test_the_unreadable_keys_are_bounded_and_batch_remove_is_checked_as_an_optional_method() -> None:
    """The remembered unreadable keys are bounded, and check_backend checks batch_remove as optional."""
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
