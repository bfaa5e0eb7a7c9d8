"""MemoryBackend's temporary memory stays within about twice the bytes of one call, whatever the
regions' alignment or block length, and the bytes moved are exact.

Peak memory is measured with ``tracemalloc``, which NumPy reports its buffers to; the store's own heap
is allocated (by a first small put) before measuring, so only a call's temporaries count. The bound is
on bytes: per-region bookkeeping (a few int64 arrays over the regions) is on top, and dominates only for
regions of a few dozen bytes, far below a KV block.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from aiokv import MemoryBackend

MiB = 1 << 20
CALL_BYTES = 64 * MiB
KEYS = 64
PEAK_FACTOR = 2.0  # the bound: extra peak memory <= 2x the bytes of the call


def _stride(block_len: int) -> int:
    """Regions start a page multiple apart (small ones 8 bytes past their end): gaps never copied."""
    return -(-block_len // 4096) * 4096 if block_len >= 4096 else -(-block_len // 8) * 8 + 8


def _regions(base: int, misalign: int, block_len: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` regions of ``block_len`` bytes, ``misalign`` bytes past ``base``, as (KEYS, count //
    KEYS) arrays."""
    stride = _stride(block_len)
    addrs = base + misalign + stride * np.arange(count, dtype=np.int64)
    sizes = np.full(count, block_len, dtype=np.int64)
    return addrs.reshape(KEYS, -1), sizes.reshape(KEYS, -1)


@pytest.mark.parametrize(
    ("block_len", "misalign"),
    [(32767, 0), (32767, 2), (32768, 2), (32768, 0), (4096, 0), (1000, 2), (1001, 3)],
    ids=["odd-len", "odd-len-misaligned", "misaligned", "aligned", "page", "1000-misaligned", "1001-odd"],
)
def test_memory_backend_temporaries_stay_within_twice_the_bytes_of_a_call(
    block_len: int, misalign: int
) -> None:
    """A 64 MiB MemoryBackend put or get moves the exact bytes with at most ~2x 64 MiB of temporaries."""
    count = CALL_BYTES // block_len // KEYS * KEYS
    moved = count * block_len
    span = _stride(block_len) * count + 8192
    source = np.random.default_rng(0).integers(0, 256, size=span, dtype=np.uint8)
    target = np.zeros(span, dtype=np.uint8)
    base_src, base_dst = int(source.ctypes.data), int(target.ctypes.data)
    backend = MemoryBackend(capacity_bytes=moved + 16 * MiB)
    backend.register_buffer(base_src, source.nbytes)
    backend.register_buffer(base_dst, target.nbytes)
    assert backend.batch_put(["warm"], [[base_src]], [[1]]) == [0]  # the heap exists from here on
    put_addrs, sizes = _regions(base_src, misalign, block_len, count)
    get_addrs, _ = _regions(base_dst, misalign, block_len, count)
    keys = [f"k{i}" for i in range(KEYS)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert backend.batch_put(keys, put_addrs, sizes) == [0] * KEYS
        put_peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        per_key = sizes.sum(axis=1).tolist()
        assert backend.batch_get(keys, get_addrs, sizes) == per_key
        get_peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    starts = (put_addrs - base_src).ravel()
    edges = np.zeros(span + 1, dtype=np.int8)
    edges[starts] += 1
    edges[starts + block_len] -= 1
    inside = np.cumsum(edges[:-1], dtype=np.int8).astype(bool)
    assert np.array_equal(target[inside], source[inside]), "the bytes read back differ from those put"
    assert not target[~inside].any(), "a get wrote outside its regions"
    limit = PEAK_FACTOR * moved
    assert put_peak <= limit, f"put: +{put_peak / MiB:.0f} MiB of temporaries for {moved / MiB:.0f} MiB"
    assert get_peak <= limit, f"get: +{get_peak / MiB:.0f} MiB of temporaries for {moved / MiB:.0f} MiB"
