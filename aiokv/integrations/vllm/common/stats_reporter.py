"""The counters the connector hands vLLM's stats hook, taken without ever waiting for aiokv's loop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any, Protocol

from ....codes import Code
from ....errors import WorkerClosedError

# The host tier's own counters, reported next to the worker's.
TIER_COUNTERS = ("hits", "bytes_read", "bytes_written", "evictions", "promotions")
# A disk tier with a memory level in front (memory_cache_capacity): each level's own, as Prometheus
# documents them (``vllm:aiokv_host_tier_<name>_total``).
TIER_LEVEL_COUNTERS = {
    "memory_hits": "Chunks loaded from the memory level in front of the disk tier",
    "memory_bytes_read": "Bytes loaded from the memory level in front of the disk tier",
    "memory_bytes_written": "Bytes copied into the memory level (stores and promotions)",
    "memory_evictions": "Chunks dropped from the memory level to make room (the disk keeps them)",
    "memory_promotions": "Chunks loaded from the disk tier and copied into its memory level",
    "memory_verify_failed": "Memory-level copies that failed their checksum (read from the disk instead)",
    "disk_hits": "Chunks loaded from the disk tier's files",
    "disk_bytes_read": "Bytes loaded from the disk tier's files",
    "disk_bytes_written": "Bytes written into the disk tier's files",
    "disk_evictions": "Chunks the disk tier evicted to make room",
}


class StatsSource(Protocol):
    """``ThreadedKVWorker``, or the host tier's worker (which adds its own counters)."""

    def stats_soon(self) -> concurrent.futures.Future[dict[str, Any]]: ...


def connector_counters(stats: dict[str, Any]) -> dict[str, float]:
    """The counters of one :meth:`KVWorker.stats` snapshot that the connector reports."""
    requests, chunks, moved = stats["requests"], stats["chunks"], stats["bytes"]
    phases = {
        f"{kind}_{phase}_{unit}": figures[unit]
        for kind, by_phase in stats.get("phases", {}).items()
        if kind in ("load", "store")
        for phase, figures in by_phase.items()
        for unit in ("seconds", "count")
    }
    return {
        **phases,
        "store_requests": requests.get("store", 0),
        "load_requests": requests.get("load", 0),
        "lookup_requests": requests.get("lookup", 0),
        "chunks_stored": chunks.get("stored", 0),
        "chunks_skipped": chunks.get("skipped", 0),
        "chunks_loaded": chunks.get("loaded", 0),
        "chunks_failed": chunks.get("failed", 0) + chunks.get("load_failed", 0),
        "bytes_put": moved.get("put", 0),
        "bytes_get": moved.get("get", 0),
        "backend_errors": sum(stats["backend_errors"].values()),
        # The host tier's own (backends "memory" and "tiered"): the counters above are the store behind's.
        **{
            f"host_tier_{key}": value
            for key, value in stats.get("host_tier", {}).items()
            if key in TIER_COUNTERS or key in TIER_LEVEL_COUNTERS
        },
        "chunks_verify_failed": stats["backend_errors"].get(int(Code.VERIFY_FAILED), 0),
    }


class CounterDeltas:
    """What ever-growing counters gained since the last call: vLLM's stats hook wants increments."""

    def __init__(self) -> None:
        self._reported: dict[str, float] = {}

    def since_last(self, current: Mapping[str, float]) -> dict[str, float] | None:
        """The counters that moved since the last call, or None if none did."""
        delta = {key: value - self._reported.get(key, 0) for key, value in current.items()}
        self._reported = dict(current)
        return {key: value for key, value in delta.items() if value} or None


class StatsReporter:
    """Counters since the last report, for vLLM's ``get_kv_connector_stats``.

    vLLM asks every step, on the engine's thread, and a blocking snapshot waited for aiokv's loop
    thread (1-2 ms a time here, more while transfers hold the GIL). Instead a snapshot is asked for
    at most every ``interval_s`` and reported at the first call after it has arrived: counters are
    never lost, only reported up to one call later.
    """

    def __init__(self, worker: StatsSource, interval_s: float = 1.0) -> None:
        self._worker = worker
        self._interval_s = interval_s
        self._asked_at = -math.inf
        self._pending: concurrent.futures.Future[dict[str, Any]] | None = None
        self._deltas = CounterDeltas()

    def delta(self) -> dict[str, float] | None:
        """The counters that changed since the last report (None if none did or no snapshot is in)."""
        report = None
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            if not pending.cancelled() and pending.exception() is None:
                report = self._deltas.since_last(connector_counters(pending.result()))
        now = time.monotonic()
        if self._pending is None and now - self._asked_at >= self._interval_s:
            self._asked_at = now
            with contextlib.suppress(WorkerClosedError):  # closing: nothing more to report
                self._pending = self._worker.stats_soon()
        return report


def add_counters(total: dict[str, Any], counters: Mapping[str, Any]) -> None:
    """Add ``counters`` (nested dicts of numbers) into ``total``; anything else keeps its first value."""
    for key, value in counters.items():
        if isinstance(value, Mapping):
            add_counters(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key in total:
            total[key] += value
        else:
            total.setdefault(key, value)
