"""The host-memory tier's index: owned by the scheduler, kept true by what every worker reports.

Each worker process (one per TP/PP rank) holds its own shard of every chunk in a bounded store of its
own (:mod:`..worker_side.tier_worker`); no memory is shared between processes. The scheduler decides
everything that enters or leaves those stores and tells every worker the same thing in the step's
metadata (:class:`TierStep`): chunks to drop (applied first), and chunks the workers may write (a store,
or the promotion of a chunk loaded from the store behind the tier). Each worker reports the writes it
made and those it could not through vLLM's worker-to-scheduler channel (``kv_connector_worker_meta``),
and a chunk becomes a hit only once every rank reported it written: a hit is whole on every rank.

So lookups are answered here, from this process's memory, without waiting on a worker; eviction is
least recently used, within a byte budget per rank; a chunk a load reads is pinned from the step that
sends the load until the load is reported done, and never dropped meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ....backends.disk_format import ALIGN
from ....keys import HashedPrompt
from ..common.chained_futures import copy_outcome
from ..common.connector_config import tier_capacity_per_rank
from ..common.wire import TierReport, TierStep

logger = logging.getLogger("aiokv.vllm")

_PAGE = 4096  # the workers' stores place values on page boundaries


class TierWatcher(Protocol):
    """Told of each change of the index, as it happens (the connector's KV events)."""

    def admitted(self, digest: str) -> None: ...

    def ready(self, digest: str) -> None: ...  # a hit from now on

    def dropped(self, digest: str) -> None: ...  # evicted, or its write failed on some rank


class LookupClient(Protocol):
    """What the scheduler asks for hits: aiokv's ``ThreadedKVWorker`` or the tier's :class:`TierLookup`."""

    def lookup_many(self, prompts: Iterable[HashedPrompt]) -> list[concurrent.futures.Future[int]]: ...

    def close(self, timeout: float | None = None) -> None: ...


@dataclass
class _Entry:
    nbytes: int
    stored: set[int] = field(default_factory=set)  # ranks that reported it written
    failed: set[int] = field(default_factory=set)  # ranks that reported it not written
    pins: int = 0  # loads that may read it
    ready: bool = False  # every rank wrote it: a hit


class TierIndex:
    """Which chunks every worker holds, in least-recently-used order, within ``capacity_bytes`` per
    rank (every rank holds its own shard of the same chunks, so one count stands for all).
    ``overhead_bytes``: what the ranks' stores add to each value (a disk tier: a header page)."""

    def __init__(self, capacity_bytes: int, ranks: int, overhead_bytes: int = 0) -> None:
        if capacity_bytes <= 0 or ranks <= 0:
            raise ValueError(
                f"a host tier needs a positive capacity and rank count, got {capacity_bytes}, {ranks}"
            )
        self.capacity_bytes = capacity_bytes
        self.ranks = ranks
        self.used_bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest use first
        self._removes: list[str] = []
        self._admits: list[str] = []
        self.evictions = 0
        self.watcher: TierWatcher | None = None
        self.overhead_bytes = overhead_bytes
        self._listed: set[int] = set()  # ranks that reported what their store held at open
        self._restoring: set[str] = set()  # chunks found at open, until every rank has listed

    def __len__(self) -> int:
        return len(self._entries)

    def ready(self, digest: str) -> bool:
        entry = self._entries.get(digest)
        return entry is not None and entry.ready

    def known(self, digest: str) -> bool:
        """Held or being written."""
        return digest in self._entries

    def leading_ready(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes``, from the first, every rank holds; those are marked used."""
        count = 0
        for digest in hashes:
            if not self.ready(digest):
                break
            self._entries.move_to_end(digest)
            count += 1
        return count

    def ready_digests(self) -> list[str]:
        """The chunks every rank holds, least recently used first."""
        return [digest for digest, entry in self._entries.items() if entry.ready]

    def touch(self, digest: str) -> None:
        if digest in self._entries:
            self._entries.move_to_end(digest)

    def admit(self, digest: str, nbytes: int) -> bool:
        """Reserve room for ``digest`` (dropping the least recently used unpinned chunks as needed) and
        order its write; False if it is known already or nothing can make room."""
        if digest in self._entries:
            return False
        nbytes = self._cost(nbytes)
        if nbytes > self.capacity_bytes:
            return False
        if self.used_bytes + nbytes > self.capacity_bytes:
            victims: list[str] = []
            freed = 0
            for victim, entry in self._entries.items():
                if entry.ready and not entry.pins:
                    victims.append(victim)
                    freed += entry.nbytes
                    if self.used_bytes - freed + nbytes <= self.capacity_bytes:
                        break
            if self.used_bytes - freed + nbytes > self.capacity_bytes:
                return False
            for victim in victims:
                self._drop(victim)
                self.evictions += 1
        self._entries[digest] = _Entry(nbytes)
        self.used_bytes += nbytes
        self._admits.append(digest)
        if self.watcher is not None:
            self.watcher.admitted(digest)
        return True

    def pin(self, hashes: Iterable[str]) -> list[str]:
        """Pin the ready chunks of ``hashes`` (a load will read them); the ones pinned."""
        pinned = []
        for digest in hashes:
            entry = self._entries.get(digest)
            if entry is not None and entry.ready:
                entry.pins += 1
                self._entries.move_to_end(digest)
                pinned.append(digest)
        return pinned

    def unpin(self, hashes: Iterable[str]) -> None:
        for digest in hashes:
            entry = self._entries.get(digest)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def on_report(self, report: TierReport) -> None:
        """Record what the ranks wrote; a chunk every rank wrote is a hit from now on, one some rank
        could not write is dropped everywhere (once every rank answered: a drop never races a write).
        Then what ranks found at open (:meth:`_learn`) and lost (dropped everywhere: a write in flight
        reports for itself)."""
        for rank, held in report.found.items():
            self._learn(rank, held)
        for digests in report.lost.values():
            for digest in digests:
                entry = self._entries.get(digest)
                if entry is not None and entry.ready:
                    self._drop(digest)
        for outcome, by_rank in ((True, report.stored), (False, report.failed)):
            for rank, digests in by_rank.items():
                for digest in digests:
                    entry = self._entries.get(digest)
                    if entry is None or entry.ready:
                        if outcome:  # a write nobody ordered (never expected): drop it
                            logger.warning(
                                "aiokv: host tier: rank %d wrote unexpected chunk %s", rank, digest
                            )
                            self._removes.append(digest)
                        continue
                    (entry.stored if outcome else entry.failed).add(rank)
                    if len(entry.stored) + len(entry.failed) >= self.ranks:
                        if entry.failed:
                            self._drop(digest)
                        else:
                            entry.ready = True
                            if self.watcher is not None:
                                self.watcher.ready(digest)

    def _learn(self, rank: int, held: Mapping[str, int]) -> None:
        """Rank ``rank``'s store held ``held`` (digest -> value bytes) when it opened: each chunk is a
        hit once every rank listed it (or wrote it), as a written chunk is; once every rank has listed,
        the chunks some rank lacks are dropped everywhere. A chunk past the budget is dropped."""
        if rank in self._listed:
            return
        self._listed.add(rank)
        for digest, nbytes in held.items():
            entry = self._entries.get(digest)
            if entry is None:
                cost = self._cost(nbytes)
                if self.used_bytes + cost > self.capacity_bytes:
                    self._removes.append(digest)
                    continue
                entry = self._entries[digest] = _Entry(cost)
                self.used_bytes += cost
                self._restoring.add(digest)
            elif entry.ready:
                continue
            entry.stored.add(rank)
            if len(entry.stored) + len(entry.failed) >= self.ranks:
                if entry.failed:
                    self._drop(digest)
                else:
                    entry.ready = True
        if len(self._listed) < self.ranks:
            return
        partial = [d for d in self._restoring if d in self._entries and not self._entries[d].ready]
        for digest in partial:
            self._drop(digest)
        logger.info(
            "aiokv: tier: %d chunk(s) its stores held at start are hits; %d not on every rank dropped",
            len(self._restoring) - len(partial),
            len(partial),
        )
        self._restoring = set()

    def _cost(self, nbytes: int) -> int:
        return -(-nbytes // _PAGE) * _PAGE + self.overhead_bytes

    def take_step(self) -> TierStep | None:
        """The orders gathered since the last step, or None."""
        if not self._removes and not self._admits:
            return None
        step = TierStep(tuple(self._removes), tuple(self._admits))
        self._removes, self._admits = [], []
        return step

    def _drop(self, digest: str) -> None:
        entry = self._entries.pop(digest)
        self.used_bytes -= entry.nbytes
        self._removes.append(digest)
        if self.watcher is not None:
            self.watcher.dropped(digest)


class TierLookup:
    """Hits answered from the index at once; with a store behind the tier, the chunks the tier lacks
    are asked of it (the answer then comes when the store's does)."""

    def __init__(self, index: TierIndex, remote: LookupClient | None) -> None:
        self.index = index
        self.remote = remote

    def lookup_many(self, prompts: Iterable[HashedPrompt]) -> list[concurrent.futures.Future[int]]:
        futures = []
        for prompt in prompts:
            local = self.index.leading_ready(prompt.hashes)
            if self.remote is None or local == len(prompt.hashes):
                done: concurrent.futures.Future[int] = concurrent.futures.Future()
                done.set_result(local * prompt.chunk_tokens)
                futures.append(done)
                continue
            rest = HashedPrompt(prompt.hashes[local:], prompt.chunk_tokens)
            (remote,) = self.remote.lookup_many([rest])
            futures.append(_offset(remote, local * prompt.chunk_tokens))
        return futures

    def close(self, timeout: float | None = None) -> None:
        if self.remote is not None:
            self.remote.close(timeout)


def _offset(inner: concurrent.futures.Future[int], tokens: int) -> concurrent.futures.Future[int]:
    """A future answering ``inner``'s tokens plus ``tokens``; cancelling it cancels ``inner``."""
    outer: concurrent.futures.Future[int] = concurrent.futures.Future()

    def settle(done: concurrent.futures.Future[int]) -> None:
        if not outer.done() and outer.set_running_or_notify_cancel():
            copy_outcome(done, outer, lambda found: tokens + found)

    def cancelled(_: concurrent.futures.Future[int]) -> None:
        if outer.cancelled():
            inner.cancel()

    outer.add_done_callback(cancelled)
    inner.add_done_callback(settle)
    return outer


class SchedulerTier:
    """The scheduler side's use of the index: lookups, pins for loads, admissions for stores and
    promotions, the workers' reports. ``rank_capacity_bytes``: each rank's tier; ``block_bytes``: one
    block of every layer on one rank."""

    def __init__(
        self,
        rank_capacity_bytes: int,
        ranks: int,
        block_bytes: int,
        block_size: int,
        *,
        behind: bool,
        overhead_bytes: int = 0,
    ) -> None:
        self.index = TierIndex(rank_capacity_bytes, ranks, overhead_bytes)
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.behind = behind  # a store behind the tier: chunks loaded from it are promoted
        self._pins: dict[str, list[str]] = {}  # request -> chunks its load reads
        self._release_after_step: list[str] = []  # synchronous loads: done within the step

    def lookup_client(self, remote: LookupClient | None) -> TierLookup:
        return TierLookup(self.index, remote)

    def _chunk_bytes(self, prompt: HashedPrompt) -> int:
        return prompt.chunk_tokens // self.block_size * self.block_bytes

    def on_load(self, req_id: str, prompt: HashedPrompt, *, asynchronous: bool) -> None:
        """A load of ``prompt``'s chunks was decided: pin those in the tier; order the others promoted."""
        self._pins.setdefault(req_id, []).extend(self.index.pin(prompt.hashes))
        if self.behind:
            nbytes = self._chunk_bytes(prompt)
            for digest in prompt.hashes:
                if not self.index.known(digest):
                    self.index.admit(digest, nbytes)
        if not asynchronous:
            self._release_after_step.append(req_id)

    def on_step(self, stores: Sequence[Any]) -> TierStep | None:
        """Admit the new chunks of this step's stores (``TransferSpec``s); the step's orders."""
        for spec in stores:
            nbytes = self._chunk_bytes(spec.prompt)
            for digest in spec.prompt.hashes:
                if self.index.known(digest):
                    self.index.touch(digest)
                else:
                    self.index.admit(digest, nbytes)
        step = self.index.take_step()
        for req_id in self._release_after_step:  # orders of later steps reach the workers after them
            self.release(req_id)
        self._release_after_step = []
        return step

    def on_output(self, report: Any, finished_loading: Iterable[str]) -> None:
        if isinstance(report, TierReport):
            self.index.on_report(report)
        for req_id in finished_loading:
            self.release(req_id)

    def release(self, req_id: str) -> None:
        self.index.unpin(self._pins.pop(req_id, ()))

    def log_contents(self) -> None:
        """At DEBUG, the chunks that are hits now (to set against what a KV event subscriber rebuilt)."""
        if logger.isEnabledFor(logging.DEBUG):
            held = self.index.ready_digests()
            logger.debug("aiokv: host tier holds %d chunk(s): %s", len(held), " ".join(held))


def scheduler_tier(vllm_config: Any, config: Any, geometry: Any) -> SchedulerTier | None:
    """The scheduler's host tier for this engine, or None without one."""
    if not config.host_tier:
        return None
    ranks = int(vllm_config.parallel_config.world_size)
    return SchedulerTier(
        tier_capacity_per_rank(config, ranks),
        ranks,
        geometry.page_bytes * geometry.num_layers,
        geometry.block_size,
        behind=config.remote,
        overhead_bytes=ALIGN if config.disk_tier else 0,  # each value's file starts with a header page
    )
