"""aiokv's worker counters through vLLM's connector stats hook (logged) and Prometheus."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

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
    "chunks_verify_failed": "Chunks read whole whose checksum, key or fingerprint did not match (recomputed)",
    "declined_requests": "Requests whose hit was (partly) not loaded: recomputing was expected to be faster",
    "declined_tokens": "Hit tokens recomputed instead of loaded (all reasons)",
    "declined_tokens_slow_store": "Hit tokens declined: the store loads slower than the engine prefills",
    "declined_tokens_queued_loads": "Hit tokens declined: loads queued ahead would make this one late",
    "declined_tokens_fixed_cost": "Hit tokens declined: a hit too short to pay a load's fixed cost",
    "probe_loads": "Loads of one chunk taken to measure a store whose hits were being declined",
}


class AiokvConnectorStats(KVConnectorStats):
    """Counter increments over an interval; aggregating sums them."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data[key] for key in COUNTERS if self.data.get(key)}


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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            counter = self._counters.get(key)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)
