"""A backend on a local disk: one file per value under a directory, an LRU index in memory.

Files (:mod:`aiokv.backends.disk_format`) carry their key, their value's length and its xxh3-64
checksum in a header, so :class:`DiskBackend` on an existing directory rebuilds its index from the
headers alone, and a value whose file was cut short or whose bytes changed is never answered as
loaded: the get answers ``VERIFY_FAILED`` (-13) for that key and removes the file, so the next store
of the chunk writes it again.

I/O: ``os.pwritev``/``os.preadv`` (the GIL is released while the disk works), with ``O_DIRECT`` where
the file system takes it (probed when the directory is opened; otherwise buffered I/O, logged once).
``O_DIRECT`` moves data between the disk and page-aligned memory only:

- regions that are page-aligned (a KV cache's blocks usually are) move straight between the file and
  the caller's memory, only a value's last partial block goes through an aligned block of this
  backend's;
- other regions move through an aligned staging buffer of up to 8 MiB per calling thread (copied,
  then written; read, then copied). Measured, a direct read followed by our copy was faster than a
  buffered ``preadv`` straight into the regions and took a fraction of its CPU time (the page
  cache's path costs more than one copy), and it leaves the page cache to the engine;
- without ``O_DIRECT`` every read and write goes straight between the file and the regions.

Writes go to a temporary file renamed into place, so a value is whole under its final name.
``fsync=False`` (the default) leaves the file and the rename in the page cache: a crashed process
loses nothing it wrote, a crashed machine may lose the last writes (or leave files whose bytes never
reached the disk; their checksums fail on read). ``fsync=True`` syncs each file and its directory
before the put answers, at the cost of a disk flush per value.

Capacity: ``capacity_bytes`` bounds the files' bytes (headers and padding included). A put that would
pass ``high_watermark`` of it evicts the least recently used values (``batch_exists`` and
``batch_get`` count as uses) down to ``low_watermark``; values being read are pinned, never evicted
while a get reads them. A put that cannot fit (a value larger than the capacity, space held by reads
in progress, or the file system full) answers ``NO_SPACE`` (-200) for that key; it is counted and
logged once, and no other value is touched.

One ``DiskBackend`` at a time per directory: a second one, in this process or another, is refused
(an ``flock`` on a lock file in the directory).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from .._arrays import BoolArray
from ..codes import Code
from ..errors import BackendError
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys
from .base import ClosingContext
from .disk_format import (
    ALIGN,
    TEMP_DIR,
    TEMP_SUFFIX,
    Header,
    aligned,
    data_offset,
    encode_key,
    file_bytes,
    file_name,
    pack_header,
    parse_header,
)
from .disk_io import (
    FULL_ERRNOS,
    O_DIRECT,
    STAGE_BYTES,
    Scratch,
    choose_direct,
    fsync_directory,
    make_subdirectories,
    open_directory,
    read_all,
    unlink_quietly,
    write_all,
)
from .disk_scan import scan

logger = logging.getLogger(__name__)

OK, NO_SPACE, INVALID = int(Code.OK), int(Code.NO_SPACE), int(Code.INVALID)
NOT_FOUND, TRANSFER_FAILED, VERIFY_FAILED = (
    int(Code.NOT_FOUND),
    int(Code.TRANSFER_FAILED),
    int(Code.VERIFY_FAILED),
)

DEFAULT_CAPACITY_BYTES = 64 << 30
_ZEROS = memoryview(bytes(ALIGN))
# Per key of a get: read and verified, the file gone (removed behind this backend's back), the file
# damaged (cut short, a bad header or checksum), or an I/O error (the file is kept).
_READ, _MISSING, _DAMAGED, _FAILED = "read", "missing", "damaged", "failed"
_READ_CODES = {_MISSING: NOT_FOUND, _DAMAGED: VERIFY_FAILED, _FAILED: TRANSFER_FAILED}

Pieces = list[tuple[int, int]]  # a value's regions as (offset in the mapped space, size), merged
Space = tuple[int, memoryview, npt.NDArray[np.uint8]]  # first registered address, views up to the end

STAT_NAMES = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "puts",
    "evictions",
    "evicted_bytes",
    "corrupt_dropped",
    "missing_dropped",
    "temp_files_dropped",
    "put_no_space",
    "put_errors",
    "get_errors",
)


class _Entry:
    """A value in the index. ``pins``: gets reading it now; ``removed``: out of the index, its file
    deleted when the last of them is done."""

    __slots__ = ("name", "value_bytes", "file_bytes", "pins", "removed")

    def __init__(self, name: str, value_bytes: int, size: int) -> None:
        self.name = name
        self.value_bytes = value_bytes
        self.file_bytes = size
        self.pins = 0
        self.removed = False


class _Write(NamedTuple):
    row: int
    key: str
    encoded: bytes
    size: int  # the file's bytes, reserved against the capacity
    generation: int


class DiskBackend(ClosingContext):
    """Values in files under ``directory`` (created if missing), at most ``capacity_bytes`` of them.

    ``high_watermark``/``low_watermark``: fractions of the capacity; a put that would pass the high one
    evicts down to the low one. ``fsync``: sync each value to the disk before its put answers (see the
    module's docstring). ``direct_io``: None probes the file system for ``O_DIRECT``; True requires it
    (``ValueError`` where it is refused); False never uses it.

    Regions outside registered memory answer ``INVALID`` (-600) with no I/O; a get whose regions do not
    add up to the stored size answers ``INVALID`` (regions too small) or ``TRANSFER_FAILED`` (too
    large), as the embedded backend and Mooncake do. Thread-safe: files are read and written outside
    the index's lock.
    """

    exists_in_process = True  # the index answers: no I/O, and the lock is never held across I/O

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        fsync: bool = False,
        direct_io: bool | None = None,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        for name, mark in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
            if isinstance(mark, bool) or not isinstance(mark, (int, float)) or not 0 < mark <= 1:
                raise ValueError(f"{name} must be a fraction in (0, 1], got {mark!r}")
        if low_watermark > high_watermark:
            raise ValueError(f"low_watermark {low_watermark} is above high_watermark {high_watermark}")
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be a bool, got {fsync!r}")
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be None or a bool, got {direct_io!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.capacity_bytes = capacity_bytes
        self._high = round(capacity_bytes * high_watermark)
        self._low = round(capacity_bytes * low_watermark)
        self._fsync = fsync
        self._temp_dir = os.path.join(self.directory, TEMP_DIR)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # close() waits on it for calls in progress
        self._active = 0
        self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # oldest use first
        self._writing: dict[str, int] = {}  # key -> bytes reserved by the put writing it
        self._used = 0  # files indexed, files removed but still read, and reservations of puts
        self._pinned_bytes = 0
        self._writing_bytes = 0
        self._next_generation = 1
        self._counts = dict.fromkeys(STAT_NAMES, 0)
        self._logged: set[str] = set()
        self._memory = RegisteredMemory()
        self._space: Space | None = None
        self._scratch = Scratch()
        self._closed = False
        self._lock_fd = open_directory(self.directory)
        try:
            make_subdirectories(self.directory, self._temp_dir)
            self._direct = choose_direct(self.directory, self._temp_dir, direct_io)
            self._rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._check_open()
        self._memory.add(addr, size)
        self._map_space()

    def unregister_buffer(self, addr: int) -> None:
        self._check_open()
        self._memory.remove(addr)
        self._map_space()

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            if self._closed:
                raise BackendError("DiskBackend is closed")
            index = self._index
            found = [key in index for key in keys]
            for key, hit in zip(keys, found, strict=True):
                if hit:  # a lookup announces a load: keep what it found
                    index.move_to_end(key)
        return found

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._call():
            space, valid = self._proven(table)
            totals = table.key_totals().tolist()
            codes = [OK if ok else INVALID for ok in valid.tolist()]
            writes: list[_Write] = []
            victims: list[str] = []
            refused = 0  # the size of a file that did not fit, logged once the lock is released
            with self._lock:
                index, writing = self._index, self._writing
                for k, key in enumerate(keys):
                    if codes[k] != OK or key in index or key in writing:
                        continue  # invalid, or present / being written / a duplicate: the first value wins
                    encoded = encode_key(key)
                    size = file_bytes(len(encoded), totals[k])
                    if not self._reserve(size, victims):
                        codes[k] = NO_SPACE
                        self._counts["put_no_space"] += 1
                        refused = size
                        continue
                    writing[key] = size
                    writes.append(_Write(k, key, encoded, size, self._next_generation))
                    self._next_generation += 1
            if refused:
                self._log_full(refused)
            self._unlink(victims)  # before writing: the disk holds what the index counts
            done = 0
            try:
                for write in writes:
                    codes[write.row] = self._put_one(
                        write, _pieces(table, write.row, space), totals[write.row]
                    )
                    done += 1
            finally:
                if done < len(writes):  # an exception: the reservations of values never written go
                    with self._lock:
                        for write in writes[done:]:
                            self._release(write)
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._call():
            space, valid = self._proven(table)
            totals = table.key_totals().tolist()
            codes = [INVALID] * len(keys)
            proven = valid.tolist()
            reads: list[tuple[int, str, _Entry]] = []
            with self._lock:
                index = self._index
                for k, key in enumerate(keys):
                    if not proven[k]:
                        continue
                    entry = index.get(key)
                    if entry is None:
                        codes[k] = NOT_FOUND
                        self._counts["misses"] += 1
                    elif totals[k] != entry.value_bytes:
                        codes[k] = INVALID if totals[k] < entry.value_bytes else TRANSFER_FAILED
                    else:
                        self._pin(entry)
                        index.move_to_end(key)
                        reads.append((k, key, entry))
            outcomes: list[str] = []
            try:
                for k, key, entry in reads:
                    outcome = self._get_one(key, entry, _pieces(table, k, space))
                    outcomes.append(outcome)
                    codes[k] = entry.value_bytes if outcome == _READ else _READ_CODES[outcome]
            finally:
                self._done_reading(reads, outcomes)
        return codes

    def close(self) -> None:
        """Wait for calls in progress, forget the index and the registered memory and release the
        directory; the files stay (a later ``DiskBackend`` on the directory finds them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._idle.wait()
            self._index.clear()
            self._writing.clear()
            self._used = self._pinned_bytes = self._writing_bytes = 0
            self._space = None
        os.close(self._lock_fd)  # releases the flock

    # -- extras beyond the protocol -------------------------------------------------------------

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Drop keys and delete their files; ``NOT_FOUND`` for those absent. A value being read is
        dropped from the index at once and its file deleted when its reads are done.

        ``force`` is accepted for the same signature as :meth:`MooncakeBackend.batch_remove`; this
        store grants no read leases, so every remove is forced.
        """
        check_keys(keys)
        with self._call():
            codes = []
            doomed: list[str] = []
            with self._lock:
                for key in keys:
                    entry = self._index.pop(key, None)
                    if entry is None:
                        codes.append(NOT_FOUND)
                        continue
                    codes.append(OK)
                    path = self._drop(entry)
                    if path is not None:
                        doomed.append(path)
            self._unlink(doomed)
        return codes

    def stats(self) -> dict[str, int]:
        """Counts since the backend was opened: ``hits``/``misses`` (keys a get found and read whole,
        keys it did not find), ``bytes_read``/``bytes_written`` (values' bytes), ``puts`` (values
        written), ``evictions``/``evicted_bytes``, ``corrupt_dropped`` (files cut short or damaged,
        removed at open or on read), ``missing_dropped`` (files deleted behind the backend's back),
        ``temp_files_dropped`` (left by a crashed writer, removed at open), ``put_no_space``,
        ``put_errors`` and ``get_errors`` (other I/O errors); with ``values``, ``used_bytes`` and
        ``capacity_bytes`` now."""
        with self._lock:
            return {
                **self._counts,
                "values": len(self._index),
                "used_bytes": self._used,
                "capacity_bytes": self.capacity_bytes,
            }

    def listing(self, prefix: str = "") -> list[tuple[str, int]]:
        """The keys held that start with ``prefix``, with their values' bytes, least recently used
        first: after a restart, what the files found at open hold."""
        with self._lock:
            return [(key, entry.value_bytes) for key, entry in self._index.items() if key.startswith(prefix)]

    @property
    def used_bytes(self) -> int:
        """The bytes of every file this backend holds or is writing (headers and padding included)."""
        return self._used

    @property
    def direct_io(self) -> bool:
        """Whether values are read and written with ``O_DIRECT``."""
        return self._direct

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DiskBackend({self.directory!r}, capacity_bytes={self.capacity_bytes}, {state})"

    # -- writing ---------------------------------------------------------------------------------

    def _put_one(self, write: _Write, pieces: Pieces, value_bytes: int) -> int:
        """Write one value and publish it; its code (the reservation is released on failure)."""
        name = file_name(write.encoded, write.generation)
        temp = os.path.join(self._temp_dir, f"{write.generation:016x}{TEMP_SUFFIX}")
        path = os.path.join(self.directory, name)
        try:
            self._write_file(temp, write.encoded, pieces, value_bytes)
            os.rename(temp, path)
            if self._fsync:
                fsync_directory(os.path.dirname(path))
        except BaseException as exc:
            # The path is this write's own (its generation): no other value is ever deleted here.
            unlink_quietly(temp)
            unlink_quietly(path)
            if not isinstance(exc, OSError):
                raise
            with self._lock:
                self._release(write)
                full = exc.errno in FULL_ERRNOS
                self._counts["put_no_space" if full else "put_errors"] += 1
            self._log_once(
                f"put-{exc.errno}",
                "aiokv: DiskBackend %s: writing a value failed (%s); such puts answer %s",
                self.directory,
                exc,
                "NO_SPACE" if full else "TRANSFER_FAILED",
            )
            return NO_SPACE if full else TRANSFER_FAILED
        with self._lock:
            del self._writing[write.key]
            self._writing_bytes -= write.size
            self._index[write.key] = _Entry(name, value_bytes, write.size)
            self._counts["puts"] += 1
            self._counts["bytes_written"] += value_bytes
        return OK

    def _write_file(self, temp: str, key: bytes, pieces: Pieces, value_bytes: int) -> None:
        direct = self._direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
        fd = os.open(temp, flags, 0o644)
        try:
            if direct and not self._aligned(pieces):
                self._write_staged(fd, key, pieces, value_bytes)
            else:
                self._write_in_place(fd, key, pieces, value_bytes, direct)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_in_place(self, fd: int, key: bytes, pieces: Pieces, value_bytes: int, direct: bool) -> None:
        """One ``pwritev`` of the header and the regions themselves (aligned ones, with ``O_DIRECT``)."""
        views = self._views(pieces)
        header = self._scratch.get("header", data_offset(len(key)))
        end = pack_header(header.view, key, value_bytes, _digest(views))
        tail = value_bytes % ALIGN
        if not tail:
            write_all(fd, [header.view[:end], *views], 0)
        elif direct:
            # The last partial block goes through an aligned block of ours, padded with zeros.
            block = self._scratch.get("tail", ALIGN)
            body = views[-1][: len(views[-1]) - tail]
            block.view[:tail] = views[-1][len(body) :]
            block.view[tail:ALIGN] = _ZEROS[tail:]
            write_all(fd, [header.view[:end], *views[:-1], body, block.view[:ALIGN]], 0)
        else:
            write_all(fd, [header.view[:end], *views, _ZEROS[: ALIGN - tail]], 0)

    def _write_staged(self, fd: int, key: bytes, pieces: Pieces, value_bytes: int) -> None:
        """``O_DIRECT`` from unaligned regions: copied into an aligned buffer a piece at a time, the
        value first and the header (which holds its checksum) last."""
        _, _, array = self._mapped()
        stage = self._scratch.get("stage", min(STAGE_BYTES, aligned(value_bytes)))
        hasher = xxhash.xxh3_64()
        offset = data_offset(len(key))
        for chunk in _chunks(pieces, len(stage)):
            filled = 0
            for start, size in chunk:
                stage.array[filled : filled + size] = array[start : start + size]
                filled += size
            hasher.update(stage.view[:filled])
            padded = aligned(filled)
            stage.view[filled:padded] = _ZEROS[: padded - filled]
            write_all(fd, [stage.view[:padded]], offset)
            offset += padded
        header = self._scratch.get("header", data_offset(len(key)))
        end = pack_header(header.view, key, value_bytes, hasher.intdigest())
        write_all(fd, [header.view[:end]], 0)

    # -- reading ---------------------------------------------------------------------------------

    def _get_one(self, key: str, entry: _Entry, pieces: Pieces) -> str:
        """Read one value into its regions; what happened (``_READ`` only when it verified whole)."""
        path = os.path.join(self.directory, entry.name)
        direct = self._direct
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
        except FileNotFoundError:
            return _MISSING
        except OSError as exc:
            return self._read_failed(path, exc)
        try:
            if direct and not self._aligned(pieces):
                intact = self._read_staged(fd, encode_key(key), entry.value_bytes, pieces)
            else:
                intact = self._read_in_place(fd, encode_key(key), entry.value_bytes, pieces, direct)
        except OSError as exc:
            return self._read_failed(path, exc)
        finally:
            os.close(fd)
        if not intact:
            self._log_once(
                "damaged",
                "aiokv: DiskBackend %s: %s was cut short or damaged; it is removed and its key answers "
                "VERIFY_FAILED (logged once; stats()['corrupt_dropped'] counts them)",
                self.directory,
                path,
            )
        return _READ if intact else _DAMAGED

    def _read_in_place(self, fd: int, key: bytes, value_bytes: int, pieces: Pieces, direct: bool) -> bool:
        """Read the header and the value into the regions in one ``preadv``; whether the header is the
        key's and the bytes read match its checksum."""
        views = self._views(pieces)
        offset = data_offset(len(key))
        header = self._scratch.get("header", offset)
        tail = value_bytes % ALIGN
        if direct and tail:
            block = self._scratch.get("tail", ALIGN)
            body = views[-1][: len(views[-1]) - tail]
            got = read_all(fd, [header.view[:offset], *views[:-1], body, block.view[:ALIGN]], 0)
            views[-1][len(body) :] = block.view[:tail]
            wanted = offset + aligned(value_bytes)
        else:
            got = read_all(fd, [header.view[:offset], *views], 0)
            wanted = offset + value_bytes
        found = parse_header(header.view[:offset])
        return (
            got >= wanted
            and found is not None
            and found.key == key
            and found.value_bytes == value_bytes
            and _digest(views) == found.value_sum
        )

    def _read_staged(self, fd: int, key: bytes, value_bytes: int, pieces: Pieces) -> bool:
        """``O_DIRECT`` into unaligned regions: read into an aligned buffer a piece at a time (the
        header with the first), then copied out; whether the value is whole and intact."""
        _, _, array = self._mapped()
        offset = data_offset(len(key))
        header = self._scratch.get("header", offset)
        stage = self._scratch.get("stage", min(STAGE_BYTES, aligned(value_bytes)))
        hasher = xxhash.xxh3_64()
        found: Header | None = None
        position = offset
        for chunk in _chunks(pieces, len(stage)):
            filled = sum(size for _, size in chunk)
            padded = aligned(filled)
            if position == offset:
                got = read_all(fd, [header.view[:offset], stage.view[:padded]], 0) - offset
                found = parse_header(header.view[:offset])
                if found is None or found.key != key or found.value_bytes != value_bytes:
                    return False
            else:
                got = read_all(fd, [stage.view[:padded]], position)
            if got < padded:
                return False
            hasher.update(stage.view[:filled])
            filled = 0
            for start, size in chunk:
                array[start : start + size] = stage.array[filled : filled + size]
                filled += size
            position += padded
        return found is not None and hasher.intdigest() == found.value_sum

    def _read_failed(self, path: str, exc: OSError) -> str:
        with self._lock:
            self._counts["get_errors"] += 1
        self._log_once(
            f"get-{exc.errno}",
            "aiokv: DiskBackend %s: reading %s failed (%s); such keys answer TRANSFER_FAILED",
            self.directory,
            path,
            exc,
        )
        return _FAILED

    def _done_reading(self, reads: list[tuple[int, str, _Entry]], outcomes: list[str]) -> None:
        """Unpin what a get read; drop the values found damaged or missing (unless a remove or a
        newer write replaced them meanwhile) and delete the files no reader needs any more."""
        doomed: list[str] = []
        with self._lock:
            counts = self._counts
            for i, (_, key, entry) in enumerate(reads):
                outcome = outcomes[i] if i < len(outcomes) else None
                if outcome == _READ:
                    counts["hits"] += 1
                    counts["bytes_read"] += entry.value_bytes
                elif outcome in (_DAMAGED, _MISSING) and self._index.get(key) is entry:
                    del self._index[key]
                    entry.removed = True
                    counts["corrupt_dropped" if outcome == _DAMAGED else "missing_dropped"] += 1
                path = self._unpin(entry)
                if path is not None:
                    doomed.append(path)
        self._unlink(doomed)

    # -- the index (every method here runs under the lock) -------------------------------------

    def _reserve(self, size: int, victims: list[str]) -> bool:
        """Count ``size`` bytes for a put, evicting down to the low watermark when it would pass the
        high one; False (nothing evicted) when it cannot fit."""
        if size > self.capacity_bytes:
            return False
        if self._used + size > self._high:
            held = self._pinned_bytes + self._writing_bytes  # what no eviction can free
            if held + size > self.capacity_bytes:
                return False
            self._evict(max(0, self._low - size), victims)
            if self._used + size > self.capacity_bytes:
                return False
        self._used += size
        self._writing_bytes += size
        return True

    def _evict(self, target: int, victims: list[str]) -> None:
        """Drop the least recently used values nobody reads until ``used_bytes <= target``."""
        excess = self._used - target
        chosen = []
        for key, entry in self._index.items():
            if excess <= 0:
                break
            if entry.pins:
                continue
            chosen.append(key)
            excess -= entry.file_bytes
        for key in chosen:
            entry = self._index.pop(key)
            self._used -= entry.file_bytes
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += entry.file_bytes
            victims.append(os.path.join(self.directory, entry.name))

    def _release(self, write: _Write) -> None:
        """A reserved put that wrote nothing."""
        del self._writing[write.key]
        self._writing_bytes -= write.size
        self._used -= write.size

    def _pin(self, entry: _Entry) -> None:
        if not entry.pins:
            self._pinned_bytes += entry.file_bytes
        entry.pins += 1

    def _unpin(self, entry: _Entry) -> str | None:
        """One reader done; the path to delete when it was the last reader of a removed value."""
        entry.pins -= 1
        if entry.pins:
            return None
        self._pinned_bytes -= entry.file_bytes
        if not entry.removed:
            return None
        self._used -= entry.file_bytes
        return os.path.join(self.directory, entry.name)

    def _drop(self, entry: _Entry) -> str | None:
        """An entry just taken out of the index: its path to delete now, or None while it is read."""
        entry.removed = True
        if entry.pins:
            return None
        self._used -= entry.file_bytes
        return os.path.join(self.directory, entry.name)

    def _log_full(self, size: int) -> None:
        if size > self.capacity_bytes:
            self._log_once(
                "too-large",
                "aiokv: DiskBackend %s: a %d-byte file exceeds the capacity of %d bytes; such puts answer "
                "NO_SPACE",
                self.directory,
                size,
                self.capacity_bytes,
            )
            return
        self._log_once(
            "full",
            "aiokv: DiskBackend %s is full (%d of %d bytes, %d held by reads and writes in progress); "
            "puts that do not fit answer NO_SPACE (logged once; stats()['put_no_space'] counts them)",
            self.directory,
            self._used,
            self.capacity_bytes,
            self._pinned_bytes + self._writing_bytes,
        )

    # -- opening ---------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the files found (:func:`~aiokv.backends.disk_scan.scan`), oldest first; evict down to
        the low watermark if they pass the capacity."""
        started = time.perf_counter()
        found = scan(self.directory)
        for item in found.values:
            name = file_name(encode_key(item.key), item.generation)
            self._index[item.key] = _Entry(name, item.value_bytes, item.file_bytes)
            self._used += item.file_bytes
            self._next_generation = max(self._next_generation, item.generation + 1)
        self._counts["temp_files_dropped"] = found.temp_files
        self._counts["corrupt_dropped"] = found.damaged
        if found.other_versions:
            logger.warning(
                "aiokv: DiskBackend %s: %d files of another format version are left alone (not indexed, "
                "not counted against the capacity)",
                self.directory,
                found.other_versions,
            )
        if self._used > self.capacity_bytes:
            victims: list[str] = []
            self._evict(self._low, victims)
            self._unlink(victims)
        logger.info(
            "aiokv: DiskBackend %s: %d values (%d bytes) indexed from their headers in %.3f s; removed %d "
            "temp files, %d damaged files, %d older copies; %d evicted to fit %d bytes; %s I/O",
            self.directory,
            len(self._index),
            self._used,
            time.perf_counter() - started,
            found.temp_files,
            found.damaged,
            found.older_copies,
            self._counts["evictions"],
            self.capacity_bytes,
            "O_DIRECT" if self._direct else "buffered",
        )
        info = os.statvfs(self.directory)
        room = info.f_bavail * info.f_frsize + self._used
        if room < self.capacity_bytes:
            logger.warning(
                "aiokv: DiskBackend %s: capacity_bytes (%d) is more than the file system can hold for it "
                "(%d bytes free plus %d stored); puts answer NO_SPACE once it is full",
                self.directory,
                self.capacity_bytes,
                room - self._used,
                self._used,
            )

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _call(self) -> Iterator[None]:
        """A call in progress: refused once closed, and waited for by close()."""
        with self._lock:
            if self._closed:
                raise BackendError("DiskBackend is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def _proven(self, table: RegionTable) -> tuple[Space | None, BoolArray]:
        """The mapped space, and per key whether all its regions lie in registered memory and in that
        view (a buffer registered after the view was taken is refused, not read past the view)."""
        space = self._space
        valid = self._memory.valid_keys(table)
        if space is None:
            return None, np.zeros(table.num_keys, dtype=bool)
        base, view, _ = space
        outside = (table.addrs < base) | (table.addrs - base > len(view) - table.sizes)
        if outside.any():
            counts = np.zeros(table.addrs.size + 1, dtype=np.int64)
            np.cumsum(outside, out=counts[1:])
            valid &= counts[table.offsets[1:]] == counts[table.offsets[:-1]]
        return space, valid

    def _views(self, pieces: Pieces) -> list[memoryview]:
        _, view, _ = self._mapped()
        return [view[start : start + size] for start, size in pieces]

    def _aligned(self, pieces: Pieces) -> bool:
        """Whether ``O_DIRECT`` can move the regions in place: each starts on a page, and all but the
        last are whole pages long."""
        base = self._mapped()[0]
        last = len(pieces) - 1
        return all(
            (base + start) % ALIGN == 0 and (j == last or size % ALIGN == 0)
            for j, (start, size) in enumerate(pieces)
        )

    def _map_space(self) -> None:
        """Views over all registered memory (see ``RegisteredMemory.address_space``)."""
        space = self._memory.address_space()
        if space is None:
            self._space = None
            return
        base, array = space
        self._space = (base, memoryview(array).cast("B"), np.ctypeslib.as_array(array))

    def _mapped(self) -> Space:
        space = self._space
        if space is None:
            raise BackendError("DiskBackend has no registered memory")
        return space

    def _unlink(self, paths: list[str]) -> None:
        for path in paths:
            unlink_quietly(path)

    def _log_once(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(message, *args)
        else:
            logger.debug(message, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("DiskBackend is closed")


def _pieces(table: RegionTable, row: int, space: Space | None) -> Pieces:
    """Key ``row``'s regions as offsets in the mapped space, regions that continue each other merged."""
    if space is None:
        raise BackendError("DiskBackend has no registered memory")
    first, last = int(table.offsets[row]), int(table.offsets[row + 1])
    base = space[0]
    pieces: Pieces = []
    for addr, size in zip(table.addrs[first:last].tolist(), table.sizes[first:last].tolist(), strict=True):
        start = addr - base
        if pieces and pieces[-1][0] + pieces[-1][1] == start:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
        else:
            pieces.append((start, size))
    return pieces


def _chunks(pieces: Pieces, limit: int) -> Iterator[Pieces]:
    """``pieces`` cut into consecutive runs of at most ``limit`` bytes (a piece may be split)."""
    chunk: Pieces = []
    room = limit
    for start, size in pieces:
        while size:
            take = min(size, room)
            chunk.append((start, take))
            start, size, room = start + take, size - take, room - take
            if not room:
                yield chunk
                chunk, room = [], limit
    if chunk:
        yield chunk


def _digest(views: list[memoryview]) -> int:
    """xxh3-64 of the views back to back (the same digest as one call over the joined bytes)."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view)
    return hasher.intdigest()
