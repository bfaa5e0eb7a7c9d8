"""aiokv.breaker.CircuitBreaker: the state machine under a fake clock (no I/O, no sleeping)."""

from __future__ import annotations

import math
import threading

import pytest

from aiokv.breaker import BreakerConfig, BreakerState, CircuitBreaker
from aiokv.errors import BackendUnavailableError, InvalidRequestError


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(**config: object) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerConfig(**config), clock=clock), clock  # type: ignore[arg-type]


def fail(breaker: CircuitBreaker, **outcome: object) -> None:
    token = breaker.on_call_started()
    breaker.on_call_finished(token, **outcome)  # type: ignore[arg-type]


def succeed(breaker: CircuitBreaker) -> None:
    token = breaker.on_call_started()
    breaker.on_call_finished(token, codes=[0, 16, -704])


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.config.failure_threshold):
        fail(breaker, codes=[-900])
    assert breaker.state is BreakerState.OPEN


def test_starts_closed_and_allows_everything() -> None:
    breaker, _ = make()
    assert breaker.state is BreakerState.CLOSED
    assert all(breaker.allow(op) for op in ("lookup", "store", "load"))
    assert breaker.snapshot()["rejected_total"] == 0
    assert breaker.next_check_in() == math.inf


@pytest.mark.parametrize(
    "outcome",
    [
        {"codes": [16, -900, 16]},
        {"codes": [-1]},
        {"error": BackendUnavailableError("master gone", code=-900)},
        {"error": RuntimeError("binding raised")},
    ],
    ids=["unavailable-code", "internal-code", "unavailable-error", "other-exception"],
)
def test_trips_after_threshold_consecutive_failures(outcome: dict[str, object]) -> None:
    breaker, _ = make(failure_threshold=3)
    fail(breaker, **outcome)
    fail(breaker, **outcome)
    assert breaker.state is BreakerState.CLOSED
    fail(breaker, **outcome)
    assert breaker.state is BreakerState.OPEN
    assert breaker.snapshot()["trips"] == 1
    assert not breaker.allow("lookup")
    assert not breaker.allow("store")
    assert not breaker.allow("store")
    snap = breaker.snapshot()
    assert snap["rejected"] == {"lookup": 1, "store": 2}
    assert snap["rejected_total"] == 3
    assert snap["failures"] == 3


def test_success_resets_the_consecutive_count() -> None:
    breaker, _ = make(failure_threshold=2)
    fail(breaker, codes=[-900])
    succeed(breaker)
    fail(breaker, codes=[-900])
    assert breaker.state is BreakerState.CLOSED
    fail(breaker, codes=[-900])
    assert breaker.state is BreakerState.OPEN


@pytest.mark.parametrize(
    "outcome",
    [
        {"codes": [-704, -800, -200, -600]},
        {"error": InvalidRequestError("caller's fault")},
        {"error": TypeError("caller's fault")},
    ],
    ids=["per-key-codes", "invalid-request", "type-error"],
)
def test_per_key_codes_and_caller_errors_never_trip(outcome: dict[str, object]) -> None:
    breaker, _ = make(failure_threshold=1)
    for _ in range(10):
        fail(breaker, **outcome)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["failures"] == 0


def test_a_stuck_call_trips_it_without_any_answer() -> None:
    breaker, clock = make(stuck_after_s=2.0)
    token = breaker.on_call_started()
    clock.advance(1.5)
    assert breaker.allow("lookup")
    assert breaker.next_check_in() == pytest.approx(0.5)
    clock.advance(0.6)
    assert not breaker.allow("lookup")  # checked on the loop: nothing queues behind the stuck call
    assert breaker.state is BreakerState.OPEN
    snap = breaker.snapshot()
    assert snap["stuck_calls"] == 1 and snap["trips"] == 1 and snap["calls_in_flight"] == 1
    assert "not returned" in breaker.describe()
    # The stuck call finally returning does not close the breaker: only a probe does.
    breaker.on_call_finished(token, codes=[0])
    assert breaker.state is BreakerState.OPEN


def test_poll_trips_on_a_stuck_call_with_no_traffic() -> None:
    breaker, clock = make(stuck_after_s=2.0)
    breaker.on_call_started()
    clock.advance(breaker.next_check_in() + 0.01)
    assert breaker.poll() is BreakerState.OPEN


def test_unhealthy_health_check_trips_at_once() -> None:
    breaker, _ = make()
    breaker.on_health(0)
    assert breaker.state is BreakerState.CLOSED
    breaker.on_health(2)
    assert breaker.state is BreakerState.OPEN
    assert "health_check answered 2" in breaker.describe()


def test_probe_after_backoff_closes_it_when_healthy() -> None:
    breaker, clock = make(backoff_initial_s=1.0)
    trip(breaker)
    assert not breaker.should_probe()  # backoff not over
    assert breaker.next_check_in() == pytest.approx(1.0)
    clock.advance(1.0)
    assert breaker.should_probe()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.should_probe()  # one probe at a time
    assert not breaker.allow("store")  # work waits for the probe's verdict
    breaker.on_probe_finished(healthy=True)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow("store")
    snap = breaker.snapshot()
    assert snap["probes"] == 1 and snap["probe_failures"] == 0
    assert snap["open_seconds_total"] == pytest.approx(1.0)


def test_failed_probes_back_off_exponentially_up_to_the_cap() -> None:
    breaker, clock = make(backoff_initial_s=1.0, backoff_multiplier=2.0, backoff_max_s=5.0)
    trip(breaker)
    waits = []
    for _ in range(5):
        waits.append(breaker.next_check_in())
        clock.advance(breaker.next_check_in())
        assert breaker.should_probe()
        breaker.on_probe_finished(healthy=False)
        assert breaker.state is BreakerState.OPEN
    assert waits == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])
    clock.advance(breaker.next_check_in())
    assert breaker.should_probe()
    breaker.on_probe_finished(healthy=True)
    assert breaker.snapshot()["backoff_s"] == 1.0  # reset on close
    trip(breaker)
    assert breaker.next_check_in() == pytest.approx(1.0)


def test_a_probe_without_answer_times_out_and_its_late_answer_is_ignored() -> None:
    breaker, clock = make(backoff_initial_s=1.0, probe_timeout_s=2.0)
    trip(breaker)
    clock.advance(1.0)
    assert breaker.should_probe()
    assert breaker.next_check_in() == pytest.approx(2.0)
    clock.advance(2.01)
    assert breaker.state is BreakerState.OPEN
    assert breaker.snapshot()["probe_failures"] == 1
    breaker.on_probe_finished(healthy=True)  # too late: the breaker stays open
    assert breaker.state is BreakerState.OPEN


def test_calls_stuck_before_recovery_do_not_trip_it_again() -> None:
    breaker, clock = make(stuck_after_s=2.0, backoff_initial_s=1.0)
    old = breaker.on_call_started()
    clock.advance(2.5)
    assert breaker.state is BreakerState.OPEN
    clock.advance(1.0)
    assert breaker.should_probe()
    breaker.on_probe_finished(healthy=True)
    assert breaker.state is BreakerState.CLOSED
    clock.advance(10.0)
    assert breaker.allow("lookup")  # the old call is still out, already counted
    breaker.on_call_finished(old, codes=[0])
    new = breaker.on_call_started()
    clock.advance(2.5)
    assert not breaker.allow("lookup")  # a new stuck call trips it again
    breaker.on_call_finished(new, codes=[0])
    assert breaker.snapshot()["trips"] == 2


def test_disabled_breaker_allows_everything_but_still_counts() -> None:
    breaker, _ = make(enabled=False, failure_threshold=1)
    fail(breaker, codes=[-900])
    assert breaker.allow("lookup")
    snap = breaker.snapshot()
    assert snap["enabled"] is False and snap["failures"] == 1 and snap["rejected_total"] == 0


@pytest.mark.parametrize(
    "config",
    [
        {"failure_threshold": 0},
        {"stuck_after_s": 0},
        {"stuck_after_s": float("inf")},
        {"backoff_initial_s": -1},
        {"backoff_initial_s": 5.0, "backoff_max_s": 1.0},
        {"backoff_multiplier": 0.5},
        {"probe_timeout_s": float("nan")},
    ],
)
def test_bad_config_is_refused(config: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        BreakerConfig(**config)  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [{"enabled": 1}, {"failure_threshold": 2.0}, {"failure_threshold": True}])
def test_wrong_config_types_are_refused(config: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        BreakerConfig(**config)  # type: ignore[arg-type]


def test_concurrent_reports_from_threads_are_all_counted() -> None:
    breaker, _ = make(failure_threshold=10**9)

    def worker() -> None:
        for _ in range(2000):
            fail(breaker, codes=[-900])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    snap = breaker.snapshot()
    assert snap["failures"] == 8000 and snap["calls_in_flight"] == 0


def test_an_unwatched_call_never_counts_as_stuck_but_its_failure_counts() -> None:
    breaker, clock = make(stuck_after_s=2.0, failure_threshold=1)
    token = breaker.on_call_started(watch_stuck=False)  # a long transfer
    clock.advance(60.0)
    assert breaker.state is BreakerState.CLOSED and breaker.next_check_in() == math.inf
    assert breaker.snapshot()["calls_in_flight"] == 1 and breaker.snapshot()["stuck_calls"] == 0
    breaker.on_call_finished(token, codes=[0, -900])
    assert breaker.state is BreakerState.OPEN and breaker.snapshot()["calls_in_flight"] == 0


def test_calls_that_ran_side_by_side_and_failed_together_count_once() -> None:
    breaker, clock = make(failure_threshold=2)
    first, second = breaker.on_call_started(), breaker.on_call_started()
    clock.advance(0.1)
    breaker.on_call_finished(first, codes=[-900])
    clock.advance(0.1)
    breaker.on_call_finished(second, error=BackendUnavailableError("down"))
    assert breaker.state is BreakerState.CLOSED  # one failure: both started before either failed
    fail(breaker, codes=[-900])  # started after the last failure: consecutive
    assert breaker.state is BreakerState.OPEN
    assert breaker.snapshot()["failures"] == 3
