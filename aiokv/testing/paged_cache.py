"""A toy paged KV cache in NumPy, as an engine holds one: per group, regions of fixed-size blocks.

:class:`GroupCache` is one KV-cache group (``R`` regions, each a ``(num_blocks, block_len)`` uint8
array, with the matching :class:`~aiokv.KVLayout`); :class:`PagedCache` several groups (e.g. full
attention and sliding window). :func:`chunk_value` gives the bytes a store holds for one chunk and
:func:`same_blocks` compares blocks of two caches, so a test, the demo or a benchmark can check every
byte a worker moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layout import KVLayout

__all__ = ["SENTINEL", "GroupCache", "PagedCache", "chunk_block_ids", "chunk_value", "same_blocks"]

SENTINEL = 0xA5
"""The byte a destination cache is filled with, so blocks nothing wrote can be told apart."""


@dataclass
class GroupCache:
    """One KV-cache group: ``regions[i]`` is a ``(num_blocks, block_lens[i])`` uint8 array."""

    regions: list[np.ndarray]
    layout: KVLayout

    @classmethod
    def allocate(
        cls,
        *,
        num_regions: int,
        num_blocks: int,
        block_size: int,
        block_lens: int | Sequence[int],
        fill: str | int = "random",
        seed: int = 0,
        dtype: str = "bytes",
    ) -> GroupCache:
        """``block_lens``: one length, or several cycled over the regions (as :class:`KVLayout` does).
        ``fill``: ``"random"`` bytes (from ``seed``) or one byte value for every byte (0 allocates
        lazily: pages are touched only when written). ``dtype`` is the layout's element type label."""
        lens = [block_lens] if isinstance(block_lens, int) else list(block_lens)
        rng = np.random.default_rng(seed)
        regions = []
        for i in range(num_regions):
            shape = (num_blocks, lens[i % len(lens)])
            if fill == "random":
                regions.append(rng.integers(0, 256, size=shape, dtype=np.uint8))
            elif int(fill) == 0:
                regions.append(np.zeros(shape, dtype=np.uint8))
            else:
                regions.append(np.full(shape, int(fill), dtype=np.uint8))
        layout = KVLayout([r.ctypes.data for r in regions], lens, block_size, num_blocks, dtype=dtype)
        return cls(regions, layout)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(region.nbytes for region in self.regions)

    def blocks(self, block_ids: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Copies of the given blocks, one array per region."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return [region[ids].copy() for region in self.regions]

    def fill(self, value: int, block_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Set every byte (of the given blocks only, when ``block_ids`` is given) to ``value``."""
        for region in self.regions:
            if block_ids is None:
                region[:] = value
            else:
                region[np.asarray(block_ids, dtype=np.int64)] = value

    def randomize(self, block_ids: Sequence[int] | np.ndarray, rng: np.random.Generator) -> None:
        """Fill the given blocks of every region with random bytes from ``rng``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for region in self.regions:
            region[ids] = rng.integers(0, 256, size=(ids.size, region.shape[1]), dtype=np.uint8)

    def untouched(self, block_ids: Sequence[int] | np.ndarray, value: int = SENTINEL) -> bool:
        """True when every byte of the given blocks, in every region, still equals ``value``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return all(bool((region[ids] == value).all()) for region in self.regions)

    def written_blocks(self, value: int = SENTINEL) -> set[int]:
        """Block ids holding any byte other than ``value`` in some region."""
        written = np.zeros(self.num_blocks, dtype=bool)
        for region in self.regions:
            written |= (region != value).any(axis=1)
        return set(np.flatnonzero(written).tolist())


@dataclass
class PagedCache:
    """An engine's KV cache of several groups (e.g. full attention and sliding window)."""

    groups: list[GroupCache]

    @classmethod
    def allocate(
        cls,
        specs: Sequence[dict[str, Any]],
        *,
        fill: str | int = "random",
        seed: int = 0,
    ) -> PagedCache:
        """One group per spec: keyword arguments of :meth:`GroupCache.allocate` (``fill`` and ``seed``
        default to the ones given here; each group gets its own seed)."""
        groups = [
            GroupCache.allocate(**{"fill": fill, "seed": seed + 1000 * g, **spec})
            for g, spec in enumerate(specs)
        ]
        return cls(groups)

    @property
    def layouts(self) -> list[KVLayout]:
        return [g.layout for g in self.groups]

    def __getitem__(self, group: int) -> GroupCache:
        return self.groups[group]

    def __len__(self) -> int:
        return len(self.groups)

    def fill(self, value: int) -> None:
        for group in self.groups:
            group.fill(value)


def chunk_value(cache: GroupCache, chunk_block_ids: Sequence[int] | np.ndarray) -> bytes:
    """The value a store must hold for a chunk made of these blocks (in token order): region by region,
    the blocks' bytes concatenated."""
    ids = [int(b) for b in chunk_block_ids]
    return b"".join(region[b].tobytes() for region in cache.regions for b in ids)


def same_blocks(
    src: GroupCache,
    src_ids: Sequence[int] | np.ndarray,
    dst: GroupCache,
    dst_ids: Sequence[int] | np.ndarray,
) -> bool:
    """True when block ``dst_ids[i]`` of ``dst`` equals block ``src_ids[i]`` of ``src`` in every region."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source blocks against {d.size} destination blocks")
    return all(np.array_equal(a[s], b[d]) for a, b in zip(src.regions, dst.regions, strict=True))


def chunk_block_ids(block_ids: Sequence[int] | np.ndarray, chunk: int, per_chunk: int) -> list[int]:
    """The block ids of chunk ``chunk`` when each chunk spans ``per_chunk`` blocks."""
    return [int(b) for b in block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]]
