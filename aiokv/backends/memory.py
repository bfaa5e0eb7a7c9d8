"""The embedded default backend: an in-process, thread-safe store of real bytes.

It needs no server, so the demo and most tests run on it. Copies are vectorised: a batch's regions
are grouped by registered buffer and moved with one NumPy fancy-indexing copy per buffer (in units of
the regions' common alignment), so a large batch costs a handful of GIL-releasing NumPy calls rather
than a Python loop per region.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from ..errors import BackendError
from .base import (
    INVALID,
    NO_SPACE,
    NOT_FOUND,
    OK,
    TRANSFER_FAILED,
    Regions,
    RegionTable,
    RegisteredMemory,
    check_keys,
)

logger = logging.getLogger(__name__)

Bytes = npt.NDArray[np.uint8]
DEFAULT_CAPACITY_BYTES = 1 << 30


class MemoryBackend:
    """Keys and their bytes in this process's memory, bounded by ``capacity_bytes``.

    A put that does not fit answers ``NO_SPACE`` (-200) for the keys that do not fit; nothing is ever
    evicted behind a reader's back. Regions outside registered memory answer ``INVALID`` (-600) and
    nothing is touched. A get whose regions do not add up to the stored size answers ``INVALID``
    (regions too small) or ``TRANSFER_FAILED`` (too large), as Mooncake does.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._values: dict[str, Bytes] = {}
        self._writing: set[str] = set()
        self._used = 0  # bytes stored or reserved by puts in progress
        self._memory = RegisteredMemory()
        self._views: dict[int, Bytes] = {}
        self._closed = False

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._check_open()
        self._memory.add(addr, size)
        # A NumPy view of the caller's memory; safe because every region is proven inside it first.
        self._views[int(addr)] = np.frombuffer((ctypes.c_uint8 * int(size)).from_address(int(addr)), np.uint8)

    def unregister_buffer(self, addr: int) -> None:
        self._check_open()
        self._memory.remove(addr)
        del self._views[int(addr)]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        check_keys(keys)
        values = self._values
        return [key in values for key in keys]

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        valid = self._memory.valid_keys(table)
        totals = table.key_totals()
        codes = [OK if ok else INVALID for ok in valid.tolist()]
        to_write: list[int] = []
        with self._lock:
            claimed: set[str] = set()
            for k, key in enumerate(keys):
                if codes[k] != OK or key in self._values or key in self._writing or key in claimed:
                    continue  # invalid, or present / being written / duplicate: the first value wins
                size = int(totals[k])
                if self._used + size > self.capacity_bytes:
                    codes[k] = NO_SPACE
                    continue
                self._used += size
                claimed.add(key)
                to_write.append(k)
            self._writing |= claimed
        if not to_write:
            return codes
        try:
            rows = np.asarray(to_write, dtype=np.int64)
            sub = _select_keys(table, rows)
            arena = np.empty(int(sub.sizes.sum()), dtype=np.uint8)
            self._move(sub, arena, into_arena=True)
            bounds = np.concatenate([[0], np.cumsum(totals[rows])]).tolist()
        except BaseException:
            with self._lock:
                self._writing -= {keys[k] for k in to_write}
                self._used -= int(totals[to_write].sum())
            raise
        with self._lock:
            for i, k in enumerate(to_write):
                # Views share the batch's arena; the arena lives while any of its keys does.
                self._values[keys[k]] = arena[bounds[i] : bounds[i + 1]]
                self._writing.discard(keys[k])
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        valid = self._memory.valid_keys(table).tolist()
        totals = table.key_totals().tolist()
        codes: list[int] = []
        found: list[Bytes] = []
        rows: list[int] = []
        values = self._values
        for k, key in enumerate(keys):
            value = values.get(key)
            if not valid[k]:
                codes.append(INVALID)
            elif value is None:
                codes.append(NOT_FOUND)
            elif totals[k] != value.size:
                codes.append(INVALID if totals[k] < value.size else TRANSFER_FAILED)
            else:
                codes.append(value.size)
                found.append(value)
                rows.append(k)
        if rows:
            arena = np.concatenate(found) if len(found) > 1 else found[0]
            self._move(_select_keys(table, np.asarray(rows, dtype=np.int64)), arena, into_arena=False)
        return codes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._values.clear()
            self._views.clear()
            self._used = 0

    # -- extras beyond the protocol -------------------------------------------------------------

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        """Drop keys; ``NOT_FOUND`` for those absent. For tests and explicit eviction."""
        self._check_open()
        check_keys(keys)
        codes = []
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is None:
                    codes.append(NOT_FOUND)
                else:
                    self._used -= value.size
                    codes.append(OK)
        return codes

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._values)

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("MemoryBackend is closed")

    def _move(self, table: RegionTable, arena: Bytes, *, into_arena: bool) -> None:
        """Copy between registered memory (the regions of ``table``) and the contiguous ``arena``
        holding the regions' bytes back to back."""
        buffer_starts, _ = self._memory.locate(table.addrs, table.sizes)
        relative = table.addrs - buffer_starts
        arena_offsets = np.concatenate([[0], np.cumsum(table.sizes)[:-1]])
        unit = math.gcd(*np.gcd.reduce(np.stack([relative, table.sizes, arena_offsets]), axis=1).tolist())
        order = np.argsort(buffer_starts, kind="stable")
        sorted_starts = buffer_starts[order]
        cuts = np.flatnonzero(np.diff(sorted_starts)) + 1
        arena_units = _as_units(arena, unit)
        for group in np.split(order, cuts):
            buffer_units = _as_units(self._views[int(buffer_starts[group[0]])], unit)
            lengths = table.sizes[group] // unit
            buffer_index = _expand_ranges(relative[group] // unit, lengths)
            arena_index = _expand_ranges(arena_offsets[group] // unit, lengths)
            if into_arena:
                arena_units[arena_index] = buffer_units[buffer_index]
            else:
                buffer_units[buffer_index] = arena_units[arena_index]


def _select_keys(table: RegionTable, rows: IntArray) -> RegionTable:
    counts = np.diff(table.offsets)[rows]
    pair_index = _expand_ranges(table.offsets[rows], counts)
    offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return RegionTable(table.addrs[pair_index], table.sizes[pair_index], offsets)


def _expand_ranges(starts: IntArray, lengths: IntArray) -> IntArray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def _as_units(data: Bytes, unit: int) -> np.ndarray:
    """View bytes as elements of ``unit`` bytes (a trailing remainder is never addressed)."""
    usable = data.size - data.size % unit
    return data[:usable].view(np.dtype((np.void, unit)))
