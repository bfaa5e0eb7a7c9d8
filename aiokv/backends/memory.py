"""The embedded default backend: an in-process, thread-safe store of real bytes.

It needs no server, so the demo and most tests run on it. Copies are vectorised (see
:mod:`aiokv.backends._copies`): one NumPy view spans the address range of every registered buffer, and a
batch's regions move in a few fancy-indexing copies between that view and the store's heap, so a
large batch costs a few GIL-releasing NumPy calls rather than a Python loop per region or per buffer.

Values live in one heap of ``capacity_bytes``, allocated on first use and reused (first fit), so
its pages are faulted in once rather than on every put: a fresh allocation per put made puts cost
mostly page faults.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Sequence

import numpy as np

from .._arrays import BoolArray
from ..codes import Code
from ..errors import BackendError
from ..tier_events import TierEvent, TierListener
from ._copies import Bytes, offsets_within_keys, select_keys
from ._copies import gather as _gather
from ._copies import scatter as _scatter
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys
from .base import ClosingContext

logger = logging.getLogger(__name__)

# Plain ints: puts build one per key, and lists of ints are what callers compare and convert.
OK, NO_SPACE, INVALID = int(Code.OK), int(Code.NO_SPACE), int(Code.INVALID)
NOT_FOUND, TRANSFER_FAILED = int(Code.NOT_FOUND), int(Code.TRANSFER_FAILED)

DEFAULT_CAPACITY_BYTES = 1 << 30


class MemoryBackend(ClosingContext):
    """Keys and their bytes in this process's memory, bounded by ``capacity_bytes``.

    A put that does not fit answers ``NO_SPACE`` (-200) for the keys that do not fit; nothing is ever
    evicted behind a reader's back. Regions outside registered memory answer ``INVALID`` (-600) and
    nothing is touched. A get whose regions do not add up to the stored size answers ``INVALID``
    (regions too small) or ``TRANSFER_FAILED`` (too large), as Mooncake does.

    Visibility: a key exists (``batch_exists``, ``batch_get``) only once every byte of it is copied.
    A put of a key that is present, or that another put is still copying, keeps the first value and
    answers ``OK`` at once, as Mooncake does: that success does not mean the bytes are readable yet
    (the worker confirms its puts with ``batch_exists``, see ``aiokv._engine.confirm``).
    """

    # Copies release the GIL; what holds it is per-key bookkeeping (~1 us a key), so calls of up to
    # 65536 regions (~680 keys at 96 regions) keep each hold well under a millisecond.
    max_regions_per_call = 65536
    exists_in_process = True  # a dict lookup per key, no lock: lookups need no thread

    def __init__(
        self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, *, listener: TierListener | None = None
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if capacity_bytes >= _SIZE_SPAN:
            raise ValueError(f"capacity_bytes must be below 2**48, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}  # key -> _packed(heap offset, size)
        self._writing: set[str] = set()
        self._used = 0  # bytes stored or reserved by puts in progress
        self._heap = _Heap(capacity_bytes)
        # Heap offsets gets are copying out of right now, and how many gets each: a value removed while
        # read keeps its space until its last reader is done (its size waits in _deferred_frees); the
        # space of values nobody reads is reused at once (an evicting cache removes while it loads).
        self._reading: dict[int, int] = {}
        self._deferred_frees: dict[int, int] = {}
        self._memory = RegisteredMemory()
        self._space: tuple[int, Bytes] | None = None  # (first address, view up to the last end)
        self._closed = False
        # Told of every key stored and removed, under the lock (aiokv.tier_events).
        self._listener = listener

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
        self._check_open()
        check_keys(keys)
        values = self._values
        return [key in values for key in keys]

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        valid = self._memory.valid_keys(table)
        totals_array = table.key_totals()
        totals = totals_array.tolist()  # Python ints: per-key NumPy scalar access costs more than the work
        codes = [OK if ok else INVALID for ok in valid.tolist()]
        to_write: list[int] = []
        with self._lock:
            # Under the lock: two first calls at once would otherwise each allocate a heap, and the
            # values copied into the one that is replaced would be lost (yet answered as stored).
            heap = self._heap.buffer
            claimed: set[str] = set()
            values, writing = self._values, self._writing
            for k, key in enumerate(keys):
                if codes[k] != OK or key in values or key in writing or key in claimed:
                    continue  # invalid, or present / being written / duplicate: the first value wins
                size = totals[k]
                if self._used + size > self.capacity_bytes:
                    codes[k] = NO_SPACE
                    continue
                self._used += size
                claimed.add(key)
                to_write.append(k)
            offsets = self._allocate(totals, to_write, codes) if to_write else {}
            writing |= claimed
        written = [k for k in to_write if codes[k] == OK]
        if not written:
            with self._lock:
                self._writing -= claimed
            return codes
        rows = np.asarray(written, dtype=np.int64)
        key_offsets_list = [offsets[k] for k in written]
        key_sizes_list = [totals[k] for k in written]
        try:
            sub = select_keys(table, rows)
            base, space = self._mapped()
            key_offsets = np.asarray(key_offsets_list, dtype=np.int64)
            key_sizes = totals_array[rows]
            if bool((key_offsets[1:] == key_offsets[:-1] + key_sizes[:-1]).all()):
                start = key_offsets_list[0]  # the usual case: one heap block for the whole batch
                _gather(space, sub.addrs - base, sub.sizes, heap[start : start + sum(key_sizes_list)])
            else:
                targets = np.repeat(key_offsets, np.diff(sub.offsets)) + offsets_within_keys(sub)
                _scatter(space, sub.addrs - base, sub.sizes, heap, targets)
        except BaseException:
            with self._lock:
                self._writing -= claimed
                for offset, size in zip(key_offsets_list, key_sizes_list, strict=True):
                    self._heap.free(offset, size)
                self._used -= sum(key_sizes_list)
            raise
        with self._lock:
            placed = map(_packed, key_offsets_list, key_sizes_list)
            stored = [keys[k] for k in written]
            self._values.update(zip(stored, placed, strict=True))
            self._writing -= claimed
            if self._listener is not None:
                for key in stored:
                    self._listener(TierEvent("stored", key, "memory", "put"))
        return codes

    def _allocate(self, totals: list[int], to_write: list[int], codes: list[int]) -> dict[int, int]:
        """Heap offsets for the keys ``to_write`` (under the lock): one block for the whole batch when
        it fits, else key by key; a key that finds no room gets ``NO_SPACE``."""
        sizes = [totals[k] for k in to_write]
        start = self._heap.allocate(sum(sizes))
        if start is not None:
            bounds = itertools.accumulate(sizes[:-1], initial=start)
            return dict(zip(to_write, bounds, strict=True))
        offsets = {}
        for k, size in zip(to_write, sizes, strict=True):
            offset = self._heap.allocate(size)
            if offset is None:
                codes[k] = NO_SPACE
                self._used -= size
            else:
                offsets[k] = offset
        return offsets

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        table = RegionTable.from_arguments(keys, addrs, sizes)
        valid = self._memory.valid_keys(table).tolist()
        totals = table.key_totals().tolist()
        codes: list[int] = []
        found: list[int] = []  # heap offsets
        rows: list[int] = []
        with self._lock:
            values = self._values
            for k, key in enumerate(keys):
                packed = values.get(key)
                if not valid[k]:
                    codes.append(INVALID)
                    continue
                if packed is None:
                    codes.append(NOT_FOUND)
                    continue
                offset, size = _unpacked(packed)
                if totals[k] != size:
                    codes.append(INVALID if totals[k] < size else TRANSFER_FAILED)
                else:
                    codes.append(size)
                    found.append(offset)
                    rows.append(k)
            if not rows:
                return codes
            heap = self._heap.buffer  # the heap the values are in, whatever a close() does meanwhile
            reading = self._reading
            for offset in found:  # the values' heap space is not reused until the copy is done
                reading[offset] = reading.get(offset, 0) + 1
        try:
            sub = select_keys(table, np.asarray(rows, dtype=np.int64))
            value_offsets = np.asarray(found, dtype=np.int64)
            base, space = self._mapped()
            _scatter(
                heap,
                np.repeat(value_offsets, np.diff(sub.offsets)) + offsets_within_keys(sub),
                sub.sizes,
                space,
                sub.addrs - base,
            )
        finally:
            with self._lock:
                self._done_reading(found)
        return codes

    def _done_reading(self, offsets: list[int]) -> None:
        """(Under the lock.) A get finished copying out of ``offsets``: free the ones removed meanwhile
        whose last reader it was."""
        reading, deferred = self._reading, self._deferred_frees
        for offset in offsets:
            left = reading.get(offset, 0) - 1  # absent: a close() dropped the heap meanwhile
            if left > 0:
                reading[offset] = left
                continue
            reading.pop(offset, None)
            size = deferred.pop(offset, None)
            if size is not None:
                self._heap.free(offset, size)

    def close(self) -> None:
        """Drop every value and the registered memory; later calls raise. Idempotent."""
        with self._lock:
            self._closed = True
            self._values.clear()
            self._space = None
            self._heap = _Heap(self.capacity_bytes)
            self._reading, self._deferred_frees = {}, {}
            self._used = 0

    # -- extras beyond the protocol -------------------------------------------------------------

    def valid_keys(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> BoolArray:
        """Per key: whether every region lies inside registered memory, the proof every batch call
        makes before touching memory (a key failing it is answered -600)."""
        self._check_open()
        check_keys(keys)
        return self._memory.valid_keys(RegionTable.from_arguments(keys, addrs, sizes))

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Drop keys; ``NOT_FOUND`` for those absent. For tests and explicit eviction.

        ``force`` is accepted for the same signature as :meth:`MooncakeBackend.batch_remove`; this
        store has no read leases, so every remove is forced.
        """
        self._check_open()
        check_keys(keys)
        codes = []
        with self._lock:
            for key in keys:
                packed = self._values.pop(key, None)
                if packed is None:
                    codes.append(NOT_FOUND)
                    continue
                offset, size = _unpacked(packed)
                if self._listener is not None:
                    self._listener(TierEvent("removed", key, "memory", "removed"))
                self._used -= size
                if offset in self._reading:
                    self._deferred_frees[offset] = size
                else:
                    self._heap.free(offset, size)
                codes.append(OK)
        return codes

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"MemoryBackend(capacity_bytes={self.capacity_bytes}, {'closed' if self._closed else 'open'})"

    def __len__(self) -> int:
        return len(self._values)

    # -- internals ------------------------------------------------------------------------------

    def _map_space(self) -> None:
        """One NumPy view over all registered memory (see ``RegisteredMemory.address_space``)."""
        space = self._memory.address_space()
        self._space = None if space is None else (space[0], np.ctypeslib.as_array(space[1]))

    def _mapped(self) -> tuple[int, Bytes]:
        space = self._space
        if space is None:
            raise BackendError("MemoryBackend has no registered memory")
        return space

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("MemoryBackend is closed")


# A value's heap offset and size packed in one int: a put of 62,500 keys then allocates no tuple per
# key, each of which would count towards (and trigger) the garbage collector's young collections.
_SIZE_SPAN = 1 << 48


def _packed(offset: int, size: int) -> int:
    return offset * _SIZE_SPAN + size


def _unpacked(packed: int) -> tuple[int, int]:
    """(heap offset, size) of a packed value."""
    offset, size = divmod(packed, _SIZE_SPAN)
    return offset, size


_ALIGN = 4096  # heap blocks start on page boundaries: copies then move large aligned units


class _Heap:
    """First-fit allocator over one buffer allocated on first use. Not thread-safe: callers lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buffer: Bytes | None = None
        self._free: list[list[int]] = [[0, size]]  # [offset, size], sorted, coalesced

    @property
    def buffer(self) -> Bytes:
        if self._buffer is None:
            try:
                self._buffer = np.empty(self.size, dtype=np.uint8)  # pages are faulted in on first write
            except MemoryError as exc:
                raise BackendError(f"MemoryBackend cannot allocate its {self.size}-byte store") from exc
        return self._buffer

    def allocate(self, size: int) -> int | None:
        """An offset for ``size`` bytes, page-aligned where a free range allows it (copies then move
        large units), else anywhere it fits; None when no free range is large enough."""
        for aligned in (True, False):
            for index, (start, length) in enumerate(self._free):
                offset = -(-start // _ALIGN) * _ALIGN if aligned else start
                if offset + size <= start + length:
                    pieces = [[start, offset - start], [offset + size, start + length - offset - size]]
                    self._free[index : index + 1] = [p for p in pieces if p[1] > 0]
                    return offset
        return None

    def free(self, offset: int, size: int) -> None:
        index = bisect.bisect(self._free, offset, key=lambda entry: entry[0])
        self._free.insert(index, [offset, size])
        # Merge with the neighbours it touches.
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
            self._free[index][1] += self._free.pop(index + 1)[1]
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:
            self._free[index - 1][1] += self._free.pop(index)[1]
