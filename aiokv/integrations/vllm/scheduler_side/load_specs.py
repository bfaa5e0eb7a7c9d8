"""Which chunks a hit loads, into which blocks: a hit's load for vLLM's allocation of the request."""

from __future__ import annotations

import logging
from typing import Any

from ....keys import HashedPrompt
from ..common.geometry import EngineGeometry, usable_from
from ..common.wire import TransferSpec
from .state_groups import StateGroups

logger = logging.getLogger("aiokv.vllm")


def load_spec(
    req_id: str,
    prompt: HashedPrompt,
    local: int,
    group_block_ids: Any,
    num_external_tokens: int,
    *,
    geometry: EngineGeometry,
    chunk_blocks: int,
    states: StateGroups,
) -> TransferSpec:
    """The chunks of the hit ``prompt`` covering tokens ``[local, local + num_external_tokens)``, into
    the blocks vLLM allocated in each KV cache group. A chunk is loaded only if every one of its blocks
    was allocated (a load never writes a block the request was not given); the blocks of the hit left
    unloaded are reported failed, so vLLM recomputes them instead of reading what they hold. A
    sliding-window group gets null blocks before its window: only the chunks after them load. A state
    group loads the state at the hit's end (:mod:`.state_groups`)."""
    block_size = geometry.block_size
    chunk_tokens = chunk_blocks * block_size
    first = local // chunk_tokens
    end_token = local + num_external_tokens
    wanted = min(-(-end_token // chunk_tokens), len(prompt.hashes))
    allocated = min(len(ids) for ids in group_block_ids) // chunk_blocks
    last = max(first, min(wanted, allocated))
    end = last * chunk_blocks
    block_ids, first_chunks, unloaded = [], [], []
    for group, ids in enumerate(group_block_ids):
        if geometry.groups[group].is_state:
            state, missing = states.load_blocks(ids, end_token, end * block_size)
            first_chunks.append(last - first - 1)
            block_ids.append(state)
            unloaded.append(missing)
            continue
        window = max(first, usable_from(ids[:end], chunk_blocks))
        first_chunks.append(window - first)
        block_ids.append(tuple(int(b) for b in ids[window * chunk_blocks : end]))
        hit_blocks = min(-(-end_token // block_size), len(ids))
        unloaded.append(tuple(int(b) for b in ids[end:hit_blocks]))
    if any(unloaded) or last < wanted:
        logger.warning(
            "aiokv: %s was given %d blocks for a hit of %d tokens; %d block(s) are recomputed",
            req_id,
            allocated * chunk_blocks,
            end_token,
            max(sum(map(len, unloaded)), 1),
        )
    return TransferSpec(
        req_id,
        HashedPrompt(prompt.hashes[first:last], chunk_tokens),
        tuple(block_ids),
        tuple(first_chunks),
        tuple(unloaded),
        offset=first,
    )
