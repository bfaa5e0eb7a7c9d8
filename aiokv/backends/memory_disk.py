"""Host memory in front of a local disk: :class:`MemoryDiskBackend`, one backend of two levels.

The disk (a :class:`~aiokv.backends.disk.DiskBackend`) holds every value; a bounded
:class:`~aiokv.backends.memory.MemoryBackend` holds copies of the most recently used ones (an inclusive
read cache). So what the backend holds, answers ``batch_exists`` for, lists, and reports to a
``listener`` is the disk's, and a restart finds the disk's values and an empty memory level.

- ``batch_put`` writes the disk; each value the disk wrote is copied into memory too.
- ``batch_get`` reads the keys memory holds from memory, the others from the disk; each value read
  whole from the disk is copied into memory (promoted). Making room in memory evicts its least
  recently used copies, never a copy a get is reading, and never touches the disk.
- A value the disk stops holding (evicted, removed, found damaged or missing) leaves memory at once.

Checks: the disk answers a value only when the header names its key and length and the bytes read
hash to the xxh3-64 checksum written with them. A memory copy keeps that checksum (computed from the
bytes put, or from the bytes the disk just verified), and a memory hit is answered only when the bytes
that landed in the caller's regions hash to it; a copy that does not is dropped and the key read from
the disk instead. Keys name their copies (a dict), and a get's regions must add up to the value's size
on either level.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..codes import Code
from ..tier_events import TierEvent, TierListener
from ._call_gate import CallGate
from ._copies import select_keys
from ._regions import Regions, RegionTable, check_keys
from .base import ClosingContext
from .disk import DEFAULT_CAPACITY_BYTES, DiskBackend
from .disk_transfer import MappedSpace
from .memory import MemoryBackend
from .verified import region_checksums

NOT_FOUND = int(Code.NOT_FOUND)

DEFAULT_MEMORY_CAPACITY_BYTES = 4 << 30

# The memory level's own counters (stats() prefixes the disk's with "disk_").
MEMORY_STATS = (
    "memory_hits",
    "memory_bytes_read",
    "memory_bytes_written",
    "memory_evictions",
    "memory_evicted_bytes",
    "memory_promotions",
    "memory_promoted_bytes",
    "memory_dropped",
    "memory_verify_failed",
    "memory_no_space",
)


class MemoryDiskBackend(ClosingContext):
    """Values in files under ``directory`` (at most ``capacity_bytes``, as :class:`DiskBackend`), the
    most recently used of them also in ``memory_capacity_bytes`` of this process's memory.

    ``high_watermark``, ``low_watermark``, ``fsync``, ``direct_io`` are the disk's (see
    :class:`DiskBackend`); ``listener`` is told of the disk's events (what the backend holds).
    """

    exists_in_process = True  # the disk's index answers

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        memory_capacity_bytes: int = DEFAULT_MEMORY_CAPACITY_BYTES,
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        fsync: bool = False,
        direct_io: bool | None = None,
        listener: TierListener | None = None,
    ) -> None:
        self.memory = MemoryBackend(memory_capacity_bytes)
        self._listener = listener
        # Lock order: the disk's (its listener) before this one, this one before the memory's.
        self._lock = threading.Lock()
        self._gate = CallGate(self._lock, "MemoryDiskBackend")
        self._copies: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (bytes, xxh3-64), LRU first
        self._reading: Counter[str] = Counter()  # copies gets are reading: never evicted meanwhile
        # Per call copying into memory: key -> whether the disk still holds it (its events flip it).
        self._watches: dict[int, dict[str, bool]] = {}
        self._thread = threading.local()  # the keys the disk stored for this thread's put
        self.counts: Counter[str] = Counter()
        self._space = MappedSpace()
        self.disk = DiskBackend(
            directory,
            capacity_bytes,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            fsync=fsync,
            direct_io=direct_io,
            listener=self._on_disk_event,
        )

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._gate.check_open()
        self.disk.register_buffer(addr, size)
        self.memory.register_buffer(addr, size)
        self._space.add(addr, size)

    def unregister_buffer(self, addr: int) -> None:
        self._gate.check_open()
        self._space.remove(addr)
        self.memory.unregister_buffer(addr)
        self.disk.unregister_buffer(addr)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._gate.check_open()
        return self.disk.batch_exists(keys)

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._gate.call(), self._watching(keys) as watch:
            stored: set[str] = set()
            self._thread.stored = stored
            try:
                codes = self.disk.batch_put(keys, addrs, sizes)
            finally:
                self._thread.stored = None
            # Only values this put wrote: a key the disk already held keeps its own value.
            rows = [k for k, key in enumerate(keys) if codes[k] >= 0 and key in stored]
            self._copy_in(table, keys, rows, watch, promoted=False)
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        with self._gate.call():
            codes = [NOT_FOUND] * len(keys)
            served = self._from_memory(table, keys, codes)
            rest = [k for k in range(len(keys)) if k not in served]
            if not rest:
                return codes
            with self._watching([keys[k] for k in rest]) as watch:
                sub = select_keys(table, np.asarray(rest, dtype=np.int64))
                sub_keys = [keys[k] for k in rest]
                for k, code in zip(rest, self.disk.batch_get(sub_keys, *_regions(sub)), strict=True):
                    codes[k] = code
                promote = [k for k in rest if codes[k] >= 0]
                self._copy_in(table, keys, promote, watch, promoted=True)
        return codes

    def close(self) -> None:
        """Wait for calls in progress, close the disk (its files stay) and drop the memory level.
        Idempotent."""
        with self._lock:
            if not self._gate.shut():
                return
        self.disk.close()
        with self._lock:
            self.memory.close()
            self._copies.clear()
            self._space.unmap()

    # -- extras beyond the protocol -------------------------------------------------------------

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Drop keys from both levels; ``NOT_FOUND`` for those the disk does not hold."""
        self._gate.check_open()
        return self.disk.batch_remove(keys, force=force)

    def listing(self, prefix: str = "") -> list[tuple[str, int]]:
        """The disk's keys that start with ``prefix`` and their values' bytes, least recently used
        first (:meth:`DiskBackend.listing`)."""
        return self.disk.listing(prefix)

    def stats(self) -> dict[str, int]:
        """The memory level's counts since the backend was opened (:data:`MEMORY_STATS`: hits and
        bytes read from memory, bytes copied in, evictions to make room, promotions of disk hits,
        copies dropped with their disk value, copies that failed their checksum, copies refused for
        room), ``memory_values``/``memory_used_bytes``/``memory_capacity_bytes`` now, and the disk's
        :meth:`DiskBackend.stats` each prefixed ``disk_``."""
        disk = self.disk.stats()
        with self._lock:
            counts = {name: self.counts[name] for name in MEMORY_STATS}
            counts["memory_values"] = len(self._copies)
        return {
            **counts,
            "memory_used_bytes": self.memory.used_bytes,
            "memory_capacity_bytes": self.memory.capacity_bytes,
            **{f"disk_{name}": value for name, value in disk.items()},
        }

    @property
    def capacity_bytes(self) -> int:
        return self.disk.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """The disk's bytes (what the backend holds; memory holds copies of some of it)."""
        return self.disk.used_bytes

    @property
    def directory(self) -> str:
        return self.disk.directory

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def __len__(self) -> int:
        return len(self.disk)

    def __repr__(self) -> str:
        state = "closed" if self._gate.closed else "open"
        return (
            f"MemoryDiskBackend({self.disk.directory!r}, capacity_bytes={self.disk.capacity_bytes}, "
            f"memory_capacity_bytes={self.memory.capacity_bytes}, {state})"
        )

    # -- the memory level ------------------------------------------------------------------------

    def _from_memory(self, table: RegionTable, keys: Sequence[str], codes: list[int]) -> set[int]:
        """Read the keys memory holds into their regions, checked; the rows served (their codes set)."""
        space, valid = self._space.proven(table)
        with self._lock:
            rows = [k for k, key in enumerate(keys) if valid[k] and key in self._copies]
            expected = []
            for k in rows:
                self._copies.move_to_end(keys[k])
                self._reading[keys[k]] += 1
                expected.append(self._copies[keys[k]][1])
        if not rows or space is None:
            return set()
        served: set[int] = set()
        damaged: list[str] = []
        try:
            sub = select_keys(table, np.asarray(rows, dtype=np.int64))
            sub_keys = [keys[k] for k in rows]
            got = self.memory.batch_get(sub_keys, *_regions(sub))
            sums = region_checksums(sub, space[0], space[1])
            for k, key, code, digest, want in zip(rows, sub_keys, got, sums, expected, strict=True):
                if code < 0:
                    continue
                if digest != want:
                    damaged.append(key)
                    continue
                codes[k] = code
                served.add(k)
        finally:
            with self._lock:
                for k in rows:
                    self._reading[keys[k]] -= 1
                    if not self._reading[keys[k]]:
                        del self._reading[keys[k]]
                self.counts["memory_hits"] += len(served)
                self.counts["memory_bytes_read"] += sum(codes[k] for k in served)
                self.counts["memory_verify_failed"] += len(damaged)
                self._drop(damaged)
        return served

    def _copy_in(
        self,
        table: RegionTable,
        keys: Sequence[str],
        rows: list[int],
        watch: dict[str, bool],
        *,
        promoted: bool,
    ) -> None:
        """Copy the values in ``rows``' regions (just written to or verified by the disk) into memory,
        with their checksums; a key the disk dropped meanwhile (``watch``) is not kept."""
        space, valid = self._space.proven(table)
        rows = [k for k in rows if valid[k]]
        if not rows or space is None:
            return
        sub = select_keys(table, np.asarray(rows, dtype=np.int64))
        sub_keys = [keys[k] for k in rows]
        totals = sub.key_totals().tolist()
        sums = region_checksums(sub, space[0], space[1])
        self._make_room(sum(totals))
        got = self.memory.batch_put(sub_keys, *_regions(sub))
        with self._lock:
            gone = []
            for key, code, size, digest in zip(sub_keys, got, totals, sums, strict=True):
                if code < 0:
                    self.counts["memory_no_space"] += 1
                elif not watch.get(key, False):
                    gone.append(key)
                elif key not in self._copies:
                    self._copies[key] = (size, digest)
                    self.counts["memory_bytes_written"] += size
                    if promoted:
                        self.counts["memory_promotions"] += 1
                        self.counts["memory_promoted_bytes"] += size
            if gone:
                self.memory.batch_remove(gone)

    def _make_room(self, needed: int) -> None:
        """Evict the least recently used copies nobody reads until ``needed`` more bytes fit."""
        with self._lock:
            room = self.memory.capacity_bytes - self.memory.used_bytes
            victims = []
            for key, (size, _) in self._copies.items():
                if room >= needed:
                    break
                if key not in self._reading:
                    victims.append(key)
                    room += size
            for key in victims:
                self.counts["memory_evicted_bytes"] += self._copies.pop(key)[0]
            self.counts["memory_evictions"] += len(victims)
            if victims:
                self.memory.batch_remove(victims)

    def _drop(self, keys: list[str]) -> None:
        """(Under the lock.) Remove the memory copies of ``keys`` it holds."""
        held = [key for key in keys if self._copies.pop(key, None) is not None]
        if held:
            self.memory.batch_remove(held)

    def _on_disk_event(self, event: TierEvent) -> None:
        """The disk stored or stopped holding a key (under the disk's lock, on the calling thread)."""
        if self._listener is not None:
            self._listener(event)
        stored = event.kind == "stored"
        if stored and event.reason == "put":
            mine = getattr(self._thread, "stored", None)
            if mine is not None:
                mine.add(event.key)
        with self._lock:
            for watch in self._watches.values():
                if event.key in watch:
                    watch[event.key] = stored
            if not stored and event.key in self._copies:
                self.counts["memory_dropped"] += 1
                self._drop([event.key])

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _watching(self, keys: Sequence[str]) -> Iterator[dict[str, bool]]:
        """A watch over ``keys``: each stays True until the disk removes it."""
        watch = dict.fromkeys(keys, True)
        with self._lock:
            self._watches[id(watch)] = watch
        try:
            yield watch
        finally:
            with self._lock:
                del self._watches[id(watch)]


def _regions(table: RegionTable) -> tuple[Regions, Regions]:
    """``table``'s regions as a batch call's arguments: one row per key (an array when every key has
    as many regions, the usual case, so the callee converts no Python lists)."""
    counts = np.diff(table.offsets)
    if counts.size and counts[0] > 0 and bool((counts == counts[0]).all()):
        width = int(counts[0])
        return table.addrs.reshape(-1, width), table.sizes.reshape(-1, width)
    cuts = table.offsets[1:-1]
    return [row.tolist() for row in np.split(table.addrs, cuts)], [
        row.tolist() for row in np.split(table.sizes, cuts)
    ]
