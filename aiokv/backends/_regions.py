"""What every backend needs to stay safe: normalising region arguments (:class:`RegionTable`,
:func:`check_keys`), and :class:`RegisteredMemory`, which proves each region lies inside registered
memory before a native library (which would crash the process on a wrong pointer) ever sees it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

from .._arrays import BoolArray, IntArray, as_int64_array
from ..errors import InvalidRequestError

Regions = IntArray | Sequence[Sequence[int]]

_INT64_MAX = int(np.iinfo(np.int64).max)


class RegionTable:
    """Regions of a batch flattened: pair ``j`` of key ``k`` is ``addrs[offsets[k] + j]``."""

    __slots__ = ("addrs", "sizes", "offsets")

    def __init__(self, addrs: IntArray, sizes: IntArray, offsets: IntArray) -> None:
        self.addrs = addrs
        self.sizes = sizes
        self.offsets = offsets

    @property
    def num_keys(self) -> int:
        return int(self.offsets.size - 1)

    def key_totals(self) -> IntArray:
        """Bytes of each key's value."""
        return _per_key_sum(self.sizes, self.offsets)

    @classmethod
    def from_arguments(cls, keys: Sequence[str], addrs: Regions, sizes: Regions) -> RegionTable:
        """Validate a batch call's arguments; raise ``InvalidRequestError``/``TypeError`` when wrong."""
        if isinstance(addrs, np.ndarray) and isinstance(sizes, np.ndarray) and addrs.ndim == 2:
            flat_addrs = as_int64_array(addrs, "addrs", ndim=2)
            flat_sizes = as_int64_array(sizes, "sizes", ndim=2)
            if flat_addrs.shape != flat_sizes.shape or flat_addrs.shape[0] != len(keys):
                raise InvalidRequestError(
                    f"addrs {flat_addrs.shape} and sizes {flat_sizes.shape} must both have one row "
                    f"per key ({len(keys)} keys)"
                )
            width = flat_addrs.shape[1]
            # Zero width: every key has no region (answered INVALID per key, as empty list rows are).
            offsets = np.arange(len(keys) + 1, dtype=np.int64) * width
            return cls(flat_addrs.ravel(), flat_sizes.ravel(), offsets)
        if len(addrs) != len(keys) or len(sizes) != len(keys):
            raise InvalidRequestError(
                f"addrs ({len(addrs)}) and sizes ({len(sizes)}) must have one entry per key ({len(keys)})"
            )
        counts = []
        for k, (row_addrs, row_sizes) in enumerate(zip(addrs, sizes, strict=True)):
            if len(row_addrs) != len(row_sizes):
                raise InvalidRequestError(f"key {k}: {len(row_addrs)} addresses but {len(row_sizes)} sizes")
            counts.append(len(row_addrs))
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat_addrs = as_int64_array([a for row in addrs for a in row], "addrs", ndim=1)
        flat_sizes = as_int64_array([s for row in sizes for s in row], "sizes", ndim=1)
        return cls(flat_addrs, flat_sizes, offsets)


def _per_key_sum(values: IntArray, offsets: IntArray) -> IntArray:
    totals = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=totals[1:])
    return totals[offsets[1:]] - totals[offsets[:-1]]


def check_keys(keys: Sequence[str]) -> None:
    """Refuse what would make a store misbehave: non-str or empty keys."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a sequence of str, not a single string")
    # The common case in C loops (4x faster than the loop below for thousands of keys: the GIL is held);
    # the loop names the first bad key.
    if set(map(type, keys)) <= {str} and "" not in keys:
        return
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"keys[{index}] must be a non-empty str, got {key!r}")


class RegisteredMemory:
    """The address ranges a backend may touch, and the proof that a batch stays inside them.

    Ranges are kept sorted and disjoint; registering one that overlaps another is refused (Mooncake
    answers -600 there too). ``valid_keys`` is vectorised: one ``searchsorted`` per batch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (starts, ends) in one attribute, replaced whole and never mutated: a reader without the
        # lock always gets a matching pair (two attributes could be read across an update).
        empty = np.empty(0, dtype=np.int64)
        self._table: tuple[IntArray, IntArray] = (empty, empty)

    def add(self, addr: int, size: int) -> None:
        if isinstance(addr, bool) or isinstance(size, bool):
            raise TypeError("addr and size must be ints")
        addr, size = int(addr), int(size)
        if addr <= 0 or size <= 0:
            raise InvalidRequestError(
                f"cannot register [{addr:#x}, +{size}): address and size must be positive"
            )
        if addr + size > _INT64_MAX:
            # Refused before the tables change: the end would not fit the int64 table of ends.
            raise InvalidRequestError(f"cannot register [{addr:#x}, +{size}): it ends past the int64 range")
        with self._lock:
            starts, ends = self._table
            index = int(np.searchsorted(starts, addr))
            overlaps_prev = index > 0 and ends[index - 1] > addr
            overlaps_next = index < starts.size and starts[index] < addr + size
            if overlaps_prev or overlaps_next:
                raise InvalidRequestError(f"[{addr:#x}, +{size}) overlaps memory already registered")
            self._table = (np.insert(starts, index, addr), np.insert(ends, index, addr + size))

    def remove(self, addr: int) -> None:
        with self._lock:
            starts, ends = self._table
            index = int(np.searchsorted(starts, addr))
            if index >= starts.size or starts[index] != addr:
                raise InvalidRequestError(f"{addr:#x} is not the start of a registered buffer")
            self._table = (np.delete(starts, index), np.delete(ends, index))

    def spans(self) -> list[tuple[int, int]]:
        with self._lock:
            starts, ends = self._table
            return [(s, e - s) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]

    def address_space(self) -> tuple[int, ctypes.Array[ctypes.c_uint8]] | None:
        """One ctypes array from the first registered address to the last registered end, or None.

        Only regions proven inside a registered buffer may be touched through it; the gaps between
        buffers never are (an array over an address maps and reads nothing by itself)."""
        spans = self.spans()
        if not spans:
            return None
        base = spans[0][0]
        end = max(addr + size for addr, size in spans)
        return base, (ctypes.c_uint8 * (end - base)).from_address(base)

    def locate(self, addrs: IntArray, sizes: IntArray) -> tuple[IntArray, np.ndarray]:
        """Per region: the start address of the registered buffer holding it, and whether the region
        lies wholly inside that buffer."""
        starts, ends = self._table  # one read: a consistent snapshot
        if not starts.size:
            return np.zeros(addrs.shape, dtype=np.int64), np.zeros(addrs.shape, dtype=bool)
        index = np.searchsorted(starts, addrs, side="right") - 1
        safe = np.maximum(index, 0)
        # ``ends - addrs`` rather than ``addrs + sizes``: the sum could wrap around int64.
        inside = (index >= 0) & (sizes > 0) & (sizes <= ends[safe] - addrs)
        return starts[safe], inside

    def valid_keys(self, table: RegionTable) -> BoolArray:
        """Per key: True when every region of the key is inside one registered buffer."""
        _, inside = self.locate(table.addrs, table.sizes)
        bad = _per_key_sum((~inside).astype(np.int64), table.offsets)
        empty = table.offsets[1:] == table.offsets[:-1]
        return (bad == 0) & ~empty
