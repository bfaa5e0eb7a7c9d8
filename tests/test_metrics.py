"""aiokv.metrics: Prometheus export of worker.stats(), scraped with generate_latest after real traffic."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiokv import BackendError, Code, KVWorker, MemoryBackend, ThreadedKVWorker
from aiokv.metrics import PrometheusExporter, register_worker_metrics
from aiokv.testing import SENTINEL, FaultInjectingBackend, FaultRule, PagedCache
from tests.helpers import chunk_keys

CHUNK = 8
NAMESPACE = "metrics-model"
# Group 0: 2 regions x 32 B, 2 blocks per chunk -> 128 B a chunk; group 1: 64 B a chunk.
SPECS = [
    {"num_regions": 2, "num_blocks": 32, "block_size": 4, "block_lens": 32},
    {"num_regions": 1, "num_blocks": 16, "block_size": 8, "block_lens": 64},
]
CHUNK_BYTES = (128, 64)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def ids(chunks: int, start: int = 0) -> list[np.ndarray]:
    return [
        np.arange(start * CHUNK // s["block_size"], (start + chunks) * CHUNK // s["block_size"])
        for s in SPECS
    ]


def keys(cache: PagedCache, tokens: np.ndarray, group: int) -> list[str]:
    return chunk_keys(tokens, CHUNK, cache[group].layout, group, NAMESPACE)


@pytest.mark.asyncio
async def test_scrape_after_real_traffic_reports_the_exact_figures() -> None:
    cache = PagedCache.allocate(SPECS, fill=SENTINEL)
    rng = np.random.default_rng(0)
    for group in cache.groups:
        for region in group.regions:
            region[: region.shape[0] // 2] = rng.integers(0, 256, size=region[: region.shape[0] // 2].shape)
    backend = FaultInjectingBackend(MemoryBackend())
    a, b, c = (rng.integers(0, 1000, size=n * CHUNK) for n in (3, 1, 1))
    backend.add_rule(FaultRule(op="put", keys={keys(cache, a, 0)[2]}, code=Code.TRANSFER_FAILED))
    backend.add_rule(
        FaultRule(op="put", keys={keys(cache, b, 0)[0]}, exception=RuntimeError("disk"), times=1)
    )
    registry = CollectorRegistry()
    async with KVWorker(cache.layouts, backend, namespace=NAMESPACE, chunk_tokens=CHUNK) as worker:
        exporter = PrometheusExporter(worker, registry)
        before = scrape(registry)
        stored = await worker.store(a, ids(3))  # chunk 2 fails in group 0
        assert (stored.stored, stored.failed) == (2, 1)
        loaded = await worker.load(a, ids(3, start=6))  # prefix of 2 chunks
        assert loaded.loaded_tokens == 2 * CHUNK
        assert await worker.lookup(a) == 2 * CHUNK
        with pytest.raises(BackendError):
            await worker.store(b, ids(1, start=3))  # its group-0 put raises
        cancelled = worker.store(c, ids(1, start=4))
        assert cancelled.cancel()
        after = scrape(registry)
        stats = worker.stats()
    exporter.unregister()

    # Known label values are there from the start, at 0.
    for kind in ("store", "load", "lookup"):
        assert value(before, "aiokv_requests_total", kind=kind) == 0
    for outcome in ("stored", "skipped", "failed", "loaded", "load_failed"):
        assert value(before, "aiokv_chunks_total", outcome=outcome) == 0
    assert value(before, "aiokv_pressure_backoffs_total") == 0

    expected = {
        ("aiokv_requests_total", "kind", "store"): 3,
        ("aiokv_requests_total", "kind", "load"): 1,
        ("aiokv_requests_total", "kind", "lookup"): 1,
        ("aiokv_requests_failed_total", "kind", "store"): 1,
        ("aiokv_requests_failed_total", "kind", "load"): 0,
        ("aiokv_requests_cancelled_total", "kind", "store"): 1,
        ("aiokv_chunks_total", "outcome", "stored"): 2,
        ("aiokv_chunks_total", "outcome", "failed"): 1,
        ("aiokv_chunks_total", "outcome", "skipped"): 0,
        ("aiokv_chunks_total", "outcome", "loaded"): 2,
        ("aiokv_chunks_total", "outcome", "load_failed"): 1,
        # Store a: group 1 whole (3 x 64) + group 0 chunks 0-1 (2 x 128); store b: group 1 only.
        ("aiokv_bytes_total", "direction", "put"): 3 * 64 + 2 * 128 + 64,
        ("aiokv_bytes_total", "direction", "get"): 2 * (128 + 64),
        # One exists per batch and per lookup batch, and one confirming each of the two store batches
        # whose puts answered success; one put / get per group per batch.
        ("aiokv_backend_calls_total", "op", "exists"): 6,
        ("aiokv_backend_calls_total", "op", "put"): 4,
        ("aiokv_backend_calls_total", "op", "get"): 2,
        ("aiokv_backend_exceptions_total", "op", "put"): 1,
        ("aiokv_backend_exceptions_total", "op", "get"): 0,
    }
    for (name, label, label_value), number in expected.items():
        assert value(after, name, **{label: label_value}) == number, (name, label_value)
    assert value(after, "aiokv_backend_errors_total", code="-800", error="TRANSFER_FAILED") == 1
    assert [k for k in after if k[0] == "aiokv_backend_errors_total"] == [
        ("aiokv_backend_errors_total", (("code", "-800"), ("error", "TRANSFER_FAILED")))
    ]
    assert value(after, "aiokv_batches_total") == 3
    assert value(after, "aiokv_pressure_backoffs_total") == 0

    # The same figures as worker.stats().
    assert value(after, "aiokv_bytes_total", direction="put") == stats["bytes"]["put"]
    assert value(after, "aiokv_batches_total") == stats["batches"]
    for kind in ("store", "load", "lookup"):
        summary = stats["latency"][kind]
        window = value(after, "aiokv_request_latency_window", kind=kind)
        assert window == summary.count
        p50, p99, top = (
            value(after, "aiokv_request_latency_seconds", kind=kind, quantile=q) for q in ("0.5", "0.99", "1")
        )
        assert p50 == pytest.approx(summary.p50_ms / 1e3)
        assert top == pytest.approx(summary.max_ms / 1e3)
        assert 0 < p50 <= p99 <= top
        assert value(after, "aiokv_request_latency_mean_seconds", kind=kind) == pytest.approx(
            summary.mean_ms / 1e3
        )
    assert value(after, "aiokv_request_latency_window", kind="store") == 3  # finished, failed, cancelled


@pytest.mark.asyncio
async def test_values_are_read_at_scrape_time_and_names_carry_the_namespace() -> None:
    cache = PagedCache.allocate(SPECS, seed=1)
    registry = CollectorRegistry()
    async with KVWorker(cache.layouts, MemoryBackend(), namespace=NAMESPACE, chunk_tokens=CHUNK) as worker:
        register_worker_metrics(worker, registry, namespace="engine_kv")
        tokens = np.arange(2 * CHUNK)
        assert value(scrape(registry), "engine_kv_requests_total", kind="store") == 0
        await worker.store(tokens, ids(2))
        first = scrape(registry)
        await worker.store(tokens, ids(2))
        second = scrape(registry)
    assert value(first, "engine_kv_chunks_total", outcome="stored") == 2
    assert value(second, "engine_kv_chunks_total", outcome="stored") == 2
    assert value(second, "engine_kv_chunks_total", outcome="skipped") == 2
    assert value(second, "engine_kv_requests_total", kind="store") == 2
    assert not any(name.startswith("aiokv_") for name, _ in second)


def test_a_threaded_worker_is_scraped_from_another_thread() -> None:
    cache = PagedCache.allocate(SPECS, seed=2)
    registry = CollectorRegistry()
    with ThreadedKVWorker(cache.layouts, MemoryBackend(), namespace=NAMESPACE, chunk_tokens=CHUNK) as worker:
        PrometheusExporter(worker, registry)
        assert worker.store(np.arange(3 * CHUNK), ids(3)).result(timeout=30).stored == 3
        samples = scrape(registry)
    assert value(samples, "aiokv_chunks_total", outcome="stored") == 3
    assert value(samples, "aiokv_bytes_total", direction="put") == 3 * sum(CHUNK_BYTES)


@pytest.mark.asyncio
async def test_registration_rules() -> None:
    cache = PagedCache.allocate(SPECS, seed=3)
    registry = CollectorRegistry()
    async with KVWorker(cache.layouts, MemoryBackend(), namespace=NAMESPACE, chunk_tokens=CHUNK) as worker:
        exporter = PrometheusExporter(worker, registry)
        with pytest.raises(ValueError, match="Duplicated"):
            PrometheusExporter(worker, registry)  # same names in one registry
        PrometheusExporter(worker, registry, namespace="second")
        exporter.unregister()
        exporter.unregister()  # idempotent
        PrometheusExporter(worker, registry)  # the names are free again
        unregistered = PrometheusExporter(worker, register=False)
        assert unregistered.registry is None
        assert {f.name for f in unregistered.collect()} >= {"aiokv_requests", "aiokv_request_latency_seconds"}
    with pytest.raises(TypeError, match="stats"):
        PrometheusExporter(object(), registry)
    with pytest.raises(ValueError, match="namespace"):
        PrometheusExporter(worker, CollectorRegistry(), namespace="bad-name")


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)

    class Worker:
        def stats(self) -> dict[str, object]:
            return {}

    with pytest.raises(ImportError, match=r"pip install 'aiokv\[prometheus\]'"):
        PrometheusExporter(Worker(), register=False)
