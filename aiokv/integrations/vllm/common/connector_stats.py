"""aiokv's counters and a hit's phases through vLLM's connector stats hook (logged) and Prometheus.

Counters (:data:`COUNTERS`) arrive as increments and are summed; phases (:data:`HISTOGRAMS`) arrive as
lists of observations (the scheduler side's :mod:`..scheduler_side.hit_phases`) and become histograms
labelled with the connector's ``tier`` (its backend: ``mooncake``, ``memory``, ``tiered``).
"""

from __future__ import annotations

import statistics
from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .stats_reporter import TIER_LEVEL_COUNTERS

COUNTERS = {
    "store_requests": "Store requests submitted to aiokv",
    "load_requests": "Load requests submitted to aiokv",
    "lookup_requests": "Lookups answered by this worker's aiokv client",
    "lookups_deferred": "Scheduler asks answered 'ask again': the request's lookup was still in flight",
    "chunks_stored": "Chunks written to the store",
    "chunks_skipped": "Chunks not written because the store had them",
    "chunks_loaded": "Chunks read from the store",
    "chunks_failed": "Chunks that failed to store or load",
    "bytes_put": "Bytes written to the store",
    "bytes_get": "Bytes read from the store",
    "backend_errors": "Per-chunk error codes answered by the store",
    "host_tier_hits": "Chunks loaded from the host-memory tier",
    "host_tier_bytes_read": "Bytes loaded from the host-memory tier",
    "host_tier_bytes_written": "Bytes written into the host-memory tier (stores and promotions)",
    "host_tier_evictions": "Chunks dropped from the host-memory tier to make room",
    "host_tier_promotions": "Chunks loaded from the store behind the host tier and written into it",
    **{f"host_tier_{key}": text for key, text in TIER_LEVEL_COUNTERS.items()},
    "chunks_verify_failed": "Chunks read whole whose checksum, key or fingerprint did not match (recomputed)",
    "declined_requests": "Requests whose hit was (partly) not loaded: recomputing was expected to be faster",
    "declined_tokens": "Hit tokens recomputed instead of loaded (all reasons)",
    "declined_tokens_slow_store": "Hit tokens declined: the store loads slower than the engine prefills",
    "declined_tokens_queued_loads": "Hit tokens declined: loads queued ahead would make this one late",
    "declined_tokens_fixed_cost": "Hit tokens declined: a hit too short to pay a load's fixed cost",
    "probe_loads": "Loads of one chunk taken to measure a store whose hits were being declined",
    **{
        f"{kind}_{phase}_{unit}": f"{what} of the aiokv worker's {kind}s ({phase}: {why})"
        for kind in ("load", "store")
        for phase, why in (
            ("queue", "submitted until the batch begins, per request"),
            ("prepare", "keys, existence check and plan, per batch"),
            ("transfer", "the backend calls, verification included, per batch"),
            ("confirm", "stores read back, per batch"),
            ("settle", "results and futures, per batch"),
        )
        for unit, what in (("seconds", "Seconds spent"), ("count", "Observations"))
        if not (kind == "load" and phase == "confirm")
    },
    "verify_read_seconds": "CPU seconds spent checking the checksums of values read (loads)",
}

# A hit's phases in the scheduler (hit_phases.py): name -> (documentation, histogram buckets).
_SECONDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "hit_lookup_seconds": ("A hit's lookup: vLLM's first ask until the answer", _SECONDS),
    "hit_lookup_asks": ("Asks a lookup took (each 'ask again' costs a step)", (1, 2, 3, 5, 10, 20, 50)),
    "hit_alloc_seconds": ("A hit's answer until vLLM allocated its blocks", _SECONDS),
    "hit_dispatch_seconds": ("Blocks allocated until the step sending the load to the workers", _SECONDS),
    "hit_load_seconds": ("The load sent until the last worker's load was done", _SECONDS),
    "hit_load_bytes_per_second": (
        "A hit's bytes over its load time",
        (1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10),
    ),
    "hit_notice_seconds": ("The load done until the scheduler heard of it", _SECONDS),
    "hit_resume_seconds": ("Heard until a step scheduled the request's tail", _SECONDS),
    "hit_tail_seconds": ("The step computing the hit's tail and first token", _SECONDS),
}


class AiokvConnectorStats(KVConnectorStats):
    """Counter increments and phase observations over an interval; aggregating sums the counters and
    joins the observations."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data[key] = [*self.data.get(key, ()), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {key: self.data[key] for key in COUNTERS if self.data.get(key)}
        for key in HISTOGRAMS:
            if values := self.data.get(key):
                reduced[f"{key}_median"] = statistics.median(values)
        return reduced


class AiokvPromMetrics(KVConnectorPromMetrics):
    """``vllm:aiokv_<counter>_total`` per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self._counters = {
            key: counter_cls(name=f"vllm:aiokv_{key}", documentation=text, labelnames=labelnames)
            for key, text in COUNTERS.items()
        }
        histogram_cls = metric_types[Histogram]
        self._histograms = {
            key: histogram_cls(
                name=f"vllm:aiokv_{key}",
                documentation=text,
                labelnames=[*labelnames, "tier"],
                buckets=list(buckets),
            )
            for key, (text, buckets) in HISTOGRAMS.items()
        }
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self._tier = str(extra.get("backend", "mooncake"))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if isinstance(value, list):
                histogram = self._histograms.get(key)
                if histogram is not None:
                    child = histogram.labels(*labels, self._tier)
                    for observation in value:
                        child.observe(observation)
                continue
            counter = self._counters.get(key)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)
