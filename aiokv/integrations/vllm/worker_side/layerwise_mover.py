"""A chunk keyed per run of layers (``layer_groups`` > 1), moved so the forward and the transfers overlap.

One aiokv worker per run of consecutive layers (a *layer group*), over that run's regions, under keys
of its own: a chunk is ``layer_groups`` keys. To the worker side this is one :class:`ChunkMover` of the
engine's KV cache group: a request's load or store gets one future, done once every layer group's is,
so nothing is reported finished while a layer group may still touch the blocks. Besides:

- the layer groups of a load are read one after another, in the forward's order, so the first land
  first; a synchronous load (scheduled in the step whose forward reads it) is waited for one layer
  group at a time, :meth:`LayerwiseMover.wait_for_layer`, which vLLM's attention calls before each
  layer reads its KV: layer 0 computes while later layer groups still load;
- a step's stores leave layer group by layer group as the forward writes them
  (:meth:`LayerwiseMover.layer_written`, from ``save_kv_layer``), the rest in :meth:`store_many` at the
  end of the forward.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ....results import LoadResult, StoreResult
from ....threaded import ThreadedKVWorker
from ..common.chained_futures import copy_outcome, when_all
from ..common.stats_reporter import add_counters
from .chunk_movers import ChunkRequest
from .transfer_waits import wait_all

StoreFutures = list[concurrent.futures.Future[StoreResult]]
R = TypeVar("R")


def merged_load(parts: Sequence[concurrent.futures.Future[LoadResult]]) -> Callable[[], LoadResult]:
    """One request's load over every layer group: a block is filled only if every group filled it (a
    part that raised fails the whole request through the caller: it raises here)."""

    def finish() -> LoadResult:
        results = [part.result() for part in parts]
        failed = sorted({b for result in results for ids in result.failed_block_ids[:1] for b in ids})
        errors: Counter[int] = Counter()
        for result in results:
            errors.update(result.errors)
        return LoadResult(
            min(result.loaded_tokens for result in results),
            (tuple(failed),),
            min(result.loaded_chunks for result in results),
            dict(errors),
        )

    return finish


def merged_store(parts: Sequence[concurrent.futures.Future[StoreResult]]) -> Callable[[], StoreResult]:
    """One request's store over every layer group: a chunk failed if any group failed it, and was
    skipped if every group found it stored."""

    def finish() -> StoreResult:
        results = [part.result() for part in parts]
        failed = tuple(sorted({chunk for result in results for chunk in result.failed_chunks}))
        errors: Counter[int] = Counter()
        for result in results:
            errors.update(result.errors)
        return StoreResult(
            max(result.stored for result in results),
            min(result.skipped for result in results),
            len(failed) if failed else max(result.failed for result in results),
            failed,
            dict(errors),
        )

    return finish


def _submitted(
    submit: Callable[[], Sequence[concurrent.futures.Future[R]]], count: int
) -> list[concurrent.futures.Future[R]]:
    """``submit()``'s futures; if it refuses, ``count`` futures failed with its exception, so the
    request's other layer groups, already in flight, are still waited for through the merged future."""
    try:
        return list(submit())
    except Exception as exc:
        failed: list[concurrent.futures.Future[R]] = []
        for _ in range(count):
            future: concurrent.futures.Future[R] = concurrent.futures.Future()
            future.set_exception(exc)
            failed.append(future)
        return failed


def _settle(target: concurrent.futures.Future[R], source: concurrent.futures.Future[R]) -> None:
    copy_outcome(source, target)


class LayerwiseMover:
    """The workers of one KV cache group's layer groups (``workers[i]`` moves the layers
    ``layer_names[i]``, in the forward's order). The workers stay their owner's to close."""

    def __init__(self, workers: Sequence[ThreadedKVWorker], layer_names: Sequence[Sequence[str]]) -> None:
        if len(workers) != len(layer_names) or not all(layer_names):
            raise ValueError("one worker per non-empty layer group")
        self._workers = list(workers)
        self._group_of = {name: group for group, names in enumerate(layer_names) for name in names}
        self._layer_names = [frozenset(names) for names in layer_names]
        # The step's synchronous loads, per layer group, until the forward's first layer of it waits.
        self._loading: list[list[concurrent.futures.Future[LoadResult]]] = [[] for _ in self._workers]
        # The step's stores: their requests, per layer group the futures once submitted, and the
        # layers each group still waits for the forward to write (vLLM's order is not assumed).
        self._staged: tuple[list[ChunkRequest], list[StoreFutures | None], list[set[str]]] | None = None
        # Layer groups a forward waited for, and stores that left during a forward (tests, logs).
        self.counters: Counter[str] = Counter()

    @property
    def workers(self) -> list[ThreadedKVWorker]:
        return list(self._workers)

    # -- loads ----------------------------------------------------------------------------------

    def load_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> list[concurrent.futures.Future[LoadResult]]:
        """The layer groups' loads one after another, in the forward's order: sharing the store's
        bandwidth, they would all land near the end; in turn, the first layers' land first."""
        requests = list(requests)
        parts: list[list[concurrent.futures.Future[LoadResult]]] = [
            [concurrent.futures.Future() for _ in requests] for _ in self._workers
        ]

        def submit(group: int) -> None:
            load = functools.partial(self._workers[group].load_many, requests, timeout=timeout)
            submitted = _submitted(load, len(requests))
            for source, target in zip(submitted, parts[group], strict=True):
                source.add_done_callback(functools.partial(_settle, target))
            if group + 1 < len(self._workers):
                when_all(submitted, lambda: None).add_done_callback(lambda _: submit(group + 1))

        submit(0)
        for group, futures in enumerate(parts):
            self._loading[group].extend(futures)
        return [when_all(group_parts, merged_load(group_parts)) for group_parts in zip(*parts, strict=True)]

    def new_step(self) -> None:
        """A step begins: the loads of earlier steps are no forward's to wait for. Stores a forward
        started without ending (no ``store_many``) are waited for here: nothing else tracks them, and
        their blocks may be reused from this step on."""
        self._loading = [[] for _ in self._workers]
        staged, self._staged = self._staged, None
        if staged is not None:
            self.counters["layer_stores_unfinished_steps"] += 1
            wait_all([future for futures in staged[1] if futures for future in futures], "layer-wise stores")

    def wait_for_layer(self, layer_name: str) -> float:
        """Before ``layer_name`` reads its KV: wait for the step's loads of its layer group (loads of an
        unknown layer, e.g. another KV cache group's, are not this mover's). The seconds waited."""
        group = self._group_of.get(layer_name)
        if group is None or not self._loading[group]:
            return 0.0
        futures, self._loading[group] = self._loading[group], []
        started = time.monotonic()
        self.counters["layer_loads_waited"] += 1
        if not all(future.done() for future in futures):
            self.counters["layer_loads_not_in_yet"] += 1  # the forward overtook the transfer here
        wait_all(futures, f"load of layers {layer_name} and on")
        return time.monotonic() - started

    # -- stores ---------------------------------------------------------------------------------

    def layer_written(
        self, layer_name: str, requests: Callable[[], list[ChunkRequest]], *, timeout: float | None = None
    ) -> None:
        """The forward wrote ``layer_name``'s KV: once every layer of its layer group is written, the
        group's part of the step's stores (``requests()``, asked once per step) leaves."""
        group = self._group_of.get(layer_name)
        if group is None:
            return
        if self._staged is None:
            self._staged = (
                requests(),
                [None] * len(self._workers),
                [set(names) for names in self._layer_names],
            )
        staged, submitted, unwritten = self._staged
        unwritten[group].discard(layer_name)
        if staged and not unwritten[group] and submitted[group] is None:
            store = functools.partial(self._workers[group].store_many, staged, timeout=timeout)
            submitted[group] = _submitted(store, len(staged))
            self.counters["layer_stores_during_forward"] += 1

    def store_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> list[concurrent.futures.Future[StoreResult]]:
        """A step's stores (at the end of its forward): the layer groups that did not leave yet leave
        now. ``requests`` must be the ones :meth:`layer_written` was given this step, if it was."""
        requests = list(requests)
        staged, self._staged = self._staged, None
        submitted: list[StoreFutures | None] = [None] * len(self._workers)
        if staged is not None:
            if len(staged[0]) != len(requests):
                raise RuntimeError(
                    f"the step's stores changed during its forward: {len(staged[0])} requests, "
                    f"then {len(requests)}"
                )
            submitted = staged[1]
        parts = [
            futures
            if futures is not None
            else _submitted(functools.partial(worker.store_many, requests, timeout=timeout), len(requests))
            for worker, futures in zip(self._workers, submitted, strict=True)
        ]
        return [when_all(group_parts, merged_store(group_parts)) for group_parts in zip(*parts, strict=True)]

    # -- the rest of :class:`ChunkMover` ----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {"layerwise": dict(self.counters)}
        for worker in self._workers:
            add_counters(total, worker.stats())
        return total

    def stats_soon(self) -> concurrent.futures.Future[dict[str, Any]]:
        parts = [worker.stats_soon() for worker in self._workers]

        def summed() -> dict[str, Any]:
            total: dict[str, Any] = {}
            for part in parts:
                add_counters(total, part.result())
            return total

        return when_all(parts, summed)

    def close(self, timeout: float | None = None) -> None:
        """Nothing: the workers are closed by their owner (the worker side's group workers)."""
