"""Prometheus export of a worker's statistics (optional: ``pip install 'aiokv[prometheus]'``).

A custom collector reads ``worker.stats()`` at scrape time, so the transfer path pays nothing::

    from prometheus_client import start_http_server

    from aiokv.metrics import PrometheusExporter

    async with KVWorker(...) as worker:
        PrometheusExporter(worker)  # registers with prometheus_client's default REGISTRY
        start_http_server(9400)
        ...

The figures are those of :meth:`aiokv.KVWorker.stats`, under stable names (``aiokv`` is the default
``namespace``):

=================================== ======= ================================ =======================
metric                              type    labels                           ``stats()`` key
=================================== ======= ================================ =======================
``aiokv_requests_total``            counter ``kind``: store, load, lookup    ``requests``
``aiokv_requests_failed_total``     counter ``kind``                         ``requests_failed``
``aiokv_requests_cancelled_total``  counter ``kind``                         ``requests_cancelled``
``aiokv_chunks_total``              counter ``outcome``: stored, skipped,    ``chunks``
                                            failed, loaded, load_failed
``aiokv_bytes_total``               counter ``direction``: put, get          ``bytes``
``aiokv_backend_calls_total``       counter ``op``: exists, put, get         ``backend_calls``
``aiokv_backend_errors_total``      counter ``code`` (e.g. ``-704``),        ``backend_errors``
                                            ``error`` (e.g. ``NOT_FOUND``)
``aiokv_backend_exceptions_total``  counter ``op``                           ``backend_exceptions``
``aiokv_pressure_backoffs_total``   counter                                  ``pressure_backoffs``
``aiokv_batches_total``             counter                                  ``batches``
``aiokv_request_latency_seconds``   gauge   ``kind``, ``quantile``: 0.5,     ``latency``
                                            0.99, 1 (the maximum)
``aiokv_request_latency_mean_s...`` gauge   ``kind``                         ``latency``
``aiokv_request_latency_window``    gauge   ``kind``: requests summarised    ``latency``
``aiokv_breaker_state``             gauge   ``state``: closed, open,         ``breaker["state"]``
                                            half_open (1 for the current)
``aiokv_breaker_trips_total``       counter                                  ``breaker["trips"]``
``aiokv_breaker_rejected_total``    counter ``kind``: store, load, lookup    ``breaker["rejected"]``
``aiokv_breaker_failures_total``    counter                                  ``breaker["failures"]``
``aiokv_breaker_stuck_calls_total`` counter                                  ``breaker["stuck_calls"]``
``aiokv_breaker_probes_total``      counter                                  ``breaker["probes"]``
``aiokv_breaker_probe_failures_...``counter                                  ``breaker[...]``
``aiokv_breaker_open_seconds_total``counter                                  ``breaker[...]``
=================================== ======= ================================ =======================

(the mean's full name is ``aiokv_request_latency_mean_seconds``; the breaker's
``aiokv_breaker_probe_failures_total`` and ``aiokv_breaker_open_seconds_total``; the breaker families
have samples only when the worker has a circuit breaker). Counters count since the worker
started; the known label values are exported from the start, at 0, so that ``rate()`` works at once.
Latencies are submit-to-done times over the worker's recent window of requests (see
:mod:`aiokv.stats`), hence gauges rather than a histogram. Error codes count (chunk, group) pairs.

A scrape of a worker that has been closed exports the figures of the last scrape (nothing if there
was none) instead of raising: a closed :class:`~aiokv.ThreadedKVWorker` refuses ``stats()``. Unregister
the exporter once the worker is closed for good.

One exporter per worker and registry: a second one with the same ``namespace`` in the same registry
is refused by ``prometheus_client`` (duplicate metric names); give it another registry or namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .breaker import BreakerState
from .codes import code_name
from .errors import WorkerClosedError
from .stats import DIRECTIONS, TRANSFER_KINDS, ChunkOutcome, Kind, Op, StatName

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger("aiokv")

__all__ = ["PrometheusExporter", "register_worker_metrics"]

_INSTALL_HINT = "aiokv.metrics needs prometheus_client: pip install 'aiokv[prometheus]'"

# Label values exported even before they occur (the vocabularies of aiokv.stats).
KINDS = tuple(kind.value for kind in Kind)
OUTCOMES = tuple(outcome.value for outcome in ChunkOutcome)
OPS = tuple(op.value for op in Op)
BREAKER_STATES = tuple(state.value for state in BreakerState)
QUANTILES = (("0.5", "p50_ms"), ("0.99", "p99_ms"), ("1", "max_ms"))


def _core() -> Any:
    try:
        from prometheus_client import core
    except ImportError as exc:  # the optional extra is not installed
        raise ImportError(_INSTALL_HINT) from exc
    return core


class PrometheusExporter:
    """A ``prometheus_client`` collector over ``worker.stats()``, registered on creation.

    ``worker``: a :class:`~aiokv.KVWorker` or :class:`~aiokv.ThreadedKVWorker` (anything with a
    ``stats()`` method returning that dict). ``registry``: where to register, by default
    ``prometheus_client.REGISTRY``; ``register=False`` builds the collector without registering it.
    """

    def __init__(
        self,
        worker: Any,
        registry: CollectorRegistry | None = None,
        namespace: str = "aiokv",
        *,
        register: bool = True,
    ) -> None:
        stats = getattr(worker, "stats", None)
        if not callable(stats):
            raise TypeError(f"worker must have a stats() method, got {type(worker).__name__}")
        if not isinstance(namespace, str) or not namespace.isidentifier():
            raise ValueError(f"namespace must be a metric-name prefix such as 'aiokv', got {namespace!r}")
        self._core = _core()
        self._stats: Callable[[], Mapping[str, Any]] = stats
        self._last: Mapping[str, Any] | None = None  # the figures of the last scrape
        self.namespace = namespace
        self.registry: CollectorRegistry | None = None
        if register:
            if registry is None:
                from prometheus_client import REGISTRY

                registry = REGISTRY
            registry.register(self)
            self.registry = registry

    def unregister(self) -> None:
        """Remove the collector from its registry (e.g. once the worker is closed)."""
        if self.registry is not None:
            self.registry.unregister(self)
            self.registry = None

    # -- the collector protocol -------------------------------------------------------------------

    def describe(self) -> Iterator[Any]:
        """The metric families without samples: lets a registry check names without a scrape."""
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        try:
            stats = self._stats()
        except WorkerClosedError:
            # A closed ThreadedKVWorker refuses stats(): export the figures of the last scrape (or
            # nothing), so one closed worker never breaks the scrape of a whole registry.
            if self._last is None:
                return
            stats = self._last
        self._last = stats
        families = {family.name: family for family in self._families()}
        n = self.namespace

        def counters(key: StatName, known: tuple[str, ...]) -> None:
            values = dict.fromkeys(known, 0)
            values.update(stats.get(key.value) or {})
            for label, value in sorted(values.items()):
                families[f"{n}_{key.value}"].add_metric([str(label)], value)

        counters(StatName.REQUESTS, KINDS)
        counters(StatName.REQUESTS_FAILED, KINDS)
        counters(StatName.REQUESTS_CANCELLED, tuple(kind.value for kind in TRANSFER_KINDS))
        counters(StatName.CHUNKS, OUTCOMES)
        counters(StatName.BYTES, tuple(op.value for op in DIRECTIONS))
        counters(StatName.BACKEND_CALLS, OPS)
        counters(StatName.BACKEND_EXCEPTIONS, OPS)
        for code, count in sorted((stats.get(StatName.BACKEND_ERRORS.value) or {}).items()):
            families[f"{n}_{StatName.BACKEND_ERRORS.value}"].add_metric(
                [str(code), code_name(int(code))], count
            )
        for key in (StatName.PRESSURE_BACKOFFS, StatName.BATCHES):
            families[f"{n}_{key.value}"].add_metric([], stats.get(key.value, 0))
        for kind, summary in sorted((stats.get(StatName.LATENCY.value) or {}).items()):
            if summary is None:
                continue
            for quantile, field in QUANTILES:
                families[f"{n}_request_latency_seconds"].add_metric(
                    [kind, quantile], getattr(summary, field) / 1e3
                )
            families[f"{n}_request_latency_mean_seconds"].add_metric([kind], summary.mean_ms / 1e3)
            families[f"{n}_request_latency_window"].add_metric([kind], summary.count)
        breaker = stats.get(StatName.BREAKER.value)
        if breaker:
            for state in BREAKER_STATES:
                families[f"{n}_breaker_state"].add_metric([state], int(breaker["state"] == state))
            rejected = dict.fromkeys(KINDS, 0)
            rejected.update(breaker.get("rejected") or {})
            for kind, count in sorted(rejected.items()):
                families[f"{n}_breaker_rejected"].add_metric([kind], count)
            for name in _BREAKER_COUNTERS:
                families[f"{n}_breaker_{name}"].add_metric([], breaker.get(name, 0))
        yield from families.values()

    def _families(self) -> list[Any]:
        core, n = self._core, self.namespace
        counter, gauge = core.CounterMetricFamily, core.GaugeMetricFamily
        families = [
            counter(f"{n}_{name.value}", text, labels=labels) for name, (text, labels) in _COUNTERS.items()
        ]
        families += [gauge(f"{n}_{name}", text, labels=labels) for name, (text, labels) in _GAUGES.items()]
        families.append(
            gauge(f"{n}_breaker_state", "Circuit breaker state (1 for the current).", labels=["state"])
        )
        families.append(
            counter(
                f"{n}_breaker_rejected",
                "Requests the open circuit breaker answered at once.",
                labels=["kind"],
            )
        )
        families += [counter(f"{n}_breaker_{name}", text) for name, text in _BREAKER_COUNTERS.items()]
        return families


# Counter families, named by the stats() key they export.
_COUNTERS: dict[StatName, tuple[str, list[str]]] = {
    StatName.REQUESTS: ("Requests submitted, by kind.", ["kind"]),
    StatName.REQUESTS_FAILED: ("Requests that finished with an error, by kind.", ["kind"]),
    StatName.REQUESTS_CANCELLED: ("Requests cancelled, by kind.", ["kind"]),
    StatName.CHUNKS: (
        "Chunks by outcome: stored, skipped (already present), failed, loaded, load_failed.",
        ["outcome"],
    ),
    StatName.BYTES: ("Bytes moved: put (to the store), get (from it).", ["direction"]),
    StatName.BACKEND_CALLS: ("Backend batch calls, by operation.", ["op"]),
    StatName.BACKEND_ERRORS: (
        "(chunk, group) pairs a backend call answered with an error code, by code.",
        ["code", "error"],
    ),
    StatName.BACKEND_EXCEPTIONS: ("Backend batch calls that raised, by operation.", ["op"]),
    StatName.PRESSURE_BACKOFFS: ("Times stores backed off after the store answered full (-200).", []),
    StatName.BATCHES: ("Dispatcher batches run.", []),
}
# Gauge families of the latency summaries (stats()["latency"]).
_GAUGES: dict[str, tuple[str, list[str]]] = {
    "request_latency_seconds": (
        "Submit-to-done latency over recent requests: quantile 0.5, 0.99, and 1 (the maximum).",
        ["kind", "quantile"],
    ),
    "request_latency_mean_seconds": ("Mean submit-to-done latency over recent requests.", ["kind"]),
    "request_latency_window": ("Recent requests the latency figures summarise.", ["kind"]),
}


def register_worker_metrics(
    worker: Any, registry: CollectorRegistry | None = None, namespace: str = "aiokv"
) -> PrometheusExporter:
    """Register ``worker``'s statistics with ``registry`` (default: ``prometheus_client.REGISTRY``)."""
    return PrometheusExporter(worker, registry, namespace)


# Counter families of the circuit breaker (stats()["breaker"][name]).
_BREAKER_COUNTERS: dict[str, str] = {
    "trips": "Times the circuit breaker opened.",
    "failures": "Backend calls the circuit breaker counted as failed (raised, or answered -900/-1).",
    "stuck_calls": "Backend calls that ran longer than the breaker's stuck_after_s.",
    "probes": "Health probes the circuit breaker ran.",
    "probe_failures": "Health probes that failed or did not answer in time.",
    "open_seconds": "Seconds the circuit breaker has been open (or half-open).",
}
