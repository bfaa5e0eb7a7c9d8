"""Geometry of one KV-cache group and the vectorised address computation over it.

A group is ``R`` cache regions (typically layer x K/V), each an array of ``num_blocks`` blocks of
``block_len`` bytes holding ``block_size`` tokens. The value of a chunk in the store is, region by
region, the bytes of the chunk's blocks in token order; :meth:`KVLayout.prepare_values` gives the
(address, size) of each region's part for many chunks at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from ._arrays import IntArray, IntArrayLike, NonIntegerError, as_int64_array, as_positive_int
from .errors import InvalidRequestError

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True, slots=True)
class RegionBatch:
    """Regions of some chunks of a group: row ``k`` of ``addrs``/``sizes`` belongs to chunk
    ``rows[k]`` of the caller's list; its value is those regions concatenated in order."""

    rows: IntArray
    addrs: IntArray
    sizes: IntArray


class KVLayout:
    """One KV-cache group of an engine.

    ``base_addrs``: one base address per cache region; ``block_lens``: bytes per block, cycled over the
    regions when shorter (region ``i`` uses ``block_lens[i % len(block_lens)]``); ``block_size``: tokens
    per block; ``num_blocks``: blocks per region. ``dtype`` names the element type and enters the
    :attr:`fingerprint`, so caches of equal byte geometry but different dtypes never share keys.
    """

    __slots__ = (
        "_base",
        "_block_lens",
        "_region_block_lens",
        "block_size",
        "num_blocks",
        "dtype",
        "fingerprint",
    )

    def __init__(
        self,
        base_addrs: IntArrayLike,
        block_lens: IntArrayLike,
        block_size: int,
        num_blocks: int,
        *,
        dtype: str = "bytes",
    ) -> None:
        base = as_int64_array(base_addrs, "base_addrs", ndim=1)
        lens = as_int64_array(block_lens, "block_lens", ndim=1)
        self.block_size = as_positive_int(block_size, "block_size")
        self.num_blocks = as_positive_int(num_blocks, "num_blocks")
        if base.size == 0:
            raise InvalidRequestError("base_addrs must name at least one cache region")
        if lens.size == 0:
            raise InvalidRequestError("block_lens must hold at least one block length")
        if lens.size > base.size:
            raise InvalidRequestError(
                f"block_lens has {lens.size} entries but there are only {base.size} regions"
            )
        if (base <= 0).any():
            region = int(np.flatnonzero(base <= 0)[0])
            raise InvalidRequestError(f"base_addrs[{region}] must be a positive address")
        if (lens <= 0).any():
            index = int(np.flatnonzero(lens <= 0)[0])
            raise InvalidRequestError(f"block_lens[{index}] must be positive")
        if not isinstance(dtype, str) or not dtype:
            raise TypeError("dtype must be a non-empty str such as 'bfloat16'")
        region_lens = np.resize(lens, base.size)
        # Python ints: the end of the last region must not overflow int64 addresses.
        for region, (addr, blen) in enumerate(zip(base.tolist(), region_lens.tolist(), strict=True)):
            if addr + blen * self.num_blocks > _INT64_MAX:
                raise InvalidRequestError(
                    f"region {region} ends past the int64 address range "
                    f"(base_addrs[{region}] + block_lens * num_blocks)"
                )
        base.flags.writeable = False
        lens.flags.writeable = False
        region_lens.flags.writeable = False
        self._base = base
        self._block_lens = lens
        self._region_block_lens = region_lens
        self.dtype = dtype
        self.fingerprint = _fingerprint(self.block_size, region_lens, dtype)

    @property
    def num_regions(self) -> int:
        return int(self._base.size)

    @property
    def base_addrs(self) -> IntArray:
        return self._base

    @property
    def block_lens(self) -> IntArray:
        """The block lengths as given (before cycling)."""
        return self._block_lens

    @property
    def region_block_lens(self) -> IntArray:
        """Bytes per block of each region (``block_lens`` cycled to ``num_regions``)."""
        return self._region_block_lens

    @property
    def chunk_bytes_per_block(self) -> int:
        """Bytes one block contributes to a chunk's value, over all regions."""
        return int(self._region_block_lens.sum())

    def region_spans(self) -> list[tuple[int, int]]:
        """``(address, byte length)`` of every region, for registration with a backend."""
        return [
            (addr, blen * self.num_blocks)
            for addr, blen in zip(self._base.tolist(), self._region_block_lens.tolist(), strict=True)
        ]

    def __repr__(self) -> str:
        return (
            f"KVLayout(num_regions={self.num_regions}, block_lens={self._block_lens.tolist()}, "
            f"block_size={self.block_size}, num_blocks={self.num_blocks}, dtype={self.dtype!r})"
        )

    def prepare_values(
        self, chunks: Sequence[tuple[int, int]] | IntArray, block_ids: IntArrayLike
    ) -> tuple[IntArray, IntArray, IntArray]:
        """Addresses and sizes of many token ranges at once.

        ``chunks``: ``(start, end)`` token ranges (or an ``(n, 2)`` array); ``block_ids`` maps block
        index to physical block id. Chunk ``k`` starts at physical block
        ``bid = block_ids[start // block_size]`` and is assumed to cover the physically consecutive
        blocks ``[bid, bid + (end - start) // block_size)``. Returns int64 arrays ``addrs`` ``(n, R)``,
        ``sizes`` ``(n, R)`` and ``chunk_block_ids`` ``(n,)`` with
        ``addrs[k, i] = base[i] + bid * block_len[i]`` and
        ``sizes[k, i] = block_len[i] * (end - start) // block_size``. ``sizes`` may be a read-only
        broadcast view when all chunks have one length; copy it before writing to it.

        Raises ``InvalidRequestError`` (a ``ValueError``) naming the first bad chunk before anything is
        computed, and never yields an address outside the cache.
        """
        spans_array = as_int64_array(chunks, "chunks")
        if spans_array.size == 0:
            empty = np.empty((0, self.num_regions), dtype=np.int64)
            return empty, empty.copy(), np.empty(0, dtype=np.int64)
        if spans_array.ndim != 2 or spans_array.shape[1] != 2:
            raise InvalidRequestError(
                f"chunks must be (start, end) pairs, got an array of shape {spans_array.shape}"
            )
        ids = as_int64_array(block_ids, "block_ids", ndim=1)
        starts = spans_array[:, 0]
        nblocks, first_bids = self._check_chunks(starts, spans_array[:, 1], ids)
        addrs = np.multiply.outer(first_bids, self._region_block_lens)
        addrs += self._base
        if (nblocks == nblocks[0]).all():
            # The usual case (equal chunks): a read-only broadcast row instead of a second (n, R)
            # allocation, which costs more than the arithmetic.
            row = self._region_block_lens * nblocks[0]
            sizes = np.broadcast_to(row, addrs.shape)
        else:
            sizes = np.multiply.outer(nblocks, self._region_block_lens)
        return addrs, sizes, first_bids

    def prepare_value(
        self, start: int, end: int, block_ids: IntArrayLike
    ) -> tuple[list[int], list[int], int]:
        """Single-chunk form of :meth:`prepare_values`, returning plain Python ints."""
        # Checked here: ``np.array(..., dtype=int64)`` would silently truncate floats and parse strings.
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise NonIntegerError(
                    f"chunk 0 ({start!r}, {end!r}): {name} must be an int, not {type(value).__name__}"
                )
        # A list, not an int64 array: values past int64 then fail validation instead of overflowing.
        addrs, sizes, bids = self.prepare_values([(int(start), int(end))], block_ids)
        return addrs[0].tolist(), sizes[0].tolist(), int(bids[0])

    def regions_for_chunks(self, chunk_blocks: IntArray) -> list[RegionBatch]:
        """Regions of whole chunks whose blocks need not be physically consecutive.

        ``chunk_blocks`` is ``(n, nb)``: the physical block ids of each chunk, in token order. Chunks
        whose blocks are consecutive get one region per cache region (coalesced); the others get one
        region per block per cache region, in the same byte order, so a chunk's value is the same
        whatever its physical placement. Makes exactly one :meth:`prepare_values` call; returns at most
        two batches (coalesced, per-block), each with a uniform row width.
        """
        n, per_chunk = chunk_blocks.shape
        if n == 0:
            return []
        if per_chunk > 1:
            gaps = chunk_blocks[:, 1:] != chunk_blocks[:, :-1] + 1
            fragmented = gaps.any(axis=1)
        else:
            fragmented = np.zeros(n, dtype=bool)
        whole_rows = np.flatnonzero(~fragmented)
        split_rows = np.flatnonzero(fragmented)
        # Synthetic token ranges over a flat block-id table: [whole chunks' first blocks,
        # then every block of the fragmented chunks], so one prepare_values call serves both kinds.
        bs = self.block_size
        table = np.concatenate([chunk_blocks[whole_rows, 0], chunk_blocks[split_rows].ravel()])
        starts = np.arange(table.size, dtype=np.int64) * bs
        spans = np.full(table.size, bs, dtype=np.int64)
        spans[: whole_rows.size] = per_chunk * bs
        ranges = np.stack([starts, starts + spans], axis=1)
        addrs, sizes, _ = self.prepare_values(ranges, table)
        batches = []
        if whole_rows.size:
            batches.append(RegionBatch(whole_rows, addrs[: whole_rows.size], sizes[: whole_rows.size]))
        if split_rows.size:
            width = self.num_regions * per_chunk

            def region_major(values: IntArray) -> IntArray:
                # (chunk, block, region) -> (chunk, region, block): each region's blocks in token order.
                cube = values[whole_rows.size :].reshape(split_rows.size, per_chunk, self.num_regions)
                return np.ascontiguousarray(cube.transpose(0, 2, 1)).reshape(split_rows.size, width)

            batches.append(RegionBatch(split_rows, region_major(addrs), region_major(sizes)))
        return batches

    def _check_chunks(
        self, starts: IntArray, ends: IntArray, block_ids: IntArray
    ) -> tuple[IntArray, IntArray]:
        """Validate chunk ranges; return (blocks per chunk, first physical block id per chunk)."""
        bs = self.block_size
        spans = ends - starts
        # ``ends <= starts``, not ``spans <= 0``: for a negative end the difference can wrap around.
        bad = (starts < 0) | (ends <= starts) | (spans % bs != 0) | (starts % bs != 0)
        first_index = starts // bs
        bad |= first_index >= block_ids.size
        if bad.any():
            self._raise_first_bad(starts, ends, block_ids)
        nblocks = spans // bs
        first_bids = block_ids[first_index]
        outside = (first_bids < 0) | (first_bids > self.num_blocks - nblocks)
        if outside.any():
            self._raise_first_bad(starts, ends, block_ids)
        return nblocks, first_bids

    def _raise_first_bad(self, starts: IntArray, ends: IntArray, block_ids: IntArray) -> NoReturn:
        """Raise for the first chunk failing any check, whichever check it fails (error path only, so
        a plain loop over Python ints: exact, no wraparound)."""
        bs, num_blocks, table_len = self.block_size, self.num_blocks, block_ids.size
        for k, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            span = end - start
            if start < 0:
                problem = "start is negative"
            elif span <= 0 or span % bs:
                problem = f"span {span} is not a positive multiple of block_size {bs}"
            elif start % bs:
                problem = f"start is not aligned to block_size {bs}"
            elif start // bs >= table_len:
                problem = f"block index {start // bs} is past the end of block_ids (length {table_len})"
            else:
                bid = int(block_ids[start // bs])
                if bid >= 0 and bid + span // bs <= num_blocks:
                    continue
                problem = (
                    f"physical blocks [{bid}, {bid + span // bs}) fall outside the cache's "
                    f"{num_blocks} blocks"
                )
            raise InvalidRequestError(f"chunk {k} ({start}, {end}): {problem}")
        # Not reached: the vectorised checks above only call here when some chunk is bad.
        raise InvalidRequestError("chunks failed validation")


def _fingerprint(block_size: int, region_block_lens: IntArray, dtype: str) -> str:
    """Short digest of what decides a chunk's bytes: never addresses or the cache's size, so another
    process with the same geometry computes the same keys."""
    text = f"v1|{dtype}|{block_size}|{','.join(map(str, region_block_lens.tolist()))}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]
