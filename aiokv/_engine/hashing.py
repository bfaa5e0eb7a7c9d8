"""Hashing: chunk digests of the prompts that came as token ids, in short slices, with a
yield to the loop whenever the batch's time slice is used up (:class:`.slices.LoopSlice`), so the loop
stalls neither on a long prompt nor on thousands of short ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import InvalidRequestError
from ..keys import chain_digests, digests_to_hex, token_bytes
from .batch import KeyArray
from .request import Request
from .slices import LoopSlice
from .tracker import RequestTracker

# Tokens hashed per piece (~0.4 ms) between checks of the slice clock: a Python list also pays its
# conversion to an array, about 3x the hashing, so it gets smaller pieces.
HASH_SLICE_TOKENS_ARRAY = 12288
HASH_SLICE_TOKENS_LIST = 4096
HASH_SLICE_CHUNKS = 1024  # short chunks: each digest costs ~1.5 us whatever its length
SHORT_PROMPT_CHUNKS = 64  # up to this many digests go in a list, more in an object array


async def hash_prompts(
    requests: list[Request], chunk_tokens: int, seed: bytes, tracker: RequestTracker
) -> None:
    """Set ``hashes`` of every unfinished request that has tokens; a bad token value fails only its
    request."""
    clock = LoopSlice()
    for request in requests:
        await clock.tick()
        if request.hashes is not None or request.finished:
            continue
        for _ in _hashing(request, chunk_tokens, seed, tracker):
            await clock.tick()


def hash_now(request: Request, chunk_tokens: int, seed: bytes, tracker: RequestTracker) -> None:
    """:func:`hash_prompts` of one short prompt, in the call."""
    for _ in _hashing(request, chunk_tokens, seed, tracker):
        pass


def _hashing(request: Request, chunk_tokens: int, seed: bytes, tracker: RequestTracker) -> Iterator[None]:
    """Hash ``request``'s tokens a slice at a time (yielding after each), then set its ``hashes``;
    on a bad token value, fail it instead."""
    c = chunk_tokens
    tokens = request.tokens
    # A long prompt's digests go in an object array, which the collector never tracks (see the
    # batch module); a short one's in a list, cheaper to make.
    hashes: list[str] | KeyArray = (
        np.empty(request.num_chunks, dtype=object) if request.num_chunks > SHORT_PROMPT_CHUNKS else []
    )
    previous = seed
    slice_tokens = HASH_SLICE_TOKENS_ARRAY if isinstance(tokens, np.ndarray) else HASH_SLICE_TOKENS_LIST
    per_slice = max(1, min(slice_tokens // c, HASH_SLICE_CHUNKS))
    try:
        for first in range(0, request.num_chunks, per_slice):
            count = min(per_slice, request.num_chunks - first)
            data = token_bytes(tokens[first * c : (first + count) * c])  # type: ignore[index]
            digests = chain_digests(data, 4 * c, count, previous)
            if isinstance(hashes, list):
                hashes += digests_to_hex(digests)
            else:
                hashes[first : first + count] = digests_to_hex(digests)
            previous = digests[-1]
            yield
    except (TypeError, ValueError) as exc:
        tracker.fail(request, InvalidRequestError(f"{request.kind.value} #{request.id}: {exc}"))
        return
    request.hashes = hashes
    request.tokens = None
