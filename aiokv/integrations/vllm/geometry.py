"""What the connector supports of vLLM's KV cache, and the aiokv layouts built from it.

The scheduler sees only the KV cache spec, the worker the tensors; both derive the same geometry, so
their keys (whose fingerprint is the layout's geometry) agree. Anything else is refused at start-up:
a guessed layout would mean wrong KV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...layout import KVLayout

HYBRID_HINT = (
    "AiokvConnector supports models whose KV cache is one full-attention group (it does not implement "
    "SupportsHMA); this model has {groups}. Start the engine with disable_hybrid_kv_cache_manager=True "
    "(--disable-hybrid-kv-cache-manager) so vLLM keeps every attention layer in one full-attention "
    "group; models with Mamba or linear-attention layers cannot run with this connector"
)


@dataclass(frozen=True)
class KVGeometry:
    """One full-attention KV cache group: ``num_layers`` regions of ``num_blocks`` pages."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int
    dtype: str
    is_mla: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def lookup_layout(self, scratch: np.ndarray) -> KVLayout:
        """A layout with this geometry over one scratch page: a lookup client's worker never moves
        bytes, but its keys need the engine layout's fingerprint (which ignores addresses)."""
        if scratch.nbytes < self.page_bytes:
            raise ValueError(f"scratch buffer of {scratch.nbytes} bytes is smaller than a page")
        return KVLayout(
            [int(scratch.ctypes.data)] * self.num_layers,
            [self.page_bytes],
            block_size=self.block_size,
            num_blocks=1,
            dtype=self.dtype,
        )


def kv_geometry(kv_cache_config: Any) -> KVGeometry:
    """The geometry of ``kv_cache_config`` (vLLM's ``KVCacheConfig``), or ``ValueError`` saying why not."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups) or "none"
        raise ValueError(HYBRID_HINT.format(groups=f"{len(groups)} KV cache groups ({kinds})"))
    spec = groups[0].kv_cache_spec
    # Exact types: a subclass (sliding window chunks, sinks, ...) may change what a block means.
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ValueError(HYBRID_HINT.format(groups=f"a {type(spec).__name__} group"))
    # A FullAttentionSpec with a sliding window (hybrid manager off) still keeps every token's KV in
    # its blocks, so its blocks are whole and safe to store and load.
    return KVGeometry(
        layer_names=tuple(groups[0].layer_names),
        block_size=int(spec.block_size),
        page_bytes=int(spec.page_size_bytes),
        dtype=str(spec.dtype).removeprefix("torch."),
        is_mla=type(spec) is MLAAttentionSpec,
    )


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


def engine_layout(kv_caches: Mapping[str, Any], geometry: KVGeometry) -> KVLayout:
    """The aiokv layout of the engine's KV cache, layers in vLLM's registration order."""
    names = set(geometry.layer_names)
    missing = names - set(kv_caches)
    if missing:
        raise ValueError(f"vLLM registered no KV cache for layer(s) {sorted(missing)}")
    tensors = [tensor for name, tensor in kv_caches.items() if name in names]
    if not all(hasattr(tensor, "data_ptr") for tensor in tensors):
        raise ValueError("AiokvConnector needs one tensor per layer (not a list of state tensors)")
    return kv_layout_from_tensors(
        tensors, block_size=geometry.block_size, page_bytes=geometry.page_bytes, dtype=geometry.dtype
    )
