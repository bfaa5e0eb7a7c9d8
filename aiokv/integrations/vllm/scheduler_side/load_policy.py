"""Load only what beats recomputing: the scheduler's model of load and prefill speed, and its decision.

The workers measure (:mod:`..worker_side.load_meter`): every load's bytes and seconds, with the bytes of
the loads that were in flight ahead of it, and every forward's tokens and seconds. The measurements
travel to the scheduler in the step's worker metadata; :class:`LoadPolicy` fits, per store, ``seconds =
fixed + bytes * seconds_per_byte`` and, for the engine, ``seconds = overhead + tokens *
seconds_per_token``, each an exponentially weighted least-squares fit (half-lives 2 s and 10 s). A load
that the fit predicts badly (the store slowed down or recovered) drops the older samples: an old large
sample would otherwise steer the line through a fresh small one. A forward is not trusted that far: one
slowed by another process on a shared CPU is noise, not a slower engine, so it moves the fit as if it
were at most 3x off.

For a hit of ``N`` chunks the request waits for its load, then computes the rest of the prompt either
way, so (both costs being linear in the chunks taken) the best prefix is all of the hit or none of it:
it is loaded when ``fixed + (bytes queued ahead + its bytes) * seconds_per_byte + a step`` is below
``its tokens * seconds_per_token``. A load already submitted is never revoked; a load in flight longer
than the fit said raises the estimate at once (the store is at least that slow). Without measurements
every hit is taken (as without the policy). While hits are declined no load measures the store: once
the estimate is ``STALE_S`` old its slowness is halved every ``STALE_S`` (belief without evidence
fades), and a request may then load its first chunk as a probe if that costs it at most
``PROBE_BUDGET`` of its recompute time by the faded estimate, at most one request in ``PROBE_EVERY``
declined ones (the faded estimate is optimistic by design: a probe of a store still slow costs its
request more than the budget).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..common.wire import Measurements

HALF_LIFE_S = 2.0  # weight of a load sample halves every this many seconds
STEP_HALF_LIFE_S = 10.0  # of a forward's: the engine's speed drifts slowly, a forward's time is noisy
SURPRISE = 3.0  # a sample this many times slower or faster than predicted: the older ones are dropped
ALIKE = 0.25  # x values whose spread is below this share of their mean cannot separate fixed from slope
STALE_S = 5.0  # a load estimate this old starts to fade; probes are allowed from then on
PROBE_BUDGET = 0.1  # a probe may cost its request this share of its recompute time (expected)
PROBE_EVERY = 8  # at most one probe per this many declined requests (bounds what probing costs in all)
MIN_STEP_TOKENS = 32  # forwards of fewer tokens are decode steps: not a prefill measurement

REASONS = ("slow_store", "queued_loads", "fixed_cost")


class LinearFit:
    """``y = intercept + x * slope`` by exponentially weighted least squares (time-based decay)."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, *, forget_on_surprise: bool = True) -> None:
        self.half_life_s = half_life_s
        self.forget_on_surprise = forget_on_surprise
        self._sums = [0.0] * 5  # weight, x, y, xx, xy
        self._at: float | None = None
        self._intercept = 0.0  # the last intercept a spread of x could tell (reused when it cannot)
        self.last_sample_at: float | None = None

    def add(self, x: float, y: float, now: float) -> None:
        if x <= 0 or y < 0 or not math.isfinite(y):
            return
        self._decay(now)
        expected = self._expected(x)
        if expected is not None and not expected[0] / SURPRISE <= y <= expected[1] * SURPRISE:
            if self.forget_on_surprise:
                self._sums = [0.0] * 5  # the store changed: only fresh evidence counts
            else:  # an outlier moves the fit by at most SURPRISE times the prediction
                y = min(max(y, expected[0] / SURPRISE), expected[1] * SURPRISE)
        for index, value in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[index] += value
        self.last_sample_at = now

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            factor = 0.5 ** ((now - self._at) / self.half_life_s)
            self._sums = [s * factor for s in self._sums]
        self._at = now if self._at is None else max(self._at, now)

    def _expected(self, x: float) -> tuple[float, float] | None:
        """What the fit expects at ``x``, as a range: a fit from sizes too alike cannot tell its fixed
        part from its speed, so anything between all-fixed and all-proportional."""
        fit = self._fit()
        if fit is None:
            return None
        intercept, slope, spread = fit
        if spread:
            return intercept + x * slope, intercept + x * slope
        mean_x, mean_y = self._sums[1] / self._sums[0], self._sums[2] / self._sums[0]
        low, high = sorted((mean_y, mean_y * x / mean_x))
        return low, high

    def coefficients(self) -> tuple[float, float] | None:
        """(intercept, slope), or None before the first sample."""
        fit = self._fit()
        return None if fit is None else fit[:2]

    def _fit(self) -> tuple[float, float, bool] | None:
        """(intercept, slope, whether a spread of x values told them apart)."""
        w, sx, sy, sxx, sxy = self._sums
        if w <= 0:
            return None
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x > (ALIKE * mean_x) ** 2:
            slope = (sxy / w - mean_x * mean_y) / var_x
            intercept = mean_y - slope * mean_x
            if slope > 0 and intercept >= 0:
                self._intercept = intercept
                return intercept, slope, True
            if slope > 0:  # a negative fixed cost: the line through the origin instead
                return 0.0, sxy / sxx, True
        # Sizes too alike to tell the fixed part from the rest: keep the last fixed part known.
        intercept = min(self._intercept, 0.5 * mean_y)
        return intercept, (mean_y - intercept) / mean_x, False

    def predict(self, x: float) -> float | None:
        fit = self.coefficients()
        return None if fit is None else fit[0] + x * fit[1]


@dataclass(frozen=True)
class Decision:
    """How many of a hit's chunks to load, and why the rest are declined (``reason`` None: none are);
    ``probe``: one chunk loads anyway, to measure a store not measured for a while."""

    chunks: int
    reason: str | None = None
    load_s: float = 0.0  # expected, for the whole hit
    recompute_s: float = 0.0
    probe: bool = False


@dataclass
class _InFlight:
    nbytes: int
    ahead_bytes: int
    started: float


class LoadPolicy:
    """The scheduler's estimates and decisions for one engine; ``source``: the store its loads read."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.loads = LinearFit()
        # A forward slowed by another process (a shared CPU) is not a slower engine: no forgetting.
        self.steps = LinearFit(STEP_HALF_LIFE_S, forget_on_surprise=False)
        self._in_flight: dict[str, _InFlight] = {}
        self.counters: Counter[str] = Counter()
        self._declined_since_probe = PROBE_EVERY  # the first stale decline may probe

    # -- measurements ---------------------------------------------------------------------------

    def observe(self, measured: Measurements, now: float) -> None:
        for sample in measured.loads:
            if sample.source == self.source:
                self.loads.add(sample.nbytes + sample.ahead_bytes, sample.seconds, now)
        for tokens, seconds in measured.steps:
            if tokens >= MIN_STEP_TOKENS:
                self.steps.add(tokens, seconds, now)

    def load_started(self, req_id: str, nbytes: int, now: float) -> None:
        """An asynchronous load was handed to the workers: later loads queue behind it."""
        self._in_flight[req_id] = _InFlight(nbytes, self.queued_bytes(), now)

    def load_ended(self, req_id: str) -> None:
        self._in_flight.pop(req_id, None)

    def queued_bytes(self) -> int:
        return sum(load.nbytes for load in self._in_flight.values())

    # -- the decision ---------------------------------------------------------------------------

    def _seconds_per_byte(self, fixed: float, slope: float, now: float) -> tuple[float, float | None]:
        """The store's seconds per byte (at least what a load still in flight shows), and, once the
        estimate is stale, its faded value (see the module docstring), which only decides probes."""
        for load in self._in_flight.values():
            age = now - load.started
            slope = max(slope, (age - fixed) / (load.ahead_bytes + load.nbytes))
        last = self.loads.last_sample_at
        age = now - last if last is not None else 0.0
        if age <= STALE_S or self._in_flight:
            return slope, None
        return slope, slope * 0.5 ** ((age - STALE_S) / STALE_S)

    def decide(self, chunks: int, chunk_tokens: int, chunk_bytes: int, now: float) -> Decision:
        """How much of a hit of ``chunks`` chunks (``chunk_tokens`` tokens, ``chunk_bytes`` bytes per
        worker each) to load."""
        load_fit, step_fit = self.loads.coefficients(), self.steps.coefficients()
        if chunks <= 0 or load_fit is None or step_fit is None:
            return Decision(chunks)
        fixed, per_byte = load_fit
        step_s, per_token = step_fit
        per_byte, faded = self._seconds_per_byte(fixed, per_byte, now)
        queued = self.queued_bytes()

        def load_s(n: int, ahead: int = queued, per_byte: float = per_byte) -> float:
            # The load, the loads queued ahead of it, and the step that notices it is done.
            return fixed + (ahead + n * chunk_bytes) * per_byte + step_s

        recompute_s = chunks * chunk_tokens * per_token
        whole = Decision(chunks, None, load_s(chunks), recompute_s)
        if whole.load_s <= recompute_s:
            return whole
        if chunk_bytes * per_byte >= chunk_tokens * per_token:
            reason = "slow_store"
        elif load_s(chunks, 0) <= recompute_s:
            reason = "queued_loads"
        else:
            reason = "fixed_cost"
        if (
            faded is not None
            and self._declined_since_probe >= PROBE_EVERY
            and load_s(1, 0, faded) - chunk_tokens * per_token <= PROBE_BUDGET * recompute_s
        ):
            return Decision(1, reason, whole.load_s, recompute_s, probe=True)
        return Decision(0, reason, whole.load_s, recompute_s)

    def count(self, decision: Decision, chunk_tokens: int, hit_tokens: int) -> None:
        """A request was scheduled under ``decision`` for a hit of ``hit_tokens``: count what it
        declined."""
        declined = max(0, hit_tokens - decision.chunks * chunk_tokens)
        self.counters["probe_loads"] += decision.probe
        if decision.probe:
            self._declined_since_probe = 0
        elif decision.reason is not None:
            self._declined_since_probe += 1
        if declined and decision.reason is not None:
            self.counters["declined_requests"] += 1
            self.counters["declined_tokens"] += declined
            self.counters[f"declined_tokens_{decision.reason}"] += declined

    def report(self, now: float) -> dict[str, object]:
        """The counters and current estimates (for tests and logs)."""
        return {**self.counters, "estimates": self.estimates(now)}

    def estimates(self, now: float) -> dict[str, float]:
        """The current estimates."""
        out: dict[str, float] = {}
        if (load_fit := self.loads.coefficients()) is not None:
            per_byte, _ = self._seconds_per_byte(load_fit[0], load_fit[1], now)  # not faded: evidence only
            out.update(load_fixed_s=load_fit[0], load_bytes_per_s=1 / per_byte if per_byte > 0 else math.inf)
        if (step_fit := self.steps.coefficients()) is not None:
            out.update(step_overhead_s=step_fit[0], prefill_tokens_per_s=1 / step_fit[1])
        return out
