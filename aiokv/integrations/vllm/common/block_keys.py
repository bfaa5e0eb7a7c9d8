"""Keys from vLLM's own block hashes, in aiokv's format or exactly as vLLM's MooncakeStoreConnector.

vLLM hashes every full block (chained, with cache salt, LoRA and multimodal inputs folded in), so
nothing re-hashes tokens here. ``"aiokv"`` chains ``chunk_blocks`` block hashes into one chunk digest
(``HashedPrompt.from_block_hashes``) under a namespace naming model, device, layout and ranks.
``"vllm"`` writes ``<model>@tp_rank:T@pcp0@dcp0@pp_rank:P@group:0@<block hash hex>``, one key per block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ....keys import HashedPrompt, KeyNamespace
from ....layout import KVLayout
from .amx import amx_tiles_supported
from .connector_config import ConnectorConfig
from .geometry import EngineGeometry, KVGeometry, layer_slices


@dataclass(frozen=True)
class VllmKeyNamespace(KeyNamespace):
    """Keys byte-identical to vLLM's ``PoolKey`` (``RankLocalStoreLayout``, no store-TP sharding)."""

    cache_prefix: str = ""
    # The engine's KV cache group, for a worker that moves one group of a hybrid engine alone.
    group: int | None = None

    def prefix(self, layout_fingerprint: str, group: int) -> str:
        # vLLM's keys carry no layout fingerprint: both connectors must run the same KV layout.
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        group = group if self.group is None else self.group
        return f"{head}{self.model}@tp_rank:{self.tp_rank}@pcp0@dcp0@pp_rank:{self.pp_rank}@group:{group}@"


def model_name(vllm_config: Any, config: ConnectorConfig) -> str:
    """``model_name`` from the config, else the model path's last component (as vLLM's connector)."""
    if config.model_name:
        return config.model_name
    return str(vllm_config.model_config.model).rstrip("/").split("/")[-1]


def device_tag() -> str:
    """The kernel family that wrote the bytes: CPU attention kernels differ per ISA (amx, vec).

    torch's capability names the vector ISA only (AVX512 with or without AMX), so AMX is named apart:
    vLLM picks its ``amx`` kernels, which lay blocks out differently, wherever the CPU offers AMX."""
    import torch
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if device == "cpu":
        amx = "-amx" if amx_tiles_supported() else ""
        return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}{amx}"
    return device


def key_namespace(
    vllm_config: Any,
    config: ConnectorConfig,
    geometry: EngineGeometry,
    *,
    tp_rank: int,
    pp_rank: int,
    group: int = 0,
) -> KeyNamespace:
    """The namespace of this rank's keys of KV cache ``group`` (the scheduler's lookups use rank 0's).

    A hybrid engine's groups are moved by one aiokv worker each: their namespaces name the group (and,
    in aiokv's format, its kind), so a hybrid engine and a full-attention engine of one model never
    exchange a chunk, and two groups of one geometry never share a key."""
    parallel = vllm_config.parallel_config
    tp_size, pp_size = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    name = model_name(vllm_config, config)
    if config.key_format == "vllm":
        num_kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        # As vLLM: byte-identical TP replicas share one key (MLA: every rank; GQA: tp_size / kv heads);
        # a linear-attention / Mamba state is each rank's own shard.
        if geometry.groups[group].is_state:
            replicas = 1
        elif geometry.is_mla:
            replicas = tp_size
        else:
            replicas = max(1, tp_size // max(1, num_kv_heads))
        return VllmKeyNamespace(
            name,
            tp_rank=tp_rank // replicas,
            pp_rank=pp_rank,
            cache_prefix=config.cache_prefix,
            group=group if geometry.hybrid else None,
        )
    head = f"{config.cache_prefix}@" if config.cache_prefix else ""
    # TP size is in the key: another TP size holds other shards. MLA's KV is the same on every rank.
    shards = "mla" if geometry.is_mla else f"tp{tp_size}"
    # Single-group engines keep the keys they always had; a hybrid engine's name its group and kind.
    kind = f"@hma-g{group}-{geometry.groups[group].kind}" if geometry.hybrid else ""
    return KeyNamespace(
        f"{head}{name}@{device_tag()}@{shards}pp{pp_size}{kind}",
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        share_across_tp=geometry.is_mla,
    )


def moved_groups(
    vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry, *, tp_rank: int, pp_rank: int
) -> list[tuple[KVGeometry, KeyNamespace]]:
    """What one aiokv worker each moves, with its keys' namespace: the engine's KV cache groups, or
    with ``layer_groups`` > 1 the runs of layers of its one group (:func:`.geometry.layer_slices`),
    each run's keys naming it, so a chunk is ``layer_groups`` keys."""
    if config.layer_groups <= 1:
        return [
            (
                group,
                key_namespace(vllm_config, config, geometry, tp_rank=tp_rank, pp_rank=pp_rank, group=index),
            )
            for index, group in enumerate(geometry.groups)
        ]
    namespace = key_namespace(vllm_config, config, geometry, tp_rank=tp_rank, pp_rank=pp_rank)
    runs = layer_slices(geometry.groups[0], config.layer_groups)
    return [
        (run, dataclasses.replace(namespace, model=f"{namespace.model}@layers{index}of{len(runs)}"))
        for index, run in enumerate(runs)
    ]


def value_fingerprint(
    vllm_config: Any, namespace: KeyNamespace, geometry: KVGeometry, layout: KVLayout
) -> bytes:
    """What the bytes of this engine's values mean, for :class:`aiokv.VerifiedBackend`: a value written
    under another fingerprint is refused on load. The model as vLLM names it (path or hub id, and
    revision: other weights under the same ``model_name`` give other KV), the namespace (ISA tag, TP
    and PP sizes), dtype, block geometry, attention kind and the layout (blocks outermost, region
    sizes). Engines sharing a cache must name their model alike (same path or hub id)."""
    model = vllm_config.model_config
    parts = {
        "model": str(model.model),
        "revision": str(getattr(model, "revision", None)),
        "namespace": namespace.model,
        "dtype": geometry.dtype,
        "block_size": geometry.block_size,
        "page_bytes": geometry.page_bytes,
        "layers": geometry.num_layers,
        "attention": geometry.kind,  # full, mla, swa<window>: one KV cache group's
        "layout": f"blocks-outermost/{layout.fingerprint}",
    }
    return ";".join(f"{name}={value}" for name, value in parts.items()).encode()


def hashed_prompt(
    block_hashes: Sequence[Any], num_blocks: int, config: ConnectorConfig, block_size: int
) -> HashedPrompt:
    """The chunk digests of the first ``num_blocks`` blocks (whole chunks only)."""
    chunk_tokens = config.chunk_blocks * block_size
    usable = num_blocks - num_blocks % config.chunk_blocks
    hashes = block_hashes[:usable]
    if config.key_format == "vllm":
        return HashedPrompt(tuple(bytes(h).hex() for h in hashes), chunk_tokens)
    return HashedPrompt.from_block_hashes([bytes(h) for h in hashes], block_size, chunk_tokens)
