"""Where a hit's time goes, phase by phase, as the scheduler sees it (monotonic clock, seconds).

A request's hit passes, in order:

- ``lookup``: from vLLM's first ask until the answer (``lookup_asks``: the asks it took; each ``None``
  answer costs the request a scheduler step);
- ``alloc``: the answer until vLLM allocated the request's blocks (``update_state_after_alloc``);
- ``dispatch``: until the step's metadata carrying the load was built (the workers start it then);
- ``load``: until the last worker's load was done (the workers report when, in their metadata);
- ``notice``: until the scheduler heard of it (``finished_recving``);
- ``resume``: until a step scheduled the request's tail;
- ``tail``: the step computing the tail (and sampling the first token): from its schedule to the
  next call the scheduler makes into the connector.

Each finished phase is one observation, handed to vLLM's stats hook (Prometheus histograms
``vllm:aiokv_hit_<phase>_seconds``, see :mod:`..common.connector_stats`); with OpenTelemetry tracing
on (:func:`hit_tracer`), each finished hit is also a span ``aiokv.hit`` with one child span per phase.
The workers' view of a load (aiokv's queue, transfer and settle, and what verifying values cost) comes
from their counters.
Clock readings are the same ``time.monotonic()`` in every process of one machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

PHASES = ("lookup", "alloc", "dispatch", "load", "notice", "resume", "tail")
# Observations kept per name between takes: vLLM takes them every step when it logs stats, never when
# it does not; the newest are kept.
MAX_KEPT = 4096


@dataclass
class _Timeline:
    asked: float
    asks: int = 1
    answered: float | None = None
    allocated: float | None = None
    dispatched: float | None = None
    nbytes: int = 0
    loaded: float | None = None
    noticed: float | None = None
    tail_scheduled: float | None = None


@dataclass
class HitPhases:
    """Per request in flight, the times of its hit's steps; the finished phases since the last take."""

    _live: dict[str, _Timeline] = field(default_factory=dict)
    _observed: dict[str, list[float]] = field(default_factory=dict)
    tracer: Any = None  # an OpenTelemetry tracer: each finished hit becomes spans (None: no spans)

    def _observe(self, name: str, value: float) -> None:
        values = self._observed.setdefault(name, [])
        values.append(max(0.0, value))
        if len(values) > MAX_KEPT:
            del values[: MAX_KEPT // 2]

    def asked(self, req_id: str, now: float) -> None:
        """vLLM asked for the request's hit (again, if it was answered "ask again" before)."""
        timeline = self._live.get(req_id)
        if timeline is None:
            self._live[req_id] = _Timeline(now)
        elif timeline.answered is None:
            timeline.asks += 1

    def answered(self, req_id: str, now: float) -> None:
        timeline = self._live.get(req_id)
        if timeline is None or timeline.answered is not None:
            return
        timeline.answered = now
        self._observe("lookup_seconds", now - timeline.asked)
        self._observe("lookup_asks", timeline.asks)

    def allocated(self, req_id: str, now: float, nbytes: int) -> None:
        """vLLM allocated blocks for a load of ``nbytes``; without a load the record ends here."""
        timeline = self._live.get(req_id)
        if timeline is None or timeline.answered is None:
            return
        if not nbytes:
            del self._live[req_id]
            return
        timeline.allocated, timeline.nbytes = now, nbytes
        self._observe("alloc_seconds", now - timeline.answered)

    def step(self, dispatched: list[str], scheduled: set[str], now: float) -> None:
        """A step's metadata was built: the loads of ``dispatched`` start; requests ``scheduled``
        compute tokens in it."""
        self._end_tails(now)
        for req_id in dispatched:
            timeline = self._live.get(req_id)
            if timeline is not None and timeline.allocated is not None and timeline.dispatched is None:
                timeline.dispatched = now
                self._observe("dispatch_seconds", now - timeline.allocated)
        for req_id in scheduled:
            timeline = self._live.get(req_id)
            if timeline is not None and timeline.noticed is not None and timeline.tail_scheduled is None:
                timeline.tail_scheduled = now
                self._observe("resume_seconds", now - timeline.noticed)

    def loads_done(self, done_at: dict[str, float]) -> None:
        """When the workers' loads were done, as they reported (the last rank's time per request)."""
        for req_id, at in done_at.items():
            timeline = self._live.get(req_id)
            if timeline is None or timeline.dispatched is None or timeline.loaded is not None:
                continue
            timeline.loaded = at
            seconds = at - timeline.dispatched
            self._observe("load_seconds", seconds)
            if seconds > 0:
                self._observe("load_bytes_per_second", timeline.nbytes / seconds)

    def noticed(self, req_ids: list[str], now: float) -> None:
        """The scheduler heard that the loads of ``req_ids`` finished."""
        self._end_tails(now)
        for req_id in req_ids:
            timeline = self._live.get(req_id)
            if timeline is None or timeline.noticed is not None:
                continue
            timeline.noticed = now
            if timeline.loaded is not None:
                self._observe("notice_seconds", now - timeline.loaded)

    def _end_tails(self, now: float) -> None:
        for req_id, timeline in list(self._live.items()):
            if timeline.tail_scheduled is not None:
                self._observe("tail_seconds", now - timeline.tail_scheduled)
                del self._live[req_id]
                if self.tracer is not None:
                    _spans(self.tracer, req_id, timeline, now)

    def forget(self, req_id: str) -> None:
        """The request ended or was preempted: what it did not reach is not observed."""
        self._live.pop(req_id, None)

    def take(self) -> dict[str, list[float]]:
        """The observations since the last take, by name (``<phase>_seconds``, ``lookup_asks``,
        ``load_bytes_per_second``)."""
        observed, self._observed = self._observed, {}
        return observed


def _spans(tracer: Any, req_id: str, timeline: _Timeline, ended: float) -> None:
    """The hit as a span with a child per phase, at the times recorded (monotonic, turned into the
    wall-clock nanoseconds OpenTelemetry takes)."""
    to_ns = time.time_ns() - time.monotonic_ns()
    marks = [
        timeline.asked,
        timeline.answered,
        timeline.allocated,
        timeline.dispatched,
        timeline.loaded,
        timeline.noticed,
        timeline.tail_scheduled,
        ended,
    ]
    if any(mark is None for mark in marks):
        return
    stamps = [round(mark * 1e9) + to_ns for mark in marks if mark is not None]
    attributes = {
        "vllm.request_id": req_id,
        "aiokv.bytes": timeline.nbytes,
        "aiokv.lookup_asks": timeline.asks,
    }
    hit = tracer.start_span("aiokv.hit", start_time=stamps[0], attributes=attributes)
    try:
        from opentelemetry import trace

        context = trace.set_span_in_context(hit)
        for name, start, end in zip(PHASES, stamps, stamps[1:], strict=False):
            tracer.start_span(f"aiokv.hit.{name}", context=context, start_time=start).end(end_time=end)
    finally:
        hit.end(end_time=stamps[-1])


def hit_tracer() -> Any:
    """An OpenTelemetry tracer for the hits' spans, or None: tracing is on when the process has a
    tracer provider set (vLLM sets one with ``--otlp-traces-endpoint`` where it traces), or when
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` names an endpoint (vLLM passes it to its engine processes);
    ``opentelemetry-api`` is used only if installed."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint:
            return None
        try:
            from vllm.tracing import init_tracer

            return init_tracer("aiokv.connector", endpoint)
        except Exception:  # no SDK or exporter: spans are an extra, never a reason to fail
            return None
    return trace.get_tracer("aiokv.connector")
