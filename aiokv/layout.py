"""Geometry of one KV-cache group and the vectorised address computation over it.

A group is ``R`` cache regions (typically layer x K/V), each ``num_blocks`` blocks of ``block_len``
bytes holding ``block_size`` tokens, ``block_stride`` bytes apart. The value of a chunk in the store
is, region by region, the bytes of the chunk's blocks in token order; :meth:`KVLayout.regions_for_chunks`
gives its (address, size) pairs for many chunks at once, merging pieces adjacent in memory
(:mod:`aiokv.coalesce`); token ranges are checked by :mod:`aiokv.chunk_ranges`.
:meth:`KVLayout.from_tensors` (:mod:`aiokv.tensors`) reads a layout from tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import IntArray, IntArrayLike, NonIntegerError, as_int64_array, as_positive_int
from .chunk_ranges import check_chunks
from .coalesce import RunPlan
from .errors import InvalidRequestError
from .tensors import describe_tensors

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
    per block; ``num_blocks``: blocks per region. ``block_strides``: bytes from one block of a region to
    the next, cycled like ``block_lens`` (default: the block lengths, blocks back to back); block ``b``
    of region ``i`` is the ``block_lens[i]`` bytes at ``base_addrs[i] + b * block_strides[i]``.
    ``dtype`` names the element type and enters the :attr:`fingerprint`, so caches of equal byte
    geometry but different dtypes never share keys; strides and addresses never do, so caches of equal
    geometry but different allocation share keys. ``device`` says where the memory lives: ``"cpu"``
    for host memory, else e.g. ``"cuda:0"`` (backends that cannot reach it refuse the layout).

    A chunk's value is, region by region, the bytes of its blocks in token order, whatever the strides.
    :meth:`from_tensors` builds a layout from an engine's tensors.
    """

    __slots__ = (
        "_base",
        "_block_lens",
        "_block_strides",
        "_region_block_lens",
        "_region_strides",
        "_plans",
        "_owners",
        "block_size",
        "num_blocks",
        "dtype",
        "device",
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
        block_strides: IntArrayLike | None = None,
        device: str = "cpu",
    ) -> None:
        base = as_int64_array(base_addrs, "base_addrs", ndim=1)
        lens = as_int64_array(block_lens, "block_lens", ndim=1)
        self.block_size = as_positive_int(block_size, "block_size")
        self.num_blocks = as_positive_int(num_blocks, "num_blocks")
        if base.size == 0:
            raise InvalidRequestError("base_addrs must name at least one cache region")
        region_lens = _cycled(lens, "block_lens", base.size)
        if (base <= 0).any():
            region = int(np.flatnonzero(base <= 0)[0])
            raise InvalidRequestError(f"base_addrs[{region}] must be a positive address")
        for name, value in (("dtype", dtype), ("device", device)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty str such as 'bfloat16' or 'cpu'")
        if block_strides is None:
            strides, region_strides = lens, region_lens
        else:
            strides = as_int64_array(block_strides, "block_strides", ndim=1)
            region_strides = _cycled(strides, "block_strides", base.size)
            short = region_strides < region_lens
            if short.any():
                region = int(np.flatnonzero(short)[0])
                raise InvalidRequestError(
                    f"region {region}: block stride {int(region_strides[region])} is shorter than its "
                    f"block length {int(region_lens[region])} (its blocks would overlap)"
                )
        # Python ints: the end of the last block must not overflow int64 addresses.
        for region, (addr, blen, stride) in enumerate(
            zip(base.tolist(), region_lens.tolist(), region_strides.tolist(), strict=True)
        ):
            if addr + stride * (self.num_blocks - 1) + blen > _INT64_MAX:
                raise InvalidRequestError(
                    f"region {region} ends past the int64 address range "
                    f"(base_addrs[{region}] + block_strides * (num_blocks - 1) + block_lens)"
                )
        for array in (base, lens, strides, region_lens, region_strides):
            array.flags.writeable = False
        self._base = base
        self._block_lens = lens
        self._block_strides = strides
        self._region_block_lens = region_lens
        self._region_strides = region_strides
        self._plans: dict[int, RunPlan] = {}
        self._owners: tuple[object, ...] = ()
        self.dtype = dtype
        self.device = device
        self.fingerprint = _fingerprint(self.block_size, region_lens, dtype)

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[Any] | Mapping[str, Any], *, block_size: int, block_dim: int = 0
    ) -> KVLayout:
        """The layout of an engine's KV-cache tensors (``torch.Tensor`` or ``numpy.ndarray``).

        Every tensor holds ``num_blocks`` blocks along ``block_dim``; block ``b`` is the slice at ``b``
        there. The dims after ``block_dim`` must be C-contiguous, so a block is ``P`` contiguous
        pieces (``P``: the product of the dims before ``block_dim``), each piece one region: regions
        go tensor by tensor, piece by piece in row-major order. ``tensors`` may be a mapping (e.g.
        vLLM's layer name -> tensor), whose names then appear in errors. dtype and device come from
        the tensors. The layout keeps the tensors referenced so their memory outlives it.

        Raises ``TypeError``/``ValueError`` naming the tensor for anything it cannot describe exactly
        (non-contiguous trailing dims, negative strides, ``block_dim`` out of range, unequal block
        counts, empty tensors, mixed dtypes or devices, regions sharing bytes).
        """
        block_size = as_positive_int(block_size, "block_size")  # before any tensor is inspected
        regions = describe_tensors(tensors, block_dim=block_dim)
        layout = cls(
            regions.base_addrs,
            regions.block_lens,
            block_size,
            regions.num_blocks,
            dtype=regions.dtype,
            block_strides=regions.block_strides,
            device=regions.device,
        )
        layout._owners = regions.owners
        return layout

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
    def block_strides(self) -> IntArray:
        """The block strides as given (before cycling; the block lengths when none were given)."""
        return self._block_strides

    @property
    def region_block_lens(self) -> IntArray:
        """Bytes per block of each region (``block_lens`` cycled to ``num_regions``)."""
        return self._region_block_lens

    @property
    def region_block_strides(self) -> IntArray:
        """Bytes between consecutive blocks of each region (``block_strides`` cycled)."""
        return self._region_strides

    @property
    def chunk_bytes_per_block(self) -> int:
        """Bytes one block contributes to a chunk's value, over all regions."""
        return int(self._region_block_lens.sum())

    def region_spans(self) -> list[tuple[int, int]]:
        """``(address, byte length)`` of every region, first block's start to last block's end, for
        registration with a backend (a strided region's span includes the gaps between its blocks)."""
        last = self.num_blocks - 1
        return [
            (addr, stride * last + blen)
            for addr, blen, stride in zip(
                self._base.tolist(),
                self._region_block_lens.tolist(),
                self._region_strides.tolist(),
                strict=True,
            )
        ]

    def pairs_per_chunk(self, blocks_per_chunk: int, *, consecutive: bool = True) -> int:
        """(address, size) pairs :meth:`regions_for_chunks` gives one chunk of ``blocks_per_chunk``
        blocks: physically consecutive ones (``consecutive``), or scattered ones (one per block per
        region when there are several blocks)."""
        per_chunk = as_positive_int(blocks_per_chunk, "blocks_per_chunk")
        if consecutive or per_chunk == 1:
            return int(self._run_plan(per_chunk).sizes.size)
        return self.num_regions * per_chunk

    def __repr__(self) -> str:
        extra = ""
        if not np.array_equal(self._region_strides, self._region_block_lens):
            extra += f", block_strides={self._block_strides.tolist()}"
        if self.device != "cpu":
            extra += f", device={self.device!r}"
        return (
            f"KVLayout(num_regions={self.num_regions}, block_lens={self._block_lens.tolist()}, "
            f"block_size={self.block_size}, num_blocks={self.num_blocks}, dtype={self.dtype!r}{extra})"
        )

    def prepare_values(
        self, chunks: Sequence[tuple[int, int]] | IntArray, block_ids: IntArrayLike
    ) -> tuple[IntArray, IntArray, IntArray]:
        """Addresses and sizes of many token ranges at once, one (address, size) per region.

        ``chunks``: ``(start, end)`` token ranges (or an ``(n, 2)`` array); ``block_ids`` maps block
        index to physical block id. Chunk ``k`` starts at physical block
        ``bid = block_ids[start // block_size]`` and is assumed to cover the physically consecutive
        blocks ``[bid, bid + (end - start) // block_size)``. Returns int64 arrays ``addrs`` ``(n, R)``,
        ``sizes`` ``(n, R)`` and ``chunk_block_ids`` ``(n,)`` with
        ``addrs[k, i] = base[i] + bid * block_stride[i]`` and
        ``sizes[k, i] = block_len[i] * (end - start) // block_size``. ``sizes`` may be a read-only
        broadcast view when all chunks have one length; copy it before writing to it.

        In a strided region (stride > length) a chunk of several blocks is not one piece of memory,
        so such chunks are refused there; :meth:`regions_for_chunks` handles them.

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
        nblocks, first_bids = check_chunks(starts, spans_array[:, 1], ids, self.block_size, self.num_blocks)
        gapped = self._region_strides != self._region_block_lens
        if gapped.any() and (nblocks > 1).any():
            k = int(np.flatnonzero(nblocks > 1)[0])
            region = int(np.flatnonzero(gapped)[0])
            raise InvalidRequestError(
                f"chunk {k} ({int(starts[k])}, {int(spans_array[k, 1])}): its {int(nblocks[k])} blocks "
                f"are not contiguous in region {region} (block stride {int(self._region_strides[region])}"
                f" > block length {int(self._region_block_lens[region])}); use regions_for_chunks"
            )
        addrs = np.multiply.outer(first_bids, self._region_strides)
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
        """The (address, size) pairs of whole chunks, coalesced where memory allows.

        ``chunk_blocks`` is ``(n, nb)``: the physical block ids of each chunk, in token order. A chunk's
        value is region by region its blocks' bytes in token order; pieces of it adjacent in memory
        for every chunk of a kind are sent as one pair. Chunks whose blocks are consecutive get
        :meth:`pairs_per_chunk` pairs each: a region's blocks merge when its stride equals its length,
        and region ``k+1``'s first piece joins region ``k``'s last where it starts at its end (a
        block-major cache with consecutive blocks moves as one pair per chunk). The others get one
        pair per block per region. Returns at most two batches (consecutive, scattered), each with a
        uniform row width; raises ``InvalidRequestError`` for a block id outside the cache.
        """
        blocks = as_int64_array(chunk_blocks, "chunk_blocks", ndim=2)
        n = blocks.shape[0] if blocks.ndim == 2 else 0
        if n == 0:
            return []
        per_chunk = blocks.shape[1]
        outside = (blocks < 0) | (blocks >= self.num_blocks)
        if outside.any():
            row = int(np.flatnonzero(outside.any(axis=1))[0])
            raise InvalidRequestError(
                f"chunk {row}: physical blocks {blocks[row].tolist()} fall outside the cache's "
                f"{self.num_blocks} blocks"
            )
        if per_chunk > 1:
            fragmented = (blocks[:, 1:] != blocks[:, :-1] + 1).any(axis=1)
            whole_rows = np.flatnonzero(~fragmented)
            split_rows = np.flatnonzero(fragmented)
        else:
            whole_rows = np.arange(n, dtype=np.int64)
            split_rows = whole_rows[:0]
        batches = []
        if whole_rows.size:
            plan = self._run_plan(per_chunk)
            first = blocks[whole_rows, 0] if split_rows.size else blocks[:, 0]
            addrs = np.multiply.outer(first, plan.strides)
            addrs += plan.offsets
            sizes = np.broadcast_to(plan.sizes, addrs.shape)
            batches.append(RegionBatch(whole_rows, addrs, sizes))
        if split_rows.size:
            # Region-major: each region's blocks in token order, one pair per block.
            scattered = blocks[split_rows]
            addrs = scattered[:, None, :] * self._region_strides[None, :, None]
            addrs += self._base[None, :, None]
            width = self.num_regions * per_chunk
            sizes = np.broadcast_to(np.repeat(self._region_block_lens, per_chunk), (split_rows.size, width))
            batches.append(RegionBatch(split_rows, addrs.reshape(split_rows.size, width), sizes))
        return batches

    def _run_plan(self, per_chunk: int) -> RunPlan:
        plan = self._plans.get(per_chunk)
        if plan is None:
            plan = RunPlan.build(self._base, self._region_block_lens, self._region_strides, per_chunk)
            self._plans[per_chunk] = plan
        return plan


def _fingerprint(block_size: int, region_block_lens: IntArray, dtype: str) -> str:
    """Short digest of what decides a chunk's bytes: never addresses or the cache's size, so another
    process with the same geometry computes the same keys."""
    text = f"v1|{dtype}|{block_size}|{','.join(map(str, region_block_lens.tolist()))}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cycled(values: IntArray, name: str, regions: int) -> IntArray:
    """``values`` (checked positive) repeated over ``regions`` regions."""
    if values.size == 0:
        raise InvalidRequestError(f"{name} must hold at least one value")
    if values.size > regions:
        raise InvalidRequestError(f"{name} has {values.size} entries but there are only {regions} regions")
    if (values <= 0).any():
        index = int(np.flatnonzero(values <= 0)[0])
        raise InvalidRequestError(f"{name}[{index}] must be positive")
    return np.resize(values, regions)
