"""Prototype of the worker's circuit-breaker wiring, for lookups, driven against a real master.

It follows the contract in :mod:`aiokv.breaker` (docs/cluster.md, "Wiring the breaker"): ``allow()`` on
the event loop before anything goes to an executor; ``on_call_started``/``on_call_finished`` around the
backend call in its thread; a lookup never waits on a call once the breaker is open (a lookup holds no
caller memory, so it may be answered while its call is still stuck); probes run on a thread of their
own, one at a time, as the backend's ``health_check() == 0`` and a ``batch_exists`` that returns. The
cluster tests use it to measure time to "no cache" and time to resume with the master frozen or killed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..breaker import BreakerState, CircuitBreaker

PROBE_KEY = "aiokv-breaker-probe"


class GuardedLookups:
    """``lookup(keys)`` -> leading keys present, answered 0 while the breaker is open."""

    def __init__(self, backend: Any, breaker: CircuitBreaker) -> None:
        self._backend = backend  # a MooncakeBackend: batch_exists and health_check
        self._breaker = breaker
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="aiokv-guarded")
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="aiokv-probe")
        self._probe: asyncio.Future[bool] | None = None

    async def lookup(self, keys: Sequence[str]) -> int:
        self._maybe_probe()
        if not self._breaker.allow("lookup"):
            return 0
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._calls, self._exists, list(keys))
        while not call.done():
            await asyncio.wait({call}, timeout=min(self._breaker.next_check_in(), 0.5))
            if not call.done() and self._breaker.poll() is not BreakerState.CLOSED:
                # Abandoned, not cancelled: the thread finishes the call later and reports it.
                call.add_done_callback(lambda done: done.exception())
                return 0
        present = call.result()
        return next((k for k, found in enumerate(present) if not found), len(present))

    def _exists(self, keys: list[str]) -> list[bool]:
        token = self._breaker.on_call_started()
        try:
            present = self._backend.batch_exists(keys)
        except BaseException as exc:
            self._breaker.on_call_finished(token, error=exc)
            raise
        self._breaker.on_call_finished(token)
        return list(present)

    def _maybe_probe(self) -> None:
        if self._probe is not None and not self._probe.done():
            return  # one probe thread at a time, even one stuck past its timeout
        if self._breaker.should_probe():
            self._probe = asyncio.get_running_loop().run_in_executor(self._probes, self._run_probe)

    def _run_probe(self) -> bool:
        try:
            healthy = self._backend.health_check() == 0
            if healthy:
                self._backend.batch_exists([PROBE_KEY])
        except Exception:
            healthy = False
        self._breaker.on_probe_finished(healthy)
        return healthy

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
