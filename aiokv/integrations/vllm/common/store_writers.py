"""Which worker ranks write to the store behind the engine: each TP/PP rank writes its own shard's keys,
except with MLA, where the KV is the same on every TP rank and only TP rank 0 of each pipeline stage
writes. A chunk is whole in the store once every writer has it; the workers' confirmations
(:class:`.wire.StoreReport`) name their writer rank, and the scheduler counts them."""

from __future__ import annotations

from typing import Any

from .geometry import EngineGeometry


def store_writer_rank(geometry: EngineGeometry, tp_rank: int, pp_rank: int, tp_size: int) -> int | None:
    """This rank's number among the store's writers (as the host tier numbers ranks), or None if it
    writes nothing to the store."""
    if geometry.is_mla and tp_rank != 0:
        return None
    return tp_rank + tp_size * pp_rank


def store_writer_count(vllm_config: Any, geometry: EngineGeometry) -> int:
    parallel = vllm_config.parallel_config
    tp_size, pp_size = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    return pp_size if geometry.is_mla else tp_size * pp_size
