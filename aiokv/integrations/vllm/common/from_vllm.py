"""The engine's geometry and layouts from vLLM's objects: the KV cache config (scheduler and workers) and
the registered tensors (workers). Anything unsupported is refused at start-up with a ``ValueError``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ....layout import KVLayout
from .connector_config import ConnectorConfig
from .geometry import EngineGeometry, KVGeometry
from .state_geometry import state_engine_layout, state_geometry


def kv_geometry(kv_cache_config: Any) -> EngineGeometry:
    """The geometry of ``kv_cache_config`` (vLLM's ``KVCacheConfig``), or ``ValueError`` saying why not."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("AiokvConnector: the engine has no KV cache group")
    geometries = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            geometries.append(state_geometry(index, group.layer_names, spec))
            continue
        # Exact types: a subclass (chunked local attention, sinks, ...) may change what a block means.
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
            raise ValueError(
                f"AiokvConnector: KV cache group {index} is a {type(spec).__name__} group; supported: "
                "full attention, MLA, sliding window and linear attention / Mamba (mamba_cache_mode 'align')"
            )
        # A FullAttentionSpec with a sliding window (hybrid manager off) still keeps every token's KV in
        # its blocks, so its blocks are whole and safe to store and load.
        geometries.append(
            KVGeometry(
                layer_names=tuple(group.layer_names),
                block_size=int(spec.block_size),
                page_bytes=int(spec.page_size_bytes),
                dtype=str(spec.dtype).removeprefix("torch."),
                is_mla=type(spec) is MLAAttentionSpec,
                sliding_window=int(spec.sliding_window) if type(spec) is SlidingWindowSpec else None,
            )
        )
    if any(geometry.is_state for geometry in geometries) and all(g.is_state for g in geometries):
        raise ValueError(
            "AiokvConnector: a model of linear-attention / Mamba layers only has no prefix to key"
        )
    sizes = {geometry.block_size for geometry in geometries}
    if len(sizes) > 1:
        # vLLM then hashes blocks at the groups' GCD; chunks would have to span the LCM.
        raise ValueError(f"AiokvConnector: KV cache groups of different block sizes {sorted(sizes)}")
    # Finer prefix hashes (vLLM's prefix_match_unit) would key a block by the hash of a shorter prefix
    # than the block ends: two prompts parting inside a block would share its key, and its bytes.
    hash_tokens = getattr(kv_cache_config, "hash_block_size", None)
    if hash_tokens is not None and int(hash_tokens) not in sizes:
        raise ValueError(
            f"AiokvConnector: vLLM hashes prefixes every {hash_tokens} tokens (prefix_match_unit) and its "
            f"blocks hold {min(sizes)}; the connector keys each block by its prefix's hash: run without "
            "prefix_match_unit, or with it equal to the block size"
        )
    return EngineGeometry(tuple(geometries))


def kv_layout_from_tensors(
    tensors: Sequence[Any], *, block_size: int, page_bytes: int, dtype: str
) -> KVLayout:
    """One region per layer tensor ``[num_blocks, ...]`` whose block ``b`` is the contiguous
    ``page_bytes`` at ``data_ptr() + b * page_bytes`` (vLLM's CPU attention backend, and any backend
    with blocks outermost). The value of a block in the store is then its page of every layer back to
    back, as vLLM's MooncakeStoreConnector writes it; the checks here give vLLM users messages in vLLM's
    terms before :meth:`KVLayout.from_tensors` builds the layout."""
    if not tensors:
        raise ValueError("no KV cache tensors to register")
    num_blocks = int(tensors[0].shape[0])
    for index, tensor in enumerate(tensors):
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        if tensor.device.type != tensors[0].device.type:
            raise ValueError("KV cache tensors live on different devices")
        if not tensor.is_contiguous() or int(tensor.shape[0]) != num_blocks:
            raise ValueError(
                f"unsupported KV cache tensor {index}: shape {shape}, stride {stride}; AiokvConnector "
                f"needs contiguous [num_blocks={num_blocks}, ...] tensors (blocks outermost, as the "
                "CPU attention backend lays them out)"
            )
        if stride[0] * tensor.element_size() != page_bytes:
            raise ValueError(
                f"unsupported KV cache tensor {index}: a block is {stride[0] * tensor.element_size()} "
                f"bytes but the KV cache spec says {page_bytes}"
            )
    layout = KVLayout.from_tensors(tensors, block_size=block_size, block_dim=0)
    if layout.dtype != dtype:
        raise ValueError(f"the KV cache tensors hold {layout.dtype}, the KV cache spec says {dtype}")
    return layout


def engine_layout(
    kv_caches: Mapping[str, Any], geometry: KVGeometry, chunk_tokens: int, *, whole_state_pages: bool = False
) -> KVLayout:
    """The aiokv layout of the engine's KV cache, layers in vLLM's registration order
    (``whole_state_pages``: a state group's values are its whole pages, as vLLM's connector's)."""
    names = set(geometry.layer_names)
    missing = names - set(kv_caches)
    if missing:
        raise ValueError(f"vLLM registered no KV cache for layer(s) {sorted(missing)}")
    tensors = [tensor for name, tensor in kv_caches.items() if name in names]
    if geometry.is_state:
        return state_engine_layout(tensors, geometry, chunk_tokens, whole_pages=whole_state_pages)
    if not all(hasattr(tensor, "data_ptr") for tensor in tensors):
        raise ValueError("AiokvConnector needs one tensor per layer (not a list of state tensors)")
    return kv_layout_from_tensors(
        tensors, block_size=geometry.block_size, page_bytes=geometry.page_bytes, dtype=geometry.dtype
    )


def check_tiers_fit(config: ConnectorConfig, geometry: EngineGeometry) -> None:
    """``ValueError`` if ``config``'s tiers cannot serve ``geometry``: the host tier's index and workers
    hold one KV cache group's chunks; per-group tiers are not built."""
    if geometry.hybrid and config.host_tier:
        raise ValueError(
            f"AiokvConnector backend {config.backend!r} (the host tier) supports models with one "
            f"KV cache group; this model has {len(geometry.groups)} (hybrid allocator: "
            f"{', '.join(group.kind for group in geometry.groups)}): use backend 'mooncake', or disable "
            "vLLM's hybrid allocator"
        )
    if config.layer_groups > 1 and (geometry.hybrid or geometry.has_state):
        raise ValueError(
            "AiokvConnector layer_groups > 1 supports models with one attention KV cache group; this "
            f"model has {', '.join(group.kind for group in geometry.groups)}: leave layer_groups at 1"
        )
    if config.layer_groups > geometry.groups[0].num_layers:
        raise ValueError(
            f"AiokvConnector layer_groups {config.layer_groups} is more than the model's "
            f"{geometry.groups[0].num_layers} layers"
        )
