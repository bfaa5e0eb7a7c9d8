"""Vectorised copies between byte ranges, for :class:`~aiokv.backends.memory.MemoryBackend`.

A batch's regions move in a few NumPy copies (fancy indexing in units of the regions' common
alignment), not a Python loop per region. The copies run in bounded slices so their index arrays and
temporaries stay a small fraction of the bytes moved, whatever the regions' alignment or length.
Callers prove every region lies inside the arrays first (these functions trust their offsets).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from ._regions import RegionTable

Bytes = npt.NDArray[np.uint8]


def _unit(*offsets: IntArray) -> int:
    """The largest element size dividing every offset and size: copies move elements, not bytes."""
    return math.gcd(*(int(np.gcd.reduce(values)) for values in offsets))


# A call's copy runs in slices of at most this many elements (of its unit), so its index arrays and
# temporaries stay a bounded fraction of the bytes moved, whatever the alignment: one index for every
# byte of a 64 MiB call took 1-1.5 GiB.
_SLICE_MAX_UNITS = 1 << 20  # 8 MiB per index array
_SLICE_MIN_UNITS = 1 << 16  # small calls: few slices, each still one vectorised copy
_SLICE_MAX_BYTES = 16 << 20  # a slice's gathered rows
_WIDE = 8  # misaligned regions still move in rows of this many bytes (see scatter)
# Regions at least this large move one slice each when the call's common unit is smaller (the loop's
# ~1 us a region is under 10 % of copying 64 KiB).
_LARGE_REGION = 64 << 10


def gather(source: Bytes, offsets: IntArray, sizes: IntArray, target: Bytes) -> None:
    """``target`` = the regions ``source[offsets[j] : offsets[j] + sizes[j]]`` back to back."""
    scatter(source, offsets, sizes, target, _exclusive_cumsum(sizes))


def scatter(
    source: Bytes, offsets: IntArray, sizes: IntArray, target: Bytes, target_offsets: IntArray
) -> None:
    """Copy ``source[offsets[j] : +sizes[j]]`` to ``target[target_offsets[j] : +sizes[j]]`` for all j."""
    if not sizes.size:
        return
    unit = _unit(offsets, sizes, target_offsets)
    if unit < _LARGE_REGION:
        # One small or odd region (a verified value's 64-byte header) would make every region move in
        # small units, through an index per unit (3x slower than memcpy for 2 MiB values): large
        # regions move one slice each instead, and the rest by the common unit of their own.
        large = sizes >= _LARGE_REGION
        if large.any():
            for start, size, to in zip(
                offsets[large].tolist(), sizes[large].tolist(), target_offsets[large].tolist(), strict=True
            ):
                target[to : to + size] = source[start : start + size]
            rest = ~large
            if not rest.any():
                return
            offsets, sizes, target_offsets = offsets[rest], sizes[rest], target_offsets[rest]
            unit = _unit(offsets, sizes, target_offsets)
    if unit >= _WIDE:
        _copy_in_units(source, offsets, sizes, target, target_offsets, unit)
        return
    # Misaligned or odd-length regions: a byte-sized unit would index every byte (slow, and 8 index
    # bytes per byte). Instead each region's body moves in 8-byte rows of views shifted by its
    # residues (one vectorised copy per pair of source and target residues, 64 at most), and only
    # the last few bytes of each region move byte by byte.
    tails = sizes % _WIDE
    bodies = sizes - tails
    residues = (offsets % _WIDE) * _WIDE + target_offsets % _WIDE
    with_body = bodies > 0
    for residue in np.unique(residues[with_body]).tolist():
        picked = np.flatnonzero(with_body & (residues == residue))
        shift, target_shift = divmod(residue, _WIDE)
        _copy_in_units(
            source[shift:],
            offsets[picked] - shift,
            bodies[picked],
            target[target_shift:],
            target_offsets[picked] - target_shift,
            _WIDE,
        )
    picked = np.flatnonzero(tails)
    if picked.size:
        body = bodies[picked]
        _copy_in_units(
            source, offsets[picked] + body, tails[picked], target, target_offsets[picked] + body, 1
        )


def _copy_in_units(
    source: Bytes, offsets: IntArray, sizes: IntArray, target: Bytes, target_offsets: IntArray, unit: int
) -> None:
    """The copy of :func:`scatter` for offsets and sizes all multiples of ``unit``, in slices."""
    if unit > 1:
        offsets, target_offsets, sizes = offsets // unit, target_offsets // unit, sizes // unit
    total = int(sizes.sum())
    per_slice = max(1, min(_SLICE_MAX_UNITS, max(_SLICE_MIN_UNITS, total // 32), _SLICE_MAX_BYTES // unit))
    starts, target_starts, lengths = _split_long(offsets, target_offsets, sizes, per_slice)
    source_rows, target_rows = _as_rows(source, unit), _as_rows(target, unit)
    ends = np.cumsum(lengths)
    first = 0
    while first < lengths.size:
        done = int(ends[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(ends, done + per_slice, side="right")))
        _copy_rows(
            source_rows, starts[first:last], target_rows, target_starts[first:last], lengths[first:last]
        )
        first = last


def _split_long(
    starts: IntArray, target_starts: IntArray, lengths: IntArray, limit: int
) -> tuple[IntArray, IntArray, IntArray]:
    """Regions cut into pieces of at most ``limit`` elements (the same copy, in smaller parts)."""
    if int(lengths.max()) <= limit:
        return starts, target_starts, lengths
    pieces = np.maximum(1, -(-lengths // limit))
    region = np.repeat(np.arange(lengths.size), pieces)
    within = (np.arange(region.size) - np.repeat(_exclusive_cumsum(pieces), pieces)) * limit
    return (
        starts[region] + within,
        target_starts[region] + within,
        np.minimum(limit, lengths[region] - within),
    )


def _copy_rows(
    source_rows: Bytes, starts: IntArray, target_rows: Bytes, target_starts: IntArray, lengths: IntArray
) -> None:
    """One vectorised copy of the regions (in rows); a side whose regions lie back to back is sliced,
    not indexed."""
    count = int(lengths.sum())
    if not count:
        return
    source_run = _back_to_back(starts, lengths)
    target_run = _back_to_back(target_starts, lengths)
    if source_run and target_run:
        first, to = int(starts[0]), int(target_starts[0])
        target_rows[to : to + count] = source_rows[first : first + count]
    elif target_run:
        to = int(target_starts[0])
        # mode="clip" skips take's buffered bounds check (10x slower here): every index is proven in range.
        index = _expand_ranges(starts, lengths)
        np.take(source_rows, index, axis=0, out=target_rows[to : to + count], mode="clip")
    elif source_run:
        first = int(starts[0])
        target_rows[_expand_ranges(target_starts, lengths)] = source_rows[first : first + count]
    else:
        target_rows[_expand_ranges(target_starts, lengths)] = source_rows[_expand_ranges(starts, lengths)]


def _back_to_back(starts: IntArray, lengths: IntArray) -> bool:
    return bool((starts[1:] == starts[:-1] + lengths[:-1]).all())


def offsets_within_keys(table: RegionTable) -> IntArray:
    """Per region: its byte offset inside its key's value."""
    starts = _exclusive_cumsum(table.sizes)
    return starts - np.repeat(starts[table.offsets[:-1]], np.diff(table.offsets))


def _exclusive_cumsum(values: IntArray) -> IntArray:
    out = np.zeros(values.size, dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


def select_keys(table: RegionTable, rows: IntArray) -> RegionTable:
    if rows.size == table.num_keys:  # rows ascend: every key, the usual case, needs no copy
        return table
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


def _as_rows(data: Bytes, unit: int) -> Bytes:
    """View bytes as a 1-D array of ``unit``-byte elements (a trailing remainder is never addressed).

    The elements are opaque ``V{unit}`` (alignment 1), never integers: NumPy copies a whole array that
    is not aligned before indexing it, which here would read the entire span between registered
    buffers, gaps included (a crash). One element per row also moves a row in one copy rather than a
    loop over its bytes (5-10x faster for small units)."""
    usable = data[: data.size - data.size % unit]
    return usable if unit == 1 else usable.view(np.dtype(f"V{unit}"))
