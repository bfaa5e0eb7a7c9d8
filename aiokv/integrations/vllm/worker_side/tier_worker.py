"""A worker process's side of the host-memory tier (the index and the design:
:mod:`..scheduler_side.tier_index`).

:class:`TierWorker` holds this rank's shard of the tier's chunks in a bounded :class:`MemoryBackend`
of its own, moved by an aiokv worker of its own, and optionally the aiokv worker of a store behind the
tier (Mooncake). It offers the connector what aiokv's ``ThreadedKVWorker`` does (``load_many``,
``store_many``, ``stats_soon``, ``close``), so the worker side drives it unchanged:

- a load reads the chunks this store holds from it, the others from the store behind; a chunk read
  from behind that the scheduler admitted is written into the tier (promoted) before the load is
  reported done, from the blocks it was just read into (still the request's until then);
- a store writes the chunks the scheduler admitted into the tier, and every chunk to the store behind;
  one future per request, done once both are (the engine keeps the blocks until then, the step never
  waits for either);
- the scheduler's orders (:class:`TierStep`) are applied at the start of each step, before the step's
  transfers; every admitted chunk is reported written or not (:meth:`TierWorker.report`);
- a store of another kind may take the memory's place (``store``: a disk tier, :mod:`.tier_stores`);
  what it held at open is reported once (``found``), and a chunk a load found gone (a damaged file the
  store removed) is reported lost.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ....backends.base import Backend
from ....backends.memory import MemoryBackend
from ....backends.memory_disk import MemoryDiskBackend
from ....keys import HashedPrompt, KeyNamespace
from ....layout import KVLayout
from ....results import LoadResult, StoreResult
from ....threaded import ThreadedKVWorker
from ..common.chained_futures import copy_outcome, when_all
from ..common.stats_reporter import TIER_COUNTERS, TIER_LEVEL_COUNTERS
from ..common.wire import TierReport, TierStep
from .chunk_movers import ChunkRequest

logger = logging.getLogger("aiokv.vllm")

T = TypeVar("T")


def _settled(value: T) -> concurrent.futures.Future[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _chunks(prompt: HashedPrompt, blocks: Sequence[int], picked: Sequence[int]) -> ChunkRequest:
    """The chunks ``picked`` (indices) of a request, with their blocks."""
    per_chunk = len(blocks) // len(prompt.hashes)
    ids = [b for i in picked for b in blocks[i * per_chunk : (i + 1) * per_chunk]]
    return HashedPrompt(tuple(prompt.hashes[i] for i in picked), prompt.chunk_tokens), [ids]


class TierWorker:
    """One rank's host tier, in front of ``behind`` (an aiokv worker over the store behind), if any.
    ``behind_writes``: whether this rank writes to the store behind (MLA: rank 0 only). ``store``: the
    tier's store (default: a ``MemoryBackend`` of ``capacity_bytes``), closed with the tier; ``found``:
    what it held for this engine at open (digest -> value bytes), reported once."""

    def __init__(
        self,
        layout: KVLayout,
        namespace: KeyNamespace,
        chunk_tokens: int,
        capacity_bytes: int,
        rank: int,
        *,
        behind: ThreadedKVWorker | None = None,
        behind_writes: bool = True,
        store: Backend | None = None,
        found: dict[str, int] | None = None,
    ) -> None:
        self.rank = rank
        self.store: Any = store if store is not None else MemoryBackend(capacity_bytes)
        self.local = ThreadedKVWorker(
            layout, self.store, namespace=namespace, chunk_tokens=chunk_tokens, executor_threads=1
        )
        self.behind = behind
        self._behind_writes = behind_writes
        self._prefix = namespace.prefix(layout.fingerprint, 0)
        self._lock = threading.Lock()  # admits and the report: the engine's thread and aiokv's loops
        self._admits: set[str] = set()
        self._stored: set[str] = set()
        self._failed: set[str] = set()
        self._lost: set[str] = set()
        self._found = found
        self.counters: Counter[str] = Counter()

    def _keys(self, hashes: Iterable[str]) -> list[str]:
        return [self._prefix + digest for digest in hashes]

    # -- the scheduler's orders and this rank's report -------------------------------------------

    def apply(self, step: TierStep | None) -> None:
        """A new step: admits of the last one that no transfer took are reported not written; then
        this step's drops, then its admits."""
        with self._lock:
            self._failed |= self._admits
            self._admits = set(step.admits) if step is not None else set()
        if step is not None and step.removes:
            codes = self.store.batch_remove(self._keys(step.removes))
            self.counters["evictions"] += sum(1 for code in codes if code == 0)

    def report(self) -> TierReport | None:
        """Admitted chunks written or not, and chunks lost, since the last report; the first one also
        carries what the store held at open unless :meth:`take_found` took it (None if nothing)."""
        found = self.take_found()
        with self._lock:
            if not self._stored and not self._failed and not self._lost and found is None:
                return None
            report = TierReport(
                {self.rank: self._stored}, {self.rank: self._failed}, lost={self.rank: self._lost}
            )
            self._stored, self._failed, self._lost = set(), set(), set()
        return report.merge(found) if found is not None else report

    def take_found(self) -> TierReport | None:
        """What the store held at open, the first time only (None after, or without a listing)."""
        with self._lock:
            found, self._found = self._found, None
        return None if found is None else TierReport(found={self.rank: found})

    def _take_admitted(self, hashes: Sequence[str]) -> list[int]:
        with self._lock:
            picked = [i for i, digest in enumerate(hashes) if digest in self._admits]
            self._admits.difference_update(hashes[i] for i in picked)
        return picked

    def _record_written(self, hashes: Sequence[str]) -> int:
        """Report each of ``hashes`` (admitted, their writes finished) written or not, by whether the
        store holds it now; how many it holds."""
        present = self.store.batch_exists(self._keys(hashes)) if hashes else []
        with self._lock:
            for digest, held in zip(hashes, present, strict=True):
                (self._stored if held else self._failed).add(digest)
        return sum(present)

    # -- transfers (ThreadedKVWorker's interface) ------------------------------------------------

    def store_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> list[concurrent.futures.Future[StoreResult]]:
        requests = list(requests)
        picks = [self._take_admitted(prompt.hashes) for prompt, _ in requests]
        local = self._submit_parts(
            self.local.store_many,
            [
                (n, _chunks(p, b[0], pick))
                for n, ((p, b), pick) in enumerate(zip(requests, picks, strict=True))
                if pick
            ],
            timeout,
        )
        behind: dict[int, concurrent.futures.Future[Any]] = {}
        if self.behind is not None and self._behind_writes:
            behind = self._submit_parts(self.behind.store_many, list(enumerate(requests)), timeout)
        out = []
        for n, (prompt, _) in enumerate(requests):
            admitted = [prompt.hashes[i] for i in picks[n]]
            parts = [f for f in (local.get(n), behind.get(n)) if f is not None]
            out.append(when_all(parts, self._store_finisher(prompt, admitted, local.get(n), behind.get(n))))
        return out

    def _store_finisher(
        self,
        prompt: HashedPrompt,
        admitted: list[str],
        local: concurrent.futures.Future[StoreResult] | None,
        behind: concurrent.futures.Future[StoreResult] | None,
    ) -> Callable[[], StoreResult]:
        def finish() -> StoreResult:
            self._record_written(admitted)
            main = behind if behind is not None else local
            if main is None:
                return StoreResult(stored=0, skipped=len(prompt.hashes), failed=0)
            return main.result()  # its exception, if any, is the store's

        return finish

    def load_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> list[concurrent.futures.Future[LoadResult]]:
        requests = list(requests)
        if self.behind is None:  # everything is read from the tier (a chunk it lacks fails the load)
            return self._noting_lost(requests, self._submit(self.local.load_many, requests, timeout))
        from_tier: list[tuple[int, ChunkRequest]] = []
        from_behind: list[tuple[int, ChunkRequest]] = []
        for n, (prompt, blocks) in enumerate(requests):
            held = self.store.batch_exists(self._keys(prompt.hashes))
            if any(held):
                from_tier.append((n, _chunks(prompt, blocks[0], [i for i, h in enumerate(held) if h])))
            if not all(held):
                from_behind.append((n, _chunks(prompt, blocks[0], [i for i, h in enumerate(held) if not h])))
        local = self._submit_parts(self.local.load_many, from_tier, timeout)
        self._noting_lost([request for _, request in from_tier], list(local.values()))
        remote = self._submit_parts(self.behind.load_many, from_behind, timeout)
        for n, (sub_prompt, sub_blocks) in from_behind:
            remote[n] = self._promoted(sub_prompt, sub_blocks[0], remote[n], timeout)
        out = []
        for n, (prompt, _) in enumerate(requests):
            parts = [f for f in (local.get(n), remote.get(n)) if f is not None]
            out.append(when_all(parts, _merged_load(parts, prompt.chunk_tokens)))
        return out

    def _promoted(
        self,
        prompt: HashedPrompt,
        blocks: Sequence[int],
        loaded: concurrent.futures.Future[LoadResult],
        timeout: float | None,
    ) -> concurrent.futures.Future[LoadResult]:
        """``loaded`` (a load from behind), done only once the admitted chunks it read are written into
        the tier (from the blocks, which stay the request's until the load is reported done)."""
        admitted = self._take_admitted(prompt.hashes)
        if not admitted:
            return loaded
        outer: concurrent.futures.Future[LoadResult] = concurrent.futures.Future()

        def promote(done: concurrent.futures.Future[LoadResult]) -> None:
            try:
                write_back(done)
            except Exception:  # the load must still be reported, whatever went wrong here
                logger.exception("aiokv: host tier: promoting %d chunk(s) failed", len(admitted))
                copy_outcome(done, outer)

        def write_back(done: concurrent.futures.Future[LoadResult]) -> None:
            failed_blocks: set[int] = set(blocks)
            if not done.cancelled() and done.exception() is None:
                result = done.result()
                failed_blocks = set(result.failed_block_ids[0]) if result.failed_block_ids else set()
            per_chunk = len(blocks) // len(prompt.hashes)
            readable = [
                i for i in admitted if not failed_blocks & set(blocks[i * per_chunk : (i + 1) * per_chunk])
            ]
            self._record_written([prompt.hashes[i] for i in admitted if i not in readable])
            if not readable:
                copy_outcome(done, outer)
                return
            digests = [prompt.hashes[i] for i in readable]
            (write,) = self._submit(self.local.store_many, [_chunks(prompt, blocks, readable)], timeout)

            def written(_: concurrent.futures.Future[Any]) -> None:
                self.counters["promotions"] += self._record_written(digests)
                copy_outcome(done, outer)

            write.add_done_callback(written)

        loaded.add_done_callback(promote)
        return outer

    def _noting_lost(
        self, requests: list[ChunkRequest], futures: list[concurrent.futures.Future[LoadResult]]
    ) -> list[concurrent.futures.Future[LoadResult]]:
        """``futures``, each watched: when its load from the tier fails, the chunks the store no longer
        holds (a damaged file is removed as it is read) are reported lost, so no later lookup hits them."""

        def check(prompt: HashedPrompt, done: concurrent.futures.Future[LoadResult]) -> None:
            if not done.cancelled() and done.exception() is None and done.result().ok:
                return
            try:
                held = self.store.batch_exists(self._keys(prompt.hashes))
            except Exception:  # the tier is closing: nothing is reported any more
                return
            with self._lock:
                self._lost.update(d for d, h in zip(prompt.hashes, held, strict=True) if not h)

        for (prompt, _), future in zip(requests, futures, strict=True):
            future.add_done_callback(functools.partial(check, prompt))
        return futures

    def _submit_parts(
        self, method: Callable[..., list[Any]], parts: list[tuple[int, ChunkRequest]], timeout: float | None
    ) -> dict[int, concurrent.futures.Future[Any]]:
        """:meth:`_submit` of numbered requests: their futures by number."""
        futures = self._submit(method, [request for _, request in parts], timeout)
        return dict(zip([n for n, _ in parts], futures, strict=True))

    def _submit(
        self, method: Callable[..., list[Any]], requests: list[ChunkRequest], timeout: float | None
    ) -> list[concurrent.futures.Future[Any]]:
        """``method(requests)``, or one failed future each if the worker refused them all."""
        if not requests:
            return []
        try:
            return list(method(requests, timeout=timeout))
        except Exception as exc:
            failed: list[concurrent.futures.Future[Any]] = []
            for _ in requests:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                future.set_exception(exc)
                failed.append(future)
            return failed

    # -- stats and lifecycle --------------------------------------------------------------------

    def _with_tier(self, main: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
        counters = dict(self.counters)
        counters["hits"] = local["chunks"].get("loaded", 0)
        counters["bytes_read"] = local["bytes"].get("get", 0)
        counters["bytes_written"] = local["bytes"].get("put", 0)
        levels = self.store.stats() if isinstance(self.store, MemoryDiskBackend) else {}
        return {
            **main,
            "host_tier": {
                **{key: counters.get(key, 0) for key in TIER_COUNTERS},
                **{key: value for key, value in levels.items() if key in TIER_LEVEL_COUNTERS},
                "used_bytes": self.store.used_bytes,
                "chunks": len(self.store),
                "capacity_bytes": self.store.capacity_bytes,
            },
        }

    def stats(self) -> dict[str, Any]:
        local = self.local.stats()
        return self._with_tier(self.behind.stats() if self.behind is not None else local, local)

    def stats_soon(self) -> concurrent.futures.Future[dict[str, Any]]:
        local = self.local.stats_soon()
        main = self.behind.stats_soon() if self.behind is not None else local
        return when_all([local, main], lambda: self._with_tier(main.result(), local.result()))

    def close(self, timeout: float | None = None) -> None:
        try:
            if self.behind is not None:
                self.behind.close(timeout)
        finally:
            self.local.close(timeout)
            self.store.close()


def _merged_load(
    parts: list[concurrent.futures.Future[LoadResult]], chunk_tokens: int
) -> Callable[[], LoadResult]:
    """One request's load from both tiers: the blocks either failed; a part that raised fails its
    blocks through the caller (it raises here)."""

    def finish() -> LoadResult:
        results = [part.result() for part in parts]
        failed = sorted({b for result in results for group in result.failed_block_ids[:1] for b in group})
        chunks = sum(result.loaded_chunks for result in results)
        return LoadResult(chunks * chunk_tokens, (tuple(failed),), chunks)

    return finish
