"""Checks of the worker's arguments: at construction, and at submit (cheap, on the caller's time).

Token values are checked later, as they are hashed, slice by slice (:mod:`aiokv._engine.hashing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._arrays import IntArray, as_int64_array, as_positive_int
from .errors import InvalidRequestError
from .keys import HashedPrompt, TokenIds, uint32_tokens
from .layout import KVLayout

BlockIds = Sequence[Sequence[int]] | Sequence[IntArray] | IntArray


def check_layouts(layouts: Sequence[KVLayout] | KVLayout) -> tuple[KVLayout, ...]:
    if isinstance(layouts, KVLayout):
        layouts = [layouts]
    if not isinstance(layouts, Sequence):
        raise TypeError("layouts must be a KVLayout or a non-empty sequence of KVLayout")
    checked = tuple(layouts)
    if not checked or not all(isinstance(layout, KVLayout) for layout in checked):
        raise TypeError("layouts must be a KVLayout or a non-empty sequence of KVLayout")
    return checked


# Tokens per key by default: large enough that pairs are 128 KiB-1 MiB across processes (Mooncake's TCP
# path is bound by slice count), small enough that a hit loses at most 255 tokens to recomputation.
DEFAULT_CHUNK_TOKENS = 256


def default_chunk_tokens(layouts: Sequence[KVLayout]) -> int:
    """:data:`DEFAULT_CHUNK_TOKENS` rounded up to a multiple of every group's block size."""
    unit = math.lcm(*(layout.block_size for layout in layouts))
    return -(-DEFAULT_CHUNK_TOKENS // unit) * unit


def check_chunk_tokens(chunk_tokens: object, layouts: Sequence[KVLayout]) -> int:
    """``chunk_tokens`` checked against every group's block size (None: the default for the layouts)."""
    if chunk_tokens is None:
        return default_chunk_tokens(layouts)
    chunk_tokens = as_positive_int(chunk_tokens, "chunk_tokens")
    for group, layout in enumerate(layouts):
        if chunk_tokens % layout.block_size:
            raise InvalidRequestError(
                f"chunk_tokens {chunk_tokens} is not a multiple of group {group}'s "
                f"block_size {layout.block_size}"
            )
    return chunk_tokens


def check_instance(value: object, kind: type, name: str, *, optional: bool = False) -> None:
    """TypeError unless ``value`` is a ``kind`` (or None, when ``optional``)."""
    if not (isinstance(value, kind) or (optional and value is None)):
        allowed = f"a {kind.__name__} or None" if optional else f"a {kind.__name__}"
        raise TypeError(f"{name} must be {allowed}, not {type(value).__name__}")


def check_layouts_reachable(layouts: Sequence[KVLayout], backend: object, device_memory: bool) -> None:
    """Refuse device memory on a backend that can only move host memory."""
    if device_memory:
        return
    for group, layout in enumerate(layouts):
        device = getattr(layout, "device", "cpu")
        if device != "cpu":
            raise InvalidRequestError(
                f"group {group}'s layout is on device {device!r}, but backend {type(backend).__name__} "
                "moves host memory only (its supports_device_memory is False)"
            )


def check_backoff(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise InvalidRequestError(f"pressure_backoff_s must be a finite number >= 0, got {seconds!r}")
    return float(seconds)


def check_tokens(
    tokens: TokenIds | HashedPrompt, chunk_tokens: int
) -> tuple[Sequence[str] | None, TokenIds | None, int]:
    """The prompt's digests if it came hashed, else its token ids of whole chunks (the worker's own
    copy), and its number of whole chunks.

    Hashing runs later in the dispatcher: the copy is what lets the caller reuse its token buffer as
    soon as the call returns (a list or tuple is copied by reference to its ints, an array in one
    memcpy; the values are checked as they are hashed).
    """
    if isinstance(tokens, HashedPrompt):
        if tokens.chunk_tokens != chunk_tokens:
            raise InvalidRequestError(
                f"the HashedPrompt was chunked by {tokens.chunk_tokens} tokens, the worker by {chunk_tokens}"
            )
        return tokens.hashes, None, len(tokens.hashes)  # a HashedPrompt is immutable and validated
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(
        tokens, (Sequence, np.ndarray)
    ):
        raise TypeError(f"token_ids must be a sequence or 1-D array of ints, not {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray) and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
        raise InvalidRequestError(
            f"token_ids must be a 1-D integer array, got shape {tokens.shape} and dtype {tokens.dtype}"
        )
    num_chunks = len(tokens) // chunk_tokens
    return None, owned_tokens(tokens, num_chunks * chunk_tokens), num_chunks


def owned_tokens(tokens: TokenIds, count: int) -> TokenIds:
    """The first ``count`` token ids, in an object no caller holds. An array is copied as uint32 when
    its values allow (the copy is the encoding hashed, so hashing converts nothing)."""
    if isinstance(tokens, np.ndarray):
        head = tokens[:count]
        encoded = uint32_tokens(head)
        return head.copy() if encoded is None else encoded
    if isinstance(tokens, (list, tuple)):
        return tokens[:count]  # slicing copies a list; a tuple cannot change
    return list(tokens[:count])  # any other sequence: its slice may be a view


def check_block_ids(
    block_ids: BlockIds | None,
    num_chunks: int,
    layouts: Sequence[KVLayout],
    blocks_per_chunk: Sequence[int],
) -> list[IntArray]:
    """Per group: the block ids the whole chunks use, as a ``(num_chunks, blocks per chunk)`` array."""
    groups = len(layouts)
    if (
        block_ids is None
        or isinstance(block_ids, (str, bytes))
        or not isinstance(block_ids, (Sequence, np.ndarray))
        or (isinstance(block_ids, np.ndarray) and block_ids.ndim != 2)
    ):
        raise TypeError("block_ids must hold one sequence of block ids per KV-cache group")
    if len(block_ids) != groups:
        hint = " (for one group pass [block_ids])" if groups == 1 else ""
        raise InvalidRequestError(
            f"block_ids must hold one sequence per KV-cache group: expected {groups}, "
            f"got {len(block_ids)}{hint}"
        )
    checked = []
    for group, (ids, layout, per_chunk) in enumerate(zip(block_ids, layouts, blocks_per_chunk, strict=True)):
        if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
            array = ids  # the common form, as is: the conversion's checks cost more than the ids' work
        else:
            if np.isscalar(ids):
                raise TypeError(f"block_ids[{group}] must be a sequence of block ids, not a single value")
            array = as_int64_array(ids, f"block_ids[{group}]", ndim=1)
        needed = num_chunks * per_chunk
        if array.size < needed:
            raise InvalidRequestError(
                f"block_ids[{group}] has {array.size} block ids but the {num_chunks} whole chunks "
                f"need {needed}"
            )
        used = array[:needed]
        # As uint64 a negative id is past every block: one reduction checks both ends (a request's
        # few ids cost per-call NumPy overhead, not per-element work).
        if used.size and int(used.view(np.uint64).max()) >= layout.num_blocks:
            index = int(np.flatnonzero((used < 0) | (used >= layout.num_blocks))[0])
            raise InvalidRequestError(
                f"block_ids[{group}][{index}] = {int(used[index])} is outside the group's "
                f"{layout.num_blocks} blocks"
            )
        if array is ids or (isinstance(ids, np.ndarray) and np.may_share_memory(used, ids)):
            # An int64 array (or a row of a 2-D table) passes unconverted: the pipeline reads it after
            # the call returns, so it takes its own copy (one memcpy), as every other form gets.
            used = used.copy()
        checked.append(used.reshape(num_chunks, per_chunk))
    return checked
