"""VerifiedBackend: every value checks itself on load, over the embedded store and a real Mooncake store.

The stored values are damaged the way a store bug or a bad disk would: one bit of one value flipped
(the value read raw through the inner store, altered and written back under the same key), two
equal-size values swapped between their keys, a value written by a reader of another fingerprint,
a value written without verification. Each time the load answers exactly those keys
``VERIFY_FAILED`` (or a size error) and every other key its bytes.

The Mooncake cases skip (fail under CI) outside a private network namespace; run them with
    unshare -rn sh -c 'ip link set lo up && python -m pytest tests/test_verified_backend.py'
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from aiokv import Code, KVWorker, MemoryBackend, backend_traits
from aiokv.backends.value_header import HEADER_BYTES
from aiokv.backends.verified import VerifiedBackend
from aiokv.errors import BackendError
from aiokv.metrics import PrometheusExporter
from aiokv.testing import SENTINEL, PagedCache, same_blocks

from .helpers import TWO_GROUP_SPECS, TWO_GROUPS_CHUNK_TOKENS, chunk_keys, prompt
from .mooncake_support import random_bytes, registered, unique_keys

VALUE_BYTES = 6000  # not a multiple of 8: the checksum covers odd tails too
KEYS = 6
FINGERPRINT = b"float16/block16/page6000/layers2/block-major/model-a/cpu-avx512"


@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def inner(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The store below the wrapper: the embedded one, or a real Mooncake client."""
    if request.param == "memory":
        backend: Any = MemoryBackend(capacity_bytes=64 << 20)
        yield backend
        backend.close()
        return
    master = request.getfixturevalue("mooncake_master")
    connect: Callable[..., Any] = request.getfixturevalue("mooncake_backend_factory")
    yield connect(master.address)


class Values:
    """``KEYS`` random values of ``VALUE_BYTES`` in a source buffer, each stored in two regions, and a
    destination buffer they are read back into."""

    def __init__(self, backend: VerifiedBackend, seed: int = 0) -> None:
        self.keys = unique_keys(KEYS, "verified")
        self.src = random_bytes(KEYS * VALUE_BYTES, seed)
        self.dst = np.full(KEYS * VALUE_BYTES, SENTINEL, dtype=np.uint8)
        self.backend = backend

    def regions(self, base: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each value as two regions of unequal size (the second one odd)."""
        cut = 1000
        addrs = [[base + k * VALUE_BYTES, base + k * VALUE_BYTES + cut] for k in range(KEYS)]
        sizes = [[cut, VALUE_BYTES - cut]] * KEYS
        return addrs, sizes

    def put(self) -> list[int]:
        return self.backend.batch_put(self.keys, *self.regions(int(self.src.ctypes.data)))

    def get(self) -> list[int]:
        self.dst[:] = SENTINEL
        return self.backend.batch_get(self.keys, *self.regions(int(self.dst.ctypes.data)))

    def loaded(self, k: int) -> bool:
        span = slice(k * VALUE_BYTES, (k + 1) * VALUE_BYTES)
        return bool((self.dst[span] == self.src[span]).all())


def raw_value(inner: Any, key: str) -> np.ndarray:
    """The stored value of ``key`` with its header, read through the inner store."""
    scratch = np.zeros(VALUE_BYTES + HEADER_BYTES, dtype=np.uint8)
    with registered(inner, scratch) as addr:
        assert inner.batch_get([key], [[addr]], [[scratch.nbytes]]) == [scratch.nbytes]
    return scratch


def raw_write(inner: Any, values: dict[str, np.ndarray]) -> None:
    """Replace each key's stored value with ``values[key]``, through the inner store."""
    assert inner.batch_remove(list(values), force=True) == [0] * len(values)
    buffer = np.concatenate(list(values.values()))
    size = buffer.nbytes // len(values)
    with registered(inner, buffer) as addr:
        codes = inner.batch_put(
            list(values), [[addr + i * size] for i in range(len(values))], [[size]] * len(values)
        )
    assert codes == [0] * len(values)


@pytest.fixture
def verified(inner: Any) -> Iterator[tuple[VerifiedBackend, Values]]:
    backend = VerifiedBackend(inner, FINGERPRINT, close_inner=False)
    values = Values(backend)
    with registered(backend, values.src), registered(backend, values.dst):
        assert values.put() == [0] * KEYS
        yield backend, values
    backend.close()


def failed_keys(codes: list[int]) -> list[int]:
    return [k for k, code in enumerate(codes) if code != VALUE_BYTES]


def test_round_trip_verifies_every_value(verified: tuple[VerifiedBackend, Values]) -> None:
    backend, values = verified
    assert values.get() == [VALUE_BYTES] * KEYS
    assert all(values.loaded(k) for k in range(KEYS))
    stats = backend.verification_stats()
    assert (
        stats["verified"] == KEYS
        and sum(stats[m] for m in ("format", "length", "identity", "fingerprint", "checksum")) == 0
    )
    assert stats["checksum_bytes"] == 2 * KEYS * VALUE_BYTES  # hashed on put and on get
    assert stats["checksum_cpu_ns"] > 0
    # What the store holds: the bytes, then the header (64 bytes more than the caller's regions).
    stored = raw_value(backend.inner, values.keys[2])
    assert stored[:VALUE_BYTES].tobytes() == values.src[2 * VALUE_BYTES : 3 * VALUE_BYTES].tobytes()
    assert stored[VALUE_BYTES : VALUE_BYTES + 4].tobytes() == b"AKV1"


def test_one_flipped_bit_fails_exactly_that_value(
    verified: tuple[VerifiedBackend, Values], caplog: pytest.LogCaptureFixture
) -> None:
    backend, values = verified
    victim = values.keys[3]
    value = raw_value(backend.inner, victim)
    value[4321] ^= 0x10  # one bit of the bytes, not of the header
    raw_write(backend.inner, {victim: value})

    with caplog.at_level(logging.WARNING, logger="aiokv"):
        codes = values.get()
    assert failed_keys(codes) == [3] and codes[3] == Code.VERIFY_FAILED
    assert all(values.loaded(k) for k in range(KEYS) if k != 3)
    assert backend.verification_stats()["checksum"] == 1
    logged = [r.getMessage() for r in caplog.records if victim in r.getMessage()]
    assert len(logged) == 1 and "checksum" in logged[0]
    # The broken value was dropped: a store writes the chunk again, and it loads.
    assert backend.inner.batch_exists([victim]) == [False]
    assert values.put() == [0] * KEYS
    assert values.get() == [VALUE_BYTES] * KEYS


def test_swapped_values_fail_both_keys(
    verified: tuple[VerifiedBackend, Values], caplog: pytest.LogCaptureFixture
) -> None:
    backend, values = verified
    a, b = values.keys[1], values.keys[4]
    value_a, value_b = raw_value(backend.inner, a), raw_value(backend.inner, b)
    raw_write(backend.inner, {a: value_b, b: value_a})  # each well-formed, under the other key

    with caplog.at_level(logging.WARNING, logger="aiokv"):
        codes = values.get()
    assert failed_keys(codes) == [1, 4]
    assert codes[1] == codes[4] == Code.VERIFY_FAILED
    assert backend.verification_stats()["identity"] == 2
    assert sum("identity" in r.getMessage() for r in caplog.records) == 2


def test_a_damaged_header_fails_its_value(
    verified: tuple[VerifiedBackend, Values], caplog: pytest.LogCaptureFixture
) -> None:
    """A bit flipped in the header's length field: the value fails for its framing (length)."""
    backend, values = verified
    victim = values.keys[5]
    value = raw_value(backend.inner, victim)
    value[VALUE_BYTES + 8] ^= 0x01  # the length field's lowest byte
    raw_write(backend.inner, {victim: value})
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        codes = values.get()
    assert failed_keys(codes) == [5] and codes[5] == Code.VERIFY_FAILED
    assert backend.verification_stats()["length"] == 1
    assert any(victim in r.getMessage() and "length" in r.getMessage() for r in caplog.records)


def test_failures_are_logged_once_per_key(
    verified: tuple[VerifiedBackend, Values], caplog: pytest.LogCaptureFixture
) -> None:
    backend, values = verified
    other = VerifiedBackend(backend.inner, b"another engine", close_inner=False)
    dst = np.zeros_like(values.dst)  # memory of its own: the inner store registers a buffer once
    try:
        with registered(other, dst), caplog.at_level(logging.WARNING, logger="aiokv"):
            for _ in range(3):
                codes = other.batch_get(values.keys, *values.regions(int(dst.ctypes.data)))
                assert codes == [Code.VERIFY_FAILED] * KEYS
        assert other.verification_stats()["fingerprint"] == 3 * KEYS
        assert sum("fingerprint" in r.getMessage() for r in caplog.records) == KEYS
    finally:
        other.close()


def test_another_fingerprint_is_refused_chunk_by_chunk_and_left_stored(
    verified: tuple[VerifiedBackend, Values],
) -> None:
    """A reader of another geometry under the same keys gets no byte counted; the writer still reads."""
    backend, values = verified
    other = VerifiedBackend(backend.inner, FINGERPRINT.replace(b"block16", b"block32"), close_inner=False)
    dst = np.zeros_like(values.dst)
    try:
        with registered(other, dst):
            codes = other.batch_get(values.keys, *values.regions(int(dst.ctypes.data)))
        assert codes == [Code.VERIFY_FAILED] * KEYS
        assert other.verification_stats()["fingerprint"] == KEYS
    finally:
        other.close()
    assert backend.inner.batch_exists(values.keys) == [True] * KEYS
    assert values.get() == [VALUE_BYTES] * KEYS


def test_a_value_written_without_verification_is_never_loaded(
    verified: tuple[VerifiedBackend, Values],
) -> None:
    """An old-format value is 64 bytes shorter than a verified get asks for: a size error."""
    backend, values = verified
    victim = values.keys[0]
    raw_write(backend.inner, {victim: values.src[:VALUE_BYTES].copy()})
    codes = values.get()
    assert failed_keys(codes) == [0] and codes[0] == Code.TRANSFER_FAILED
    assert all(values.loaded(k) for k in range(1, KEYS))


def test_a_region_outside_registered_memory_is_refused_before_the_store(
    verified: tuple[VerifiedBackend, Values],
) -> None:
    backend, values = verified
    stray = np.zeros(VALUE_BYTES, dtype=np.uint8)  # registered with nobody
    keys = unique_keys(2, "stray")
    base = int(values.src.ctypes.data)
    codes = backend.batch_put(keys, [[base], [int(stray.ctypes.data)]], [[VALUE_BYTES]] * 2)
    assert codes == [0, Code.INVALID]
    assert backend.inner.batch_exists(keys) == [True, False]
    codes = backend.batch_get(keys, [[int(stray.ctypes.data)], [base]], [[VALUE_BYTES]] * 2)
    assert codes == [Code.INVALID, Code.NOT_FOUND]


def test_concurrent_calls_share_the_header_arena(inner: Any) -> None:
    """More threads than header pages: every call still gets slots of its own and every value checks."""
    backend = VerifiedBackend(inner, FINGERPRINT, close_inner=False, pages=2)
    threads, rounds = 6, 4
    sets = [Values(backend, seed=t) for t in range(threads)]
    errors: list[BaseException] = []

    def work(values: Values) -> None:
        try:
            for _ in range(rounds):
                assert values.put() == [0] * KEYS
                assert values.get() == [VALUE_BYTES] * KEYS
                assert all(values.loaded(k) for k in range(KEYS))
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    try:
        for values in sets:
            backend.register_buffer(int(values.src.ctypes.data), values.src.nbytes)
            backend.register_buffer(int(values.dst.ctypes.data), values.dst.nbytes)
        workers = [threading.Thread(target=work, args=(values,)) for values in sets]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        assert not errors, errors
        assert backend.verification_stats()["verified"] == threads * rounds * KEYS
    finally:
        backend.close()


def test_closed_wrapper_refuses_calls(inner: Any) -> None:
    backend = VerifiedBackend(inner, FINGERPRINT, close_inner=False)
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendError):
        backend.batch_get(["k"], [[1]], [[1]])
    assert not inner.closed  # close_inner=False: the owner closes it
    with pytest.raises(TypeError):
        VerifiedBackend(inner, "not bytes")  # type: ignore[arg-type]


def test_worker_reports_the_corrupt_chunk_failed() -> None:
    """Through KVWorker: one flipped bit fails exactly that chunk (the loaded prefix ends there),
    counted in stats and Prometheus as VERIFY_FAILED; every other chunk of both groups loads its bytes."""
    src = PagedCache.allocate(TWO_GROUP_SPECS, fill="random", seed=1)
    dst = PagedCache.allocate(TWO_GROUP_SPECS, fill=SENTINEL)
    inner = MemoryBackend(capacity_bytes=64 << 20)
    backend = VerifiedBackend(inner, FINGERPRINT)
    chunks, c = 4, TWO_GROUPS_CHUNK_TOKENS
    tokens = prompt(7, chunks)
    ids = [np.arange(chunks * (c // layout.block_size), dtype=np.int64) for layout in src.layouts]

    async def run() -> None:
        async with KVWorker(src.layouts, backend, namespace="verified", chunk_tokens=c) as worker:
            stored = await worker.store(tokens, ids)
            assert stored.stored == chunks
        victim = chunk_keys(tokens, c, src.layouts[0], 0, "verified")[2]
        size = src.layouts[0].chunk_bytes_per_block * (c // src.layouts[0].block_size) + HEADER_BYTES
        scratch = np.zeros(size, dtype=np.uint8)
        with registered(inner, scratch) as addr:
            assert inner.batch_get([victim], [[addr]], [[size]]) == [size]
            scratch[17] ^= 1
            assert inner.batch_remove([victim]) == [0]
            assert inner.batch_put([victim], [[addr]], [[size]]) == [0]
        async with KVWorker(dst.layouts, backend, namespace="verified", chunk_tokens=c) as worker:
            loaded = await worker.load(tokens, ids)
            stats = worker.stats()
            registry = CollectorRegistry()
            PrometheusExporter(worker, registry)
            labels = {"code": str(int(Code.VERIFY_FAILED)), "error": "VERIFY_FAILED"}
            assert registry.get_sample_value("aiokv_backend_errors_total", labels) == 1
        assert loaded.loaded_tokens == 2 * c
        assert loaded.errors == {int(Code.VERIFY_FAILED): 1}
        per = [c // layout.block_size for layout in src.layouts]
        # Exactly the corrupt chunk's blocks (in every group: a chunk loads whole or not) are to
        # recompute; the others hold the stored bytes.
        assert loaded.failed_block_ids == tuple(tuple(range(2 * n, 3 * n)) for n in per)
        for g, layout_ids in enumerate(ids):
            good = [b for b in layout_ids.tolist() if b not in loaded.failed_block_ids[g]]
            assert same_blocks(src[g], good, dst[g], good)
        assert stats["backend_errors"] == {int(Code.VERIFY_FAILED): 1}

    try:
        asyncio.run(run())
    finally:
        backend.close()
    assert inner.closed


class ReplicaReading(MemoryBackend):
    """The embedded store with a replica read (as MooncakeBackend's: a get's arguments and answers)."""

    def read_from_replicas(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        return self.batch_get(keys, addrs, sizes)


class WithoutRemove:
    """A store offering only the protocol's required methods."""

    def __init__(self) -> None:
        self.inner = MemoryBackend(capacity_bytes=1 << 20)
        self.register_buffer = self.inner.register_buffer
        self.batch_exists = self.inner.batch_exists
        self.batch_put = self.inner.batch_put
        self.batch_get = self.inner.batch_get
        self.close = self.inner.close


def test_optional_members_follow_the_inner_store() -> None:
    """A replica read is verified like a get; members the inner store lacks are absent."""
    replicas = VerifiedBackend(ReplicaReading(capacity_bytes=1 << 20), FINGERPRINT)
    values = Values(replicas)
    try:
        with registered(replicas, values.src), registered(replicas, values.dst):
            assert values.put() == [0] * KEYS
            addrs, sizes = values.regions(int(values.dst.ctypes.data))
            assert replicas.read_from_replicas(values.keys, addrs, sizes) == [VALUE_BYTES] * KEYS
            assert all(values.loaded(k) for k in range(KEYS))
            assert replicas.verification_stats()["verified"] == KEYS
            assert backend_traits(replicas).can_remove and backend_traits(replicas).exists_in_process
    finally:
        replicas.close()
    bare = VerifiedBackend(WithoutRemove(), FINGERPRINT)  # type: ignore[arg-type]
    traits = backend_traits(bare)
    assert not traits.can_remove and not traits.exists_in_process
    assert not hasattr(bare, "read_from_replicas") and not hasattr(bare, "health_check")
    bare.close()
