"""Step 1 of a batch: chunk digests of the prompts that came as token ids, in short slices with a
yield to the loop between them, so the loop never stalls on a long prompt."""

from __future__ import annotations

import asyncio

import numpy as np

from ..errors import InvalidRequestError
from ..keys import chain_digests, digests_to_hex, token_bytes
from .request import Request
from .tracker import RequestTracker

# Tokens hashed between yields to the loop (~0.5 ms): a Python list also pays its conversion to an
# array, about 3x the hashing, so it gets smaller slices.
HASH_SLICE_TOKENS_ARRAY = 49152
HASH_SLICE_TOKENS_LIST = 16384


async def hash_prompts(
    requests: list[Request], chunk_tokens: int, seed: bytes, tracker: RequestTracker
) -> None:
    """Set ``hashes`` of every unfinished request that has tokens; a bad token value fails only its
    request."""
    c = chunk_tokens
    for request in requests:
        if request.hashes is not None or request.finished:
            continue
        tokens = request.tokens
        digests: list[bytes] = []
        previous = seed
        slice_tokens = HASH_SLICE_TOKENS_ARRAY if isinstance(tokens, np.ndarray) else HASH_SLICE_TOKENS_LIST
        per_slice = max(1, slice_tokens // c)
        try:
            for first in range(0, request.num_chunks, per_slice):
                count = min(per_slice, request.num_chunks - first)
                data = token_bytes(tokens[first * c : (first + count) * c])  # type: ignore[index]
                digests += chain_digests(data, 4 * c, count, previous)
                previous = digests[-1]
                await asyncio.sleep(0)
        except (TypeError, ValueError) as exc:
            tracker.fail(request, InvalidRequestError(f"{request.kind.value} #{request.id}: {exc}"))
            continue
        request.hashes = digests_to_hex(digests)
        request.tokens = None
