"""A circuit breaker for the store: stop sending work to a backend that cannot answer, probe it, resume.

Pure state machine: no I/O, no threads, no asyncio; time comes from an injectable clock. The worker
asks it before each backend call and reports what each call did; the breaker decides.

States::

    CLOSED --(failure_threshold consecutive failures | a call stuck > stuck_after_s | health != 0)--> OPEN
    OPEN --(backoff elapsed: should_probe() hands out one probe)--> HALF_OPEN
    HALF_OPEN --(probe healthy)--> CLOSED          (backoff reset)
    HALF_OPEN --(probe unhealthy, or no answer within probe_timeout_s)--> OPEN (backoff x multiplier)

A failure is a call that raised (other than the caller's own errors, ``ignored_errors``), or answered a
code in ``trip_codes`` (-900 master unreachable, -1 internal: the codes that mean the *store* failed, not
one key). Per-key codes (-704 missing, -800 a transfer failed, -200 full) are not failures here.
Failures are consecutive when each failed call started after the previous failure was reported: calls
that ran side by side (the groups of one batch) and failed together count once, so one bad batch does
not trip it, while requests failing one after another do.

While OPEN or HALF_OPEN, :meth:`allow` answers False and counts the refusal per operation; the worker
then answers at once (lookups 0 hits, stores and loads fail fast) instead of queueing behind calls
that may never return. All methods are thread-safe (one lock; nothing blocks under it).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError

UNAVAILABLE = -900
INTERNAL = -1


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    """Tuning; the defaults trip within ~``stuck_after_s`` of a frozen master.

    ``failure_threshold``: consecutive failures that trip it. ``stuck_after_s``: a call running longer
    trips it (a frozen master answers nothing; Mooncake's own RPC timeout is far longer).
    ``backoff_initial_s`` .. ``backoff_max_s``: time OPEN before a probe, growing by
    ``backoff_multiplier`` after each failed probe. ``probe_timeout_s``: a probe without an answer by
    then counts as failed. ``trip_codes``: answers that count as failures. ``enabled=False`` makes
    :meth:`CircuitBreaker.allow` always True (counters still kept).
    """

    enabled: bool = True
    failure_threshold: int = 3
    stuck_after_s: float = 2.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_multiplier: float = 2.0
    probe_timeout_s: float = 2.0
    trip_codes: frozenset[int] = frozenset({UNAVAILABLE, INTERNAL})

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, not {type(self.enabled).__name__}")
        if isinstance(self.failure_threshold, bool) or not isinstance(self.failure_threshold, int):
            raise TypeError("failure_threshold must be an int")
        if self.failure_threshold < 1:
            raise InvalidRequestError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        for name in ("stuck_after_s", "backoff_initial_s", "backoff_max_s", "probe_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidRequestError(f"{name} must be a finite number > 0, got {value!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise InvalidRequestError("backoff_max_s must be >= backoff_initial_s")
        multiplier = self.backoff_multiplier
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, (int, float))
            or not 1 <= multiplier < 1e6
        ):
            raise InvalidRequestError(f"backoff_multiplier must be in [1, 1e6), got {multiplier!r}")
        object.__setattr__(self, "trip_codes", frozenset(int(code) for code in self.trip_codes))


class CircuitBreaker:
    """See the module docstring. ``clock``: seconds, monotonic (default ``time.monotonic``).

    ``ignored_errors``: exception types that are the caller's fault and never count as failures.
    """

    def __init__(
        self,
        config: BreakerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        ignored_errors: tuple[type[BaseException], ...] = (InvalidRequestError, TypeError),
    ) -> None:
        self.config = config if config is not None else BreakerConfig()
        self._clock = clock
        self._ignored = ignored_errors
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive_failures = 0
        self._backoff = self.config.backoff_initial_s
        self._opened_at: float | None = None
        self._retry_at = 0.0
        self._probe_started: float | None = None
        self._calls: dict[int, float] = {}  # call token -> start time (watched for being stuck)
        self._unwatched: dict[int, float] = {}  # calls that may legitimately run long (data transfers)
        self._last_failure_at = float("-inf")  # when the last counted failure was reported
        self._stuck_reported: set[int] = set()
        self._next_token = 1
        self._reason = ""
        # Counters (monotonic, for stats and metrics).
        self._trips = 0
        self._rejected: Counter[str] = Counter()
        self._failures = 0
        self._stuck = 0
        self._probes = 0
        self._probe_failures = 0
        self._open_seconds = 0.0

    # -- the questions the worker asks ------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._advance()
            return self._state

    def allow(self, op: str) -> bool:
        """May a call for ``op`` ("lookup", "store", "load", ...) be sent now? Counts a refusal.

        Call it on the event loop before handing the call to an executor: while calls are stuck every
        executor thread may be taken, and anything queued behind them would wait as long.
        """
        with self._lock:
            self._advance()
            if self._state is BreakerState.CLOSED or not self.config.enabled:
                return True
            self._rejected[op] += 1
            return False

    def should_probe(self) -> bool:
        """True once per backoff period while open: the caller then runs one probe and reports it with
        :meth:`on_probe_finished`. While a probe is out (and not yet timed out) answers False."""
        with self._lock:
            self._advance()
            if self._state is not BreakerState.OPEN or self._clock() < self._retry_at:
                return False
            self._state = BreakerState.HALF_OPEN
            self._probe_started = self._clock()
            self._probes += 1
            return True

    def next_check_in(self) -> float:
        """Seconds until something may change without a call being reported (a call turning stuck, a
        backoff ending, a probe timing out); the worker's background task sleeps this long, then calls
        :meth:`poll`. ``inf`` when nothing is pending."""
        with self._lock:
            self._advance()
            now = self._clock()
            moments = []
            if self._state is BreakerState.CLOSED:
                moments += [start + self.config.stuck_after_s for start in self._calls.values()]
            elif self._state is BreakerState.OPEN:
                moments.append(self._retry_at)
            elif self._probe_started is not None:
                moments.append(self._probe_started + self.config.probe_timeout_s)
            return max(0.0, min(moments) - now) if moments else float("inf")

    def poll(self) -> BreakerState:
        """Re-evaluate the timers (stuck calls, probe timeout); returns the state."""
        return self.state

    # -- what the worker reports ----------------------------------------------------------------

    def on_call_started(self, *, watch_stuck: bool = True) -> int:
        """A backend call starts (in its thread); returns the token for :meth:`on_call_finished`.

        ``watch_stuck=False``: the call never counts as stuck however long it runs (a large transfer
        may take longer than ``stuck_after_s``); its outcome still counts."""
        with self._lock:
            token = self._next_token
            self._next_token += 1
            (self._calls if watch_stuck else self._unwatched)[token] = self._clock()
            return token

    def on_call_finished(
        self, token: int, *, codes: Iterable[int] = (), error: BaseException | None = None
    ) -> None:
        """The call ``token`` returned ``codes`` (per key) or raised ``error``."""
        with self._lock:
            started = self._calls.pop(token, None)
            if started is None:
                started = self._unwatched.pop(token, None)
            self._stuck_reported.discard(token)
            failed = error is not None and not isinstance(error, self._ignored)
            if not failed and error is None:
                trip_codes = self.config.trip_codes
                failed = any(int(code) in trip_codes for code in codes)
            if failed:
                self._failures += 1
                if started is None or started >= self._last_failure_at:
                    self._consecutive_failures += 1
                    self._last_failure_at = self._clock()
                if self._consecutive_failures >= self.config.failure_threshold:
                    self._trip(f"{self._consecutive_failures} consecutive failed calls")
            elif error is None:
                self._consecutive_failures = 0
            self._advance()

    def on_health(self, code: int) -> None:
        """A ``health_check()`` answer outside a probe: nonzero trips the breaker at once."""
        with self._lock:
            if code != 0:
                self._trip(f"health_check answered {code}")

    def on_probe_finished(self, healthy: bool) -> None:
        """The probe handed out by :meth:`should_probe` ended: ``healthy`` closes the breaker."""
        with self._lock:
            if self._state is not BreakerState.HALF_OPEN:
                return  # a probe that already timed out answers too late
            self._probe_started = None
            if healthy:
                self._close()
            else:
                self._probe_failures += 1
                self._reopen("probe failed")

    # -- reporting --------------------------------------------------------------------------------

    def describe(self) -> str:
        """Why the breaker is open, for error messages."""
        with self._lock:
            self._advance()
            if self._state is BreakerState.CLOSED:
                return "closed"
            left = max(0.0, self._retry_at - self._clock())
            return f"{self._state.value} ({self._reason}; next probe in {left:.1f} s)"

    def snapshot(self) -> dict[str, Any]:
        """Counters and state for ``worker.stats()`` and metrics."""
        with self._lock:
            self._advance()
            open_now = self._clock() - self._opened_at if self._opened_at is not None else 0.0
            return {
                "state": self._state.value,
                "enabled": self.config.enabled,
                "trips": self._trips,
                "rejected": dict(self._rejected),
                "rejected_total": sum(self._rejected.values()),
                "failures": self._failures,
                "stuck_calls": self._stuck,
                "probes": self._probes,
                "probe_failures": self._probe_failures,
                "open_seconds_total": self._open_seconds + open_now,
                "backoff_s": self._backoff,
                "calls_in_flight": len(self._calls) + len(self._unwatched),
            }

    # -- transitions (under the lock) -------------------------------------------------------------

    def _advance(self) -> None:
        """Apply what the clock alone decides: a stuck call trips; a probe past its timeout fails."""
        now = self._clock()
        stuck = [t for t, start in self._calls.items() if now - start > self.config.stuck_after_s]
        fresh = [t for t in stuck if t not in self._stuck_reported]
        if fresh:
            self._stuck += len(fresh)
            self._stuck_reported.update(fresh)
            if self._state is BreakerState.CLOSED:
                self._trip(f"a call has not returned for more than {self.config.stuck_after_s:g} s")
        if (
            self._state is BreakerState.HALF_OPEN
            and self._probe_started is not None
            and now - self._probe_started > self.config.probe_timeout_s
        ):
            self._probe_failures += 1
            self._probe_started = None
            self._reopen("probe timed out")

    def _trip(self, reason: str) -> None:
        if self._state is not BreakerState.CLOSED:
            return
        self._trips += 1
        self._state = BreakerState.OPEN
        self._reason = reason
        self._opened_at = self._clock()
        self._backoff = self.config.backoff_initial_s
        self._retry_at = self._opened_at + self._backoff

    def _reopen(self, reason: str) -> None:
        self._state = BreakerState.OPEN
        self._reason = reason
        self._backoff = min(self.config.backoff_max_s, self._backoff * self.config.backoff_multiplier)
        self._retry_at = self._clock() + self._backoff

    def _close(self) -> None:
        if self._opened_at is not None:
            self._open_seconds += self._clock() - self._opened_at
        self._state = BreakerState.CLOSED
        self._opened_at = None
        self._reason = ""
        self._consecutive_failures = 0
        self._backoff = self.config.backoff_initial_s
        # Calls still stuck from before the outage must not re-trip a breaker the probe just closed.
        self._stuck_reported.update(self._calls)
