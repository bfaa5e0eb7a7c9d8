"""One dispatcher batch, from drained requests to backend calls and back.

1. hash the prompts on the loop, in short slices (:mod:`.hashing`);
2. build keys and their positions in the batch (:mod:`.batch`), and claim the store keys, so no
   key is written twice, by two requests of this batch or by two overlapping batches (:mod:`.batch`);
3. one ``batch_exists`` for all keys, on the control lane (a lookup batch's on the lookup lane)
   (:mod:`.exists`);
4. decisions: what needs no transfer is settled, the rest planned per group (:mod:`.plan`); keys
   whose reads failed are not skipped but removed and rewritten (:mod:`.rewrite`);
5. per group one ``regions_for_chunks`` call, then backend calls split to at most
   ``max_regions_per_call`` regions (:mod:`.call_split`, :mod:`.transfer`);
6. per-chunk codes from each answer (:mod:`.answers`), written into each request by the tracker;
7. the keys whose puts answered success confirmed readable, waiting for another writer's write of
   them (:mod:`.confirm`); the tracker publishes the batch's outcomes and settles every request
   (:mod:`.tracker`, the only writer of codes, outcomes and lifecycles); a load is settled earlier,
   as soon as its own calls have returned (:mod:`.early_loads`).

The bookkeeping is vectorised over chunks: per key only hashing, string building and one dict
operation or two happen in Python. Every per-request or per-key loop yields to the loop within a
bounded slice (:mod:`.slices`), whether the batch holds 10,000 requests or a 62,500-key prompt.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AiokvError
from ..stats import Kind, Phase, WorkerStats
from .answers import PressureBackoff
from .batch import Claims, Cycle, KeyArray, assign_positions
from .config import EngineConfig
from .confirm import WriteConfirmation
from .early_loads import EarlyLoads
from .exists import ExistenceCheck
from .hashing import hash_now, hash_prompts
from .lanes import Lane, Lanes
from .plan import Plan, decide
from .request import Request
from .rewrite import Rewrites, UnreadableKeys
from .settling import Settling
from .slices import LoopSlice, pieces
from .tracker import RequestTracker
from .transfer import GroupTransfer, all_settled

if TYPE_CHECKING:
    from ..leases import LeaseLedger

logger = logging.getLogger("aiokv")

# A lookup of at most this many chunks, on a backend answering from this process's memory, is answered
# in the call (hashing, keys and the check: ~0.3 ms at most, within one slice of the loop).
INLINE_LOOKUP_CHUNKS = 256


class BatchPipeline:
    """Runs the batches of one worker; holds what outlives a batch (key claims, backoff). ``leases``:
    the worker's lease ledger, told of its loads' chunks and of its puts' verdicts."""

    def __init__(
        self,
        config: EngineConfig,
        tracker: RequestTracker,
        lanes: Lanes,
        stats: WorkerStats,
        leases: LeaseLedger | None = None,
    ) -> None:
        self._config = config
        self._tracker = tracker
        self._lanes = lanes
        self._stats = stats
        self._leases = leases
        self._claims = Claims()
        self._backoff = PressureBackoff(config.pressure_backoff_s, stats, leases)
        self._transfer = GroupTransfer(config, lanes, tracker, stats, self._backoff)
        self._exists = ExistenceCheck(config, lanes, tracker, stats)
        self._confirmation = WriteConfirmation(self._exists, lanes, tracker)
        self._unreadable = UnreadableKeys()
        self._rewrites = Rewrites(config, lanes, tracker, self._unreadable)
        self.settling = Settling()  # what the dispatcher waits for before its next batch

    async def run_transfers(self, batch: list[Request]) -> None:
        cycle = Cycle.new()
        self._stats.batches += 1
        # Where the batch's time goes (Phase), a clock read per step: what a hit's time is made of.
        began = time.perf_counter()
        kinds = frozenset(request.kind for request in batch)
        record = self._stats.record_phase
        record(kinds, Phase.QUEUE, sum(began - request.submitted for request in batch), len(batch))
        try:
            live = await self._prepare_keys(batch, cycle)
            await self._claims.claim(cycle, [r for r in live if r.kind is Kind.STORE])
            present = await self._exists.check(cycle.keys, live)
            if present is not None:
                live = [r for r in live if not r.finished]
                groups = self._config.groups
                unreadable = self._unreadable.contains if len(self._unreadable) else None
                backing_off = self._backoff.active()
                plan = await decide(
                    cycle,
                    live,
                    present,
                    groups,
                    self._tracker,
                    backing_off=backing_off,
                    unreadable=unreadable,
                )
                plan = await self._rewrites.prepare(cycle, plan)
                prepared = time.perf_counter()
                record(kinds, Phase.PREPARE, prepared - began)
                await self._move(cycle, plan)
                moved = time.perf_counter()
                record(kinds, Phase.TRANSFER, moved - prepared)
                self._unreadable.note_reads(plan)
                if Kind.STORE in kinds:
                    await self._confirmation.confirm(cycle, plan, lambda again: self._move(cycle, again))
                    record(frozenset((Kind.STORE,)), Phase.CONFIRM, time.perf_counter() - moved)
                self._unreadable.note_writes(cycle)
        except Exception as exc:  # a bug, not a backend fault: fail this batch, keep serving
            logger.exception("aiokv: a batch of %d requests failed unexpectedly", len(batch))
            self._fail_all(batch, AiokvError(f"internal error in the dispatcher: {exc!r}"), exc)
        finally:
            await self._claims.release(cycle)
            self._tracker.publish(cycle)
        settling = time.perf_counter()
        await self._settle(batch)
        record(kinds, Phase.SETTLE, time.perf_counter() - settling)

    async def _move(self, cycle: Cycle, plan: Plan) -> None:
        early = await EarlyLoads.of(plan, self._tracker, self._unreadable, self._config.chunk_bytes)
        await all_settled(self._transfer.run(cycle, g, rows, early) for g, rows in enumerate(plan) if rows)

    async def run_lookups(self, batch: list[Request]) -> None:
        cycle = Cycle.new()
        try:
            live = await self._prepare_keys(batch, cycle)
            present = await self._exists.check(cycle.keys, live, Lane.LOOKUP)  # never behind a batch's check
            if present is None:
                return
            clock = LoopSlice()
            for request in live:
                await clock.tick()
                if not request.finished:
                    self._tracker.answer_lookup(request, present)
        except Exception as exc:
            logger.exception("aiokv: a lookup batch failed unexpectedly")
            self._fail_all(batch, AiokvError(f"internal error in lookup: {exc!r}"), exc)

    def answer_lookup_now(self, request: Request) -> bool:
        """Answer a lookup of at most :data:`INLINE_LOOKUP_CHUNKS` chunks in the call, when the backend
        answers from this process's memory: no queue, no thread, no turn of the loop, so no batch
        ahead of it delays it. False: the lookup is for the lookup queue."""
        config = self._config
        if not config.exists_in_process or request.num_chunks > INLINE_LOOKUP_CHUNKS:
            return False
        try:
            if request.hashes is None:
                hash_now(request, config.chunk_tokens, config.seed, self._tracker)
            hashes = request.hashes
            if request.finished or hashes is None:  # a bad token value failed it
                return True
            n = request.num_chunks
            keys = [prefix + h for prefix in config.prefixes for h in hashes]
            request.positions = tuple(np.arange(g * n, (g + 1) * n) for g in range(config.groups))
            present = self._exists.check_now(keys, [request])
            if present is not None:
                self._tracker.answer_lookup(request, present)
        except Exception as exc:
            logger.exception("aiokv: a lookup failed unexpectedly")
            self._fail_all([request], AiokvError(f"internal error in lookup: {exc!r}"), exc)
        return True

    def _fail_all(self, batch: list[Request], error: AiokvError, cause: Exception) -> None:
        error.__cause__ = cause
        for request in batch:
            self._tracker.fail(request, error)

    async def _prepare_keys(self, requests: list[Request], cycle: Cycle) -> list[Request]:
        """Hash, build every key and its position in the batch's list of unique keys."""
        config = self._config
        await hash_prompts(requests, config.chunk_tokens, config.seed, self._tracker)
        live = [r for r in requests if not r.finished]
        clock = LoopSlice()
        for request in live:
            hashes = request.hashes
            if hashes is None:
                raise AiokvError(f"request #{request.id} reached key building unhashed")
            per_group: list[KeyArray] = []
            for prefix in config.prefixes:
                keys = np.empty(len(hashes), dtype=object)  # see the batch module on the collector
                for part in pieces(len(hashes)):
                    if isinstance(hashes, np.ndarray):  # an object array: added in C, 2x a list comprehension
                        np.add(prefix, hashes[part], out=keys[part])
                    else:
                        keys[part] = [prefix + h for h in hashes[part]]
                    await clock.tick()
                per_group.append(keys)
            request.keys = tuple(per_group)
            if self._leases is not None and request.kind is Kind.LOAD:
                # The load leases what it reads: the lookups that found its chunks hold them no more.
                for part in pieces(len(hashes)):
                    self._leases.loaded(hashes[part])
                    await clock.tick()
            request.hashes = None  # the keys hold what is needed from now on
            self._tracker.open_codes(request, config.groups)
        positions = await assign_positions(cycle, [r.keys for r in live])
        for request, mine in zip(live, positions, strict=True):
            request.positions = tuple(mine)
        return live

    async def _settle(self, batch: list[Request]) -> None:
        """Resolve shared chunks from their writers' outcomes; settle every request (the tracker settles
        one request at a time; the slicing of a large batch is here)."""
        clock = LoopSlice()
        with self.settling.running():
            for request in batch:
                await clock.tick()
                if not request.finished:
                    for wait in request.waits:
                        with self.settling.paused():  # the writer's batch may still wait on the store
                            await wait.cycle.outcomes_ready
                        outcome = await wait.cycle.outcome_of(wait.keys)
                        self._tracker.take_outcomes(request, wait.group, wait.chunks, outcome)
                    self._tracker.settle(request)
                request.drop_data()  # freed here, a slice at a time, not all at once as the batch ends
