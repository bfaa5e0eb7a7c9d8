"""The reference implementations of ``KVLayout.prepare_values``: the oracle the tests compare against
and the baselines the benchmark measures it against (one home for both).

Both keep the semantics of the original per-chunk code exactly and are kept deliberately unoptimised:

* :func:`reference_prepare_value` is the original scalar code, one Python loop iteration per cache
  region per chunk. It is the definition of the right answer.
* :func:`writeup_prepare_values` is the vectorised baseline: ``np.fromiter`` over the chunks,
  broadcasting, then ``.tolist()`` back to nested Python lists.

They read the layout's geometry as Python lists, as the original code held it (converted once per
layout and cached), so that neither pays for NumPy scalar arithmetic the original never did. The
original's ``assert`` checks are kept as explicit ``ValueError`` so they survive ``python -O``; no
other validation is added, because these are yardsticks, not library entry points.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from aiokv.layout import KVLayout


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def _geometry(layout: KVLayout) -> tuple[list[int], list[int]]:
    """``(base addresses, block lengths)`` as the Python lists the original code kept, converted once
    per layout so the scalar loop is not charged for a conversion the original never did."""
    return layout.base_addrs.tolist(), layout.block_lens.tolist()


def reference_prepare_value(
    layout: KVLayout, start: int, end: int, block_ids: Sequence[int]
) -> tuple[list[int], list[int], int]:
    """Addresses and sizes of one token range, region by region (the scalar reference)."""
    base_addrs, block_len = _geometry(layout)
    block_size = layout.block_size
    addr_list: list[int] = []
    size_list: list[int] = []
    block_id = block_ids[start // block_size]
    length = len(block_len)
    for index, base_addr in enumerate(base_addrs):
        addr = base_addr + block_id * block_len[index % length]
        if (end - start) % block_size != 0:
            raise ValueError(f"span {end - start} is not a multiple of block_size {block_size}")
        size = block_len[index % length] * _cdiv(end - start, block_size)
        addr_list.append(addr)
        size_list.append(size)
    return addr_list, size_list, block_id


def writeup_prepare_values(
    layout: KVLayout, chunks: Sequence[tuple[int, int]], block_ids: Sequence[int]
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Addresses and sizes of many token ranges (the vectorised baseline)."""
    if not chunks:
        return [], [], []
    kv_caches_base_addr, block_len = _geometry(layout)
    block_size = layout.block_size
    base = np.asarray(kv_caches_base_addr, dtype=np.int64)
    length = len(block_len)
    blen = np.asarray([block_len[i % length] for i in range(base.shape[0])], dtype=np.int64)
    n = len(chunks)
    starts = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
    spans = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n) - starts
    if (spans % block_size).any():
        raise ValueError(f"every span must be a multiple of block_size {block_size}")
    bids = np.fromiter(
        (block_ids[i] for i in (starts // block_size).tolist()),
        dtype=np.int64,
        count=n,
    )
    addrs = base[None, :] + bids[:, None] * blen[None, :]
    sizes = blen[None, :] * (spans // block_size)[:, None]
    return addrs.tolist(), sizes.tolist(), bids.tolist()
