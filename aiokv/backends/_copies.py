"""Vectorised copies between byte buffers, for :class:`~aiokv.backends.memory.MemoryBackend`: a
batch's regions move in one fancy-indexing copy, in units of the regions' common alignment, rather
than a Python loop per region."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from ._regions import RegionTable

Bytes = npt.NDArray[np.uint8]


def common_unit(*offsets: IntArray) -> int:
    """The largest element size dividing every offset and size: copies move elements, not bytes."""
    return math.gcd(*np.gcd.reduce(np.stack(offsets), axis=1).tolist())


def gather(source: Bytes, offsets: IntArray, sizes: IntArray, target: Bytes) -> None:
    """``target`` = the regions ``source[offsets[j] : offsets[j] + sizes[j]]`` back to back."""
    unit = common_unit(offsets, sizes, exclusive_cumsum(sizes))
    lengths = sizes // unit
    index = expand_ranges(offsets // unit, lengths)
    # mode="clip" skips take's buffered bounds check (10x slower here): every index is proven in range.
    np.take(as_rows(source, unit), index, axis=0, out=as_rows(target, unit)[: index.size], mode="clip")


def scatter(
    source: Bytes, offsets: IntArray, sizes: IntArray, target: Bytes, target_offsets: IntArray
) -> None:
    """Copy ``source[offsets[j] : +sizes[j]]`` to ``target[target_offsets[j] : +sizes[j]]`` for all j."""
    unit = common_unit(offsets, sizes, target_offsets)
    lengths = sizes // unit
    source_index = expand_ranges(offsets // unit, lengths)
    rows = as_rows(source, unit)
    if source_index.size > 1 and bool((np.diff(source_index) == 1).all()):
        first = int(source_index[0])
        rows = rows[first : first + source_index.size]  # values back to back: no gather needed
    else:
        rows = rows[source_index]
    as_rows(target, unit)[expand_ranges(target_offsets // unit, lengths)] = rows


def offsets_within_keys(table: RegionTable) -> IntArray:
    """Per region: its byte offset inside its key's value."""
    starts = exclusive_cumsum(table.sizes)
    return starts - np.repeat(starts[table.offsets[:-1]], np.diff(table.offsets))


def exclusive_cumsum(values: IntArray) -> IntArray:
    out = np.zeros(values.size, dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


def select_keys(table: RegionTable, rows: IntArray) -> RegionTable:
    counts = np.diff(table.offsets)[rows]
    pair_index = expand_ranges(table.offsets[rows], counts)
    offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return RegionTable(table.addrs[pair_index], table.sizes[pair_index], offsets)


def expand_ranges(starts: IntArray, lengths: IntArray) -> IntArray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def as_rows(data: Bytes, unit: int) -> Bytes:
    """View bytes as rows of ``unit`` bytes (a trailing remainder is never addressed)."""
    return data[: data.size - data.size % unit].reshape(-1, unit)
