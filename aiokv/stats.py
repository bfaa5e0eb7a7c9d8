"""Counters and latency summaries of a worker, readable at any time with ``worker.stats()``."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_LATENCY_WINDOW = 4096  # recent requests per operation kept for percentiles


@dataclass(frozen=True, slots=True)
class LatencySummary:
    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(slots=True)
class WorkerStats:
    """Monotonic counters (since the worker started) plus recent latency windows.

    Only the event-loop thread writes; ``snapshot()`` copies, so readers never see a torn update.
    """

    requests: Counter[str] = field(default_factory=Counter)  # by kind: store, load, lookup
    requests_failed: Counter[str] = field(default_factory=Counter)
    requests_cancelled: Counter[str] = field(default_factory=Counter)
    chunks: Counter[str] = field(default_factory=Counter)  # stored, skipped, failed, loaded, load_failed
    bytes: Counter[str] = field(default_factory=Counter)  # put, get
    backend_calls: Counter[str] = field(default_factory=Counter)  # exists, put, get
    backend_errors: Counter[int] = field(default_factory=Counter)  # status code -> (chunk, group) count
    backend_exceptions: Counter[str] = field(default_factory=Counter)  # by call
    pressure_backoffs: int = 0
    batches: int = 0
    _latencies: dict[str, deque[float]] = field(default_factory=dict)

    def record_latency(self, kind: str, seconds: float) -> None:
        window = self._latencies.get(kind)
        if window is None:
            window = self._latencies[kind] = deque(maxlen=_LATENCY_WINDOW)
        window.append(seconds)

    def latency(self, kind: str) -> LatencySummary | None:
        window = self._latencies.get(kind)
        if not window:
            return None
        values = np.fromiter(window, dtype=np.float64, count=len(window)) * 1e3
        p50, p99 = np.percentile(values, [50, 99]).tolist()
        return LatencySummary(len(values), float(values.mean()), p50, p99, float(values.max()))

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy: counters as dicts, latencies as :class:`LatencySummary`."""
        return {
            "requests": dict(self.requests),
            "requests_failed": dict(self.requests_failed),
            "requests_cancelled": dict(self.requests_cancelled),
            "chunks": dict(self.chunks),
            "bytes": dict(self.bytes),
            "backend_calls": dict(self.backend_calls),
            "backend_errors": dict(self.backend_errors),
            "backend_exceptions": dict(self.backend_exceptions),
            "pressure_backoffs": self.pressure_backoffs,
            "batches": self.batches,
            "latency": {kind: self.latency(kind) for kind in sorted(self._latencies)},
        }
