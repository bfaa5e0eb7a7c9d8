"""Which chunks each engine step stores, and which finishing requests still have stores in flight.

Only whole chunks of full blocks are stored, of the prompt unless ``save_decode_cache``, each once,
as the step whose forward computes them is scheduled; a prompt's last partial block as its request
ends (:mod:`.prompt_tails`); a state group's states as vLLM hands them over (:mod:`.state_groups`).
A request with any store ordered keeps its blocks until the worker reports that store done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....keys import HashedPrompt
from ..common.block_keys import hashed_prompt
from ..common.connector_config import ConnectorConfig
from ..common.geometry import usable_from
from ..common.wire import TransferSpec
from .prompt_tails import PromptTails
from .state_groups import StateGroups


class StepStores:
    def __init__(
        self, config: ConnectorConfig, block_size: int, tails: PromptTails, states: StateGroups
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = config.chunk_blocks * block_size
        self._tails = tails
        self._states = states
        self._prompts: dict[str, HashedPrompt] = {}  # each request's chunk digests, as far as hashed
        self._stored_chunks: dict[str, int] = {}  # each request's leading chunks ordered stored
        self._with_stores: set[str] = set()  # requests with a store ordered since they started
        self._tail_stores: list[TransferSpec] = []  # of requests that ended since the last step

    def for_step(self, scheduler_output: Any, requests: dict[str, Any]) -> list[TransferSpec]:
        """This step's stores: the tails of requests that ended since the last step, the chunks this
        step's forward completes, and the states vLLM hands over."""
        stores, self._tail_stores = self._tail_stores, []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            # Tokens whose KV exists once this step's forward ran (draft tokens may be rejected).
            computed = request.num_computed_tokens + scheduled - len(spec_tokens.get(req_id, ()))
            if not self.config.save_decode_cache:
                computed = min(computed, request.num_prompt_tokens)
            blocks = min(computed // self.block_size, len(request.block_hashes))
            chunks = blocks // self.chunk_blocks
            done = self._stored_chunks.get(req_id, 0)
            if chunks <= done:
                continue
            table = block_state.get_block_ids(req_id) if block_state is not None else None
            if table is None:
                continue
            table = self._states.without_states(table)  # their states come from vLLM's hand-offs
            prompt = self._prompts.get(req_id)
            if prompt is None or len(prompt.hashes) < chunks:
                prompt = self._prompts[req_id] = hashed_prompt(
                    request.block_hashes, blocks, self.config, self.block_size
                )
            stores.append(self._chunks(req_id, prompt, table, done, chunks))
            self._stored_chunks[req_id] = chunks
            self._with_stores.add(req_id)
        if self._states and block_state is not None:
            states = self._states.stores(block_state, requests)
            stores += states
            self._with_stores.update(spec.req_id for spec in states)
        return stores

    def _chunks(self, req_id: str, prompt: HashedPrompt, table: Any, done: int, chunks: int) -> TransferSpec:
        """Chunks ``[done, chunks)`` from each group's blocks. Every group still holds the blocks this
        step computes (vLLM frees a sliding window's older blocks only in a later step), so the null
        blocks skipped here are only those of chunks finished over several steps."""
        block_ids, first_chunks = [], []
        for ids in table:
            window = max(done, usable_from(ids[: chunks * self.chunk_blocks], self.chunk_blocks))
            first_chunks.append(window - done)
            block_ids.append(
                tuple(int(b) for b in ids[window * self.chunk_blocks : chunks * self.chunk_blocks])
            )
        return TransferSpec(
            req_id,
            HashedPrompt(prompt.hashes[done:chunks], self.chunk_tokens),
            tuple(block_ids),
            tuple(first_chunks),
            offset=done,
        )

    def finished(self, request: Any, group_block_ids: Sequence[Sequence[int]], *, store_tail: bool) -> bool:
        """Forget ``request``, ordering its prompt's tail stored on the next step if ``store_tail``;
        whether a store of it may still be in flight (its blocks must wait for the worker's report)."""
        req_id = request.request_id
        tail = self._tails.store_spec(request, group_block_ids) if store_tail else None
        if tail is not None:
            self._tail_stores.append(tail)
            self._with_stores.add(req_id)
        self._prompts.pop(req_id, None)
        self._stored_chunks.pop(req_id, None)
        stored = req_id in self._with_stores
        self._with_stores.discard(req_id)
        return stored
