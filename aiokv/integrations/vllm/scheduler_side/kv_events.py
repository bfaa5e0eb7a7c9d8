"""KV cache events for what the connector's tiers hold: vLLM's ``BlockStored`` and ``BlockRemoved``, as
vLLM's own publisher writes them, so a router subscribed to an engine's events learns its tiers too.

vLLM's scheduler publishes, after each step, its prefix cache's events and what the connector's
``take_events`` returns. They are built here, on the scheduler's thread, only when the engine runs with
``kv_events_config.enable_kv_cache_events``; otherwise this module is not used at all.

- The engine's own tier (``locality "LOCAL"``, ``medium "CPU"`` in memory, ``"STORAGE"`` on disk): its
  index (:mod:`.tier_index`) tells each chunk's admission, the moment it becomes a hit (every rank wrote
  it) and the moment it leaves (evicted, or a rank could not write or lost it): one BlockStored when
  lookups start finding it, one BlockRemoved when they stop, each exactly once. A disk tier's chunks
  found at start (a restart) are announced once every rank has listed its own, from the event journal
  beside the tier (:mod:`.event_journal`): the workers report them by digest alone.
- The store behind the engine (Mooncake or a backend of the user's own: ``medium "CPU"``, ``locality
  "REMOTE"``, ``ownership`` the backend): BlockStored once every writing rank confirmed a chunk in the
  store (the workers' :class:`..common.wire.StoreReport`), repeats of recently announced chunks left
  out (a chunk loaded is stored again, and found there); BlockRemoved when a load finds a chunk missing
  or refuses its value (verification): the store evicts without telling anyone, and another engine may
  have announced the chunk.

One event per chunk (:mod:`.event_payloads`). A chunk's request is kept from its write's order, its
payload built once the tier admits it or the store confirms it; the host tier keeps the hashes of each
chunk it holds until its removal. Engines with one KV cache group only.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVCacheEvent

from ..common.block_keys import key_namespace
from ..common.connector_config import ConnectorConfig
from ..common.geometry import EngineGeometry
from ..common.step_metadata import AiokvConnectorMetadata
from ..common.store_writers import store_writer_count
from ..common.wire import StoreReport, TierReport, TransferSpec
from .event_journal import EventJournal
from .event_payloads import Chunk, ChunkRef, Payloads, Tier, parents_first, removed
from .prompt_tails import PromptTails
from .tier_index import SchedulerTier

logger = logging.getLogger("aiokv.vllm")

# Store chunks remembered as announced, so that the stores following their loads announce nothing new;
# one forgotten is announced again when next confirmed (a repeat, never a wrong event).
ANNOUNCED_STORE_CHUNKS = 1 << 16
# A synchronous load's failures come with the output of the step that ran it: watched that long.
_SYNC_LOAD_OUTPUTS = 2
HOST_MEMORY = Tier(MEDIUM_CPU, "LOCAL")


@dataclass(slots=True)
class _Pending:
    """A chunk ordered stored: announced once every writer confirmed it, forgotten once every order's
    writes are reported (``orders`` stores of it, each confirmed or not by every writer)."""

    ref: ChunkRef
    orders: int = 1
    reports: int = 0
    writers: set[int] = field(default_factory=set)
    announced: bool = False


@dataclass(slots=True)
class _Load:
    """A load from the store: per chunk, its digest, its blocks and its reference, in prompt order."""

    chunks: list[tuple[str, frozenset[int], ChunkRef]]
    outputs_left: int | None  # synchronous loads: the outputs that may still report its failures


class ConnectorEvents:
    """The events of one engine's connector (see the module docstring). ``tier``: the engine's own tier,
    if any (this object becomes its index's watcher), named ``local``, with ``journal`` if it is on disk;
    ``store``: the store behind the engine, if any, written by ``writers`` ranks."""

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
        local: Tier = HOST_MEMORY,
        journal: EventJournal | None = None,
    ) -> None:
        self.chunk_blocks = config.chunk_blocks
        self.tails = tails
        self.payloads = Payloads(block_size, config.chunk_blocks, tails)
        self.tier = tier
        self.local = local
        self.store = store
        self.writers = writers
        self.load_async = load_async
        self.journal = journal
        self._events: list[KVCacheEvent] = []
        self._ended: dict[str, Any] = {}  # requests ended since the last step: their tails are stored next
        self._staged: dict[str, ChunkRef] = {}  # this step's writes ordered, until the tier admits them
        self._tier_writing: dict[str, Chunk] = {}  # admitted, not yet written by every rank
        self._tier_held: dict[str, list[Any]] = {}  # announced: the hashes its removal names
        self._store_pending: dict[str, _Pending] = {}
        self._announced: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, _Load] = {}
        # A restart: the journal's records, the chunks the ranks found and the ranks that listed theirs.
        self._journaled: dict[str, list[Any]] = journal.load() if journal is not None else {}
        self._found: set[str] = set()
        self._listed: set[int] = set()
        self._settled = journal is None
        self.unannounceable = 0  # chunks a restart found that the journal does not describe
        if tier is not None:
            tier.index.watcher = self

    # -- what the scheduler side tells --------------------------------------------------------

    def on_load(self, request: Any, spec: TransferSpec) -> None:
        """A load was decided (before the tier pins and admits its chunks)."""
        tier = self.tier
        if tier is not None and tier.behind:  # chunks read from the store behind are promoted into the tier
            for index, digest in enumerate(spec.prompt.hashes):
                if not tier.index.known(digest):
                    self._staged[digest] = ChunkRef(request, spec.offset + index, request.num_tokens)
        if self.store is not None:
            self._watch_load(request, spec)

    def _watch_load(self, request: Any, spec: TransferSpec) -> None:
        """Keep which blocks each chunk read from the store fills, to name a chunk a failed read found
        missing. Chunks the host tier holds are read from it, not from the store."""
        first = spec.first_chunks[0]
        blocks = spec.block_ids[0]
        chunks = []
        for index, digest in enumerate(spec.prompt.hashes[first:]):
            if self.tier is not None and self.tier.index.ready(digest):
                continue
            own = frozenset(blocks[index * self.chunk_blocks : (index + 1) * self.chunk_blocks])
            chunks.append((digest, own, ChunkRef(request, spec.offset + first + index, None)))
        if chunks:
            self._loads[spec.req_id] = _Load(chunks, None if self.load_async else _SYNC_LOAD_OUTPUTS)

    def on_step(self, meta: AiokvConnectorMetadata, requests: Mapping[str, Any]) -> None:
        """This step's stores were ordered (before the tier admits them)."""
        if self._staged:
            self._staged.clear()  # the loads' chunks were admitted when their loads were decided
        for req_id in meta.preempted:
            self._loads.pop(req_id, None)
        staging = self.tier is not None
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
                # A chunk the store was announced to hold is not ordered again (a loaded prompt's
                # chunks are stored again: most of a hit's stores), unless the engine's tier admits it.
                ordered = self.store is not None and index >= first and digest not in self._announced
                if not staging and not ordered:
                    continue
                ref = ChunkRef(request, spec.offset + index, tail_end)
                if staging:
                    self._staged[digest] = ref
                if ordered:  # the workers store the group's chunks
                    self._order_store(digest, ref)
        if self._ended:
            self._ended.clear()

    def request_finished(self, request: Any) -> None:
        if self._loads:
            self._loads.pop(request.request_id, None)
        if self.tails.enabled:
            self._ended[request.request_id] = request

    def on_output(self, output: Any) -> None:
        """A step's output from the workers (after the tier read its report)."""
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if worker_meta is None:
            return
        if not self._settled:
            report = getattr(worker_meta, "tier", None)
            if isinstance(report, TierReport) and report.found:
                self.on_found(report)
        store = self.store
        if store is None:
            return
        report = getattr(worker_meta, "stored", None)
        if isinstance(report, StoreReport):
            self._confirm(report, store)
        if self._loads:
            self._check_loads(output, store)

    def _check_loads(self, output: Any, store: Tier) -> None:
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        done = set(getattr(output, "finished_recving", None) or ())
        for req_id, load in list(self._loads.items()):
            failed = False
            if invalid:
                for digest, blocks, ref in load.chunks:
                    if blocks & invalid:  # the first chunk it could not read; those after were not tried
                        hashes = self.payloads.hashes(ref.request, ref.index, end=ref.request.num_tokens)
                        if hashes:
                            self._store_removed(digest, hashes, store)
                        failed = True
                        break
            if load.outputs_left is not None:
                load.outputs_left -= 1
            if failed or req_id in done or load.outputs_left == 0:
                del self._loads[req_id]

    def take(self) -> list[KVCacheEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # -- a restarted disk tier ------------------------------------------------------------------

    def on_found(self, report: TierReport) -> None:
        """What ranks found on disk at open (the handshake's or a step's report, after the index read
        it). Once every rank has listed, the chunks now hits are announced from the journal."""
        if self.tier is None or self.journal is None or self._settled:
            return
        for rank, held in report.found.items():
            if rank not in self._listed:
                self._listed.add(rank)
                self._found.update(held)
        if len(self._listed) < self.tier.index.ranks:
            return
        self._settled = True
        found, self._found = self._found, set()
        journaled, self._journaled = self._journaled, {}
        chunks: dict[str, Chunk] = {}
        for digest in found:
            if not self.tier.index.ready(digest) or digest in self._tier_held:
                continue  # not on every rank, or past the budget: dropped
            fields = journaled.get(digest)
            if fields is None:
                self.unannounceable += 1
            else:
                chunks[digest] = Chunk.from_fields(fields)
        for digest in parents_first(chunks):
            self._announce(digest, chunks[digest])
        announced = len(chunks)
        self.journal.retain([*self._tier_held, *self._tier_writing])
        if found:
            logger.info(
                "aiokv: KV events: %d chunk(s) the disk tier held at start announced; %d not announceable "
                "(the event journal %s does not describe them)",
                announced,
                self.unannounceable,
                self.journal.path,
            )

    # -- the host tier's index (TierWatcher) ----------------------------------------------------

    def admitted(self, digest: str) -> None:
        ref = self._staged.pop(digest, None)
        if ref is None:
            return
        chunk = self.payloads.chunk(ref)
        if chunk is None:
            return
        self._tier_writing[digest] = chunk
        if self.journal is not None:
            self.journal.admitted(digest, chunk.fields())

    def ready(self, digest: str) -> None:
        chunk = self._tier_writing.pop(digest, None)
        if chunk is not None:
            self._announce(digest, chunk)

    def _announce(self, digest: str, chunk: Chunk) -> None:
        event = self.payloads.stored(chunk, self.local)
        self._events.append(event)
        self._tier_held[digest] = event.block_hashes

    def dropped(self, digest: str) -> None:
        writing = self._tier_writing.pop(digest, None)
        hashes = self._tier_held.pop(digest, None)
        if hashes is not None:
            self._events.append(removed(hashes, self.local))
        if self.journal is not None and (writing is not None or hashes is not None):
            self.journal.dropped(digest)

    # -- the store behind -----------------------------------------------------------------------

    def _order_store(self, digest: str, ref: ChunkRef) -> None:
        pending = self._store_pending.get(digest)
        if pending is None:
            self._store_pending[digest] = _Pending(ref)
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
                        self._store_announced(digest, pending.ref, store)
                    if pending.reports >= pending.orders * self.writers:
                        del self._store_pending[digest]

    def _store_announced(self, digest: str, ref: ChunkRef, store: Tier) -> None:
        if digest in self._announced:
            self._announced.move_to_end(digest)
            return
        chunk = self.payloads.chunk(ref)
        if chunk is None:
            return
        self._announced[digest] = None
        if len(self._announced) > ANNOUNCED_STORE_CHUNKS:
            self._announced.popitem(last=False)
        self._events.append(self.payloads.stored(chunk, store))

    def _store_removed(self, digest: str, hashes: list[Any], store: Tier) -> None:
        self._announced.pop(digest, None)
        self._events.append(removed(hashes, store))


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
    journal = None
    if tier is not None and config.disk_tier and config.disk_path:
        journal = EventJournal(journal_path(vllm_config, config, geometry))
    return ConnectorEvents(
        config,
        geometry.block_size,
        tails,
        tier,
        store,
        store_writer_count(vllm_config, geometry),
        load_async=config.load_async,
        local=Tier(MEDIUM_STORAGE if config.disk_tier else MEDIUM_CPU, "LOCAL"),
        journal=journal,
    )


def journal_path(vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry) -> str:
    """The event journal of this engine's disk tier: in ``disk_path``, named after the engine's key
    namespace and model (engines that never share a chunk never share a journal)."""
    namespace = key_namespace(vllm_config, config, geometry, tp_rank=0, pp_rank=0).model
    name = xxhash.xxh3_64_hexdigest(f"{namespace};{vllm_config.model_config.model}".encode())
    return os.path.join(str(config.disk_path), f"kv-events-{name}.journal")


def _store_name(config: ConnectorConfig) -> str:
    return "mooncake" if config.backend in ("mooncake", "tiered", "disk-tiered") else config.backend
