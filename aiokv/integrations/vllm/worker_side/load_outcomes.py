"""What became of the loads a worker rank submitted, until the connector reports it to vLLM: which
are done and when, and what they could not fill (blocks of a single-group engine, whole requests of
a hybrid one)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections import Counter
from typing import Any

from ....results import LoadResult
from ..common.chained_futures import when_all
from ..common.wire import TransferSpec
from .transfer_waits import wait_all

logger = logging.getLogger("aiokv.vllm")

LoadFutures = list[concurrent.futures.Future[LoadResult]]


class LoadOutcomes:
    """The loads in flight and their outcomes. ``hybrid``: the engine has several KV cache groups;
    ``events``: the connector's event counter, where failed loads are counted."""

    def __init__(self, hybrid: bool, events: Counter[str]) -> None:
        self._hybrid = hybrid
        self._events = events
        self._loads: dict[str, tuple[LoadFutures | None, TransferSpec]] = {}
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # hybrid engines: loads that failed, reported per request
        # When each load was done (time.monotonic()), reported to the scheduler (a hit's phases).
        self._loads_done: dict[str, float] = {}
        self._loads_done_lock = threading.Lock()  # written on aiokv's loop thread, taken on the engine's

    def submitted(self, spec: TransferSpec, futures: LoadFutures | None) -> None:
        """The load of ``spec``: its groups' futures, or None when nothing was submitted (refused, or
        nothing to load: its blocks are then failed)."""
        self._loads[spec.req_id] = (futures, spec)
        if futures:
            # Stamped on the thread that finishes the last group's load.
            when_all(futures, functools.partial(self._load_done, spec.req_id))

    def pending(self) -> list[concurrent.futures.Future[Any]]:
        """The futures of loads not done yet."""
        loads = self._loads.values()
        return [future for futures, _ in loads for future in futures or () if not future.done()]

    def finished(self) -> set[str]:
        """The requests whose loads are done since the last call (their failures recorded)."""
        return {req_id for req_id in list(self._loads) if self.finish(req_id)}

    def finish(self, req_id: str, *, wait: bool = False) -> bool:
        """If the load of ``req_id`` is done (waiting for it with ``wait``), record what failed: blocks
        of a single-group engine; the whole request of a hybrid one, in every group (vLLM 0.32 takes a
        multi-group model's failures only per request, and a range loaded in one group but not in
        another must never be used)."""
        futures, spec = self._loads[req_id]
        if futures is not None and wait:
            wait_all(futures, f"load of {req_id}")
        if futures is not None and not all(future.done() for future in futures):
            return False
        del self._loads[req_id]
        failed = [set(ids) for ids in spec.block_ids]
        if futures is not None:
            moving = [group for group, ids in enumerate(spec.block_ids) if ids]
            for group, future in zip(moving, futures, strict=True):
                try:
                    result = future.result()
                    failed[group] = set(result.failed_block_ids[0]) if result.failed_block_ids else set()
                except Exception as exc:
                    logger.warning("aiokv: load for %s failed (%s); recomputing it", req_id, exc)
        for group, ids in enumerate(spec.unloaded_block_ids):
            failed[group] |= set(ids)
        count = sum(map(len, failed))
        if not count:
            return True
        self._events["load_error_blocks"] += count
        if self._hybrid:
            self._events["load_error_requests"] += 1
            self._failed_loads.add(req_id)
        else:
            self._load_errors |= failed[0]
        return True

    def take_block_errors(self) -> set[int]:
        """Blocks loads failed to fill since the last call (single-group engines)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed in some group since the last call (hybrid engines)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_done_times(self) -> dict[str, float]:
        """When each load done since the last call was done (``time.monotonic()``)."""
        with self._loads_done_lock:
            done, self._loads_done = self._loads_done, {}
        return done

    def _load_done(self, req_id: str) -> None:
        """Every group's load of ``req_id`` is done (on aiokv's loop thread)."""
        with self._loads_done_lock:
            self._loads_done[req_id] = time.monotonic()
