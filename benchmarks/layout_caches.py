"""The layouts benchmark's scenario and caches: one paged KV cache allocated three ways.

* ``layer_major``: one array per region (layer x K/V), ``(num_blocks, block_bytes)`` each;
* ``block_major``: one ``(num_blocks, regions, block_bytes)`` array seen as per-region views (the
  layer-major fingerprint, so the same keys and value bytes), whose regions coalesce into one pair per
  one-block chunk;
* ``cross_layer``: the same array as one region (vLLM's cross-layer cache): one pair per chunk of any
  length, under a fingerprint of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aiokv._arrays import IntArray
from aiokv.layout import KVLayout

from .geometry import PromptSizes

KINDS = ("layer_major", "block_major", "cross_layer")
CHUNK_TOKEN_CHOICES = (128, 256, 512, 1024, 2048, 4096)
VOCAB = 128_000


@dataclass(frozen=True, slots=True)
class Scenario(PromptSizes):
    tokens: int = 289 * 1024
    block_size: int = 128
    regions: int = 96
    block_bytes: int = 256
    chunk_tokens: int = 128
    concurrency: int = 4
    rounds: int = 3


class LayoutCache:
    """One paged cache of ``num_blocks`` blocks allocated ``kind``-wise, with its layout.

    ``block_sets`` holds ``sets`` disjoint prompt-sized block tables: chunks in random order (as after
    an allocator churned), each chunk's blocks physically consecutive. Set 0 holds random bytes.
    """

    def __init__(
        self, kind: str, *, regions: int, block_bytes: int, block_size: int, prompt_blocks: int,
        blocks_per_chunk: int, sets: int, seed: int = 0,
    ) -> None:  # fmt: skip
        num_blocks = sets * prompt_blocks
        rng = np.random.default_rng(seed)
        if kind == "layer_major":
            self.arrays: list[np.ndarray] = [
                np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)
            ]
            tensors = self.arrays
        elif kind in ("block_major", "cross_layer"):
            buffer = np.zeros((num_blocks, regions, block_bytes), dtype=np.uint8)
            self.arrays = [buffer]
            tensors = [buffer[:, i] for i in range(regions)] if kind == "block_major" else [buffer]
        else:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        for array in self.arrays:
            array[:prompt_blocks] = rng.integers(0, 256, size=array[:prompt_blocks].shape, dtype=np.uint8)
        self.layout = KVLayout.from_tensors(tensors, block_size=block_size)
        chunks = prompt_blocks // blocks_per_chunk

        def block_set(index: int) -> IntArray:
            first = index * prompt_blocks + rng.permutation(chunks).astype(np.int64) * blocks_per_chunk
            return (first[:, None] + np.arange(blocks_per_chunk, dtype=np.int64)).ravel()

        self.block_sets = [block_set(i) for i in range(sets)]

    def same_blocks(self, ids_a: IntArray, ids_b: IntArray) -> bool:
        return all(np.array_equal(a[ids_a], a[ids_b]) for a in self.arrays)

    def clear(self, ids: IntArray) -> None:
        for array in self.arrays:
            array[ids] = 0


def pairs_per_request(layout: KVLayout, matrix: IntArray) -> int:
    return sum(batch.addrs.size for batch in layout.regions_for_chunks(matrix))


def chunk_token_table(s: Scenario, choices: tuple[int, ...] = CHUNK_TOKEN_CHOICES) -> list[dict[str, Any]]:
    """Keys, pairs and bytes per pair of one request per ``chunk_tokens`` (computed, not timed), from
    the layouts' own :meth:`KVLayout.pairs_per_chunk` on addresses only."""
    rows = []
    for chunk_tokens in choices:
        if chunk_tokens % s.block_size:
            continue
        blocks = chunk_tokens // s.block_size
        keys = s.tokens // chunk_tokens
        row: dict[str, Any] = {
            "chunk_tokens": chunk_tokens,
            "keys": keys,
            "lost_tokens_max": chunk_tokens - 1,
        }
        for kind in KINDS:
            layout = address_only_layout(kind, s)
            pairs = layout.pairs_per_chunk(blocks)
            row[kind] = {
                "pairs_per_key": pairs,
                "pairs": pairs * keys,
                "pair_bytes": blocks * s.regions * s.block_bytes // pairs,
            }
        rows.append(row)
    return rows


def address_only_layout(kind: str, s: Scenario) -> KVLayout:
    """The two layouts' geometry at made-up addresses (nothing is allocated)."""
    n, r, b = s.prompt_blocks, s.regions, s.block_bytes
    if kind == "layer_major":
        return KVLayout([(1 << 32) + i * n * b for i in range(r)], [b], s.block_size, n)
    if kind == "cross_layer":
        return KVLayout([1 << 32], [r * b], s.block_size, n)
    return KVLayout([(1 << 32) + i * b for i in range(r)], [b], s.block_size, n, block_strides=[r * b])
