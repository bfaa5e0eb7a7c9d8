"""The scheduler-side half of the connector: lookups, and which chunks each step loads and stores.

It never blocks on the store for long: a lookup runs in the background and the scheduler is told to
ask again (``None``) until the answer is in; the answer is kept per request. It decides stores itself
(:mod:`.step_stores`), so it knows which finishing requests have stores the worker must finish before
their blocks are freed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....keys import HashedPrompt
from ....leases import LeaseBudget
from ..common.backend_handles import acquire_backend, at_exit, release_backend
from ..common.block_keys import hashed_prompt, moved_groups
from ..common.connector_config import ConnectorConfig
from ..common.geometry import EngineGeometry
from ..common.group_workers import GroupWorkers
from ..common.stats_reporter import CounterDeltas
from ..common.step_metadata import AiokvConnectorMetadata
from ..common.wire import TransferSpec
from .group_lookups import GroupLookup
from .hit_phases import HitPhases, hit_tracer
from .key_scope import log_key_scope
from .kv_events import connector_events
from .load_policy import Decision, LoadPolicy
from .load_specs import load_spec
from .prompt_tails import PromptTails
from .state_groups import StateGroups
from .step_stores import StepStores
from .tier_index import LookupClient, scheduler_tier

logger = logging.getLogger("aiokv.vllm")

# The scheduler's lookups may hold leases on this many KV caches' worth of chunks not loaded yet (a load
# leases what it reads itself: loaded chunks stop counting).
LOOKUP_LEASE_CACHES = 2


@dataclass
class _Hit:
    prompt: HashedPrompt  # the whole chunks found, from token 0
    tokens: int  # the hit told to vLLM, counted from token 0
    local: int = 0  # the local prefix-cache hit vLLM told us (where the load starts)
    decision: Decision | None = None  # the load policy's, if it is on


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry, cache_blocks: int
    ) -> None:
        import vllm.envs as envs

        self.config = config
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = config.chunk_blocks * geometry.block_size
        transfer = vllm_config.kv_transfer_config
        self.engine_id = str(transfer.engine_id)
        self.can_store = transfer.kv_role != "kv_consumer" or config.save_decode_cache
        self.can_load = transfer.kv_role != "kv_producer" and config.enable_lookup
        in_process = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
        if geometry.hybrid and not config.load_async:
            # vLLM 0.32 takes a multi-group model's load failures only per request, from asynchronous
            # loads (failed_recving); a synchronous load's failure could not be reported.
            raise ValueError(
                "AiokvConnector: a model with several KV cache groups (hybrid allocator) needs "
                "load_async true: vLLM recomputes a failed load of such a model only when it is asynchronous"
            )
        self._scratch = np.zeros(geometry.max_page_bytes, dtype=np.uint8)
        self._backend = (
            acquire_backend(self.engine_id, config, pure_client=not in_process) if config.remote else None
        )
        # One lookup client per KV cache group (per layer group with layer_groups > 1): a hit is as
        # long as every one can serve.
        moved = moved_groups(vllm_config, config, geometry, tp_rank=0, pp_rank=0)
        self._looked_up = [group for group, _ in moved]
        self._groups: GroupWorkers | None = None
        if self._backend is not None and self.can_load:
            self._groups = GroupWorkers(
                [group.lookup_layout(self._scratch, self.chunk_tokens) for group in self._looked_up],
                self._backend,
                [namespace for _, namespace in moved],
                chunk_tokens=self.chunk_tokens,
                executor_threads=1,
                # Not the default (the lookup layout is one scratch page). Distinct chunks (a prompt
                # asked about again costs nothing) found and not loaded yet: the hits of requests
                # waiting to be scheduled, or aborted before their load.
                lease_budgets=[
                    LeaseBudget(max_bytes=LOOKUP_LEASE_CACHES * cache_blocks * group.block_bytes)
                    for group in self._looked_up
                ],
            )
        self._clients: list[LookupClient] = list(self._groups.workers) if self._groups is not None else []
        # Host tier (backend "memory"/"tiered"): its index lives here, see :mod:`.tier_index`. Single-group
        # engines only (the connector refuses it on hybrid ones).
        self._tier = scheduler_tier(vllm_config, config, geometry.groups[0])
        if self._tier is not None and self.can_load:
            self._clients = [self._tier.lookup_client(self._clients[0] if self._clients else None)]
        self._stores_kv = self.can_store and (self._backend is not None or self._tier is not None)
        at_exit(self.shutdown)
        self._requests: dict[str, Any] = {}
        self._lookups: dict[str, GroupLookup] = {}
        self._hits: dict[str, _Hit] = {}
        self._loads: list[TransferSpec] = []
        self._loading: set[str] = set()
        # Blocks each request's load fills, until it is done; requests a load failed for (vLLM then
        # asks again: answering the same hit would load the same unreadable keys forever).
        self._load_blocks: dict[str, set[int]] = {}
        self._load_failed: set[str] = set()
        # Load only what beats recomputing (:mod:`.load_policy`); None: every hit is loaded.
        self._policy = LoadPolicy(config.backend) if config.decline_slow_loads and self._clients else None
        self._chunk_bytes = sum(g.chunk_bytes(config.chunk_blocks) for g in geometry.groups)
        # Linear-attention / Mamba groups: their states are asked for, stored and loaded apart.
        self._states = StateGroups(geometry, config)
        self._attention = [g for g, group in enumerate(self._looked_up) if not group.is_state]
        # Prompts' last partial blocks (:mod:`.prompt_tails`), stored once their requests end.
        self._tails = PromptTails(vllm_config, config, geometry)
        self._stores = StepStores(config, self.block_size, self._tails, self._states)
        # vLLM's KV events for the tiers (None unless the engine publishes events).
        self._events = connector_events(vllm_config, config, geometry, self._tails, self._tier)
        self.counters: Counter[str] = Counter()
        self._deltas = CounterDeltas()
        self._phases = HitPhases(tracer=hit_tracer())  # where each hit's time goes (stats hook, spans)
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "aiokv: kv_load_failure_policy is %r: a request whose KV fails to load errors out; "
                "set kv_load_failure_policy='recompute' to recompute those blocks instead",
                transfer.kv_load_failure_policy,
            )
        log_key_scope(vllm_config, config, geometry)

    # -- lookups --------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if not self._clients or num_computed_tokens % self.chunk_tokens or req_id in self._load_failed:
            # A local hit ending inside a chunk: loading that chunk would rewrite blocks in use. A load
            # that failed: vLLM asks again to recompute, and the same hit would fail again.
            return 0, False
        hit = self._hits.get(req_id)
        if hit is None:
            self._phases.asked(req_id, time.monotonic())
            answer = self._lookup_answer(request)
            if answer is None:
                self.counters["lookups_deferred"] += 1
                return None, False
            hit = self._hits[req_id] = answer
            self._phases.answered(req_id, time.monotonic())
        if hit.tokens <= num_computed_tokens:
            return 0, False
        hit.local = num_computed_tokens
        tokens = hit.tokens - num_computed_tokens
        if self._policy is not None:
            chunks = -(-tokens // self.chunk_tokens)
            hit.decision = self._policy.decide(chunks, self.chunk_tokens, self._chunk_bytes, time.monotonic())
            tokens = min(tokens, hit.decision.chunks * self.chunk_tokens)
            if not tokens or (self._states and tokens < hit.tokens - num_computed_tokens):
                # A shorter load would end where no state was looked up: all or nothing.
                return 0, False
        return tokens, self.config.load_async

    def _lookup_answer(self, request: Any) -> _Hit | None:
        """The hit once the lookup answered (a miss if it failed or is late), else None."""
        req_id = request.request_id
        lookup = self._lookups.get(req_id)
        if lookup is None:
            # Every full block, the last one too: an asynchronous load may cover the whole prompt
            # (vLLM then recomputes only its last token to sample from; see _hit_tokens).
            blocks = min(len(request.block_hashes), request.num_tokens // self.block_size)
            hashes = self._tails.lookup_hashes(request, blocks)  # the prompt's tail too, if stored
            prompt = hashed_prompt(hashes, len(hashes), self.config, self.block_size)
            if not prompt.hashes or not self._clients:
                return _Hit(prompt, 0)
            try:
                futures = [self._clients[g].lookup_many([prompt])[0] for g in self._attention]
                states = self._states.ask(self._clients, prompt, request.num_tokens) if self._states else {}
            except Exception as exc:
                logger.warning("aiokv: lookup for %s refused (%s); treated as a miss", req_id, exc)
                return _Hit(prompt, 0)
            lookup = self._lookups[req_id] = GroupLookup(
                futures,
                prompt,
                time.monotonic() + self.config.lookup_timeout_s,
                states=states,
                tail=len(hashes) > blocks,
            )
            # A short wait answers most lookups at the first ask; the rest are asked again next step.
            concurrent.futures.wait(lookup.pending(), timeout=self.config.lookup_wait_s)
        pending = lookup.pending()
        if not all(future.done() for future in pending):
            if time.monotonic() < lookup.deadline:
                return None
            logger.warning("aiokv: lookup for %s did not answer in time; treated as a miss", req_id)
            del self._lookups[req_id]
            for future in pending:
                future.cancel()
            return _Hit(lookup.prompt, 0)
        try:
            groups = [self._looked_up[g] for g in self._attention]
            clients = [self._clients[g] for g in self._attention]
            wait = self.config.lookup_wait_s
            if lookup.window is None and lookup.ask_windows(groups, clients, self.chunk_tokens, wait):
                return None
            chunks = lookup.found_chunks(self.chunk_tokens, self._states)
        except Exception as exc:
            logger.warning("aiokv: lookup for %s failed (%s); treated as a miss", req_id, exc)
            chunks = 0
        del self._lookups[req_id]
        tokens = chunks * self.chunk_tokens
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
        if self._policy is not None and hit is not None and hit.decision is not None:
            self._policy.count(hit.decision, self.chunk_tokens, hit.tokens - hit.local)
        if num_external_tokens <= 0 or hit is None:
            self._phases.allocated(req_id, time.monotonic(), 0)
            return
        spec = load_spec(
            req_id,
            hit.prompt,
            hit.local,
            blocks.get_block_ids(),
            num_external_tokens,
            geometry=self.geometry,
            chunk_blocks=self.chunk_blocks,
            states=self._states,
        )
        self._phases.allocated(req_id, time.monotonic(), len(spec.prompt.hashes) * self._chunk_bytes)
        self._loads.append(spec)
        if self._groups is not None:
            self._groups.lookup_loaded(spec.prompt)  # the load leases them itself from now on
        self._load_blocks[req_id] = {b for ids in (*spec.block_ids, *spec.unloaded_block_ids) for b in ids}
        if self._events is not None:
            self._events.on_load(request, spec)
        if self._tier is not None:
            self._tier.on_load(req_id, spec.prompt, asynchronous=self.config.load_async)
        if self.config.load_async:
            self._loading.add(req_id)
            if self._policy is not None:
                nbytes = len(spec.prompt.hashes) * self._chunk_bytes
                self._policy.load_started(req_id, nbytes, time.monotonic())
        # Loaded chunks are not marked stored: if the load fails they are recomputed, and the store
        # that follows writes them again (chunks the store has are skipped by one existence check).

    # -- each step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> AiokvConnectorMetadata:
        meta = AiokvConnectorMetadata(
            loads=self._loads,
            sync_loads=not self.config.load_async,
            idle=not scheduler_output.total_num_scheduled_tokens,
            scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        self._loads = []
        scheduled = set(scheduler_output.num_scheduled_tokens or ())
        self._phases.step([spec.req_id for spec in meta.loads], scheduled, time.monotonic())
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted:
            self._phases.forget(req_id)
            # Asked again from scratch when it is scheduled again.
            self._hits.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self._load_blocks.pop(req_id, None)
        if self._stores_kv:
            meta.stores = self._stores.for_step(scheduler_output, self._requests)
        return self._with_tier(meta)

    def _with_tier(self, meta: AiokvConnectorMetadata) -> AiokvConnectorMetadata:
        """The host tier's orders for this step (drops, admitted writes of its stores), if any."""
        if self._events is not None:
            self._events.on_step(meta, self._requests)
        if self._tier is not None:
            meta.tier = self._tier.on_step(meta.stores)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        # A hybrid engine's loads fail per request (block ids are not unique across groups).
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id, blocks in list(self._load_blocks.items()):
            if blocks & invalid or req_id in failed:
                logger.warning("aiokv: load for %s failed; it is computed without the cache", req_id)
                self._load_failed.add(req_id)
                del self._load_blocks[req_id]
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            self._load_blocks.pop(req_id, None)
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if loads_done := getattr(worker_meta, "loads_done", None):
            self._phases.loads_done(loads_done)
        self._phases.noticed(list(connector_output.finished_recving or ()), time.monotonic())
        if self._policy is not None:
            for req_id in (*(connector_output.finished_recving or ()), *failed):
                self._policy.load_ended(req_id)
            if measured := getattr(worker_meta, "measured", None):
                self._policy.observe(measured, time.monotonic())
        if self._tier is not None:
            self._tier.on_output(getattr(worker_meta, "tier", None), connector_output.finished_recving or ())
        if self._events is not None:
            self._events.on_output(connector_output)

    def on_handshake(self, handshakes: Iterable[Any]) -> None:
        """The workers' handshakes at start-up: what their disk tiers held (a restart), for the index."""
        for handshake in handshakes:
            if self._tier is not None and getattr(handshake, "tier", None) is not None:
                self._tier.on_output(handshake.tier, ())
                if self._events is not None:
                    self._events.on_found(handshake.tier)  # a restart's chunks, announced from the journal

    def request_finished(self, request: Any, group_block_ids: Sequence[Sequence[int]]) -> bool:
        """Whether the blocks must wait: a store of this request (its prompt's tail, ordered here for
        the next step), or its load, may still be in flight. The worker reports it in
        ``get_finished`` (sending or receiving) once memory is released."""
        req_id = request.request_id
        store_tail = self._stores_kv and req_id not in self._loading
        stored = self._stores.finished(request, group_block_ids, store_tail=store_tail)
        for table in (self._requests, self._hits, self._lookups, self._load_blocks):
            table.pop(req_id, None)  # type: ignore[attr-defined]
        self._load_failed.discard(req_id)
        self._phases.forget(req_id)
        if self._events is not None:
            self._events.request_finished(request)
        if self._policy is not None:
            self._policy.load_ended(req_id)
        loading = req_id in self._loading
        self._loading.discard(req_id)
        if self._tier is not None and not loading:
            self._tier.release(req_id)
        return loading or stored

    def take_events(self) -> list[Any]:
        """vLLM KV events for the connector's tiers since the last call (:mod:`.kv_events`)."""
        return self._events.take() if self._events is not None else []

    def stats(self) -> dict[str, Any]:
        """The scheduler's counters (lookups deferred), and the load policy's (hit tokens declined, and
        why) with its current estimates."""
        policy = self._policy.report(time.monotonic()) if self._policy is not None else None
        return {"counters": dict(self.counters), "load_policy": policy}

    def stats_delta(self) -> dict[str, Any] | None:
        """The scheduler's and the load policy's counters since the last report, and the hits' phases
        observed since then (lists of observations), for vLLM's stats hook."""
        policy = self._policy.counters if self._policy is not None else {}
        delta: dict[str, Any] = self._deltas.since_last({**self.counters, **policy}) or {}
        delta.update({f"hit_{name}": values for name, values in self._phases.take().items()})
        return delta or None

    def shutdown(self) -> None:
        if self._tier is not None:
            self._tier.log_contents()
        if self._events is not None:
            self._events.close()
        for lookup in self._lookups.values():
            for future in lookup.pending():
                future.cancel()
        self._clients = []
        if self._groups is not None:
            groups, self._groups = self._groups, None
            groups.close()
        if self._backend is not None:
            backend, self._backend = self._backend, None
            release_backend(self.engine_id, backend)
