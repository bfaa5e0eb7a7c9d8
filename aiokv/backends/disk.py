"""A backend on a local disk: one file per value under a directory, an LRU index in memory.

Files (:mod:`aiokv.backends.disk_format`) carry their key, their value's length and its xxh3-64
checksum in a header, so :class:`DiskBackend` on an existing directory rebuilds its index from the
headers alone, and a value whose file was cut short or whose bytes changed is never answered as
loaded: the get answers ``VERIFY_FAILED`` (-13) for that key and removes the file, so the next store
of the chunk writes it again.

I/O (:mod:`aiokv.backends.disk_transfer`): ``os.pwritev``/``os.preadv``, which release the GIL while
the disk works, with ``O_DIRECT`` where the file system takes it (probed when the directory is
opened; otherwise buffered I/O, logged once).

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

import logging
import os
import threading
from collections.abc import Sequence

from ..codes import Code
from ..tier_events import TierListener
from ._call_gate import CallGate
from ._regions import Regions, RegionTable, check_keys
from .base import ClosingContext
from .disk_format import TEMP_DIR, TEMP_SUFFIX, encode_key, file_name
from .disk_index import DAMAGED, FAILED, MISSING, READ, DiskIndex, Entry, Read, Write
from .disk_io import (
    FULL_ERRNOS,
    O_DIRECT,
    choose_direct,
    fsync_directory,
    make_subdirectories,
    open_directory,
    unlink_quietly,
)
from .disk_transfer import DiskTransfer, MappedSpace, Pieces, value_pieces

logger = logging.getLogger(__name__)

OK, NO_SPACE, INVALID = int(Code.OK), int(Code.NO_SPACE), int(Code.INVALID)
NOT_FOUND, TRANSFER_FAILED = int(Code.NOT_FOUND), int(Code.TRANSFER_FAILED)
VERIFY_FAILED = int(Code.VERIFY_FAILED)

DEFAULT_CAPACITY_BYTES = 64 << 30
_READ_CODES = {MISSING: NOT_FOUND, DAMAGED: VERIFY_FAILED, FAILED: TRANSFER_FAILED}


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
        listener: TierListener | None = None,
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
        self._fsync = fsync
        self._temp_dir = os.path.join(self.directory, TEMP_DIR)
        self._lock = threading.Lock()
        self._gate = CallGate(self._lock, "DiskBackend")
        self._index = DiskIndex(
            self.directory,
            capacity_bytes,
            round(capacity_bytes * high_watermark),
            round(capacity_bytes * low_watermark),
            listener,
        )
        self._logged: set[str] = set()
        self._space = MappedSpace()
        self._lock_fd = open_directory(self.directory)
        try:
            make_subdirectories(self.directory, self._temp_dir)
            self._direct = choose_direct(self.directory, self._temp_dir, direct_io)
            self._transfer = DiskTransfer(self._space, direct=self._direct, fsync=fsync)
            self._index.rebuild(direct=self._direct)
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._gate.check_open()
        self._space.add(addr, size)

    def unregister_buffer(self, addr: int) -> None:
        self._gate.check_open()
        self._space.remove(addr)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            self._gate.check_open()
            return self._index.touch(keys)

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._gate.call():
            space, valid = self._space.proven(table)
            totals = table.key_totals().tolist()
            codes = [OK if ok else INVALID for ok in valid.tolist()]
            victims: list[str] = []
            with self._lock:
                writes, refused = self._index.reserve_writes(keys, codes, totals, victims)
            if refused:  # logged once the lock is released
                self._log_full(refused)
            self._unlink(victims)  # before writing: the disk holds what the index counts
            done = 0
            try:
                for write in writes:
                    codes[write.row] = self._put_one(
                        write, value_pieces(table, write.row, space), totals[write.row]
                    )
                    done += 1
            finally:
                if done < len(writes):  # an exception: the reservations of values never written go
                    with self._lock:
                        for write in writes[done:]:
                            self._index.release(write)
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._gate.call():
            space, valid = self._space.proven(table)
            totals = table.key_totals().tolist()
            codes = [INVALID] * len(keys)
            with self._lock:
                reads = self._index.pin_reads(keys, valid.tolist(), totals, codes)
            outcomes: list[str] = []
            try:
                for k, key, entry in reads:
                    outcome = self._get_one(key, entry, value_pieces(table, k, space))
                    outcomes.append(outcome)
                    codes[k] = entry.value_bytes if outcome == READ else _READ_CODES[outcome]
            finally:
                self._done_reading(reads, outcomes)
        return codes

    def close(self) -> None:
        """Wait for calls in progress, forget the index and the registered memory and release the
        directory; the files stay (a later ``DiskBackend`` on the directory finds them). Idempotent."""
        with self._lock:
            if not self._gate.shut():
                return
            self._index.clear()
            self._space.unmap()
        os.close(self._lock_fd)  # releases the flock

    # -- extras beyond the protocol -------------------------------------------------------------

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Drop keys and delete their files; ``NOT_FOUND`` for those absent. A value being read is
        dropped from the index at once and its file deleted when its reads are done.

        ``force`` is accepted for the same signature as :meth:`MooncakeBackend.batch_remove`; this
        store grants no read leases, so every remove is forced.
        """
        check_keys(keys)
        with self._gate.call():
            with self._lock:
                codes, doomed = self._index.remove(keys)
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
            return self._index.stats()

    def listing(self, prefix: str = "") -> list[tuple[str, int]]:
        """The keys held that start with ``prefix``, with their values' bytes, least recently used
        first: after a restart, what the files found at open hold."""
        with self._lock:
            return self._index.listing(prefix)

    @property
    def used_bytes(self) -> int:
        """The bytes of every file this backend holds or is writing (headers and padding included)."""
        return self._index.used

    @property
    def direct_io(self) -> bool:
        """Whether values are read and written with ``O_DIRECT``."""
        return self._direct

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def __len__(self) -> int:
        return len(self._index.entries)

    def __repr__(self) -> str:
        state = "closed" if self._gate.closed else "open"
        return f"DiskBackend({self.directory!r}, capacity_bytes={self.capacity_bytes}, {state})"

    # -- one value -------------------------------------------------------------------------------

    def _put_one(self, write: Write, pieces: Pieces, value_bytes: int) -> int:
        """Write one value and publish it; its code (the reservation is released on failure)."""
        name = file_name(write.encoded, write.generation)
        temp = os.path.join(self._temp_dir, f"{write.generation:016x}{TEMP_SUFFIX}")
        path = os.path.join(self.directory, name)
        try:
            self._transfer.write(temp, write.encoded, pieces, value_bytes)
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
                self._index.release(write)
                full = exc.errno in FULL_ERRNOS
                self._index.counts["put_no_space" if full else "put_errors"] += 1
            self._log_once(
                f"put-{exc.errno}",
                "aiokv: DiskBackend %s: writing a value failed (%s); such puts answer %s",
                self.directory,
                exc,
                "NO_SPACE" if full else "TRANSFER_FAILED",
            )
            return NO_SPACE if full else TRANSFER_FAILED
        with self._lock:
            self._index.published(write, name, value_bytes)
        return OK

    def _get_one(self, key: str, entry: Entry, pieces: Pieces) -> str:
        """Read one value into its regions; what happened (``READ`` only when it verified whole)."""
        path = os.path.join(self.directory, entry.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if self._direct else 0))
        except FileNotFoundError:
            return MISSING
        except OSError as exc:
            return self._read_failed(path, exc)
        try:
            intact = self._transfer.read(fd, encode_key(key), entry.value_bytes, pieces)
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
        return READ if intact else DAMAGED

    def _read_failed(self, path: str, exc: OSError) -> str:
        with self._lock:
            self._index.counts["get_errors"] += 1
        self._log_once(
            f"get-{exc.errno}",
            "aiokv: DiskBackend %s: reading %s failed (%s); such keys answer TRANSFER_FAILED",
            self.directory,
            path,
            exc,
        )
        return FAILED

    def _done_reading(self, reads: list[Read], outcomes: list[str]) -> None:
        """Unpin what a get read, and delete the files no reader needs any more."""
        with self._lock:
            doomed = self._index.done_reading(reads, outcomes)
        self._unlink(doomed)

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
        index = self._index
        self._log_once(
            "full",
            "aiokv: DiskBackend %s is full (%d of %d bytes, %d held by reads and writes in progress); "
            "puts that do not fit answer NO_SPACE (logged once; stats()['put_no_space'] counts them)",
            self.directory,
            index.used,
            self.capacity_bytes,
            index.pinned_bytes + index.writing_bytes,
        )

    # -- internals -------------------------------------------------------------------------------

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
