"""Token ranges checked against a KV-cache group's block table, for :meth:`KVLayout.prepare_values`:
vectorised on the way in, and a plain loop naming the first bad range only when one is bad."""

from __future__ import annotations

from typing import NoReturn

from ._arrays import IntArray
from .errors import InvalidRequestError


def check_chunks(
    starts: IntArray, ends: IntArray, block_ids: IntArray, block_size: int, num_blocks: int
) -> tuple[IntArray, IntArray]:
    """Validate chunk ranges; return (blocks per chunk, first physical block id per chunk)."""
    bs = block_size
    spans = ends - starts
    # ``ends <= starts``, not ``spans <= 0``: for a negative end the difference can wrap around.
    bad = (starts < 0) | (ends <= starts) | (spans % bs != 0) | (starts % bs != 0)
    first_index = starts // bs
    bad |= first_index >= block_ids.size
    if bad.any():
        _raise_first_bad(starts, ends, block_ids, block_size, num_blocks)
    nblocks = spans // bs
    first_bids = block_ids[first_index]
    outside = (first_bids < 0) | (first_bids > num_blocks - nblocks)
    if outside.any():
        _raise_first_bad(starts, ends, block_ids, block_size, num_blocks)
    return nblocks, first_bids


def _raise_first_bad(
    starts: IntArray, ends: IntArray, block_ids: IntArray, block_size: int, num_blocks: int
) -> NoReturn:
    """Raise for the first chunk failing any check, whichever check it fails (error path only, so
    a plain loop over Python ints: exact, no wraparound)."""
    bs, table_len = block_size, block_ids.size
    for k, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        span = end - start
        if start < 0:
            problem = "start is negative"
        elif span <= 0 or span % bs:
            problem = f"span {span} is not a positive multiple of block_size {bs}"
        elif start % bs:
            problem = f"start is not aligned to block_size {bs}"
        elif start // bs >= table_len:
            problem = f"block index {start // bs} is past the end of block_ids (length {table_len})"
        else:
            bid = int(block_ids[start // bs])
            if bid >= 0 and bid + span // bs <= num_blocks:
                continue
            problem = (
                f"physical blocks [{bid}, {bid + span // bs}) fall outside the cache's {num_blocks} blocks"
            )
        raise InvalidRequestError(f"chunk {k} ({start}, {end}): {problem}")
    # Not reached: the vectorised checks above only call here when some chunk is bad.
    raise InvalidRequestError("chunks failed validation")
