"""DiskBackend: real bytes through files, restart from the headers, damaged files never loaded, LRU
eviction within the capacity, values pinned while read, a full disk, directories it cannot use, bad
input, and the worker end to end (alone and under VerifiedBackend).

Faults are made the way they happen: a file cut short or with a byte flipped on disk, a temp file
left by a killed writer, ``ENOSPC`` from the write (injected: filling the real disk is not an option).
Values are checked byte by byte against what was stored, every time one is loaded.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import aiokv
from aiokv import Backend, BackendError, Code, InvalidRequestError, KVWorker, VerifiedBackend, backend_traits
from aiokv.backends import disk_io, disk_transfer
from aiokv.backends.disk import DiskBackend
from aiokv.backends.disk_format import ALIGN, TEMP_DIR, VERSION, file_bytes, key_digest
from aiokv.backends.disk_io import probe_direct
from aiokv.backends.disk_transfer import DiskTransfer
from aiokv.testing import SENTINEL, PagedCache, same_blocks
from tests.helpers import read_only_directory

from .helpers import TWO_GROUP_SPECS, TWO_GROUPS_CHUNK_TOKENS, prompt

OK, NO_SPACE, INVALID = int(Code.OK), int(Code.NO_SPACE), int(Code.INVALID)
NOT_FOUND, TRANSFER_FAILED, VERIFY_FAILED = (
    int(Code.NOT_FOUND),
    int(Code.TRANSFER_FAILED),
    int(Code.VERIFY_FAILED),
)
VALUE = 20_000  # not a multiple of the block size: every value has a partial last block
FILE = file_bytes(len("key-00"), VALUE)  # what one value of the tests' keys takes on disk
WAIT_S = 30.0  # a safety bound on waits between threads, never a speed assertion


def _direct_supported() -> bool:
    with tempfile.TemporaryDirectory() as directory:
        return probe_direct(directory)


# Buffered I/O always; O_DIRECT where the file system of the temp directory takes it.
IO_MODES = [
    pytest.param(False, id="buffered"),
    pytest.param(True, id="direct", marks=pytest.mark.skipif(not _direct_supported(), reason="no O_DIRECT")),
]


def aligned_bytes(size: int) -> npt.NDArray[np.uint8]:
    """Page-aligned memory (what a KV cache's blocks usually are): O_DIRECT moves it in place."""
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


class Values:
    """Random values of ``VALUE`` bytes in a source buffer, each stored in two regions with a gap
    between them (the second odd-sized), read back into a destination buffer filled with ``SENTINEL``.

    ``aligned``: the buffers are page-aligned and each value's first region whole pages, so O_DIRECT
    reads and writes them in place; otherwise they go through the backend's staging buffer."""

    CUT = 2 * ALIGN  # the first region's size
    GAP = ALIGN

    def __init__(self, backend: Any, count: int, *, seed: int = 0, aligned: bool = False) -> None:
        self.backend = backend
        self.keys = [f"key-{k:02d}" for k in range(count)]
        self.stride = -(-VALUE // ALIGN) * ALIGN + 2 * ALIGN
        size = count * self.stride + ALIGN
        self.src = aligned_bytes(size) if aligned else np.empty(size, dtype=np.uint8)
        self.dst = aligned_bytes(size) if aligned else np.empty(size, dtype=np.uint8)
        self.src[:] = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
        self.dst[:] = SENTINEL
        self.skew = 0 if aligned else 3  # unaligned: every region starts off a page
        for buf in (self.src, self.dst):
            backend.register_buffer(int(buf.ctypes.data), buf.nbytes)

    def spans(self, k: int) -> list[slice]:
        """Where value ``k``'s two regions lie in either buffer."""
        first = self.skew + k * self.stride
        second = first + self.CUT + self.GAP
        return [slice(first, first + self.CUT), slice(second, second + VALUE - self.CUT)]

    def regions(self, buf: npt.NDArray[np.uint8], rows: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        base = int(buf.ctypes.data)
        addrs = [[base + span.start for span in self.spans(k)] for k in rows]
        return addrs, [[self.CUT, VALUE - self.CUT]] * len(rows)

    def value(self, k: int) -> npt.NDArray[np.uint8]:
        return np.concatenate([self.src[span] for span in self.spans(k)])

    def put(self, rows: list[int] | None = None) -> list[int]:
        rows = list(range(len(self.keys))) if rows is None else rows
        return self.backend.batch_put([self.keys[k] for k in rows], *self.regions(self.src, rows))

    def get(self, rows: list[int] | None = None) -> list[int]:
        rows = list(range(len(self.keys))) if rows is None else rows
        for k in rows:
            for span in self.spans(k):
                self.dst[span] = SENTINEL
        return self.backend.batch_get([self.keys[k] for k in rows], *self.regions(self.dst, rows))

    def loaded(self, k: int) -> bool:
        return all(np.array_equal(self.dst[span], self.src[span]) for span in self.spans(k))

    def untouched(self, k: int) -> bool:
        return all((self.dst[span] == SENTINEL).all() for span in self.spans(k))

    def register_with(self, backend: Any) -> None:
        self.backend = backend
        for buf in (self.src, self.dst):
            backend.register_buffer(int(buf.ctypes.data), buf.nbytes)


def value_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("??/*.kv"))


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in value_files(directory))


def file_of(backend: DiskBackend, key: str) -> Path:
    """The file holding ``key`` (the one value file whose header names it)."""
    found = [
        path for path in value_files(Path(backend.directory)) if key.encode() in path.read_bytes()[:4096]
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(params=IO_MODES)
def backend(request: pytest.FixtureRequest, store_dir: Path) -> Iterator[DiskBackend]:
    b = DiskBackend(store_dir, 64 << 20, direct_io=request.param)
    yield b
    b.close()


# -- the protocol ---------------------------------------------------------------------------------


def test_is_a_backend_with_its_traits(backend: DiskBackend) -> None:
    assert isinstance(backend, Backend)
    traits = backend_traits(backend)
    assert traits.exists_in_process and traits.can_remove and traits.can_unregister
    assert not traits.supports_device_memory


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_round_trip_every_byte(backend: DiskBackend, store_dir: Path, aligned: bool) -> None:
    values = Values(backend, 4, aligned=aligned)
    assert values.put() == [OK] * 4
    assert backend.batch_exists([*values.keys, "absent"]) == [True] * 4 + [False]
    assert len(backend) == 4
    assert backend.used_bytes == 4 * FILE == disk_bytes(store_dir)
    assert values.put() == [OK] * 4  # present: the first value stays, nothing is rewritten
    assert backend.stats()["puts"] == 4
    assert values.get() == [VALUE] * 4
    assert all(values.loaded(k) for k in range(4))
    # Nothing outside the values' regions was written.
    outside = np.ones(values.dst.size, dtype=bool)
    for k in range(4):
        for span in values.spans(k):
            outside[span] = False
    assert (values.dst[outside] == SENTINEL).all()
    stats = backend.stats()
    assert (stats["hits"], stats["bytes_read"], stats["bytes_written"]) == (4, 4 * VALUE, 4 * VALUE)


@pytest.mark.parametrize("size", [3 * ALIGN, 3 * ALIGN + 123], ids=["whole-pages", "partial-tail"])
def test_a_value_of_one_aligned_region_round_trips(backend: DiskBackend, size: int) -> None:
    # One page-aligned region is written in place (several are gathered into the staging buffer).
    src, dst = aligned_bytes(4 * ALIGN), aligned_bytes(4 * ALIGN)
    src[:] = np.random.default_rng(5).integers(0, 256, size=src.size, dtype=np.uint8)
    dst[:] = SENTINEL
    for buf in (src, dst):
        backend.register_buffer(int(buf.ctypes.data), buf.nbytes)
    assert backend.batch_put(["one"], [[int(src.ctypes.data)]], [[size]]) == [OK]
    assert backend.batch_get(["one"], [[int(dst.ctypes.data)]], [[size]]) == [size]
    assert np.array_equal(dst[:size], src[:size])
    assert (dst[size:] == SENTINEL).all()


def test_values_larger_than_the_staging_buffer(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A value moves through the staging buffer in several pieces (a region split across two of them).
    monkeypatch.setattr(disk_transfer, "STAGE_BYTES", 3 * ALIGN)
    with DiskBackend(store_dir, 1 << 20) as backend:
        values = Values(backend, 3)
        assert values.put() == [OK] * 3
        assert values.get() == [VALUE] * 3
        assert all(values.loaded(k) for k in range(3))


def test_a_value_read_split_differently_than_written(backend: DiskBackend) -> None:
    values = Values(backend, 1)
    assert values.put() == [OK]
    d = int(values.dst.ctypes.data)
    cuts = [1, 4096, 7, VALUE - 4104]
    addrs = [d + 10, d + 100, d + 9000, d + 10_000]
    assert backend.batch_get(["key-00"], [addrs], [cuts]) == [VALUE]
    got = np.concatenate([values.dst[a - d : a - d + n] for a, n in zip(addrs, cuts, strict=True)])
    assert np.array_equal(got, values.value(0))


def test_size_mismatches_answer_codes_and_move_nothing(backend: DiskBackend) -> None:
    values = Values(backend, 1)
    assert values.put() == [OK]
    d = int(values.dst.ctypes.data)
    assert backend.batch_get(["key-00", "key-00"], [[d], [d]], [[VALUE - 1], [VALUE + 1]]) == [
        INVALID,
        TRANSFER_FAILED,
    ]
    assert (values.dst == SENTINEL).all()
    assert backend.batch_get(["absent"], [[d]], [[10]]) == [NOT_FOUND]
    assert backend.stats()["misses"] == 1


def test_remove(backend: DiskBackend, store_dir: Path) -> None:
    values = Values(backend, 3)
    assert values.put() == [OK] * 3
    assert backend.batch_remove(["key-01", "absent"], force=True) == [OK, NOT_FOUND]
    assert backend.batch_exists(values.keys) == [True, False, True]
    assert len(value_files(store_dir)) == 2
    assert backend.used_bytes == 2 * FILE == disk_bytes(store_dir)
    assert values.get() == [VALUE, NOT_FOUND, VALUE]
    assert values.loaded(0) and values.untouched(1) and values.loaded(2)
    assert values.put([1]) == [OK]  # a removed key is written again
    assert values.get([1]) == [VALUE] and values.loaded(1)


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_whole_blocks_long_keys_and_contiguous_regions(
    backend: DiskBackend, store_dir: Path, aligned: bool
) -> None:
    """Values of whole blocks (no partial last block), a key longer than a header block, keys outside
    ASCII, and regions that continue each other (written as one): each round-trips, also after a
    restart."""
    size = 4 * ALIGN
    src = aligned_bytes(4 * size) if aligned else np.empty(4 * size, dtype=np.uint8)
    dst = aligned_bytes(4 * size) if aligned else np.empty(4 * size, dtype=np.uint8)
    src[:] = np.random.default_rng(2).integers(0, 256, size=src.size, dtype=np.uint8)
    keys = ["whole", "k" * 5000, "clé-\u00e9\U0001f600", "surrogate-\udcff"]
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    put_addrs = [[s + k * size, s + k * size + ALIGN] for k in range(4)]  # back to back
    put_sizes = [[ALIGN, size - ALIGN]] * 4
    get_addrs = [[d + k * size] for k in range(4)]
    for current in (backend, None):
        if current is None:
            backend.close()
            current = backend = DiskBackend(store_dir, 64 << 20)
        for buf in (src, dst):
            current.register_buffer(int(buf.ctypes.data), buf.nbytes)
        if len(current) == 0:
            assert current.batch_put(keys, put_addrs, put_sizes) == [OK] * 4
        dst[:] = SENTINEL
        assert current.batch_get(keys, get_addrs, [[size]] * 4) == [size] * 4
        assert np.array_equal(dst, src)
    assert backend.batch_exists(keys) == [True] * 4
    backend.close()


def test_a_read_error_answers_transfer_failed_and_keeps_the_file(
    backend: DiskBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = Values(backend, 2)
    assert values.put() == [OK, OK]
    real_read = disk_transfer.read_all
    failing = {"on": True}

    def read_all(fd: int, views: Any, offset: int) -> int:
        if failing["on"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(fd, views, offset)

    monkeypatch.setattr(disk_transfer, "read_all", read_all)
    assert values.get() == [TRANSFER_FAILED, TRANSFER_FAILED]
    assert backend.stats()["get_errors"] == 2 and len(backend) == 2
    failing["on"] = False  # the worker's rewrite path removes such keys; a read that works loads them
    assert values.get() == [VALUE, VALUE] and values.loaded(0) and values.loaded(1)


def test_an_exception_while_writing_releases_its_reservation(
    backend: DiskBackend, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = Values(backend, 3)
    assert values.put([0]) == [OK]
    real_write = disk_transfer.write_all

    def interrupted(fd: int, views: Any, offset: int) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(disk_transfer, "write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        values.put([1, 2])
    monkeypatch.setattr(disk_transfer, "write_all", real_write)
    assert backend.used_bytes == FILE == disk_bytes(store_dir)
    assert not list((store_dir / TEMP_DIR).iterdir())
    assert backend.batch_exists(values.keys) == [True, False, False]
    assert values.put([1, 2]) == [OK, OK]  # nothing was left claimed
    assert values.get() == [VALUE] * 3 and all(values.loaded(k) for k in range(3))


def test_close_waits_for_a_read_in_progress(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = DiskBackend(store_dir, 1 << 20)
    values = Values(backend, 1)
    assert values.put() == [OK]
    blocked = BlockedRead(monkeypatch)
    codes: list[int] = []
    reader = threading.Thread(target=lambda: codes.extend(values.get()))
    reader.start()
    assert blocked.reading.wait(WAIT_S)
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # still reading: the directory is not released under the read
    blocked.release.set()
    reader.join(WAIT_S)
    closer.join(WAIT_S)
    assert not closer.is_alive() and backend.closed
    assert codes == [VALUE] and values.loaded(0)
    with pytest.raises(BackendError, match="closed"):
        values.get()


def test_direct_io_where_the_file_system_refuses_it(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(disk_io, "probe_direct", lambda directory: False)
    with pytest.raises(ValueError, match="O_DIRECT"):
        DiskBackend(store_dir, 1 << 20, direct_io=True)
    with caplog.at_level(logging.INFO, logger="aiokv"), DiskBackend(store_dir, 1 << 20) as backend:
        assert not backend.direct_io
        values = Values(backend, 2)
        assert values.put() == [OK, OK]
        assert values.get() == [VALUE, VALUE] and values.loaded(0) and values.loaded(1)
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1


# -- the worker end to end ------------------------------------------------------------------------


def test_readme_usage_with_a_disk_backend_then_again_after_a_restart(tmp_path: Path) -> None:
    """The README's example on DiskBackend(directory); then a new worker on a reopened backend loads
    the same chunks into other blocks, every byte as stored."""
    rng = np.random.default_rng(3)
    caches = [rng.standard_normal((2, 64, 16, 8, 64)).astype(np.float16) for _ in range(2)]
    layout = aiokv.KVLayout.from_tensors(caches, block_size=16, block_dim=1)
    tokens = np.arange(300)

    async def main() -> tuple[aiokv.StoreResult, int, aiokv.LoadResult, aiokv.LoadResult]:
        backend = aiokv.DiskBackend(tmp_path / "kv")  # exported at the top level, as MemoryBackend
        async with KVWorker(layout, backend, namespace="my-model", chunk_tokens=64, close_backend=True) as w:
            stored = await w.store(tokens, [np.arange(19)])
            hit = await w.lookup(tokens)
            loaded = await w.load(tokens[:hit], [np.arange(20, 36)])
        assert backend.closed
        async with KVWorker(
            layout, DiskBackend(tmp_path / "kv"), namespace="my-model", chunk_tokens=64, close_backend=True
        ) as w:
            again = await w.load(tokens[:hit], [np.arange(40, 56)])
        return stored, hit, loaded, again

    stored, hit, loaded, again = asyncio.run(main())
    assert stored.stored == 4 and hit == 256 and loaded.loaded_tokens == 256 and again.loaded_tokens == 256
    for cache in caches:
        assert np.array_equal(cache[:, 20:36], cache[:, 0:16])
        assert np.array_equal(cache[:, 40:56], cache[:, 0:16])


def test_verified_backend_over_disk_reports_a_flipped_byte_failed(store_dir: Path) -> None:
    """VerifiedBackend wraps DiskBackend as any store (key and fingerprint checked on top of the disk's
    own checksum); a byte flipped on disk fails exactly its chunk, the others load their bytes."""
    src = PagedCache.allocate(TWO_GROUP_SPECS, fill="random", seed=5)
    dst = PagedCache.allocate(TWO_GROUP_SPECS, fill=SENTINEL)
    chunks, c = 4, TWO_GROUPS_CHUNK_TOKENS
    tokens = prompt(9, chunks)
    ids = [np.arange(chunks * (c // layout.block_size), dtype=np.int64) for layout in src.layouts]
    inner = DiskBackend(store_dir, 16 << 20)
    backend = VerifiedBackend(inner, b"test-fingerprint")

    async def store() -> aiokv.StoreResult:
        async with KVWorker(src.layouts, backend, namespace="disk", chunk_tokens=c) as worker:
            return await worker.store(tokens, ids)

    async def load() -> aiokv.LoadResult:
        async with KVWorker(dst.layouts, backend, namespace="disk", chunk_tokens=c) as worker:
            return await worker.load(tokens, ids)

    try:
        assert asyncio.run(store()).stored == chunks
        files = sorted(value_files(store_dir), key=lambda path: path.stat().st_mtime_ns)
        assert len(files) == 2 * chunks  # one value per chunk and group
        victim = files[0]
        with victim.open("r+b") as f:  # a byte of the value, past the header block
            f.seek(ALIGN + 5)
            byte = f.read(1)
            f.seek(ALIGN + 5)
            f.write(bytes([byte[0] ^ 0x10]))
        loaded = asyncio.run(load())
    finally:
        backend.close()
    assert loaded.errors == {VERIFY_FAILED: 1}
    assert loaded.loaded_tokens < chunks * c
    assert not victim.exists()  # the damaged file was removed: the next store writes the chunk again
    for g, layout_ids in enumerate(ids):
        good = [b for b in layout_ids.tolist() if b not in loaded.failed_block_ids[g]]
        assert good and same_blocks(src[g], good, dst[g], good)


# -- restart --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fsync", [False, True])
def test_restart_finds_every_value(store_dir: Path, fsync: bool) -> None:
    first = DiskBackend(store_dir, 64 << 20, fsync=fsync)
    values = Values(first, 6, seed=4)
    assert values.put() == [OK] * 6
    used = first.used_bytes
    first.close()
    with DiskBackend(store_dir, 64 << 20) as again:
        assert len(again) == 6 and again.used_bytes == used == disk_bytes(store_dir)
        values.register_with(again)
        assert again.batch_exists(values.keys) == [True] * 6
        assert values.get() == [VALUE] * 6
        assert all(values.loaded(k) for k in range(6))


def test_restart_keeps_the_recency_order(store_dir: Path) -> None:
    """The rebuilt index is ordered by the files' ages: the oldest value is evicted first."""
    with DiskBackend(store_dir, 1 << 20) as backend:
        values = Values(backend, 3)
        for k in range(3):
            assert values.put([k]) == [OK]
            os.utime(file_of(backend, values.keys[k]), ns=(10**18 + k, 10**18 + k))
    # Watermarks at the capacity: a put evicts just enough for itself (one value).
    with DiskBackend(store_dir, 3 * FILE, high_watermark=1.0, low_watermark=1.0) as backend:
        values.register_with(backend)
        assert backend.batch_put(["new"], *values.regions(values.src, [0])) == [OK]
        assert backend.batch_exists(values.keys) == [False, True, True]


def test_a_second_backend_on_the_same_directory_is_refused(backend: DiskBackend, store_dir: Path) -> None:
    with pytest.raises(BackendError, match="in use"):
        DiskBackend(store_dir)
    backend.close()
    DiskBackend(store_dir).close()  # released on close


def test_a_smaller_capacity_at_open_evicts_the_oldest(store_dir: Path) -> None:
    with DiskBackend(store_dir, 1 << 20) as backend:
        values = Values(backend, 6)
        assert values.put() == [OK] * 6
    with DiskBackend(store_dir, 3 * FILE) as backend:
        assert backend.used_bytes <= 3 * FILE * 0.85 and len(backend) >= 1
        assert backend.used_bytes == disk_bytes(store_dir)
        assert backend.stats()["evictions"] == 6 - len(backend)


# -- damaged files --------------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":  # a write cut off in the middle of the value
        path.write_bytes(data[: ALIGN + VALUE // 2])
    elif how == "value byte":
        data[ALIGN + VALUE - 1] ^= 0x01
        path.write_bytes(data)
    elif how == "header byte":
        data[20] ^= 0x80  # in the value length
        path.write_bytes(data)
    elif how == "zeroed":  # what a power loss can leave under a renamed name: the size, not the bytes
        path.write_bytes(bytes(len(data)))


@pytest.mark.parametrize("how", ["truncated", "value byte", "header byte", "zeroed"])
def test_a_damaged_file_is_never_loaded_and_is_removed(
    backend: DiskBackend, store_dir: Path, how: str
) -> None:
    values = Values(backend, 3)
    assert values.put() == [OK] * 3
    victim = file_of(backend, "key-01")
    damage(victim, how)
    assert values.get() == [VALUE, VERIFY_FAILED, VALUE]
    assert values.loaded(0) and values.loaded(2)
    assert not victim.exists()
    assert backend.batch_exists(values.keys) == [True, False, True]
    assert backend.stats()["corrupt_dropped"] == 1
    assert backend.used_bytes == 2 * FILE == disk_bytes(store_dir)
    assert values.put([1]) == [OK]  # the next store writes it again, and it loads
    assert values.get([1]) == [VALUE] and values.loaded(1)


@pytest.mark.parametrize("how", ["truncated", "header byte", "zeroed"])
def test_a_damaged_file_is_dropped_at_open(backend: DiskBackend, store_dir: Path, how: str) -> None:
    values = Values(backend, 3)
    assert values.put() == [OK] * 3
    victim = file_of(backend, "key-02")
    backend.close()
    damage(victim, how)
    with DiskBackend(store_dir, 64 << 20) as again:
        assert not victim.exists()
        assert len(again) == 2 and again.stats()["corrupt_dropped"] == 1
        assert again.batch_exists(values.keys) == [True, True, False]


def test_a_value_byte_flipped_before_a_restart_fails_on_read(backend: DiskBackend, store_dir: Path) -> None:
    # The open reads headers only: a damaged value is found when it is read.
    values = Values(backend, 2)
    assert values.put() == [OK] * 2
    victim = file_of(backend, "key-00")
    backend.close()
    damage(victim, "value byte")
    with DiskBackend(store_dir, 64 << 20) as again:
        values.register_with(again)
        assert values.get() == [VERIFY_FAILED, VALUE]
        assert values.loaded(1) and not victim.exists()


def test_a_file_deleted_behind_the_backend_answers_not_found(backend: DiskBackend) -> None:
    values = Values(backend, 2)
    assert values.put() == [OK] * 2
    file_of(backend, "key-00").unlink()
    assert values.get() == [NOT_FOUND, VALUE]
    assert values.untouched(0) and values.loaded(1)
    assert backend.stats()["missing_dropped"] == 1 and len(backend) == 1


def test_leftover_temp_files_are_removed_at_open(backend: DiskBackend, store_dir: Path) -> None:
    values = Values(backend, 1)
    assert values.put() == [OK]
    backend.close()
    leftover = store_dir / TEMP_DIR / "00000000000000ff.part"
    leftover.write_bytes(b"half a value")
    foreign = store_dir / "notes.txt"  # not the backend's: left alone
    foreign.write_text("mine")
    with DiskBackend(store_dir, 64 << 20) as again:
        assert not leftover.exists() and foreign.exists()
        assert again.stats()["temp_files_dropped"] == 1 and len(again) == 1


def test_a_file_of_another_format_version_is_left_alone(backend: DiskBackend, store_dir: Path) -> None:
    # A newer aiokv's value (same magic, another version) is neither indexed nor deleted.
    values = Values(backend, 1)
    assert values.put() == [OK]
    ours = file_of(backend, "key-00")
    backend.close()
    data = bytearray(ours.read_bytes())
    data[4:6] = (VERSION + 1).to_bytes(2, "little")
    digest = key_digest(b"from-a-newer-writer")
    newer = store_dir / digest[:2] / f"{digest}-{1:016x}.kv"
    newer.write_bytes(bytes(data))
    with DiskBackend(store_dir, 64 << 20) as again:
        assert newer.exists() and ours.exists()
        assert len(again) == 1 and again.used_bytes == FILE and again.stats()["corrupt_dropped"] == 0


def test_two_files_of_one_key_keep_the_newest(backend: DiskBackend, store_dir: Path) -> None:
    # A crash between writing a key again and deleting its old file leaves two generations.
    values = Values(backend, 1)
    assert values.put() == [OK]
    old = file_of(backend, "key-00")
    backend.close()
    digest, generation = old.stem.split("-")
    newer = old.with_name(f"{digest}-{int(generation, 16) + 5:016x}.kv")
    newer.write_bytes(old.read_bytes())
    with DiskBackend(store_dir, 64 << 20) as again:
        assert not old.exists() and newer.exists() and len(again) == 1


# -- capacity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_eviction_keeps_the_capacity_and_every_loaded_byte(store_dir: Path, aligned: bool) -> None:
    capacity = 5 * FILE
    with DiskBackend(store_dir, capacity) as backend:
        values = Values(backend, 12, seed=8, aligned=aligned)
        for k in range(12):
            assert values.put([k]) == [OK]
            assert backend.used_bytes <= capacity
            if k >= 2:  # key-00 is looked up before each put: the most recently used, never evicted
                assert backend.batch_exists(["key-00"]) == [True]
        stats = backend.stats()
        assert stats["evictions"] > 0 and stats["evictions"] == 12 - len(backend)
        assert backend.used_bytes == disk_bytes(store_dir) == len(backend) * FILE
        codes = values.get()
        present = backend.batch_exists(values.keys)
        assert codes == [VALUE if p else NOT_FOUND for p in present]
        assert present[0] and present[11]
        for k in range(12):
            assert values.loaded(k) if present[k] else values.untouched(k)


def test_eviction_goes_down_to_the_low_watermark(store_dir: Path) -> None:
    capacity = 10 * FILE
    with DiskBackend(store_dir, capacity, high_watermark=0.9, low_watermark=0.5) as backend:
        values = Values(backend, 10)
        assert values.put(list(range(9))) == [OK] * 9  # 9 files: at the high watermark
        assert backend.stats()["evictions"] == 0
        assert values.put([9]) == [OK]  # would pass it: evict to half (4 files) before writing
        assert len(backend) == 5 and backend.stats()["evictions"] == 5
        assert backend.batch_exists(values.keys) == [False] * 5 + [True] * 5


def test_a_value_larger_than_the_capacity_answers_no_space_and_loses_nothing(
    store_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DiskBackend(store_dir, 3 * FILE) as backend:
        values = Values(backend, 3)
        assert values.put([0]) == [OK]
        s = int(values.src.ctypes.data)
        big = 3 * FILE  # with its header, larger than the capacity
        addrs, sizes = values.regions(values.src, [1])
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            assert backend.batch_put(["big", "key-01"], [[s], *addrs], [[big], *sizes]) == [NO_SPACE, OK]
            assert backend.batch_put(["big"], [[s]], [[big]]) == [NO_SPACE]
        assert sum("exceeds the capacity" in r.getMessage() for r in caplog.records) == 1  # logged once
        assert backend.stats()["put_no_space"] == 2 and backend.stats()["evictions"] == 0
        assert values.get([0, 1]) == [VALUE, VALUE]
        assert values.loaded(0) and values.loaded(1)


def test_a_full_file_system_answers_no_space_and_loses_nothing(
    backend: DiskBackend, store_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    values = Values(backend, 4)
    assert values.put([0]) == [OK]
    real_write = disk_transfer.write_all
    full = {"key-01", "key-03"}  # the file system is full while these are written
    writing: list[str] = []

    def write_all(fd: int, views: Any, offset: int) -> int:
        if writing[-1] in full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, views, offset)

    real_put_one = DiskBackend._put_one

    def put_one(self: DiskBackend, write: Any, *args: Any) -> int:
        writing.append(write.key)
        return real_put_one(self, write, *args)

    monkeypatch.setattr(disk_transfer, "write_all", write_all)
    monkeypatch.setattr(DiskBackend, "_put_one", put_one)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        assert values.put([1, 2, 3]) == [NO_SPACE, OK, NO_SPACE]
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert backend.stats()["put_no_space"] == 2
    assert not list((store_dir / TEMP_DIR).iterdir())  # no half-written file left behind
    assert backend.batch_exists(values.keys) == [True, False, True, False]
    assert backend.used_bytes == 2 * FILE == disk_bytes(store_dir)
    assert values.get([0, 2]) == [VALUE, VALUE] and values.loaded(0) and values.loaded(2)


class BlockedRead:
    """Makes the next get block inside its first file read until released: the values it pinned are
    then being read while the test writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        for name in ("_read_in_place", "_read_staged"):
            monkeypatch.setattr(DiskTransfer, name, self._wrap(getattr(DiskTransfer, name)))

    def _wrap(self, read: Callable[..., bool]) -> Callable[..., bool]:
        def blocked(transfer: DiskTransfer, *args: Any) -> bool:
            if not self.reading.is_set():
                self.reading.set()
                assert self.release.wait(WAIT_S)
            return read(transfer, *args)

        return blocked


def test_values_being_read_are_never_evicted(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Watermarks at the capacity: evictions free exactly what a put needs.
    with DiskBackend(store_dir, 2 * FILE, high_watermark=1.0, low_watermark=1.0) as backend:
        values = Values(backend, 5)
        assert values.put([0, 1]) == [OK, OK]
        blocked = BlockedRead(monkeypatch)
        codes: list[int] = []
        reader = threading.Thread(target=lambda: codes.extend(values.get([0, 1])))
        reader.start()
        assert blocked.reading.wait(WAIT_S)
        # Both values pinned: the space is held by a read, a put answers NO_SPACE and evicts nothing.
        assert values.put([2]) == [NO_SPACE]
        assert backend.batch_exists(values.keys[:2]) == [True, True]
        assert backend.batch_remove(["key-01"]) == [OK]  # removed while read: its file waits for the read
        assert backend.used_bytes == 2 * FILE == disk_bytes(store_dir)
        assert values.put([2]) == [NO_SPACE]
        blocked.release.set()
        reader.join(WAIT_S)
        assert codes == [VALUE, VALUE] and values.loaded(0) and values.loaded(1)
        assert backend.used_bytes == FILE == disk_bytes(store_dir)  # the removed file went with its read
        assert values.put([2]) == [OK]
        assert backend.batch_exists(values.keys[:3]) == [True, False, True]


def test_eviction_skips_a_value_being_read(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskBackend(store_dir, 3 * FILE, high_watermark=1.0, low_watermark=1.0) as backend:
        values = Values(backend, 5)
        assert values.put([0, 1, 2]) == [OK] * 3
        blocked = BlockedRead(monkeypatch)
        codes: list[int] = []
        reader = threading.Thread(target=lambda: codes.extend(values.get([0])))  # the oldest value
        reader.start()
        assert blocked.reading.wait(WAIT_S)
        assert values.put([3]) == [OK]  # evicts, but not key-00
        assert backend.batch_exists(values.keys[:4]) == [True, False, True, True]
        blocked.release.set()
        reader.join(WAIT_S)
        assert codes == [VALUE] and values.loaded(0)


def test_threads_putting_and_getting_under_eviction(store_dir: Path) -> None:
    """Four threads store and load over a capacity of a few values: every load is whole and the
    stored bytes, or NOT_FOUND; the accounting matches the files at the end."""
    with DiskBackend(store_dir, 6 * FILE) as backend:
        values = Values(backend, 16, seed=11)
        errors: list[BaseException] = []
        dsts = [np.empty(VALUE, dtype=np.uint8) for _ in range(4)]
        for dst in dsts:
            backend.register_buffer(int(dst.ctypes.data), dst.nbytes)

        def work(t: int) -> None:
            rng = np.random.default_rng(t)
            dst = dsts[t]
            try:
                for _ in range(40):
                    k = int(rng.integers(0, 16))
                    if rng.random() < 0.5:
                        assert values.put([k])[0] in (OK, NO_SPACE)
                        continue
                    dst[:] = SENTINEL
                    code = backend.batch_get([values.keys[k]], [[int(dst.ctypes.data)]], [[VALUE]])[0]
                    assert code in (VALUE, NOT_FOUND)
                    if code == VALUE:
                        assert np.array_equal(dst, values.value(k))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert not errors, errors
        assert backend.used_bytes == disk_bytes(store_dir) <= 6 * FILE
        assert len(value_files(store_dir)) == len(backend)


# -- directories it cannot use, bad input -----------------------------------------------------------


def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    with (
        read_only_directory(tmp_path) as locked,
        pytest.raises(PermissionError, match=re.escape(str(locked))),
    ):
        DiskBackend(locked)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_directory_that_refuses_writes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    # The file system refuses writes (what a read-only mount or missing permission answers), whoever runs.
    target = tmp_path / "store"
    target.mkdir()
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).startswith(str(target)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(PermissionError, match=re.escape(f"cannot write to {target}")):
        DiskBackend(target)


def test_a_path_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    with pytest.raises(ValueError, match=re.escape(f"{regular} is not one")):
        DiskBackend(regular)
    with pytest.raises(ValueError, match="cannot be one"):
        DiskBackend(regular / "below")
    assert regular.read_text() == "not a directory"


def test_bad_arguments_are_refused(store_dir: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskBackend(store_dir, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_watermark"):
        DiskBackend(store_dir, 1 << 20, high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError, match="high_watermark"):
        DiskBackend(store_dir, 1 << 20, high_watermark=1.5)
    with pytest.raises(TypeError, match="fsync"):
        DiskBackend(store_dir, 1 << 20, fsync=1)  # type: ignore[arg-type]
    assert not store_dir.exists()  # refused before the directory is touched


def test_regions_outside_registered_memory_touch_nothing(backend: DiskBackend, store_dir: Path) -> None:
    values = Values(backend, 2)
    assert values.put([0]) == [OK]
    before = backend.stats()
    outside = np.zeros(VALUE, dtype=np.uint8)  # never registered
    o = int(outside.ctypes.data)
    s = int(values.src.ctypes.data)
    # One key partly outside: that key answers INVALID, the other is stored.
    assert backend.batch_put(["bad", "key-01"], [[s, o], [s + values.stride]], [[10, 10], [VALUE]]) == [
        INVALID,
        OK,
    ]
    assert backend.batch_get(["key-00"], [[o]], [[VALUE]]) == [INVALID]
    assert backend.batch_get(["key-00"], [[s + values.src.nbytes - 10]], [[VALUE]]) == [INVALID]  # runs past
    assert not outside.any()
    after = backend.stats()
    assert after["puts"] == before["puts"] + 1 and after["hits"] == before["hits"]
    assert backend.batch_exists(["bad", "key-01"]) == [False, True]
    assert len(value_files(store_dir)) == 2


def test_malformed_calls_raise_before_any_io(backend: DiskBackend, store_dir: Path) -> None:
    values = Values(backend, 1)
    s = int(values.src.ctypes.data)
    files = sorted(store_dir.rglob("*"))
    with pytest.raises(InvalidRequestError):
        backend.batch_put(["a", "b"], [[s]], [[10]])
    with pytest.raises(InvalidRequestError):
        backend.batch_put([""], [[s]], [[10]])
    with pytest.raises(TypeError):
        backend.batch_put("ab", [[s], [s]], [[1], [1]])
    with pytest.raises(InvalidRequestError):
        backend.batch_get(["a"], [[s, s]], [[10]])
    with pytest.raises(InvalidRequestError):
        backend.register_buffer(s, 10)  # overlaps memory already registered
    assert sorted(store_dir.rglob("*")) == files
    assert backend.stats()["puts"] == 0


def test_closed(backend: DiskBackend) -> None:
    backend.close()
    backend.close()  # idempotent
    assert backend.closed
    for call in (
        lambda: backend.batch_exists(["k"]),
        lambda: backend.batch_put(["k"], [[1]], [[1]]),
        lambda: backend.batch_get(["k"], [[1]], [[1]]),
        lambda: backend.batch_remove(["k"]),
        lambda: backend.register_buffer(1 << 20, 1),
    ):
        with pytest.raises(BackendError, match="closed"):
            call()
