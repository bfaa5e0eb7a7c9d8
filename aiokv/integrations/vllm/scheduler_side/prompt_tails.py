"""A prompt's last partial block: stored when its request ends, found when the same prompt comes again.

vLLM hashes full blocks only, so a 2,000-token prompt in 128-token blocks leaves 80 tokens no key
covers, and every repeat of it computes them again (vLLM's own connector too). Here the tokens after the
last full block get a hash made as vLLM makes a block's (its own hash function over the last full
block's hash, the tokens, and the extra keys vLLM folds in: LoRA, multimodal inputs, cache salt, prompt
embeddings), chained after the full blocks like one more block. It matches only a prompt that ends with
exactly those tokens after exactly that prefix; a longer prompt's block there is full and has another
hash.

It is stored when its request ends, if the request sampled a token (the whole prompt's KV then
exists, computed or loaded): only then are the block's slots final (decode writes into it until the
end), so the store never races a forward; vLLM keeps the blocks until the worker reports the store
done. A loading request rewrites the slots past the prompt before it reads them (vLLM recomputes the
prompt's last token into the loaded block, then decodes into the rest). An in-process engine
(``LLM``) stores it on its next step: ``LLM.generate`` returns before that step.

Off with chunks of several blocks (the tail is not a chunk), with ``key_format "vllm"`` (vLLM's
connector never asks for such keys), with state groups (no state exists at a partial block's end) and
with MLA: vLLM 0.32's CPU MLA backend, computing the one token left after a loaded partial block, gave
greedy logprobs 0.11-0.25 from a full prefill's in float32 (a whole-block prompt: 0.0135; full
attention, a partial block: bitwise equal), a difference not yet explained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....keys import HashedPrompt
from ..common.block_keys import hashed_prompt
from ..common.connector_config import ConnectorConfig
from ..common.geometry import NULL_BLOCK_ID, EngineGeometry
from ..common.wire import TransferSpec


class PromptTails:
    def __init__(self, vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry) -> None:
        self.config = config
        self.block_size = geometry.block_size
        self.enabled = (
            config.store_prompt_tails
            and config.chunk_blocks == 1
            and config.key_format == "aiokv"
            and not geometry.has_state
            and not geometry.is_mla
        )
        self._hash_fn: Any = None
        if self.enabled:
            from vllm.utils.hashing import get_hash_fn_by_name

            # The engine's own block hash function (vLLM's engine core initialised its None hash).
            self._hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)

    def tail_hash(self, request: Any, end: int) -> Any | None:
        """vLLM's hash of tokens ``[full, end)`` (``full``: the last block boundary before ``end``) as
        one more block, or None if they end on a boundary or the full blocks are not all hashed."""
        full = end // self.block_size
        if not self.enabled or not end % self.block_size or len(request.block_hashes) < full:
            return None
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        start = full * self.block_size
        extra_keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        parent = request.block_hashes[full - 1] if full else None
        return hash_block_tokens(self._hash_fn, parent, request.all_token_ids[start:end], extra_keys)

    def lookup_hashes(self, request: Any, blocks: int) -> list[Any]:
        """The block hashes a lookup asks for: the first ``blocks`` full ones, and the tail's when
        they are all of the request's full blocks."""
        hashes = list(request.block_hashes[:blocks])
        if blocks == request.num_tokens // self.block_size:
            tail = self.tail_hash(request, request.num_tokens)
            if tail is not None:
                hashes.append(tail)
        return hashes

    def store_spec(self, request: Any, group_block_ids: Sequence[Sequence[int]]) -> TransferSpec | None:
        """The store of ``request``'s prompt tail from its blocks in each group as it ends; None
        without a tail, if no token was sampled (the prompt's KV may be incomplete: aborted before its
        prefill ended), or if a group no longer holds the block (a sliding window that moved past it
        hands a null block)."""
        prompt_tokens = int(request.num_prompt_tokens)
        if not request.output_token_ids:
            return None
        tail = self.tail_hash(request, prompt_tokens)
        if tail is None:
            return None
        full = prompt_tokens // self.block_size
        if any(len(ids) <= full or ids[full] == NULL_BLOCK_ID for ids in group_block_ids):
            return None
        hashes = [*request.block_hashes[:full], tail]
        prompt = hashed_prompt(hashes, len(hashes), self.config, self.block_size)
        return TransferSpec(
            request.request_id,
            HashedPrompt(prompt.hashes[-1:], prompt.chunk_tokens),
            tuple((int(ids[full]),) for ids in group_block_ids),
            (0,) * len(group_block_ids),
            offset=full,
        )
