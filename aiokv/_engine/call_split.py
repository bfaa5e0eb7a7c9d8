"""Call splitting. One group's rows (chunks to move, of many requests) become
backend calls of at most ``max_regions_per_call`` regions each (:func:`~aiokv.backends.base.keys_per_call`),
so that no call holds the GIL for long while the binding converts its arguments, and a large move is
spread over every transfer thread. A load of :data:`LOAD_ALONE_BYTES` or more gets calls of its own,
themselves spread over the threads (:func:`load_segments`). A call also carries the rows of at most
:data:`REQUESTS_PER_CALL` requests: its go-ahead and its return visit each of them on the loop, in
one piece (:func:`.transfer.admit`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .._arrays import BoolArray, IntArray
from ..backends.base import keys_per_call
from ..layout import RegionBatch
from ..stats import Op
from .batch import KeyArray, consecutive, rows_of
from .plan import Rows
from .shared_reads import first_readers
from .slices import LoopSlice, pieces

# ~2 us per request on the loop as a call starts, and again as it returns: ~1 ms at most, where 4,096
# one-chunk requests in one call held the loop ~10 ms.
REQUESTS_PER_CALL = 512
# A load of at least this many bytes in a group gets calls of its own: it settles when its own bytes
# are in (:mod:`.early_loads`), not with the other loads a shared call carries. Below it, loads share
# calls: a call's fixed cost (~0.5 ms on Mooncake) stays under a few percent of its transfer.
LOAD_ALONE_BYTES = 8 << 20


@dataclass(slots=True)
class GroupRows:
    """A group's rows back to back: row ``r`` belongs to ``plan[plan_of_row[r]]``."""

    plan: list[Rows]
    offsets: IntArray  # rows of plan[j] are offsets[j]:offsets[j + 1]
    plan_of_row: IntArray
    is_put: BoolArray  # per row
    keys: KeyArray  # per row
    blocks: IntArray  # per row: its block ids, for ``KVLayout.regions_for_chunks``

    @classmethod
    async def of(cls, plan: list[Rows], group: int) -> GroupRows:
        """Built in slices: a plan can hold 10,000 entries, or one entry of 62,500 rows."""
        clock = LoopSlice()
        lengths = np.empty(len(plan), dtype=np.int64)
        puts = np.empty(len(plan), dtype=bool)
        keys: list[KeyArray] = []
        blocks: list[IntArray] = []
        for j, rows in enumerate(plan):
            lengths[j] = rows.chunks.size
            puts[j] = rows.op is Op.PUT
            request_keys, chunks = rows.request.keys[group], rows.chunks
            if consecutive(chunks):
                keys.append(rows_of(request_keys, chunks))  # the usual case: a view, in one piece
            else:
                for part in pieces(chunks.size):
                    keys.append(rows_of(request_keys, chunks[part]))
                    await clock.tick()
            blocks.append(rows.request.blocks[group][rows.chunks])
            await clock.tick()
        offsets = np.zeros(len(plan) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        plan_of_row = np.repeat(np.arange(len(plan)), lengths)
        return cls(plan, offsets, plan_of_row, puts[plan_of_row], await _joined(keys), np.concatenate(blocks))

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


@dataclass(slots=True)
class Call:
    """One backend batch call: its op, the rows it carries, their keys and regions. ``copy_from``
    (gets): per row, -1 for a row the backend reads, else the index of the row of the same key whose
    bytes are copied into it once the get has returned (:mod:`.shared_reads`)."""

    op: Op
    rows: IntArray
    keys: KeyArray
    addrs: IntArray
    sizes: IntArray
    copy_from: IntArray | None = None


async def _joined(parts: list[KeyArray]) -> KeyArray:
    """``parts`` as one array, joined 1,024 parts at a time (10,000 one-key parts at once: ~1 ms)."""
    clock = LoopSlice()
    while len(parts) > 1:
        joined = []
        for start in range(0, len(parts), 1024):
            joined.append(np.concatenate(parts[start : start + 1024]))
            await clock.tick()
        parts = joined
    return parts[0]


def _calls(
    op: Op,
    group_rows: GroupRows,
    rows: IntArray,
    addrs: IntArray,
    sizes: IntArray,
    max_regions_per_call: int,
    threads: int,
) -> list[Call]:
    plan_of_row = group_rows.plan_of_row[rows]
    row_bytes = sizes.sum(axis=1)
    segments = load_segments(plan_of_row, row_bytes) if op is Op.GET else [slice(0, rows.size)]
    calls = []
    for segment in segments:
        # Each segment (a large load alone, or the small loads between two) is spread over the
        # threads by itself: a large load's calls run side by side, and it lands sooner.
        per_call = keys_per_call(
            max_regions_per_call,
            addrs.shape[1],
            keys=segment.stop - segment.start,
            total_bytes=int(row_bytes[segment].sum()),
            threads=threads,
        )
        for piece in call_pieces(plan_of_row[segment], per_call):
            part = slice(segment.start + piece.start, segment.start + piece.stop)
            rows_part = rows[part]
            calls.append(Call(op, rows_part, rows_of(group_rows.keys, rows_part), addrs[part], sizes[part]))
    return calls


def load_segments(plan_of_row: IntArray, row_bytes: IntArray) -> list[slice]:
    """Consecutive segments of a group's load rows (``plan_of_row``: each row's plan entry, so its
    request): each run of at least :data:`LOAD_ALONE_BYTES` alone, the runs between two such in one."""
    count = plan_of_row.size
    run_starts = np.flatnonzero(np.diff(plan_of_row, prepend=-1) != 0)
    if run_starts.size <= 1:
        return [slice(0, count)]
    bounds = np.append(run_starts, count)
    alone = np.add.reduceat(row_bytes, run_starts) >= LOAD_ALONE_BYTES
    if not alone.any():
        return [slice(0, count)]
    cuts = np.unique(np.concatenate([[0, count], bounds[:-1][alone], bounds[1:][alone]])).tolist()
    return [slice(first, end) for first, end in itertools.pairwise(cuts)]


def call_pieces(plan_of_row: IntArray, per_call: int, max_requests: int = REQUESTS_PER_CALL) -> list[slice]:
    """Consecutive pieces of the rows (``plan_of_row``: each row's plan entry, so its request), as
    long as allowed: at most ``per_call`` rows, and rows of at most ``max_requests`` runs of one
    entry's rows (so of at most that many requests)."""
    count = plan_of_row.size
    run_starts = np.flatnonzero(np.diff(plan_of_row, prepend=-1) != 0)
    if count <= per_call and run_starts.size <= max_requests:
        return [slice(0, count)]
    parts = []
    start = 0
    while start < count:
        # The run holding `start` is the first of the piece; the piece ends before the run
        # `max_requests` runs later, if there is one.
        run = int(np.searchsorted(run_starts, start, side="right")) - 1
        next_run = run + max_requests
        end = min(start + per_call, int(run_starts[next_run]) if next_run < run_starts.size else count)
        parts.append(slice(start, end))
        start = end
    return parts


def split_calls(
    group_rows: GroupRows,
    region_batches: list[RegionBatch],
    live_row: BoolArray,
    max_regions_per_call: int,
    threads: int,
) -> list[Call]:
    """The calls moving every live row, puts and gets apart, each within ``max_regions_per_call``,
    large moves spread over the ``threads`` transfer threads (:func:`keys_per_call`)."""
    calls: list[Call] = []
    for regions in region_batches:
        for op, wanted in ((Op.PUT, group_rows.is_put), (Op.GET, ~group_rows.is_put)):
            mask = wanted[regions.rows] & live_row[regions.rows]
            if not mask.any():
                continue
            if mask.all():  # the usual case: no copy of the region arrays on the loop
                rows, addrs, sizes = regions.rows, regions.addrs, regions.sizes
            else:
                rows, addrs, sizes = regions.rows[mask], regions.addrs[mask], regions.sizes[mask]
            if op is Op.PUT:  # puts never repeat a key: claims give each key one writer
                calls += _calls(op, group_rows, rows, addrs, sizes, max_regions_per_call, threads)
            else:
                calls += _get_calls(group_rows, rows, addrs, sizes, max_regions_per_call, threads)
    return calls


def _get_calls(
    group_rows: GroupRows,
    rows: IntArray,
    addrs: IntArray,
    sizes: IntArray,
    max_regions_per_call: int,
    threads: int,
) -> list[Call]:
    """Gets: the first row of each key read, the key's other rows (other requests loading the same
    chunk) copied from it in the same call (:mod:`.shared_reads`)."""
    keys = rows_of(group_rows.keys, rows)
    first, source = first_readers(keys)
    if first.size == rows.size:
        return _calls(Op.GET, group_rows, rows, addrs, sizes, max_regions_per_call, threads)
    readers = _calls(
        Op.GET, group_rows, rows[first], addrs[first], sizes[first], max_regions_per_call, threads
    )
    copies = np.flatnonzero(source != np.arange(rows.size))
    # The call reading each first row, and the row's index in it.
    call_of_first = np.empty(first.size, dtype=np.int64)
    index_in_call = np.empty(first.size, dtype=np.int64)
    start = 0
    for c, call in enumerate(readers):
        call_of_first[start : start + call.rows.size] = c
        index_in_call[start : start + call.rows.size] = np.arange(call.rows.size)
        start += call.rows.size
    source_rank = np.searchsorted(first, source[copies])
    calls = []
    for c, call in enumerate(readers):
        mine = copies[call_of_first[source_rank] == c]
        if not mine.size:
            calls.append(call)
            continue
        copy_from = np.concatenate(
            [np.full(call.rows.size, -1, dtype=np.int64), index_in_call[np.searchsorted(first, source[mine])]]
        )
        calls.append(
            Call(
                Op.GET,
                np.concatenate([call.rows, rows[mine]]),
                np.concatenate([call.keys, keys[mine]]),
                np.concatenate([call.addrs, addrs[mine]]),
                np.concatenate([call.sizes, sizes[mine]]),
                copy_from,
            )
        )
    return calls
