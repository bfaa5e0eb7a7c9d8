"""What the connector supports of vLLM's KV cache, and the aiokv layouts built from it.

The scheduler sees only the KV cache spec, the worker the tensors; both derive the same geometry, so
their keys (whose fingerprint is the layout's geometry) agree. Anything else is refused at start-up:
a guessed layout would mean wrong KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ....layout import KVLayout

NULL_BLOCK_ID = 0  # vLLM's null block: the first block of the pool, never handed out for KV


@dataclass(frozen=True)
class KVGeometry:
    """One KV cache group: ``num_layers`` regions of ``num_blocks`` pages. ``kind`` names what a block
    means (``full``, ``mla``, ``swa<window>``): it goes into the keys of a hybrid engine's groups."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int
    dtype: str
    is_mla: bool
    sliding_window: int | None = None
    # A linear-attention / Mamba group (:mod:`.state_geometry`): each block is one running state, per layer
    # these (bytes, dtype) tensors back to back at the start of the page; ``state_kind`` names it.
    state_parts: tuple[tuple[int, str], ...] = ()
    state_kind: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def is_state(self) -> bool:
        return bool(self.state_parts)

    @property
    def block_bytes(self) -> int:
        """The bytes of one block, over every layer of the group (what a key of one block holds; a
        state group's pages are padded, and only the state itself is moved)."""
        per_layer = sum(size for size, _ in self.state_parts) if self.is_state else self.page_bytes
        return self.num_layers * per_layer

    def chunk_bytes(self, chunk_blocks: int) -> int:
        """The bytes of one key's value: ``chunk_blocks`` blocks, or a state group's one state."""
        return self.block_bytes if self.is_state else self.block_bytes * chunk_blocks

    @property
    def kind(self) -> str:
        if self.is_state:
            return self.state_kind
        if self.sliding_window is not None:
            return f"swa{self.sliding_window}"
        return "mla" if self.is_mla else "full"

    def window_first_chunk(self, end: int, chunk_tokens: int) -> int:
        """The first chunk a sliding-window group reads when the tokens before chunk ``end`` are
        cached: the window before the first computed token (every chunk, without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (end * chunk_tokens - self.sliding_window) // chunk_tokens)

    def lookup_layout(self, scratch: np.ndarray, chunk_tokens: int) -> KVLayout:
        """A layout with this geometry over one scratch page: a lookup client's worker never moves
        bytes, but its keys need the engine layout's fingerprint (which ignores addresses)."""
        if scratch.nbytes < self.page_bytes:
            raise ValueError(f"scratch buffer of {scratch.nbytes} bytes is smaller than a page")
        if self.is_state:
            return state_layout(self, [int(scratch.ctypes.data)] * self.num_layers, 1, chunk_tokens)
        return KVLayout(
            [int(scratch.ctypes.data)] * self.num_layers,
            [self.page_bytes],
            block_size=self.block_size,
            num_blocks=1,
            dtype=self.dtype,
        )


@dataclass(frozen=True)
class EngineGeometry:
    """Every KV cache group of the engine, in vLLM's group order. Several groups (vLLM's hybrid
    allocator): full-attention and sliding-window groups of one block size; each group's chunks are
    keyed and moved apart, as that group's geometry says."""

    groups: tuple[KVGeometry, ...]

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def is_mla(self) -> bool:
        return self.groups[0].is_mla

    @property
    def max_page_bytes(self) -> int:
        return max(group.page_bytes for group in self.groups)

    @property
    def has_state(self) -> bool:
        """Whether a group holds linear-attention / Mamba states (:mod:`.state_geometry`)."""
        return any(group.is_state for group in self.groups)


def layer_slices(group: KVGeometry, count: int) -> tuple[KVGeometry, ...]:
    """``group`` cut into ``count`` runs of consecutive layers (the first ones one layer longer when
    the layers do not divide evenly): each run is keyed and moved apart, so a forward can start on
    the first layers while later ones still load. ``count`` 1: the group itself."""
    if count <= 1:
        return (group,)
    names = group.layer_names
    base, extra = divmod(len(names), count)
    out, start = [], 0
    for index in range(count):
        stop = start + base + (index < extra)
        out.append(dataclasses.replace(group, layer_names=names[start:stop]))
        start = stop
    return tuple(out)


def usable_from(block_ids: Sequence[int], chunk_blocks: int) -> int:
    """The first chunk of ``block_ids`` (whole chunks of ``chunk_blocks``) after the last chunk holding
    a null block: a sliding-window group's blocks before the window are null, and only the chunks
    after them can be stored or loaded."""
    chunks = len(block_ids) // chunk_blocks
    for chunk in range(chunks - 1, -1, -1):
        if NULL_BLOCK_ID in block_ids[chunk * chunk_blocks : (chunk + 1) * chunk_blocks]:
            return chunk + 1
    return 0


def state_layout(
    geometry: KVGeometry,
    bases: Sequence[int],
    num_blocks: int,
    chunk_tokens: int,
    device: str = "cpu",
    *,
    whole_pages: bool = False,
) -> KVLayout:
    """A state group's layout: per layer (page ``b`` at ``bases[layer] + b * page_bytes``), one region
    per state tensor. One block is one key: it stands for the ``chunk_tokens`` tokens whose state it is,
    and that size is in the fingerprint (an engine of other chunks never reads it). ``whole_pages``: one
    region per layer, its whole page, padding included (the value vLLM's MooncakeStoreConnector moves)."""
    if whole_pages:
        starts, sizes = [0], [geometry.page_bytes]
    else:
        starts, sizes, offset = [], [], 0
        for size, _ in geometry.state_parts:
            starts.append(offset)
            sizes.append(size)
            offset += size
    return KVLayout(
        [base + start for base in bases for start in starts],
        sizes,
        block_size=chunk_tokens,
        num_blocks=num_blocks,
        dtype="+".join(dtype for _, dtype in geometry.state_parts),
        block_strides=[geometry.page_bytes],
        device=device,
    )
