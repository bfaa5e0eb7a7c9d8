"""Describing an engine's KV-cache tensors as a :class:`~aiokv.layout.KVLayout`.

Duck-typed over ``torch.Tensor`` (``data_ptr()``, ``stride()`` in elements, ``element_size()``,
``device``) and ``numpy.ndarray`` (``ctypes.data``, ``strides`` in bytes, ``itemsize``), so importing
aiokv never imports torch. Everything that decides an address is checked here, in Python ints, before
a layout exists: a wrong address would reach native code, which does not check.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class TensorView:
    """What a layout needs of one tensor: a data pointer, shape, strides in bytes, element size."""

    name: str
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    device: str


def inspect_tensor(tensor: Any, name: str) -> TensorView:
    """Read a tensor's memory description without importing its framework."""
    if isinstance(tensor, np.ndarray):
        return TensorView(
            name,
            int(tensor.ctypes.data),
            tuple(int(n) for n in tensor.shape),
            tuple(int(s) for s in tensor.strides),
            int(tensor.itemsize),
            str(tensor.dtype),
            "cpu",
        )
    if not all(callable(getattr(tensor, attr, None)) for attr in ("data_ptr", "stride", "element_size")):
        raise TypeError(
            f"{name} is a {type(tensor).__name__}, not a torch.Tensor or numpy.ndarray "
            "(needs data_ptr(), stride(), element_size(), or NumPy's array interface)"
        )
    if (
        getattr(tensor, "is_sparse", False)
        or str(getattr(tensor, "layout", "torch.strided")) != "torch.strided"
    ):
        raise TypeError(f"{name} is not a dense strided tensor (layout {tensor.layout})")
    itemsize = int(tensor.element_size())
    shape = tuple(int(n) for n in tensor.shape)
    strides = tuple(int(s) * itemsize for s in tensor.stride())
    dtype = str(tensor.dtype).removeprefix("torch.")
    # Empty tensors are refused later by shape, before their (possibly 0) pointer is used.
    ptr = int(tensor.data_ptr()) if math.prod(shape) else 0
    return TensorView(name, ptr, shape, strides, itemsize, dtype, str(tensor.device))


def _named(tensors: Sequence[Any] | Mapping[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(tensors, Mapping):
        return [(f"tensor {key!r}", value) for key, value in tensors.items()]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError(
            f"tensors must be a sequence (or name -> tensor mapping) of tensors, not "
            f"{type(tensors).__name__}; wrap a single tensor in a list"
        )
    return [(f"tensors[{index}]", value) for index, value in enumerate(tensors)]


def _pieces(view: TensorView, block_dim: int) -> tuple[list[int], int, int]:
    """Base address of each piece, the piece's bytes and the block stride, for one tensor."""
    name, shape, strides = view.name, view.shape, view.strides
    if not -len(shape) <= block_dim < len(shape):
        raise InvalidRequestError(f"{name}: block_dim {block_dim} is out of range for shape {shape}")
    dim = block_dim % len(shape)
    if math.prod(shape) == 0:
        raise InvalidRequestError(f"{name} is empty (shape {shape})")
    if view.ptr <= 0:
        raise InvalidRequestError(f"{name} has no memory (data pointer {view.ptr:#x})")
    if any(stride < 0 for size, stride in zip(shape, strides, strict=True) if size > 1):
        raise InvalidRequestError(f"{name} has a negative stride {strides}: give a view in memory order")
    # The dims after the block dim must be C-contiguous (size-1 dims have no meaningful stride).
    expected = view.itemsize
    for axis in range(len(shape) - 1, dim, -1):
        if shape[axis] > 1 and strides[axis] != expected:
            raise InvalidRequestError(
                f"{name}: the dims after block_dim {dim} are not C-contiguous (shape {shape}, "
                f"byte strides {strides}; dim {axis} has stride {strides[axis]}, expected {expected})"
            )
        expected *= shape[axis]
    piece_bytes = expected
    block_stride = strides[dim] if shape[dim] > 1 else piece_bytes
    if block_stride < piece_bytes:
        raise InvalidRequestError(
            f"{name}: blocks along dim {dim} are {block_stride} bytes apart but {piece_bytes} bytes "
            "long, so they overlap"
        )
    leading = [range(n) for n in shape[:dim]]
    offsets = [
        sum(i * s for i, s in zip(index, strides[:dim], strict=True)) for index in itertools.product(*leading)
    ]
    return [view.ptr + offset for offset in offsets], piece_bytes, block_stride


def first_overlap(spans: Sequence[tuple[int, int, int]], num_blocks: int) -> tuple[int, int] | None:
    """The first pair of regions ``(base, block length, block stride)`` sharing a byte, or None.

    Strided regions may interleave without sharing bytes (per-layer views of a block-major cache),
    so regions whose extents meet are compared block by block: exactly, in closed form when the
    strides are equal, else over the blocks of one region.
    """
    extents = sorted(
        (base, base + stride * (num_blocks - 1) + blen, region)
        for region, (base, blen, stride) in enumerate(spans)
    )
    for position, (_, end, region) in enumerate(extents):
        for other_start, _, other in extents[position + 1 :]:
            if other_start >= end:
                break
            if _blocks_meet(spans[region], spans[other], num_blocks):
                return min(region, other), max(region, other)
    return None


def _blocks_meet(first: tuple[int, int, int], second: tuple[int, int, int], num_blocks: int) -> bool:
    (base_a, len_a, stride_a), (base_b, len_b, stride_b) = first, second
    if stride_a == stride_b:
        # Block b of A meets block b' of B iff d - k*stride is in (-len_b, len_a), k = b - b'.
        distance, stride = base_b - base_a, stride_a
        nearest = distance // stride
        return any(
            -len_b < distance - k * stride < len_a
            for k in (nearest - 1, nearest, nearest + 1)
            if -(num_blocks - 1) <= k <= num_blocks - 1
        )
    # For each block of A, the first block of B ending after A's block starts must start after it ends.
    starts = base_a + np.arange(num_blocks, dtype=np.int64) * stride_a
    candidate = np.maximum((starts - len_b - base_b) // stride_b + 1, 0)
    hit = (candidate < num_blocks) & (base_b + candidate * stride_b < starts + len_a)
    return bool(hit.any())


@dataclass(frozen=True)
class TensorRegions:
    """Tensors as a layout's regions (what :meth:`KVLayout.from_tensors` builds itself from)."""

    base_addrs: list[int]
    block_lens: list[int]
    block_strides: list[int]
    num_blocks: int
    dtype: str
    device: str
    owners: tuple[object, ...]  # the tensors, kept referenced so their memory outlives the layout


def describe_tensors(tensors: Sequence[Any] | Mapping[str, Any], *, block_dim: int) -> TensorRegions:
    """See :meth:`KVLayout.from_tensors`."""
    named = _named(tensors)
    if not named:
        raise InvalidRequestError("tensors must hold at least one tensor")
    if isinstance(block_dim, bool) or not isinstance(block_dim, (int, np.integer)):
        raise TypeError(f"block_dim must be an int, not {type(block_dim).__name__}")
    views = [inspect_tensor(tensor, name) for name, tensor in named]
    bases: list[int] = []
    lens: list[int] = []
    strides: list[int] = []
    owner: list[str] = []
    first = views[0]
    num_blocks = 0
    for view in views:
        pieces, piece_bytes, block_stride = _pieces(view, int(block_dim))
        blocks = view.shape[int(block_dim) % len(view.shape)]
        if view is first:
            num_blocks = blocks
        elif blocks != num_blocks:
            raise InvalidRequestError(
                f"{view.name} has {blocks} blocks along block_dim but {first.name} has {num_blocks}"
            )
        for attr in ("dtype", "device"):
            if getattr(view, attr) != getattr(first, attr):
                raise InvalidRequestError(
                    f"{view.name} has {attr} {getattr(view, attr)} but {first.name} has "
                    f"{getattr(first, attr)}: one layout holds one {attr}"
                )
        bases.extend(pieces)
        lens.extend([piece_bytes] * len(pieces))
        strides.extend([block_stride] * len(pieces))
        owner.extend(f"{view.name} piece {p}" for p in range(len(pieces)))
    clash = first_overlap(list(zip(bases, lens, strides, strict=True)), num_blocks)
    if clash is not None:
        a, b = clash
        raise InvalidRequestError(f"{owner[a]} and {owner[b]} share memory: regions must not overlap")
    owners = tuple(tensor for _, tensor in named)
    return TensorRegions(bases, lens, strides, num_blocks, first.dtype, first.device, owners)
