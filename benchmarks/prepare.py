"""Benchmark of ``KVLayout.prepare_values`` against its two baselines, plus chunk hashing.

Everything is measured in one run on the same inputs: one long prompt split into equal chunks, each
chunk's blocks physically consecutive at a random place in the cache (so multi-block chunks are
valid), and the block table given to every implementation in the same form. Results are checked equal
once before anything is timed. Addresses are synthetic: nothing is dereferenced.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from aiokv.keys import chunk_hashes
from aiokv.layout import KVLayout

from .reference import reference_prepare_value, writeup_prepare_values

logger = logging.getLogger(__name__)

DEFAULT_TOKENS = 289 * 1024
# Bytes per block of one region: 8 KV heads x 128 dims x 2 bytes (bf16) x 128 tokens.
DEFAULT_BLOCK_LEN = 8 * 128 * 2 * 128
_VOCAB = 128_000
# The speed goals for prepare_values, judged like for like (list inputs) on best times.
GOAL_VS_SCALAR = 50.0
GOAL_VS_WRITEUP = 10.0


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-call wall time of one implementation, in milliseconds."""

    best_ms: float
    median_ms: float
    samples: int
    calls_per_sample: int


def _time(fn: Callable[[], object], repeats: int, min_sample_s: float) -> Timing:
    """Best and median per-call time over ``repeats`` samples.

    A sample repeats the call until it lasts ``min_sample_s`` (like ``timeit.autorange``), so that
    sub-millisecond calls are not dominated by timer resolution; GC is off while timing, as in timeit.
    """
    number = 1
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    if once < min_sample_s:
        number = max(1, int(min_sample_s / max(once, 1e-9)))
    per_call: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            per_call.append((time.perf_counter() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(
        best_ms=min(per_call) * 1e3,
        median_ms=statistics.median(per_call) * 1e3,
        samples=repeats,
        calls_per_sample=number,
    )


def build_inputs(
    tokens: int, block_size: int, regions: int, chunk_tokens: int, seed: int = 0
) -> tuple[KVLayout, list[tuple[int, int]], list[int]]:
    """A layout, the prompt's chunks and a block table mapping every block of the prompt.

    Chunks are ``chunk_tokens`` long; each occupies ``chunk_tokens // block_size`` physically
    consecutive blocks starting at a random, chunk-aligned slot of the cache.
    """
    if chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of block_size {block_size}")
    per_chunk = chunk_tokens // block_size
    num_chunks = tokens // chunk_tokens
    if num_chunks == 0:
        raise ValueError(f"{tokens} tokens hold no whole chunk of {chunk_tokens}")
    # Twice as many slots as chunks: the cache holds other requests' blocks too.
    slots = 2 * num_chunks
    num_blocks = slots * per_chunk
    region_bytes = DEFAULT_BLOCK_LEN * num_blocks
    base_addrs = [(1 << 40) + region * region_bytes for region in range(regions)]
    layout = KVLayout(base_addrs, [DEFAULT_BLOCK_LEN], block_size, num_blocks, dtype="bfloat16")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(slots, size=num_chunks, replace=False).astype(np.int64)
    block_table = (chosen[:, None] * per_chunk + np.arange(per_chunk, dtype=np.int64)).ravel()
    chunks = [(k * chunk_tokens, (k + 1) * chunk_tokens) for k in range(num_chunks)]
    return layout, chunks, block_table.tolist()


def _check_equal(
    layout: KVLayout,
    chunks: list[tuple[int, int]],
    block_ids: list[int],
    chunks_array: np.ndarray,
    block_ids_array: np.ndarray,
) -> None:
    """Every implementation gives the scalar reference's answer on the benchmark's inputs."""
    reference = [reference_prepare_value(layout, start, end, block_ids) for start, end in chunks]
    ref_addrs = [r[0] for r in reference]
    ref_sizes = [r[1] for r in reference]
    ref_bids = [r[2] for r in reference]
    if writeup_prepare_values(layout, chunks, block_ids) != (ref_addrs, ref_sizes, ref_bids):
        raise RuntimeError("the vectorised baseline's prepare_values disagrees with the scalar reference")
    for label, args in (("lists", (chunks, block_ids)), ("arrays", (chunks_array, block_ids_array))):
        addrs, sizes, bids = layout.prepare_values(*args)
        if (addrs.tolist(), sizes.tolist(), bids.tolist()) != (ref_addrs, ref_sizes, ref_bids):
            raise RuntimeError(f"KVLayout.prepare_values ({label}) disagrees with the scalar reference")


def _ratio(slow: Timing, fast: Timing) -> dict[str, float]:
    return {"best": slow.best_ms / fast.best_ms, "median": slow.median_ms / fast.median_ms}


def run_prepare_benchmark(
    tokens: int = DEFAULT_TOKENS,
    block_size: int = 128,
    regions: int = 96,
    chunk_tokens: int = 128,
    repeats: int = 15,
    *,
    min_sample_s: float = 0.02,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the scalar reference, the vectorised baseline and ``KVLayout.prepare_values`` on one
    prompt, and chunk hashing of its token ids.

    Returns ``config`` (the inputs and the machine), ``timings`` (name -> best/median ms per call),
    ``speedups`` (``prepare_values`` vs each baseline, from best and from median times), ``goals_met``
    (the 50x / 10x goals, on the like-for-like best times) and
    ``hashing`` (cost per prompt and per chunk). ``prepare_values`` is timed twice: on the very lists
    the baselines get (the like-for-like figure the speed goals are judged on) and on int64 arrays.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    layout, chunks, block_ids = build_inputs(tokens, block_size, regions, chunk_tokens, seed)
    chunks_array = np.asarray(chunks, dtype=np.int64)
    block_ids_array = np.asarray(block_ids, dtype=np.int64)
    _check_equal(layout, chunks, block_ids, chunks_array, block_ids_array)

    token_array = np.random.default_rng(seed + 1).integers(0, _VOCAB, size=tokens, dtype=np.int64)
    token_list = token_array.tolist()
    if chunk_hashes(token_array, chunk_tokens) != chunk_hashes(token_list, chunk_tokens):
        raise RuntimeError("chunk_hashes differs between an int64 array and a list of the same tokens")

    def scalar() -> object:
        return [reference_prepare_value(layout, start, end, block_ids) for start, end in chunks]

    cases: dict[str, Callable[[], object]] = {
        "scalar_reference": scalar,
        "writeup_vectorised": lambda: writeup_prepare_values(layout, chunks, block_ids),
        "prepare_values_lists": lambda: layout.prepare_values(chunks, block_ids),
        "prepare_values_arrays": lambda: layout.prepare_values(chunks_array, block_ids_array),
        "chunk_hashes_int64_array": lambda: chunk_hashes(token_array, chunk_tokens),
        "chunk_hashes_list": lambda: chunk_hashes(token_list, chunk_tokens),
    }
    timings: dict[str, Timing] = {}
    for name, fn in cases.items():
        timings[name] = _time(fn, repeats, min_sample_s)
        logger.debug("%s: %s", name, timings[name])

    scalar_t, writeup_t = timings["scalar_reference"], timings["writeup_vectorised"]
    lists_t, arrays_t = timings["prepare_values_lists"], timings["prepare_values_arrays"]
    num_chunks = len(chunks)
    vs_scalar, vs_writeup = _ratio(scalar_t, lists_t), _ratio(writeup_t, lists_t)
    return {
        "config": {
            "tokens": tokens,
            "block_size": block_size,
            "regions": regions,
            "chunk_tokens": chunk_tokens,
            "chunks": num_chunks,
            "repeats": repeats,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "timings": {name: asdict(t) for name, t in timings.items()},
        "speedups": {
            "prepare_values_lists_vs_scalar": vs_scalar,
            "prepare_values_lists_vs_writeup": vs_writeup,
            "prepare_values_arrays_vs_scalar": _ratio(scalar_t, arrays_t),
            "prepare_values_arrays_vs_writeup": _ratio(writeup_t, arrays_t),
        },
        "goals_met": {
            f"{GOAL_VS_SCALAR:g}x_vs_scalar": vs_scalar["best"] >= GOAL_VS_SCALAR,
            f"{GOAL_VS_WRITEUP:g}x_vs_writeup": vs_writeup["best"] >= GOAL_VS_WRITEUP,
        },
        "hashing": {
            name: {
                "best_ms": timings[name].best_ms,
                "us_per_chunk": timings[name].best_ms * 1e3 / num_chunks,
            }
            for name in ("chunk_hashes_int64_array", "chunk_hashes_list")
        },
    }
