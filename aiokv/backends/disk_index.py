"""The index of :class:`~aiokv.backends.disk.DiskBackend`: the values it holds, least recently used
first, and the bytes their files take against the capacity.

Besides the files indexed, the bytes count files removed while a get still reads them (pinned: never
evicted, deleted when the last reader is done) and the room reserved by puts still writing. A put that
would pass the high watermark evicts the least recently used values nobody reads down to the low one.

Not thread-safe: the backend calls every method under its lock and does the file I/O outside it (the
methods answer the paths to delete), except :meth:`DiskIndex.rebuild`, which runs at open, before any
call.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

from ..codes import Code
from ..tier_events import EventKind, TierEvent, TierListener
from .disk_format import encode_key, file_bytes, file_name
from .disk_io import unlink_quietly
from .disk_scan import Scan, scan

logger = logging.getLogger("aiokv.backends.disk")  # one logger for everything DiskBackend says

OK, NO_SPACE, INVALID = int(Code.OK), int(Code.NO_SPACE), int(Code.INVALID)
NOT_FOUND, TRANSFER_FAILED = int(Code.NOT_FOUND), int(Code.TRANSFER_FAILED)

# Per key of a get: read and verified, the file gone (removed behind the backend's back), the file
# damaged (cut short, a bad header or checksum), or an I/O error (the file is kept).
READ, MISSING, DAMAGED, FAILED = "read", "missing", "damaged", "failed"

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


class Entry:
    """A value in the index. ``pins``: gets reading it now; ``removed``: out of the index, its file
    deleted when the last of them is done."""

    __slots__ = ("name", "value_bytes", "file_bytes", "pins", "removed")

    def __init__(self, name: str, value_bytes: int, size: int) -> None:
        self.name = name
        self.value_bytes = value_bytes
        self.file_bytes = size
        self.pins = 0
        self.removed = False


class Write(NamedTuple):
    row: int
    key: str
    encoded: bytes
    size: int  # the file's bytes, reserved against the capacity
    generation: int


Read = tuple[int, str, Entry]  # a get's row, its key and the entry pinned for it


class DiskIndex:
    """The values under ``directory``, at most ``capacity_bytes`` of files; ``high``/``low``: the
    watermarks in bytes."""

    def __init__(
        self, directory: str, capacity_bytes: int, high: int, low: int, listener: TierListener | None = None
    ) -> None:
        self.directory = directory
        # Told of every key that enters or leaves the index (aiokv.tier_events), under the caller's lock.
        self._listener = listener
        self.capacity_bytes = capacity_bytes
        self.high = high
        self.low = low
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # oldest use first
        self.writing: dict[str, int] = {}  # key -> bytes reserved by the put writing it
        self.used = 0  # files indexed, files removed but still read, and reservations of puts
        self.pinned_bytes = 0
        self.writing_bytes = 0
        self.next_generation = 1
        self.counts = dict.fromkeys(STAT_NAMES, 0)

    # -- a call's keys --------------------------------------------------------------------------

    def touch(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether it is held; those found become the most recently used."""
        entries = self.entries
        found = [key in entries for key in keys]
        for key, hit in zip(keys, found, strict=True):
            if hit:  # a lookup announces a load: keep what it found
                entries.move_to_end(key)
        return found

    def reserve_writes(
        self, keys: Sequence[str], codes: list[int], totals: list[int], victims: list[str]
    ) -> tuple[list[Write], int]:
        """The values a put writes (those whose code is ``OK``, not held and not being written), their
        room reserved; ``codes`` of those that do not fit become ``NO_SPACE``. Also the size of the
        last file refused (0: none), and the evicted files' paths in ``victims``."""
        writes: list[Write] = []
        refused = 0
        entries, writing = self.entries, self.writing
        for k, key in enumerate(keys):
            if codes[k] != OK or key in entries or key in writing:
                continue  # invalid, or present / being written / a duplicate: the first value wins
            encoded = encode_key(key)
            size = file_bytes(len(encoded), totals[k])
            if not self._reserve(size, victims):
                codes[k] = NO_SPACE
                self.counts["put_no_space"] += 1
                refused = size
                continue
            writing[key] = size
            writes.append(Write(k, key, encoded, size, self.next_generation))
            self.next_generation += 1
        return writes, refused

    def published(self, write: Write, name: str, value_bytes: int) -> None:
        """A put's file is in place under ``name``: its value is held."""
        del self.writing[write.key]
        self.writing_bytes -= write.size
        self.entries[write.key] = Entry(name, value_bytes, write.size)
        self._tell("stored", write.key, "put")
        self.counts["puts"] += 1
        self.counts["bytes_written"] += value_bytes

    def release(self, write: Write) -> None:
        """A reserved put that wrote nothing."""
        del self.writing[write.key]
        self.writing_bytes -= write.size
        self.used -= write.size

    def pin_reads(
        self, keys: Sequence[str], proven: list[bool], totals: list[int], codes: list[int]
    ) -> list[Read]:
        """The values a get reads (proven keys held whose stored size the regions match), pinned and
        made the most recently used; ``codes`` of keys absent or of another size are set."""
        reads: list[Read] = []
        entries = self.entries
        for k, key in enumerate(keys):
            if not proven[k]:
                continue
            entry = entries.get(key)
            if entry is None:
                codes[k] = NOT_FOUND
                self.counts["misses"] += 1
            elif totals[k] != entry.value_bytes:
                codes[k] = INVALID if totals[k] < entry.value_bytes else TRANSFER_FAILED
            else:
                self._pin(entry)
                entries.move_to_end(key)
                reads.append((k, key, entry))
        return reads

    def done_reading(self, reads: list[Read], outcomes: list[str]) -> list[str]:
        """Unpin what a get read; drop the values found damaged or missing (unless a remove or a newer
        write replaced them meanwhile). The paths of files no reader needs any more."""
        doomed: list[str] = []
        counts = self.counts
        for i, (_, key, entry) in enumerate(reads):
            outcome = outcomes[i] if i < len(outcomes) else None
            if outcome == READ:
                counts["hits"] += 1
                counts["bytes_read"] += entry.value_bytes
            elif outcome in (DAMAGED, MISSING) and self.entries.get(key) is entry:
                del self.entries[key]
                entry.removed = True
                counts["corrupt_dropped" if outcome == DAMAGED else "missing_dropped"] += 1
                self._tell("removed", key, "damaged" if outcome == DAMAGED else "missing")
            path = self._unpin(entry)
            if path is not None:
                doomed.append(path)
        return doomed

    def remove(self, keys: Sequence[str]) -> tuple[list[int], list[str]]:
        """Drop keys: per key ``OK`` or ``NOT_FOUND``, and the paths to delete now (a value being
        read is deleted when its reads are done)."""
        codes = []
        doomed: list[str] = []
        for key in keys:
            entry = self.entries.pop(key, None)
            if entry is None:
                codes.append(NOT_FOUND)
                continue
            codes.append(OK)
            self._tell("removed", key, "removed")
            path = self._drop(entry)
            if path is not None:
                doomed.append(path)
        return codes, doomed

    # -- the whole index ------------------------------------------------------------------------

    def rebuild(self, *, direct: bool) -> None:
        """Index the files found in the directory (:func:`~aiokv.backends.disk_scan.scan`), oldest
        first; evict down to the low watermark if they pass the capacity. ``direct``: for the log."""
        started = time.perf_counter()
        found = scan(self.directory)
        self._load(found)
        if found.other_versions:
            logger.warning(
                "aiokv: DiskBackend %s: %d files of another format version are left alone (not indexed, "
                "not counted against the capacity)",
                self.directory,
                found.other_versions,
            )
        if self.used > self.capacity_bytes:
            victims: list[str] = []
            self.evict(self.low, victims)
            for path in victims:
                unlink_quietly(path)
        logger.info(
            "aiokv: DiskBackend %s: %d values (%d bytes) indexed from their headers in %.3f s; removed %d "
            "temp files, %d damaged files, %d older copies; %d evicted to fit %d bytes; %s I/O",
            self.directory,
            len(self.entries),
            self.used,
            time.perf_counter() - started,
            found.temp_files,
            found.damaged,
            found.older_copies,
            self.counts["evictions"],
            self.capacity_bytes,
            "O_DIRECT" if direct else "buffered",
        )
        info = os.statvfs(self.directory)
        room = info.f_bavail * info.f_frsize + self.used
        if room < self.capacity_bytes:
            logger.warning(
                "aiokv: DiskBackend %s: capacity_bytes (%d) is more than the file system can hold for it "
                "(%d bytes free plus %d stored); puts answer NO_SPACE once it is full",
                self.directory,
                self.capacity_bytes,
                room - self.used,
                self.used,
            )

    def evict(self, target: int, victims: list[str]) -> None:
        """Drop the least recently used values nobody reads until ``used <= target``."""
        excess = self.used - target
        chosen = []
        for key, entry in self.entries.items():
            if excess <= 0:
                break
            if entry.pins:
                continue
            chosen.append(key)
            excess -= entry.file_bytes
        for key in chosen:
            entry = self.entries.pop(key)
            self._tell("removed", key, "evicted")
            self.used -= entry.file_bytes
            self.counts["evictions"] += 1
            self.counts["evicted_bytes"] += entry.file_bytes
            victims.append(self.path(entry))

    def stats(self) -> dict[str, int]:
        return {
            **self.counts,
            "values": len(self.entries),
            "used_bytes": self.used,
            "capacity_bytes": self.capacity_bytes,
        }

    def listing(self, prefix: str) -> list[tuple[str, int]]:
        return [(key, entry.value_bytes) for key, entry in self.entries.items() if key.startswith(prefix)]

    def clear(self) -> None:
        self.entries.clear()
        self.writing.clear()
        self.used = self.pinned_bytes = self.writing_bytes = 0

    def path(self, entry: Entry) -> str:
        return os.path.join(self.directory, entry.name)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _tell(self, kind: EventKind, key: str, reason: str) -> None:
        if self._listener is not None:
            self._listener(TierEvent(kind, key, "disk", reason))

    def _load(self, found: Scan) -> None:
        for item in found.values:
            name = file_name(encode_key(item.key), item.generation)
            self.entries[item.key] = Entry(name, item.value_bytes, item.file_bytes)
            self._tell("stored", item.key, "restart")
            self.used += item.file_bytes
            self.next_generation = max(self.next_generation, item.generation + 1)
        self.counts["temp_files_dropped"] = found.temp_files
        self.counts["corrupt_dropped"] = found.damaged

    def _reserve(self, size: int, victims: list[str]) -> bool:
        """Count ``size`` bytes for a put, evicting down to the low watermark when it would pass the
        high one; False (nothing evicted) when it cannot fit."""
        if size > self.capacity_bytes:
            return False
        if self.used + size > self.high:
            held = self.pinned_bytes + self.writing_bytes  # what no eviction can free
            if held + size > self.capacity_bytes:
                return False
            self.evict(max(0, self.low - size), victims)
            if self.used + size > self.capacity_bytes:
                return False
        self.used += size
        self.writing_bytes += size
        return True

    def _pin(self, entry: Entry) -> None:
        if not entry.pins:
            self.pinned_bytes += entry.file_bytes
        entry.pins += 1

    def _unpin(self, entry: Entry) -> str | None:
        """One reader done; the path to delete when it was the last reader of a removed value."""
        entry.pins -= 1
        if entry.pins:
            return None
        self.pinned_bytes -= entry.file_bytes
        if not entry.removed:
            return None
        self.used -= entry.file_bytes
        return self.path(entry)

    def _drop(self, entry: Entry) -> str | None:
        """An entry just taken out of the index: its path to delete now, or None while it is read."""
        entry.removed = True
        if entry.pins:
            return None
        self.used -= entry.file_bytes
        return self.path(entry)
