"""A hit's phases as the scheduler side records them (scheduler_side.hit_phases): every phase once, in
order, from the times it is given; a request that ends early observes only what it reached."""

from __future__ import annotations

import pytest

from aiokv.integrations.vllm.scheduler_side.hit_phases import MAX_KEPT, HitPhases


def test_a_hit_observes_every_phase_once_from_the_times_given() -> None:
    phases = HitPhases()
    phases.asked("r", 10.0)
    phases.asked("r", 10.5)  # answered "ask again" once
    phases.answered("r", 11.0)
    phases.allocated("r", 11.25, nbytes=4_000_000)
    phases.step(["r"], set(), 12.0)  # the load leaves with this step
    phases.loads_done({"r": 14.0})
    phases.noticed(["r"], 14.5)
    phases.step([], {"r"}, 15.0)  # the tail is scheduled
    phases.step([], {"r"}, 16.5)  # the next step: the tail's step is over
    assert phases.take() == {
        "lookup_seconds": [1.0],
        "lookup_asks": [2],
        "alloc_seconds": [0.25],
        "dispatch_seconds": [0.75],
        "load_seconds": [2.0],
        "load_bytes_per_second": [2_000_000.0],
        "notice_seconds": [0.5],
        "resume_seconds": [0.5],
        "tail_seconds": [1.5],
    }
    assert phases.take() == {}  # taken once
    phases.step([], {"r"}, 20.0)
    assert phases.take() == {}  # the record ended with its tail


def test_a_miss_observes_its_lookup_only() -> None:
    phases = HitPhases()
    phases.asked("m", 1.0)
    phases.answered("m", 1.5)
    phases.allocated("m", 2.0, nbytes=0)
    phases.step(["m"], {"m"}, 3.0)
    phases.noticed(["m"], 4.0)
    phases.step([], {"m"}, 5.0)
    assert phases.take() == {"lookup_seconds": [0.5], "lookup_asks": [1]}


@pytest.mark.parametrize("ends", ["preempted", "finished"])
def test_a_request_forgotten_mid_load_observes_nothing_after(ends: str) -> None:
    phases = HitPhases()
    phases.asked("r", 0.0)
    phases.answered("r", 0.1)
    phases.allocated("r", 0.2, nbytes=10)
    phases.step(["r"], set(), 0.3)
    phases.forget("r")
    phases.loads_done({"r": 1.0})
    phases.noticed(["r"], 1.1)
    phases.step([], {"r"}, 1.2)
    observed = phases.take()
    assert set(observed) == {"lookup_seconds", "lookup_asks", "alloc_seconds", "dispatch_seconds"}


def test_a_load_reported_twice_or_unknown_counts_once() -> None:
    phases = HitPhases()
    phases.asked("r", 0.0)
    phases.answered("r", 0.0)
    phases.allocated("r", 0.0, nbytes=1)
    phases.step(["r"], set(), 1.0)
    phases.loads_done({"r": 2.0, "unknown": 2.0})
    phases.loads_done({"r": 3.0})
    assert phases.take()["load_seconds"] == [1.0]


def test_observations_not_taken_are_bounded() -> None:
    phases = HitPhases()
    for n in range(3 * MAX_KEPT):
        phases.asked(str(n), float(n))
        phases.answered(str(n), float(n) + 0.5)
    lookups = phases.take()["lookup_seconds"]
    assert 0 < len(lookups) <= MAX_KEPT


def test_a_finished_hit_is_a_span_with_a_child_per_phase_at_the_recorded_times() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK comes with vLLM")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    phases = HitPhases(tracer=provider.get_tracer("test"))
    times = [10.0, 10.5, 11.0, 11.25, 12.0, 14.0, 14.5, 15.0, 16.5]
    phases.asked("r", times[0])
    phases.asked("r", times[1])
    phases.answered("r", times[2])
    phases.allocated("r", times[3], nbytes=8)
    phases.step(["r"], set(), times[4])
    phases.loads_done({"r": times[5]})
    phases.noticed(["r"], times[6])
    phases.step([], {"r"}, times[7])
    assert exported.get_finished_spans() == ()  # the tail's step is not over
    phases.step([], set(), times[8])
    spans = {span.name: span for span in exported.get_finished_spans()}
    hit = spans.pop("aiokv.hit")
    assert hit.attributes is not None and hit.attributes["vllm.request_id"] == "r"
    assert hit.attributes["aiokv.lookup_asks"] == 2
    assert hit.end_time is not None and hit.start_time is not None
    assert hit.end_time - hit.start_time == pytest.approx(6.5e9, abs=1e3)
    durations = {
        name.removeprefix("aiokv.hit."): (span.end_time or 0) - (span.start_time or 0)
        for name, span in spans.items()
    }
    expected = [1.0, 0.25, 0.75, 2.0, 0.5, 0.5, 1.5]
    assert durations == {
        phase: pytest.approx(seconds * 1e9, abs=1e3)
        for phase, seconds in zip(
            ("lookup", "alloc", "dispatch", "load", "notice", "resume", "tail"), expected, strict=True
        )
    }
    assert all(
        span.parent is not None and span.parent.span_id == hit.context.span_id for span in spans.values()
    )
