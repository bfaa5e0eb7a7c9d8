"""KV cache events for what the connector's tiers hold: vLLM's ``BlockStored`` and ``BlockRemoved``, as
vLLM's own publisher writes them, so a router subscribed to an engine's events learns its tiers too.

vLLM's scheduler publishes, after each step, its prefix cache's events and what the connector's
``take_events`` returns. They are built here, on the scheduler's thread, only when the engine runs with
``kv_events_config.enable_kv_cache_events``; otherwise this module is not used at all.

- The engine's own tier (``locality "LOCAL"``, ``medium "CPU"`` in memory, ``"STORAGE"`` on disk): its
  index (:mod:`.tier_index`) tells each chunk's admission, the moment it becomes a hit (every rank wrote
  it) and the moment it leaves (evicted, or a rank could not write or lost it): one BlockStored when
  lookups start finding it, one BlockRemoved when they stop, each exactly once. A disk tier's chunks
  found at start are not announced: only their digests are known, not vLLM's block hashes.
- The store behind the engine (Mooncake or a backend of the user's own: ``medium "CPU"``, ``locality
  "REMOTE"``, ``ownership`` the backend): BlockStored once every writing rank confirmed a chunk in the
  store (the workers' :class:`..common.wire.StoreReport`), repeats of recently announced chunks left
  out (a chunk loaded is stored again, and found there); BlockRemoved when a load finds a chunk missing
  or refuses its value (verification): the store evicts without telling anyone, and another engine may
  have announced the chunk.

One event per chunk: its blocks' hashes as vLLM's publisher emits them (``request.block_hashes``; ints
under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the block before it as parent, its tokens. A prompt's last
partial block (:mod:`.prompt_tails`) is one block of its own tokens under its own hash. A chunk's payload
is taken from its request when its write is ordered and kept until it is announced; the host tier keeps
the hashes of each chunk it holds until its removal. Engines with one KV cache group only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ..common.connector_config import ConnectorConfig
from ..common.geometry import EngineGeometry
from ..common.step_metadata import AiokvConnectorMetadata
from ..common.store_writers import store_writer_count
from ..common.wire import StoreReport, TransferSpec
from .prompt_tails import PromptTails
from .tier_index import SchedulerTier

logger = logging.getLogger("aiokv.vllm")

# Store chunks remembered as announced, so that the stores following their loads announce nothing new;
# one forgotten is announced again when next confirmed (a repeat, never a wrong event).
ANNOUNCED_STORE_CHUNKS = 1 << 16
# A synchronous load's failures come with the output of the step that ran it: watched that long.
_SYNC_LOAD_OUTPUTS = 2


@dataclass(frozen=True)
class Tier:
    """How one of the connector's tiers is named in events."""

    medium: str
    locality: str
    ownership: str | None = None


@dataclass(slots=True)
class _Chunk:
    """One chunk's BlockStored payload, taken from its request."""

    hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    session_id: str | None


@dataclass(slots=True)
class _Pending:
    """A chunk ordered stored: announced once every writer confirmed it, forgotten once every order's
    writes are reported (``orders`` stores of it, each confirmed or not by every writer)."""

    chunk: _Chunk
    orders: int = 1
    reports: int = 0
    writers: set[int] = field(default_factory=set)
    announced: bool = False


@dataclass(slots=True)
class _Load:
    """A load from the store: per chunk, its digest, its blocks and its block hashes, in prompt order."""

    chunks: list[tuple[str, frozenset[int], list[Any]]]
    outputs_left: int | None  # synchronous loads: the outputs that may still report its failures


class ConnectorEvents:
    """The events of one engine's connector (see the module docstring). ``tier``: the engine's own tier,
    if any (this object becomes its index's watcher), named ``local``; ``store``: the store behind the
    engine, if any, written by ``writers`` ranks."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        tails: PromptTails,
        tier: SchedulerTier | None,
        store: Tier | None,
        writers: int,
        *,
        load_async: bool,
        local: Tier = Tier(MEDIUM_CPU, "LOCAL"),
    ) -> None:
        self.block_size = block_size
        self.chunk_blocks = config.chunk_blocks
        self.tails = tails
        self.tier = tier
        self.local = local
        self.store = store
        self.writers = writers
        self.load_async = load_async
        self._events: list[KVCacheEvent] = []
        self._ended: dict[str, Any] = {}  # requests ended since the last step: their tails are stored next
        self._staged: dict[str, _Chunk] = {}  # this step's writes ordered, until the tier admits them
        self._tier_writing: dict[str, _Chunk] = {}  # admitted, not yet written by every rank
        self._tier_held: dict[str, list[Any]] = {}  # announced: the hashes its removal names
        self._store_pending: dict[str, _Pending] = {}
        self._announced: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, _Load] = {}
        if tier is not None:
            tier.index.watcher = self

    # -- what the scheduler side tells --------------------------------------------------------

    def on_load(self, request: Any, spec: TransferSpec) -> None:
        """A load was decided (before the tier pins and admits its chunks)."""
        tier = self.tier
        if tier is not None and tier.behind:  # chunks read from the store behind are promoted into the tier
            for index, digest in enumerate(spec.prompt.hashes):
                if not tier.index.known(digest):
                    chunk = self._chunk(request, spec.offset + index, end=request.num_tokens)
                    if chunk is not None:
                        self._staged[digest] = chunk
        if self.store is not None:
            self._watch_load(request, spec)

    def _watch_load(self, request: Any, spec: TransferSpec) -> None:
        """Keep which blocks each chunk read from the store fills, to name a chunk a failed read found
        missing. Chunks the host tier holds are read from it, not from the store."""
        first = spec.first_chunks[0]
        blocks = spec.block_ids[0]
        chunks = []
        for index, digest in enumerate(spec.prompt.hashes[first:]):
            own = frozenset(blocks[index * self.chunk_blocks : (index + 1) * self.chunk_blocks])
            if self.tier is not None and self.tier.index.ready(digest):
                continue
            hashes = self._hashes(request, spec.offset + first + index, end=request.num_tokens)
            if hashes:
                chunks.append((digest, own, hashes))
        if chunks:
            self._loads[spec.req_id] = _Load(chunks, None if self.load_async else _SYNC_LOAD_OUTPUTS)

    def on_step(self, meta: AiokvConnectorMetadata, requests: Mapping[str, Any]) -> None:
        """This step's stores were ordered (before the tier admits them)."""
        self._staged.clear()  # the loads' chunks were admitted when their loads were decided
        for req_id in meta.preempted:
            self._loads.pop(req_id, None)
        for spec in meta.stores:
            request = requests.get(spec.req_id)
            tail_end = None
            if request is None:  # a prompt's tail, stored once its request ended
                request = self._ended.get(spec.req_id)
                if request is None:
                    continue
                tail_end = int(request.num_prompt_tokens)
            first = spec.first_chunks[0] if spec.first_chunks else 0
            for index, digest in enumerate(spec.prompt.hashes):
                # A chunk the store was announced to hold needs no payload again (a loaded prompt's
                # chunks are stored again: most of a hit's stores), unless the engine's tier admits it.
                ordered = self.store is not None and index >= first and digest not in self._announced
                if self.tier is None and not ordered:
                    continue
                chunk = self._chunk(request, spec.offset + index, end=tail_end)
                if chunk is None:
                    continue
                if self.tier is not None:
                    self._staged[digest] = chunk
                if ordered:  # the workers store the group's chunks
                    self._order_store(digest, chunk)
        self._ended.clear()

    def request_finished(self, request: Any) -> None:
        self._loads.pop(request.request_id, None)
        if self.tails.enabled:
            self._ended[request.request_id] = request

    def on_output(self, output: Any) -> None:
        """A step's output from the workers (after the tier read its report)."""
        store = self.store
        if store is None:
            return
        report = getattr(getattr(output, "kv_connector_worker_meta", None), "stored", None)
        if isinstance(report, StoreReport):
            self._confirm(report, store)
        if not self._loads:
            return
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        done = set(getattr(output, "finished_recving", None) or ())
        for req_id, load in list(self._loads.items()):
            failed = False
            if invalid:
                for digest, blocks, hashes in load.chunks:
                    if blocks & invalid:  # the first chunk it could not read; those after were not tried
                        self._store_removed(digest, hashes, store)
                        failed = True
                        break
            if load.outputs_left is not None:
                load.outputs_left -= 1
            if failed or req_id in done or load.outputs_left == 0:
                del self._loads[req_id]

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # -- the host tier's index (TierWatcher) ----------------------------------------------------

    def admitted(self, digest: str) -> None:
        chunk = self._staged.pop(digest, None)
        if chunk is not None:
            self._tier_writing[digest] = chunk

    def ready(self, digest: str) -> None:
        chunk = self._tier_writing.pop(digest, None)
        if chunk is None:
            return
        self._events.append(self._stored(chunk, self.local))
        self._tier_held[digest] = chunk.hashes

    def dropped(self, digest: str) -> None:
        self._tier_writing.pop(digest, None)
        hashes = self._tier_held.pop(digest, None)
        if hashes is not None:
            self._events.append(_removed(hashes, self.local))

    # -- the store behind -----------------------------------------------------------------------

    def _order_store(self, digest: str, chunk: _Chunk) -> None:
        pending = self._store_pending.get(digest)
        if pending is None:
            self._store_pending[digest] = _Pending(chunk)
        else:
            pending.orders += 1

    def _confirm(self, report: StoreReport, store: Tier) -> None:
        for outcome, by_rank in ((True, report.stored), (False, report.failed)):
            for rank, digests in by_rank.items():
                for digest in digests:
                    pending = self._store_pending.get(digest)
                    if pending is None:
                        continue
                    pending.reports += 1
                    if outcome:
                        pending.writers.add(rank)
                    if not pending.announced and len(pending.writers) >= self.writers:
                        pending.announced = True
                        self._store_announced(digest, pending.chunk, store)
                    if pending.reports >= pending.orders * self.writers:
                        del self._store_pending[digest]

    def _store_announced(self, digest: str, chunk: _Chunk, store: Tier) -> None:
        if digest in self._announced:
            self._announced.move_to_end(digest)
            return
        self._announced[digest] = None
        if len(self._announced) > ANNOUNCED_STORE_CHUNKS:
            self._announced.popitem(last=False)
        self._events.append(self._stored(chunk, store))

    def _store_removed(self, digest: str, hashes: list[Any], store: Tier) -> None:
        self._announced.pop(digest, None)
        self._events.append(_removed(hashes, store))

    # -- payloads -------------------------------------------------------------------------------

    def _hashes(self, request: Any, chunk: int, *, end: int) -> list[Any] | None:
        """The vLLM block hashes of ``request``'s chunk ``chunk`` (a tail past its full blocks ending
        at token ``end``), as events carry them; None if unknown."""
        first = chunk * self.chunk_blocks
        raw = request.block_hashes
        if first + self.chunk_blocks <= len(raw):
            return [maybe_convert_block_hash(h) for h in raw[first : first + self.chunk_blocks]]
        tail = self.tails.tail_hash(request, end) if first == len(raw) else None
        return [maybe_convert_block_hash(tail)] if tail is not None else None

    def _chunk(self, request: Any, chunk: int, *, end: int | None) -> _Chunk | None:
        """The payload of ``request``'s chunk ``chunk``: its full blocks, or, ``end`` given and the chunk
        not a full block below ``end``, the tail of the prompt ending at token ``end``; None if it cannot
        be named."""
        bs = self.block_size
        first = chunk * self.chunk_blocks
        raw = request.block_hashes
        tail = False
        if end is not None and (first + self.chunk_blocks > len(raw) or end < (first + 1) * bs):
            tail = True
            tail_hash = self.tails.tail_hash(request, end)
            if tail_hash is None:
                return None
            hashes = [maybe_convert_block_hash(tail_hash)]
            start, stop = first * bs, end
            blocks = [(start, stop)]
        elif first + self.chunk_blocks <= len(raw):
            hashes = [maybe_convert_block_hash(h) for h in raw[first : first + self.chunk_blocks]]
            start, stop = first * bs, (first + self.chunk_blocks) * bs
            blocks = [(b * bs, (b + 1) * bs) for b in range(first, first + self.chunk_blocks)]
        else:
            return None
        lora = request.lora_request
        return _Chunk(
            hashes=hashes,
            parent=maybe_convert_block_hash(raw[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[start:stop]),
            block_size=stop - start if tail else bs,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(
                [generate_block_hash_extra_keys(request, a, b, 0)[0] for a, b in blocks]
            ),
            session_id=getattr(request, "session_id", None),
        )

    @staticmethod
    def _stored(chunk: _Chunk, tier: Tier) -> BlockStored:
        return BlockStored(
            block_hashes=chunk.hashes,
            parent_block_hash=chunk.parent,
            token_ids=chunk.token_ids,
            block_size=chunk.block_size,
            lora_id=chunk.lora_id,
            medium=tier.medium,
            lora_name=chunk.lora_name,
            extra_keys=chunk.extra_keys,
            group_idx=0,
            locality=tier.locality,
            ownership=tier.ownership,
            session_id=chunk.session_id,
        )


def _removed(hashes: list[Any], tier: Tier) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=hashes, medium=tier.medium, group_idx=0, locality=tier.locality, ownership=tier.ownership
    )


def connector_events(
    vllm_config: Any,
    config: ConnectorConfig,
    geometry: EngineGeometry,
    tails: PromptTails,
    tier: SchedulerTier | None,
) -> ConnectorEvents | None:
    """The engine's connector events, or None: KV events off, no tier to report, or several KV cache
    groups (not reported)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        return None
    store = Tier(MEDIUM_CPU, "REMOTE", _store_name(config)) if config.remote else None
    if tier is None and store is None:
        return None
    if geometry.hybrid:
        logger.warning("aiokv: KV events name no chunk of an engine with several KV cache groups")
        return None
    return ConnectorEvents(
        config,
        geometry.block_size,
        tails,
        tier,
        store,
        store_writer_count(vllm_config, geometry),
        load_async=config.load_async,
        local=Tier(MEDIUM_STORAGE if config.disk_tier else MEDIUM_CPU, "LOCAL"),
    )


def _store_name(config: ConnectorConfig) -> str:
    return "mooncake" if config.backend in ("mooncake", "tiered", "disk-tiered") else config.backend
