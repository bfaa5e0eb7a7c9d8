"""The load policy's decision (scheduler_side.load_policy): which part of a hit to load, given
measured load and prefill speeds. Times are given, never read from the clock."""

from __future__ import annotations

import concurrent.futures

import pytest

from aiokv.integrations.vllm.common.wire import LoadSample, Measurements
from aiokv.integrations.vllm.scheduler_side.load_policy import (
    PROBE_BUDGET,
    PROBE_EVERY,
    REASONS,
    STALE_S,
    LinearFit,
    LoadPolicy,
)
from aiokv.integrations.vllm.worker_side.load_meter import LoadMeter
from aiokv.results import LoadResult
from tests.vllm.support import require_vllm

CHUNK_TOKENS = 128
CHUNK_BYTES = 1 << 20  # 1 MiB per chunk
PREFILL_TOKENS_PER_S = 10_000.0  # a 128-token chunk recomputes in 12.8 ms


def loads(bytes_per_s: float, fixed_s: float = 0.001, sizes: tuple[int, ...] = (1, 4, 16)) -> Measurements:
    """Loads of ``sizes`` chunks each, as fast as ``bytes_per_s`` after ``fixed_s``."""
    return Measurements(
        loads=[
            LoadSample("mooncake", n * CHUNK_BYTES, 0, fixed_s + n * CHUNK_BYTES / bytes_per_s) for n in sizes
        ]
    )


def steps(tokens_per_s: float = PREFILL_TOKENS_PER_S, overhead_s: float = 0.002) -> Measurements:
    return Measurements(steps=[(n, overhead_s + n / tokens_per_s) for n in (256, 1024, 2048)])


def policy_with(load: Measurements, now: float = 0.0) -> LoadPolicy:
    policy = LoadPolicy("mooncake")
    policy.observe(load.merge(steps()), now)
    return policy


def decide(policy: LoadPolicy, chunks: int = 16, now: float = 0.0) -> tuple[int, str | None]:
    decision = policy.decide(chunks, CHUNK_TOKENS, CHUNK_BYTES, now)
    return decision.chunks, decision.reason


def test_without_measurements_every_hit_is_taken() -> None:
    policy = LoadPolicy("mooncake")
    assert decide(policy) == (16, None)
    policy.observe(steps(), 0.0)  # prefill known, the store not yet
    assert decide(policy) == (16, None)


def test_a_fast_store_is_taken_a_slow_one_declined() -> None:
    # 1 GB/s: a chunk lands in ~1 ms, recomputing it takes 12.8 ms.
    assert decide(policy_with(loads(1e9))) == (16, None)
    # 20 MB/s: a chunk lands in ~52 ms.
    assert decide(policy_with(loads(20e6))) == (0, "slow_store")


def test_the_crossover_follows_the_measured_speeds() -> None:
    # A chunk recomputes in 12.8 ms; 1 MiB in 12.8 ms is ~82 MB/s. Just above loads, just below does not.
    assert decide(policy_with(loads(100e6, fixed_s=0.0)))[0] == 16
    assert decide(policy_with(loads(65e6, fixed_s=0.0)))[0] == 0


def test_a_short_hit_does_not_pay_a_large_fixed_cost() -> None:
    policy = policy_with(loads(1e9, fixed_s=0.05))  # fast bytes, 50 ms per call
    assert decide(policy, chunks=1) == (0, "fixed_cost")  # 12.8 ms to recompute
    assert decide(policy, chunks=16)[0] == 16  # 205 ms to recompute


def test_loads_queued_ahead_decline_a_hit_that_alone_would_win() -> None:
    policy = policy_with(loads(200e6))  # ~5 ms per chunk against 12.8 ms
    assert decide(policy) == (16, None)
    policy.load_started("a", 64 * CHUNK_BYTES, 0.0)  # ~335 ms of loads ahead
    assert decide(policy) == (0, "queued_loads")
    policy.load_ended("a")
    assert decide(policy) == (16, None)


def test_a_load_in_flight_longer_than_predicted_declines_at_once() -> None:
    policy = policy_with(loads(1e9))
    policy.load_started("a", CHUNK_BYTES, 0.0)  # predicted ~2 ms
    assert decide(policy, now=0.001)[0] == 16
    # Still not done after 2 s: the store moves at most 1 MiB per 2 s; nothing has completed yet.
    assert decide(policy, now=2.0) == (0, "slow_store")


def test_the_estimate_follows_a_slowdown_and_a_recovery_within_seconds() -> None:
    policy = policy_with(loads(1e9), now=0.0)
    assert decide(policy, now=0.0)[0] == 16
    policy.observe(loads(10e6, sizes=(16,)), 0.5)  # one slow load: far from the prediction
    assert decide(policy, now=0.5) == (0, "slow_store")
    # No load measures the store while its hits are declined; a probe is allowed once the estimate is
    # stale and the faded estimate says a one-chunk probe costs at most PROBE_BUDGET of the recompute.
    assert decide(policy, now=0.5 + STALE_S / 2)[0] == 0
    now, probed = 0.5, None
    while probed is None and now < 60:
        now += 0.5
        decision = policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, now)
        policy.count(decision, CHUNK_TOKENS, 16 * CHUNK_TOKENS)
        if decision.probe:
            probed = now
            assert decision.chunks == 1
    assert probed is not None, "no probe within 60 s"
    # The store recovered: the probe's one fast sample brings every hit back.
    policy.observe(loads(1e9, sizes=(1,)), probed + 0.01)
    assert decide(policy, now=probed + 0.01)[0] == 16


def test_a_probe_is_bounded_by_its_budget_and_one_at_a_time() -> None:
    policy = policy_with(loads(10e6))  # ~105 ms per chunk against 12.8 ms to recompute
    late = 100 * STALE_S  # long faded
    decision = policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, late)
    assert decision.probe and decision.chunks == 1
    policy.count(decision, CHUNK_TOKENS, 16 * CHUNK_TOKENS)
    policy.load_started("probe", CHUNK_BYTES, late)
    assert decide(policy, now=late) == (0, "slow_store")  # one probe in flight: no second
    policy.load_ended("probe")
    # The probe told nothing new (no sample here): the next ones wait for PROBE_EVERY declines.
    for _ in range(PROBE_EVERY):
        declined = policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, late)
        assert not declined.probe and declined.chunks == 0
        policy.count(declined, CHUNK_TOKENS, 16 * CHUNK_TOKENS)
    assert policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, late).probe
    # A short hit cannot pay for a probe on the faded estimate's budget at a recent staleness.
    fresh = policy_with(loads(10e6))
    just_stale = STALE_S + 0.1
    one_chunk = fresh.decide(1, CHUNK_TOKENS, CHUNK_BYTES, just_stale)
    assert not one_chunk.probe and one_chunk.chunks == 0
    assert one_chunk.load_s - one_chunk.recompute_s > PROBE_BUDGET * one_chunk.recompute_s


def test_counters_say_how_many_hit_tokens_were_declined_and_why() -> None:
    policy = policy_with(loads(10e6))
    decision = policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, 0.0)
    policy.count(decision, CHUNK_TOKENS, 16 * CHUNK_TOKENS - 1)
    taken = policy_with(loads(1e9)).decide(16, CHUNK_TOKENS, CHUNK_BYTES, 0.0)
    policy.count(taken, CHUNK_TOKENS, 16 * CHUNK_TOKENS)
    assert +policy.counters == {
        "declined_requests": 1,
        "declined_tokens": 16 * CHUNK_TOKENS - 1,
        "declined_tokens_slow_store": 16 * CHUNK_TOKENS - 1,
    }


def test_decode_steps_and_other_stores_are_not_measurements() -> None:
    policy = LoadPolicy("mooncake")
    policy.observe(Measurements(loads=[LoadSample("tiered", CHUNK_BYTES, 0, 10.0)], steps=[(1, 0.05)]), 0.0)
    assert policy.loads.coefficients() is None and policy.steps.coefficients() is None


def test_the_fit_separates_fixed_cost_from_speed() -> None:
    fit = LinearFit()
    for n, x in enumerate((1e6, 4e6, 16e6, 2e6)):
        fit.add(x, 0.003 + x / 500e6, n * 0.1)
    fixed, per_byte = fit.coefficients() or (0.0, 0.0)
    assert fixed == pytest.approx(0.003, rel=1e-6)
    assert 1 / per_byte == pytest.approx(500e6, rel=1e-6)
    # Sizes all alike: the last fixed part known is kept, the rest is speed.
    alike = LinearFit()
    alike.add(4e6, 0.011, 0.0)
    assert alike.predict(4e6) == pytest.approx(0.011)


def test_the_meter_times_loads_with_the_bytes_ahead_of_them() -> None:
    meter = LoadMeter("mooncake", [CHUNK_BYTES])
    first: concurrent.futures.Future[LoadResult] = concurrent.futures.Future()
    second: concurrent.futures.Future[LoadResult] = concurrent.futures.Future()
    failed: concurrent.futures.Future[LoadResult] = concurrent.futures.Future()
    meter.load_submitted([first], [0], 4 * CHUNK_BYTES)
    meter.load_submitted([second], [0], 2 * CHUNK_BYTES)
    meter.load_submitted([failed], [0], CHUNK_BYTES)
    assert meter.take() is None  # nothing done yet
    second.set_result(LoadResult(2 * CHUNK_TOKENS, ((),), 2))
    first.set_result(LoadResult(3 * CHUNK_TOKENS, ((40,),), 3))  # one chunk failed: 3 counted
    failed.set_exception(RuntimeError("store down"))  # moved nothing: no sample
    meter.forward_begins()
    meter.forward_ended(512)
    measured = meter.take()
    assert measured is not None
    by_size = sorted((s.nbytes, s.ahead_bytes) for s in measured.loads)
    assert by_size == [(2 * CHUNK_BYTES, 4 * CHUNK_BYTES), (3 * CHUNK_BYTES, 0)]
    assert [tokens for tokens, _ in measured.steps] == [512]
    assert meter.take() is None


def test_worker_metadata_merges_measurements_of_every_rank() -> None:
    require_vllm()
    from aiokv.integrations.vllm.common.step_metadata import AiokvWorkerMetadata

    one = AiokvWorkerMetadata(measured=loads(1e9, sizes=(1,)))
    two = AiokvWorkerMetadata(measured=steps())
    merged = one.aggregate(two)
    assert isinstance(merged, AiokvWorkerMetadata) and merged.measured is not None
    assert len(merged.measured.loads) == 1 and len(merged.measured.steps) == 3
    assert merged.tier is None


def test_the_option_turns_it_off() -> None:
    require_vllm()
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig

    assert ConnectorConfig.from_extra_config({}).decline_slow_loads is False
    assert ConnectorConfig.from_extra_config({"decline_slow_loads": True}).decline_slow_loads is True
    assert ConnectorConfig.from_extra_config({"decline_slow_loads": False}).decline_slow_loads is False
    with pytest.raises(ValueError, match="decline_slow_loads"):
        ConnectorConfig.from_extra_config({"decline_slow_loads": "sometimes"})


def test_one_slow_forward_does_not_make_the_engine_slow() -> None:
    policy = policy_with(loads(100e6, fixed_s=0.0))  # ~10.5 ms per chunk against 12.8 ms: loaded
    assert decide(policy)[0] == 16
    # One 104-token forward took 0.9 s (another process had the CPU): noise, not a slower engine.
    policy.observe(Measurements(steps=[(104, 0.9)]), 0.1)
    per_token = (policy.steps.coefficients() or (0.0, 0.0))[1]
    assert per_token < 2 / PREFILL_TOKENS_PER_S


def test_every_counter_goes_to_prometheus() -> None:
    require_vllm()
    from aiokv.integrations.vllm.common.connector_stats import COUNTERS

    policy = policy_with(loads(10e6))
    for reason in REASONS:
        policy.counters[f"declined_tokens_{reason}"] += 1
    policy.count(policy.decide(16, CHUNK_TOKENS, CHUNK_BYTES, 100 * STALE_S), CHUNK_TOKENS, 16 * CHUNK_TOKENS)
    assert "probe_loads" in policy.counters
    assert set(policy.counters) <= set(COUNTERS)
