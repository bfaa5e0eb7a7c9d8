"""Counters and latency summaries of a worker, readable at any time with ``worker.stats()``.

The vocabularies of those counters are enums, used by the worker and by :mod:`aiokv.metrics` alike;
``stats()`` hands users their string values.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_LATENCY_WINDOW = 4096  # recent requests per operation kept for percentiles


class Kind(enum.StrEnum):
    """What a request does."""

    STORE = "store"
    LOAD = "load"
    LOOKUP = "lookup"


TRANSFER_KINDS = (Kind.STORE, Kind.LOAD)


class Op(enum.StrEnum):
    """A backend batch call the worker makes (``put``/``get`` are also the byte directions)."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    REPLICA_GET = "replica_get"  # gets that failed -800 read again from another replica


DIRECTIONS = (Op.PUT, Op.GET)


class ChunkOutcome(enum.StrEnum):
    STORED = "stored"
    SKIPPED = "skipped"
    FAILED = "failed"
    LOADED = "loaded"
    LOAD_FAILED = "load_failed"


class Phase(enum.StrEnum):
    """Where a transfer's time goes inside the worker, in the order a batch runs."""

    QUEUE = "queue"  # submitted until its batch begins (per request)
    PREPARE = "prepare"  # keys, claims, the existence check and the plan
    TRANSFER = "transfer"  # the backend calls moving the bytes (verification of values included)
    CONFIRM = "confirm"  # puts read back before any result counts them (stores)
    SETTLE = "settle"  # outcomes into results, futures settled


class StatName(enum.StrEnum):
    """The keys of ``stats()``."""

    REQUESTS = "requests"  # by Kind
    REQUESTS_FAILED = "requests_failed"  # by Kind
    REQUESTS_CANCELLED = "requests_cancelled"  # by Kind
    CHUNKS = "chunks"  # by ChunkOutcome
    BYTES = "bytes"  # by direction (Op.PUT, Op.GET)
    BACKEND_CALLS = "backend_calls"  # by Op
    BACKEND_ERRORS = "backend_errors"  # by status code
    BACKEND_EXCEPTIONS = "backend_exceptions"  # by Op
    PRESSURE_BACKOFFS = "pressure_backoffs"
    BATCHES = "batches"
    LATENCY = "latency"  # by Kind
    PHASES = "phases"  # by Kind, then Phase: {"count": n, "seconds": total}
    LEASES = "leases"  # the lookups' lease ledger (added by KVWorker.stats(); None without one)
    BREAKER = "breaker"  # the circuit breaker's snapshot (added by KVWorker.stats(); None without one)


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

    requests: Counter[Kind] = field(default_factory=Counter)
    requests_failed: Counter[Kind] = field(default_factory=Counter)
    requests_cancelled: Counter[Kind] = field(default_factory=Counter)
    chunks: Counter[ChunkOutcome] = field(default_factory=Counter)
    bytes: Counter[Op] = field(default_factory=Counter)
    backend_calls: Counter[Op] = field(default_factory=Counter)
    backend_errors: Counter[int] = field(default_factory=Counter)  # status code -> (chunk, group) count
    backend_exceptions: Counter[Op] = field(default_factory=Counter)
    pressure_backoffs: int = 0
    batches: int = 0
    _latencies: dict[Kind, deque[float]] = field(default_factory=dict)
    # Seconds and counts per (kind, phase), summed since start: a mean per phase over any interval is
    # the difference of two snapshots (what Prometheus and the vLLM connector report).
    phase_seconds: dict[tuple[Kind, Phase], float] = field(default_factory=dict)
    phase_counts: Counter[tuple[Kind, Phase]] = field(default_factory=Counter)

    def record_phase(self, kinds: frozenset[Kind], phase: Phase, seconds: float, count: int = 1) -> None:
        for kind in kinds:
            self.phase_seconds[kind, phase] = self.phase_seconds.get((kind, phase), 0.0) + seconds
            self.phase_counts[kind, phase] += count

    def phases(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (kind, phase), count in sorted(self.phase_counts.items()):
            out.setdefault(kind.value, {})[phase.value] = {
                "count": count,
                "seconds": self.phase_seconds[kind, phase],
            }
        return out

    def record_latency(self, kind: Kind, seconds: float) -> None:
        window = self._latencies.get(kind)
        if window is None:
            window = self._latencies[kind] = deque(maxlen=_LATENCY_WINDOW)
        window.append(seconds)

    def latency(self, kind: Kind | str) -> LatencySummary | None:
        window = self._latencies.get(Kind(kind)) if kind in tuple(Kind) else None
        if not window:
            return None
        values = np.fromiter(window, dtype=np.float64, count=len(window)) * 1e3
        p50, p99 = np.percentile(values, [50, 99]).tolist()
        return LatencySummary(len(values), float(values.mean()), p50, p99, float(values.max()))

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy with string keys: counters as dicts, latencies as :class:`LatencySummary`."""

        def plain(counter: Counter[Any]) -> dict[Any, int]:
            return {getattr(key, "value", key): count for key, count in counter.items()}

        return {
            StatName.REQUESTS.value: plain(self.requests),
            StatName.REQUESTS_FAILED.value: plain(self.requests_failed),
            StatName.REQUESTS_CANCELLED.value: plain(self.requests_cancelled),
            StatName.CHUNKS.value: plain(self.chunks),
            StatName.BYTES.value: plain(self.bytes),
            StatName.BACKEND_CALLS.value: plain(self.backend_calls),
            StatName.BACKEND_ERRORS.value: {int(code): n for code, n in self.backend_errors.items()},
            StatName.BACKEND_EXCEPTIONS.value: plain(self.backend_exceptions),
            StatName.PRESSURE_BACKOFFS.value: self.pressure_backoffs,
            StatName.BATCHES.value: self.batches,
            StatName.LATENCY.value: {
                kind.value: self.latency(kind) for kind in sorted(self._latencies, key=lambda k: k.value)
            },
            StatName.PHASES.value: self.phases(),
        }
