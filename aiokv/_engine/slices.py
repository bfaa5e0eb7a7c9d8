"""Bounded slices of a batch's work on the event loop, and the priority lookups have over them.

Every per-request or per-key loop of a batch (key building, claims, decisions, writing codes back,
settling) runs on the loop. A batch can hold 10,000 requests or one request of 62,500 keys, so each
such loop checks a :class:`LoopSlice` between requests, and per-key work goes in pieces of
:data:`PIECE_KEYS` keys with a check between pieces: the loop (lookups, timers, the engine) never
waits much longer than :data:`SLICE_S` for a batch.

A lookup needs about five turns of the loop (dequeued, its check's answer, its future, the shield
around it, its caller) and the GIL for its check on a thread. With two batches slicing, each turn of
the loop costs a few slices, and the thread waits for the GIL the loop thread holds: a lookup took
~60 ms during a 10,000-request batch on an idle machine. So while a lookup of the same loop is in
flight (:class:`LookupsInFlight`), slices shrink to :data:`URGENT_SLICE_S` and end with a pause of
:data:`URGENT_PAUSE_S` instead of a bare yield: the loop's turns stay short and, when nothing else is
ready, the loop thread sleeps in its selector, leaving the GIL to the lookup's thread. Batches keep
going meanwhile, at a fraction of their pace.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections.abc import Iterator

SLICE_S = 0.002  # work on the loop between yields
PIECE_KEYS = 4096  # keys per piece of a per-key step (~0.5 ms of key building or dict operations)
URGENT_SLICE_S = 0.0003  # work on the loop between yields while a lookup is in flight
URGENT_PAUSE_S = 0.0002  # the loop idle (the GIL free) after such a slice, if nothing else is ready


class LookupsInFlight:
    """How many lookups submitted on one loop are not answered yet (every worker of the loop adds
    its own): while any is, every :class:`LoopSlice` of that loop runs in short slices."""

    __slots__ = ("__weakref__", "count")

    def __init__(self) -> None:
        self.count = 0

    @classmethod
    def of_running_loop(cls) -> LookupsInFlight:
        loop = asyncio.get_running_loop()
        found = _in_flight.get(loop)
        if found is None:
            found = _in_flight[loop] = cls()
        return found


_in_flight: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LookupsInFlight] = (
    weakref.WeakKeyDictionary()
)
# True in the task answering lookups (and tasks it starts): its own slices are the urgent work.
_answering_lookups: contextvars.ContextVar[bool] = contextvars.ContextVar("aiokv_lookups", default=False)


def answering_lookups() -> None:
    """Called by the task that answers lookups: its own slices never give way to lookups."""
    _answering_lookups.set(True)


class LoopSlice:
    """A clock over one step: :meth:`tick` yields to the loop once ``budget_s`` has passed since the
    last yield (:data:`URGENT_SLICE_S`, then a short pause, while a lookup is in flight). Cheap
    enough to call per request (one ``perf_counter``)."""

    __slots__ = ("_budget", "_lookups", "_since")

    def __init__(self, budget_s: float = SLICE_S) -> None:
        self._budget = budget_s
        self._lookups = _NONE_IN_FLIGHT if _answering_lookups.get() else LookupsInFlight.of_running_loop()
        self._since = time.perf_counter()

    async def tick(self) -> None:
        elapsed = time.perf_counter() - self._since
        if self._lookups.count:
            if elapsed >= min(self._budget, URGENT_SLICE_S):
                await asyncio.sleep(URGENT_PAUSE_S)
                self._since = time.perf_counter()
        elif elapsed >= self._budget:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


_NONE_IN_FLIGHT = LookupsInFlight()  # what the lookups' own slices watch: never any


def pieces(count: int, size: int = PIECE_KEYS) -> Iterator[slice]:
    """``slice``s covering ``range(count)`` in pieces of at most ``size``."""
    for start in range(0, count, size):
        yield slice(start, start + size)
