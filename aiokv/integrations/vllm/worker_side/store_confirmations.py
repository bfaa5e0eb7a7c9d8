"""Which chunks this rank's stores left in the store behind the engine (Mooncake, or a backend of the
user's own), reported to the scheduler after each step for its KV events (:class:`.wire.StoreReport`,
:mod:`..scheduler_side.kv_events`). Only with KV events on, on a rank that writes to that store.

A store's future (the group's, aiokv's ``StoreResult``) says which chunks are not in the store
afterwards (``failed_chunks``); the others are: written now or already there. A store refused at
submission, or whose future fails, leaves none it can vouch for.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Sequence
from typing import Any

from ..common.connector_config import ConnectorConfig
from ..common.geometry import EngineGeometry
from ..common.store_writers import store_writer_rank
from ..common.wire import StoreReport, TransferSpec


class StoreConfirmations:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()  # the engine's thread reports, aiokv's loop settles the futures
        self._stored: list[str] = []
        self._failed: list[str] = []

    def watch(self, spec: TransferSpec, futures: Sequence[concurrent.futures.Future[Any]] | None) -> None:
        """A store ordered for ``spec``: ``futures`` as the worker side submitted them (one per group
        moving chunks, None if refused). Single-group engines: the first is the only one."""
        digests = spec.group_prompt(0).hashes
        if not digests:
            return
        if not futures:
            self._settle(digests, ())
            return
        futures[0].add_done_callback(functools.partial(self._settled, digests))

    def _settled(self, digests: Sequence[str], future: concurrent.futures.Future[Any]) -> None:
        failed: Sequence[int] = range(len(digests))
        if not future.cancelled() and future.exception() is None:
            failed = future.result().failed_chunks
        stored = set(range(len(digests))).difference(failed)
        self._settle(digests, sorted(stored))

    def _settle(self, digests: Sequence[str], stored: Sequence[int]) -> None:
        kept = set(stored)
        with self._lock:
            for index, digest in enumerate(digests):
                (self._stored if index in kept else self._failed).append(digest)

    def report(self) -> StoreReport | None:
        """The stores settled since the last report, or None."""
        with self._lock:
            if not self._stored and not self._failed:
                return None
            report = StoreReport({self.rank: self._stored}, {self.rank: self._failed})
            self._stored, self._failed = [], []
        return report


def store_confirmations(
    vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry, tp_rank: int, pp_rank: int
) -> StoreConfirmations | None:
    """This rank's confirmations if KV events are on, a store is behind the engine, the engine has one
    KV cache group, and this rank writes to the store; else None (nothing is tracked)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events or not config.remote or geometry.hybrid:
        return None
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    rank = store_writer_rank(geometry, tp_rank, pp_rank, tp_size)
    return StoreConfirmations(rank) if rank is not None else None
