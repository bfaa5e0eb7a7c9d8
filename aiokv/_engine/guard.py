"""The worker's circuit breaker wiring (:mod:`aiokv.breaker` decides; this module acts).

- :class:`GuardedBackend` wraps the backend the engine calls: every ``batch_exists`` / ``batch_put`` /
  ``batch_get`` reports its start and its outcome to the breaker, in the thread running it (only
  existence checks count as stuck when slow: a large transfer may rightly run for seconds).
- :meth:`BreakerGuard.allow` is asked on the loop when a request is submitted, and
  :meth:`BreakerGuard.admit` when a lane thread is free for a call (calls still waiting then are
  re-checked): while the breaker is not closed both refuse, and every request that no backend call
  is using (QUEUED) is answered at once by :meth:`RequestTracker.refuse` — lookups 0, stores and
  loads a result with every open chunk failed ``UNAVAILABLE`` (-900). A request inside a backend
  call still waits for that call (its memory is in use).
- A watcher task on the loop re-evaluates the breaker's timers (a call turning stuck, the backoff
  ending), answers what is queued when it opens, and runs one probe at a time on a daemon thread of
  its own: ``health_check() == 0`` (when the backend has one) and a ``batch_exists`` that returns.
  Closing the worker stops the watcher and never waits for a probe thread (a frozen store holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..breaker import BreakerState, CircuitBreaker
from ..errors import _CircuitOpenError
from ..stats import Kind
from .tracker import RequestTracker

logger = logging.getLogger("aiokv")

PROBE_KEY = "aiokv-breaker-probe"
# Longest the watcher sleeps: how late it may notice a trip reported from a thread it was not woken for.
WATCH_TICK_S = 0.25


class GuardedBackend:
    """The backend as the engine sees it: data calls reported to the breaker; the rest passed through."""

    def __init__(self, inner: Any, breaker: CircuitBreaker, on_failure: Callable[[], None]) -> None:
        self._inner = inner
        self._breaker = breaker
        self._on_failure = on_failure

    def batch_exists(self, keys: Sequence[str]) -> Any:
        # Only existence checks count as stuck: they ask the master alone and answer in milliseconds,
        # while a put or get of a large batch may rightly take longer than stuck_after_s.
        return self._reported(self._inner.batch_exists, False, keys)

    def batch_put(self, keys: Sequence[str], addrs: Any, sizes: Any) -> Any:
        return self._reported(self._inner.batch_put, True, keys, addrs, sizes)

    def batch_get(self, keys: Sequence[str], addrs: Any, sizes: Any) -> Any:
        return self._reported(self._inner.batch_get, True, keys, addrs, sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _reported(self, method: Callable[..., Any], has_codes: bool, *args: Any) -> Any:
        breaker = self._breaker
        token = breaker.on_call_started(watch_stuck=not has_codes)
        try:
            answer = method(*args)
        except BaseException as exc:
            breaker.on_call_finished(token, error=exc)
            self._on_failure()
            raise
        codes = _failure_codes(answer) if has_codes else ()
        breaker.on_call_finished(token, codes=codes)
        if codes:
            self._on_failure()
        return answer


def _failure_codes(answer: Any) -> list[int]:
    """The negative codes of an answer (usually none: one vectorised test instead of a Python loop);
    an answer that is not one int per key is the engine's to reject, not the breaker's."""
    if type(answer) is list:
        # The usual answer, a list of codes all >= 0: one C-level min, not a conversion (~10 us for
        # a put of 170 keys, which the engine converts again to read the codes).
        with contextlib.suppress(TypeError):
            if not answer or min(answer) >= 0:
                return []
    try:
        codes = np.asarray(answer, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return []
    return codes[codes < 0].tolist() if codes.ndim == 1 else []


class BreakerGuard:
    """One worker's breaker: asked on the loop, told by the threads, watched by a task."""

    def __init__(self, breaker: CircuitBreaker, backend: Any, tracker: RequestTracker) -> None:
        self.breaker = breaker
        self._raw_backend = backend
        self._tracker = tracker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._probe_thread: threading.Thread | None = None
        self.backend = GuardedBackend(backend, breaker, self._wake_soon)

    # -- asked on the loop ----------------------------------------------------------------------

    def allow(self, kind: Kind) -> bool:
        """May a new request of ``kind`` go to the dispatcher? (A refusal is counted.)"""
        return self.breaker.allow(kind.value)

    def admit(self) -> _CircuitOpenError | None:
        """A lane thread is free for a call: None lets it run; while the breaker is not closed,
        everything queued is answered and the call is refused with the error returned."""
        if self.breaker.poll() is BreakerState.CLOSED or not self.breaker.config.enabled:
            return None
        self.refuse_queued()
        return _CircuitOpenError("circuit open: " + self.breaker.describe())

    def admits_on_thread(self) -> bool:
        """Thread-safe: True while :meth:`admit` would let a call run without asking anything of the
        loop (the breaker closed or disabled); a transfer thread then admits its call itself."""
        return not self.breaker.config.enabled or self.breaker.poll() is BreakerState.CLOSED

    def refuse_queued(self) -> None:
        """Answer every request no backend call is using now (each refusal counted per kind)."""
        for request in self._tracker.queued():
            if not self.breaker.allow(request.kind.value):
                self._tracker.refuse(request)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._watcher = self._loop.create_task(self._watch(), name="aiokv-breaker")

    def stop(self) -> None:
        """Stop watching; a probe thread still out is left to end on its own (a daemon thread)."""
        if self._watcher is not None:
            self._watcher.cancel()

    async def stopped(self) -> None:
        self.stop()
        if self._watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def snapshot(self) -> dict[str, Any]:
        return self.breaker.snapshot()

    # -- the watcher ----------------------------------------------------------------------------

    def _wake_soon(self) -> None:
        """From a thread whose call failed: let the watcher look now rather than at its next tick."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            loop.call_soon_threadsafe(wake.set)

    def _probing(self) -> bool:
        return self._probe_thread is not None and self._probe_thread.is_alive()

    async def _watch(self) -> None:
        breaker = self.breaker
        wake = self._wake
        if wake is None:
            raise RuntimeError("start() the guard before watching")
        was_closed = True
        while True:
            # While an earlier probe thread is still held, the breaker may be due a probe that is not
            # handed out: wait a tick instead of spinning on next_check_in() == 0.
            pause = WATCH_TICK_S if self._probing() else min(breaker.next_check_in(), WATCH_TICK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(pause, 0.001))
            wake.clear()
            state = breaker.poll()
            closed = state is BreakerState.CLOSED
            if closed != was_closed:
                log = logger.warning if not closed else logger.info
                log("aiokv: circuit breaker %s", breaker.describe() if not closed else "closed: resuming")
                was_closed = closed
            if not closed:
                self.refuse_queued()
                if not self._probing() and breaker.should_probe():
                    self._start_probe()

    def _start_probe(self) -> None:
        thread = threading.Thread(target=self._probe, name="aiokv-breaker-probe", daemon=True)
        self._probe_thread = thread
        thread.start()

    def _probe(self) -> None:
        """On the probe thread: is the store answering? Reported to the breaker, then the watcher woken."""
        backend = self._raw_backend
        try:
            health = getattr(backend, "health_check", None)
            healthy = health is None or int(health()) == 0
            if healthy:
                # health_check() alone still answers 0 with Mooncake's master killed: ask the master.
                backend.batch_exists([PROBE_KEY])
        except Exception as exc:
            logger.debug("aiokv: circuit breaker probe failed: %r", exc)
            healthy = False
        self.breaker.on_probe_finished(healthy)
        self._wake_soon()
