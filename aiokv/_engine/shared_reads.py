"""A key that several loads of one batch read is read from the backend once, then copied.

Concurrent requests sharing a prefix (a system prompt, a document several users ask about) load the
same chunks into their own blocks. Reading a key once per request moves its bytes across the store's
transport each time (Mooncake's TCP get costs ~0.6 CPU s per GB on the reading side here), and
Mooncake's batch get cannot even take a key twice in one call (it fills only one of the regions and
answers success for both). So the first row of each key is read, and the other rows of the key ride
in the same call: once the get has returned, the thread copies the verified bytes into their blocks.

The copies are part of the call: every request they write into is counted in as transferring for the
whole call, so none is settled, cancelled or timed out while its blocks are being written.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._arrays import IntArray
from ..codes import Code
from .batch import KeyArray

_SOURCE_GONE = -2  # in ``copy_from``: the row's source was dropped from the call (its request went away)
Get = Callable[[Sequence[str], Any, Any], Any]


def first_readers(keys: KeyArray) -> tuple[IntArray, IntArray]:
    """Positions of the first row of each key (ascending), and for every row the position of its
    key's first row (itself for a first row)."""
    n = len(keys)
    everyone = np.arange(n, dtype=np.int64)
    if len(set(keys)) == n:  # the usual case: no key twice
        return everyone, everyone
    first: dict[str, int] = {}
    source = np.fromiter((first.setdefault(key, i) for i, key in enumerate(keys)), dtype=np.int64, count=n)
    return np.flatnonzero(source == everyone), source


def cut_sources(copy_from: IntArray, keep: IntArray) -> IntArray:
    """``copy_from`` of the rows ``keep`` (ascending positions), renumbered for the cut call; a row
    whose source is not kept gets :data:`_SOURCE_GONE`."""
    new_index = np.full(copy_from.size, _SOURCE_GONE, dtype=np.int64)
    new_index[keep] = np.arange(keep.size)
    kept = copy_from[keep]
    copied = kept >= 0
    return np.where(copied, new_index[np.where(copied, kept, 0)], kept)


def read_then_copy(
    get: Get, keys: KeyArray, addrs: IntArray, sizes: IntArray, copy_from: IntArray
) -> list[int]:
    """The rows with ``copy_from`` -1 read by ``get`` (one call), then every other row copied from the
    row it names; per row, what a get answers (bytes read, or a negative code). A copy whose source
    failed answers the source's code; one whose source left the call answers ``WRITER_CANCELLED``."""
    reads = np.flatnonzero(copy_from == -1)
    codes = np.full(copy_from.size, int(Code.WRITER_CANCELLED), dtype=np.int64)
    answer = get(keys[reads].tolist(), addrs[reads], sizes[reads])
    if len(answer) != reads.size:
        return list(answer)  # the caller's check refuses an answer of the wrong length
    codes[reads] = np.asarray(answer, dtype=np.int64)
    for row in np.flatnonzero(copy_from >= 0).tolist():
        source = int(copy_from[row])
        total = int(sizes[row].sum())
        if codes[source] != int(sizes[source].sum()) or codes[source] != total:
            codes[row] = codes[source] if codes[source] < 0 else int(Code.TRANSFER_FAILED)
            continue
        _copy_regions(addrs[source], sizes[source], addrs[row], sizes[row])
        codes[row] = total
    return codes.tolist()


def _copy_regions(src_addrs: IntArray, src_sizes: IntArray, dst_addrs: IntArray, dst_sizes: IntArray) -> None:
    """The bytes of the source regions, back to back, into the destination regions (the same total;
    the two may be split differently). ``ctypes.memmove`` releases the GIL while it copies."""
    sources = list(zip(src_addrs.tolist(), src_sizes.tolist(), strict=True))
    k, offset = 0, 0
    for dst, size in zip(dst_addrs.tolist(), dst_sizes.tolist(), strict=True):
        while size:
            src, length = sources[k]
            take = min(size, length - offset)
            ctypes.memmove(dst, src + offset, take)
            dst, size, offset = dst + take, size - take, offset + take
            if offset == length:
                k, offset = k + 1, 0
