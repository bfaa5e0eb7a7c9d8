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
from typing import NamedTuple

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
        self._values: dict[str, _Value] = {}
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
        rows = np.asarray(to_write, dtype=np.int64)
        try:
            sub = _select_keys(table, rows)
            arena = np.empty(int(totals[rows].sum()), dtype=np.uint8)
            buffer_starts, _ = self._memory.locate(sub.addrs, sub.sizes)
            sources, source_of = np.unique(buffer_starts, return_inverse=True)
            _copy(
                [self._views[int(start)] for start in sources.tolist()],
                source_of,
                sub.addrs - buffer_starts,
                [arena],
                np.zeros(sub.sizes.size, dtype=np.int64),
                _exclusive_cumsum(sub.sizes),
                sub.sizes,
            )
            bounds = _exclusive_cumsum(totals[rows]).tolist()
        except BaseException:
            with self._lock:
                self._writing -= {keys[k] for k in to_write}
                self._used -= int(totals[rows].sum())
            raise
        with self._lock:
            for i, k in enumerate(to_write):
                # Values share the batch's arena, which lives while any of its keys does.
                self._values[keys[k]] = _Value(arena, bounds[i], int(totals[k]))
                self._writing.discard(keys[k])
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        valid = self._memory.valid_keys(table).tolist()
        totals = table.key_totals().tolist()
        codes: list[int] = []
        found: list[_Value] = []
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
            sub = _select_keys(table, np.asarray(rows, dtype=np.int64))
            arena_index: dict[int, int] = {}
            arenas = []
            for value in found:
                if arena_index.setdefault(id(value.arena), len(arena_index)) == len(arenas):
                    arenas.append(value.arena)
            counts = np.diff(sub.offsets)
            key_arena = np.array([arena_index[id(v.arena)] for v in found], dtype=np.int64)
            key_offset = np.array([v.offset for v in found], dtype=np.int64)
            starts = _exclusive_cumsum(sub.sizes)
            within = starts - np.repeat(starts[sub.offsets[:-1]], counts)  # offset inside the value
            buffer_starts, _ = self._memory.locate(sub.addrs, sub.sizes)
            targets, target_of = np.unique(buffer_starts, return_inverse=True)
            _copy(
                arenas,
                np.repeat(key_arena, counts),
                np.repeat(key_offset, counts) + within,
                [self._views[int(start)] for start in targets.tolist()],
                target_of,
                sub.addrs - buffer_starts,
                sub.sizes,
            )
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


class _Value(NamedTuple):
    """Where a key's bytes are: ``arena[offset : offset + size]``."""

    arena: Bytes
    offset: int
    size: int


def _copy(
    sources: list[Bytes],
    source_of: IntArray,
    source_offsets: IntArray,
    targets: list[Bytes],
    target_of: IntArray,
    target_offsets: IntArray,
    sizes: IntArray,
) -> None:
    """Copy region ``j`` (``sizes[j]`` bytes) from ``sources[source_of[j]]`` at ``source_offsets[j]``
    to ``targets[target_of[j]]`` at ``target_offsets[j]``: one fancy-indexing copy per
    (source, target) pair, in units of the regions' common alignment."""
    unit = math.gcd(*np.gcd.reduce(np.stack([source_offsets, target_offsets, sizes]), axis=1).tolist())
    pair = source_of * len(targets) + target_of
    order = np.argsort(pair, kind="stable")
    cuts = np.flatnonzero(np.diff(pair[order])) + 1
    for group in np.split(order, cuts):
        first = int(group[0])
        source = _as_units(sources[int(source_of[first])], unit)
        target = _as_units(targets[int(target_of[first])], unit)
        lengths = sizes[group] // unit
        target[_expand_ranges(target_offsets[group] // unit, lengths)] = source[
            _expand_ranges(source_offsets[group] // unit, lengths)
        ]


def _exclusive_cumsum(values: IntArray) -> IntArray:
    out = np.zeros(values.size, dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


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
