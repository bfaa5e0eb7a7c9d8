"""Which engines share this engine's keys, said once at start-up."""

from __future__ import annotations

import logging
from typing import Any

from ..common.block_keys import key_namespace
from ..common.connector_config import ConnectorConfig
from ..common.geometry import EngineGeometry

logger = logging.getLogger("aiokv.vllm")


def log_key_scope(vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry) -> None:
    """Say which engines share this engine's keys: engines of other TP sizes (a prefill engine with
    TP 2, a decode engine with TP 4) simply miss each other's KV, which is otherwise silent."""
    parallel = vllm_config.parallel_config
    namespace = key_namespace(vllm_config, config, geometry, tp_rank=0, pp_rank=0)
    if config.key_format == "vllm" and not geometry.is_mla:
        logger.info(
            "aiokv: keys in vLLM's format under %r name no TP size: give every engine sharing them TP "
            "size %d (another size's values do not fit; their loads fail and are recomputed)",
            namespace.model,
            parallel.tensor_parallel_size,
        )
        return
    if geometry.is_mla:
        scope = f"any TP size (MLA: one shared key per chunk) and PP size {parallel.pipeline_parallel_size}"
    else:
        scope = f"TP size {parallel.tensor_parallel_size} and PP size {parallel.pipeline_parallel_size}"
    logger.info(
        "aiokv: keys under %r: shared with engines of the same model name, KV layout, %s; "
        "engines of other sizes miss them",
        namespace.model,
        scope,
    )
