"""Linear-attention / Mamba KV cache groups (Qwen3-Next's gated delta net, ...) in vLLM's "align" mode.

Such a group's block is not a block of tokens: it is the running state after some position, kept by
vLLM at block-aligned positions only. Its table is not positional either (interior states are nulled
and freed as the request advances), so a state is stored only when vLLM hands it over with its exact
block (``kv_connector_block_state.boundary_state_offloads``: ``(group, block, tokens)``), under the
chunk digest of the prefix it ends (the key of the chunk ending at ``tokens``, in the group's own
namespace). A hit ends where every attention group holds the chunks before it and every state group
holds the state at that very position; the state is loaded into the block vLLM allocates for it (the
last block of the hit in the group's table). Other modes are refused.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from ....keys import HashedPrompt
from ..common.block_keys import hashed_prompt
from ..common.connector_config import ConnectorConfig
from ..common.geometry import NULL_BLOCK_ID, EngineGeometry
from ..common.wire import TransferSpec


class StateGroups:
    """The scheduler's part of the state groups: which states to store, ask for and load."""

    def __init__(self, geometry: EngineGeometry, config: ConnectorConfig) -> None:
        self.groups = [g for g, group in enumerate(geometry.groups) if group.is_state]
        self.num_groups = len(geometry.groups)
        self.block_size = geometry.block_size
        self.chunk_tokens = config.chunk_blocks * geometry.block_size
        self.config = config

    def __bool__(self) -> bool:
        return bool(self.groups)

    # -- lookups --------------------------------------------------------------------------------

    def ask(
        self, clients: Sequence[Any], prompt: HashedPrompt, num_tokens: int
    ) -> dict[int, list[concurrent.futures.Future[int]]]:
        """Per state group, whether it holds the state after each chunk of ``prompt`` (a future per
        chunk end). Only ends that leave a token to compute: vLLM then computes from the state."""
        ends = min(len(prompt.hashes), (num_tokens - 1) // self.chunk_tokens)
        singles = [HashedPrompt((digest,), self.chunk_tokens) for digest in prompt.hashes[:ends]]
        return {g: list(clients[g].lookup_many(singles)) if singles else [] for g in self.groups}

    @staticmethod
    def hit(chunks: int, states: dict[int, list[concurrent.futures.Future[int]]]) -> int:
        """The longest hit of at most ``chunks`` (what the attention groups serve) at whose end every
        state group holds its state; 0 if none."""
        for end in range(chunks, 0, -1):
            if all(len(futures) >= end and int(futures[end - 1].result()) > 0 for futures in states.values()):
                return end
        return 0

    # -- loads ----------------------------------------------------------------------------------

    def load_blocks(
        self, ids: Sequence[int], end_token: int, loaded_end: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A state group's part of a load ending at ``end_token`` (chunks loaded up to token
        ``loaded_end``): ``((block,), ())`` to load the state into, or ``((), unloaded)`` when the load
        cannot end there (vLLM then recomputes the request in every group)."""
        index = end_token // self.block_size - 1
        if end_token == loaded_end and end_token % self.chunk_tokens == 0 and 0 <= index < len(ids):
            block = int(ids[index])
            if block != NULL_BLOCK_ID:
                return (block,), ()
        return (), tuple(int(b) for b in ids[: index + 1]) or (NULL_BLOCK_ID,)

    # -- stores ---------------------------------------------------------------------------------

    def without_states(self, table: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """A request's block table with the state groups' left out: their tables are not positional
        (their states are stored from vLLM's hand-offs only)."""
        if not self.groups:
            return table
        return tuple(() if g in self.groups else ids for g, ids in enumerate(table))

    def stores(self, block_state: Any, requests: dict[str, Any]) -> list[TransferSpec]:
        """This step's states handed over at chunk ends, one spec each: the state's block under the key
        of the chunk its prefix ends with. Ends past the prompt only with ``save_decode_cache``."""
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        specs = []
        for req_id, entries in offloads.items():
            request = requests.get(req_id)
            if request is None:
                continue
            for group, block, tokens in entries:
                if group not in self.groups or int(block) == NULL_BLOCK_ID:
                    continue
                if (
                    tokens <= 0
                    or tokens % self.chunk_tokens
                    or tokens // self.block_size > len(request.block_hashes)
                ):
                    continue
                if not self.config.save_decode_cache and tokens > request.num_prompt_tokens:
                    continue
                prompt = hashed_prompt(
                    request.block_hashes, tokens // self.block_size, self.config, self.block_size
                )
                specs.append(
                    TransferSpec(
                        req_id,
                        HashedPrompt(prompt.hashes[-1:], self.chunk_tokens),
                        tuple((int(block),) if g == group else () for g in range(self.num_groups)),
                        (0,) * self.num_groups,
                    )
                )
        return specs
