"""Linear-attention / Mamba state groups' geometry and layouts from vLLM's ``MambaSpec`` and state
tensors, refused at start-up when unsupported (the scheduler's part: :mod:`..scheduler_side.state_groups`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ....layout import KVLayout
from .geometry import KVGeometry, state_layout


def state_geometry(index: int, layer_names: Sequence[str], spec: Any) -> KVGeometry:
    """The geometry of vLLM's ``MambaSpec`` group ``index``, or ``ValueError`` saying why not."""
    import torch

    mode = getattr(spec, "mamba_cache_mode", None)
    layers = ", ".join(list(layer_names)[:2])
    if mode != "align":
        raise ValueError(
            f"AiokvConnector supports linear-attention / Mamba layers (KV cache group {index}: "
            f"{type(spec).__name__}, layers {layers}) only with mamba_cache_mode='align'; this engine "
            f"runs mamba_cache_mode={mode!r}. Only 'align' keeps states at block-aligned positions and "
            "hands each one to the connector with its exact block "
            "(kv_connector_block_state.boundary_state_offloads); in other modes a state is one running "
            "value per request that no prefix key can name. Start the engine with mamba_cache_mode='align'"
        )
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise ValueError(
            f"AiokvConnector: KV cache group {index} ({type(spec).__name__}) keeps speculative state "
            "blocks (speculative decoding); their states are not stored or loaded: run without it"
        )
    parts = []
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        elements = 1
        for size in shape:
            elements *= int(size)
        parts.append(
            (elements * torch.empty((), dtype=dtype).element_size(), str(dtype).removeprefix("torch."))
        )
    page = int(spec.page_size_bytes)
    if sum(size for size, _ in parts) > page:
        raise ValueError(
            f"AiokvConnector: KV cache group {index}'s state is larger than its page ({page} bytes)"
        )
    mamba_type = getattr(spec, "mamba_type", None)
    name = str(getattr(mamba_type, "name", mamba_type or "mamba")).lower()
    return KVGeometry(
        layer_names=tuple(layer_names),
        block_size=int(spec.block_size),
        page_bytes=page,
        dtype="+".join(dtype for _, dtype in parts),
        is_mla=False,
        state_parts=tuple(parts),
        state_kind=f"state-{name}",
    )


def state_engine_layout(
    tensors: Sequence[Any], geometry: KVGeometry, chunk_tokens: int, *, whole_pages: bool = False
) -> KVLayout:
    """A state group's layout over the engine's tensors: per layer, the tensor vLLM registered (its
    page, or its list of state tensors, which start at the page); ``whole_pages``: see
    :func:`~.geometry.state_layout`."""
    bases = []
    num_blocks = None
    for index, tensor in enumerate(tensors):
        first = _first(tensor)
        blocks, page = int(first.shape[0]), int(first.stride()[0]) * int(first.element_size())
        if page != geometry.page_bytes or (num_blocks is not None and blocks != num_blocks):
            raise ValueError(
                f"unsupported state tensor {index}: {blocks} blocks {page} bytes apart; the KV cache spec "
                f"says {geometry.page_bytes}-byte pages"
            )
        if str(first.device) != str(device := _first(tensors[0]).device):
            raise ValueError(f"state tensor {index} lives on {first.device}, the first on {device}")
        num_blocks = blocks
        bases.append(int(first.data_ptr()))
        state_bytes = sum(size for size, _ in geometry.state_parts)
        if isinstance(tensor, (list, tuple)):
            offsets = [int(part.data_ptr()) - bases[-1] for part in tensor]
            expected = [
                sum(size for size, _ in geometry.state_parts[:i]) for i in range(len(geometry.state_parts))
            ]
            if offsets != expected:
                raise ValueError(
                    f"state tensor {index}'s parts lie at {offsets}, not back to back at {expected}"
                )
        elif math.prod(int(n) for n in first.shape[1:]) * int(first.element_size()) < state_bytes:
            raise ValueError(f"state tensor {index}'s pages hold less than the {state_bytes}-byte state")
    if num_blocks is None:
        raise ValueError("no state tensors to register")
    device = str(_first(tensors[0]).device)
    return state_layout(geometry, bases, num_blocks, chunk_tokens, device, whole_pages=whole_pages)


def _first(tensor: Any) -> Any:
    """The tensor vLLM registered for a layer, or the first of its list of state tensors."""
    return tensor[0] if isinstance(tensor, (list, tuple)) else tensor
