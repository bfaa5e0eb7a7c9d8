"""The scheduler-side half of the connector: lookups, and which chunks each step loads and stores.

It never blocks on the store for long: a lookup runs in the background and the scheduler is told to
ask again (``None``) until the answer is in; the answer is kept per request. It decides stores itself
(only whole chunks of full blocks, of the prompt unless ``save_decode_cache``), so it knows which
finishing requests have stores the worker must finish before their blocks are freed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...keys import HashedPrompt
from ...leases import LeaseBudget
from ...threaded import ThreadedKVWorker
from .clients import acquire_backend, at_exit, release_backend, safe_call
from .config import ConnectorConfig
from .geometry import KVGeometry
from .host_tier import LookupClient, scheduler_tier
from .keys import hashed_prompt, key_namespace
from .metadata import AiokvConnectorMetadata, TransferSpec

logger = logging.getLogger("aiokv.vllm")


@dataclass
class _Lookup:
    future: concurrent.futures.Future[int]
    prompt: HashedPrompt
    deadline: float


@dataclass
class _Hit:
    prompt: HashedPrompt  # the whole chunks found, from token 0
    tokens: int  # the hit told to vLLM, counted from token 0
    local: int = 0  # the local prefix-cache hit vLLM told us (where the load starts)


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, config: ConnectorConfig, geometry: KVGeometry, cache_blocks: int
    ) -> None:
        import vllm.envs as envs

        self.config = config
        self.block_size = geometry.block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = config.chunk_blocks * geometry.block_size
        transfer = vllm_config.kv_transfer_config
        self.engine_id = str(transfer.engine_id)
        self.can_store = transfer.kv_role != "kv_consumer" or config.save_decode_cache
        self.can_load = transfer.kv_role != "kv_producer" and config.enable_lookup
        in_process = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self._scratch = np.zeros(geometry.page_bytes, dtype=np.uint8)
        self._backend = (
            acquire_backend(self.engine_id, config, pure_client=not in_process) if config.remote else None
        )
        self._client: LookupClient | None = None
        if self._backend is not None and self.can_load:
            self._client = ThreadedKVWorker(
                geometry.lookup_layout(self._scratch),
                self._backend,
                namespace=key_namespace(vllm_config, config, geometry, tp_rank=0, pp_rank=0),
                chunk_tokens=self.chunk_tokens,
                executor_threads=1,
                # The lookup worker's own layout is one scratch page: its lookups may lease what the
                # engine's KV cache holds (the default budget would be that one page).
                lease_budget=LeaseBudget(max_bytes=cache_blocks * geometry.num_layers * geometry.page_bytes),
            )
        # Host tier (backend "memory"/"tiered"): its index lives here, see host_tier.py.
        self._tier = scheduler_tier(vllm_config, config, geometry)
        if self._tier is not None and self.can_load:
            self._client = self._tier.lookup_client(self._client)
        at_exit(self.shutdown)
        self._requests: dict[str, Any] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._hits: dict[str, _Hit] = {}
        self._loads: list[TransferSpec] = []
        self._loading: set[str] = set()
        # Blocks each request's load fills, until it is done; requests a load failed for (vLLM then
        # asks again: answering the same hit would load the same unreadable keys forever).
        self._load_blocks: dict[str, set[int]] = {}
        self._load_failed: set[str] = set()
        self._prompts: dict[str, HashedPrompt] = {}
        self._stored_chunks: dict[str, int] = {}
        self._with_stores: set[str] = set()

    # -- lookups --------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if self._client is None or num_computed_tokens % self.chunk_tokens or req_id in self._load_failed:
            # A local hit ending inside a chunk: loading that chunk would rewrite blocks in use. A load
            # that failed: vLLM asks again to recompute, and the same hit would fail again.
            return 0, False
        hit = self._hits.get(req_id)
        if hit is None:
            answer = self._lookup_answer(request)
            if answer is None:
                return None, False
            hit = self._hits[req_id] = answer
        if hit.tokens <= num_computed_tokens:
            return 0, False
        hit.local = num_computed_tokens
        return hit.tokens - num_computed_tokens, self.config.load_async

    def _lookup_answer(self, request: Any) -> _Hit | None:
        """The hit once the lookup answered (a miss if it failed or is late), else None."""
        req_id = request.request_id
        lookup = self._lookups.get(req_id)
        if lookup is None:
            # Every full block, the last one too: an asynchronous load may cover the whole prompt
            # (vLLM then recomputes only its last token to sample from; see _hit_tokens).
            blocks = min(len(request.block_hashes), request.num_tokens // self.block_size)
            prompt = hashed_prompt(request.block_hashes, blocks, self.config, self.block_size)
            if not prompt.hashes or self._client is None:
                return _Hit(prompt, 0)
            try:
                (future,) = self._client.lookup_many([prompt])
            except Exception as exc:
                logger.warning("aiokv: lookup for %s refused (%s); treated as a miss", req_id, exc)
                return _Hit(prompt, 0)
            lookup = self._lookups[req_id] = _Lookup(
                future, prompt, time.monotonic() + self.config.lookup_timeout_s
            )
            # A short wait answers most lookups at the first ask; the rest are asked again next step.
            concurrent.futures.wait([future], timeout=self.config.lookup_wait_s)
        if not lookup.future.done():
            if time.monotonic() < lookup.deadline:
                return None
            logger.warning("aiokv: lookup for %s did not answer in time; treated as a miss", req_id)
            del self._lookups[req_id]
            lookup.future.cancel()
            return _Hit(lookup.prompt, 0)
        del self._lookups[req_id]
        try:
            tokens = int(lookup.future.result())
        except Exception as exc:
            logger.warning("aiokv: lookup for %s failed (%s); treated as a miss", req_id, exc)
            tokens = 0
        chunks = tokens // self.chunk_tokens
        found = HashedPrompt(lookup.prompt.hashes[:chunks], self.chunk_tokens)
        return _Hit(found, self._hit_tokens(request, tokens))

    def _hit_tokens(self, request: Any, found: int) -> int:
        """The hit to tell vLLM for ``found`` leading tokens in the store. vLLM must compute at least
        one token to sample from: an asynchronous load may still cover the whole prompt (vLLM 0.32
        rewinds ``num_computed_tokens`` to ``num_tokens - 1`` once it lands and recomputes that
        token into the loaded last block); a synchronous one is scheduled in the same step and must
        leave one token to compute (the whole last block is loaded all the same, and the forward
        then rewrites its last slot)."""
        if self.config.load_async:
            return min(found, request.num_tokens)
        return min(found, request.num_tokens - 1)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        hit = self._hits.pop(req_id, None)
        if num_external_tokens <= 0 or hit is None:
            return
        spec = self._load_spec(req_id, hit, blocks.get_block_ids()[0], num_external_tokens)
        self._loads.append(spec)
        self._load_blocks[req_id] = set(spec.block_ids) | set(spec.unloaded_block_ids)
        if self._tier is not None:
            self._tier.on_load(req_id, spec.prompt, asynchronous=self.config.load_async)
        if self.config.load_async:
            self._loading.add(req_id)
        # Loaded chunks are not marked stored: if the load fails they are recomputed, and the store
        # that follows writes them again (chunks the store has are skipped by one existence check).

    def _load_spec(self, req_id: str, hit: _Hit, block_ids: Any, num_external_tokens: int) -> TransferSpec:
        """The chunks covering tokens ``[hit.local, hit.local + num_external_tokens)``, into the blocks
        vLLM allocated. A chunk is loaded only if every one of its blocks was allocated (a load never
        writes a block the request was not given); the blocks of the hit left unloaded are reported
        failed, so vLLM recomputes them instead of reading what they hold."""
        first = hit.local // self.chunk_tokens
        end_token = hit.local + num_external_tokens
        wanted = min(-(-end_token // self.chunk_tokens), len(hit.prompt.hashes))
        last = max(first, min(wanted, len(block_ids) // self.chunk_blocks))
        start, end = first * self.chunk_blocks, last * self.chunk_blocks
        hit_blocks = min(-(-end_token // self.block_size), len(block_ids))
        unloaded = tuple(int(b) for b in block_ids[end:hit_blocks])
        if unloaded or last < wanted:
            logger.warning(
                "aiokv: %s was given %d blocks for a hit of %d tokens; %d block(s) are recomputed",
                req_id,
                len(block_ids),
                end_token,
                max(len(unloaded), 1),
            )
        return TransferSpec(
            req_id,
            HashedPrompt(hit.prompt.hashes[first:last], self.chunk_tokens),
            tuple(int(b) for b in block_ids[start:end]),
            unloaded,
        )

    # -- each step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> AiokvConnectorMetadata:
        meta = AiokvConnectorMetadata(
            loads=self._loads,
            sync_loads=not self.config.load_async,
            idle=not scheduler_output.total_num_scheduled_tokens,
        )
        self._loads = []
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted:
            # Asked again from scratch when it is scheduled again.
            self._hits.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self._load_blocks.pop(req_id, None)
        if not self.can_store or (self._backend is None and self._tier is None):
            return self._with_tier(meta)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
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
            prompt = self._prompts.get(req_id)
            if prompt is None or len(prompt.hashes) < chunks:
                prompt = self._prompts[req_id] = hashed_prompt(
                    request.block_hashes, blocks, self.config, self.block_size
                )
            block_ids = table[0][done * self.chunk_blocks : chunks * self.chunk_blocks]
            meta.stores.append(
                TransferSpec(
                    req_id,
                    HashedPrompt(prompt.hashes[done:chunks], self.chunk_tokens),
                    tuple(int(b) for b in block_ids),
                )
            )
            self._stored_chunks[req_id] = chunks
            self._with_stores.add(req_id)
        return self._with_tier(meta)

    def _with_tier(self, meta: AiokvConnectorMetadata) -> AiokvConnectorMetadata:
        """The host tier's orders for this step (drops, admitted writes of its stores), if any."""
        if self._tier is not None:
            meta.tier = self._tier.on_step(meta.stores)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        for req_id, blocks in list(self._load_blocks.items()):
            if blocks & invalid:
                logger.warning("aiokv: load for %s failed; it is computed without the cache", req_id)
                self._load_failed.add(req_id)
                del self._load_blocks[req_id]
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            self._load_blocks.pop(req_id, None)
        if self._tier is not None:
            worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            self._tier.on_output(getattr(worker_meta, "tier", None), connector_output.finished_recving or ())

    def request_finished(self, request: Any) -> bool:
        """Whether the blocks must wait: a store of this request, or its load, may still be in flight.
        The worker reports it in ``get_finished`` (sending or receiving) once memory is released."""
        req_id = request.request_id
        for table in (
            self._requests,
            self._hits,
            self._lookups,
            self._prompts,
            self._stored_chunks,
            self._load_blocks,
        ):
            table.pop(req_id, None)  # type: ignore[attr-defined]
        self._load_failed.discard(req_id)
        loading = req_id in self._loading
        self._loading.discard(req_id)
        if self._tier is not None and not loading:
            self._tier.release(req_id)
        stored = req_id in self._with_stores
        self._with_stores.discard(req_id)
        return loading or stored

    def shutdown(self) -> None:
        for lookup in self._lookups.values():
            lookup.future.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            safe_call("closing the lookup client", lambda: client.close(timeout=5.0))
        if self._backend is not None:
            backend, self._backend = self._backend, None
            release_backend(self.engine_id, backend)
