"""Bounded slices of a batch's work on the event loop, and the priority lookups have over them.

Every per-request or per-key loop of a batch (key building, claims, decisions, writing codes back,
settling) runs on the loop. A batch can hold 10,000 requests or one request of 62,500 keys, so each
such loop checks a :class:`LoopSlice` between requests, and per-key work goes in pieces of
:data:`PIECE_KEYS` keys with a check between pieces: the loop (lookups, timers, the engine) never
waits much longer than :data:`SLICE_S` for a batch. The clocks of one loop share when a slice last
resumed (:class:`LoopSlices`), so a step crossing several sliced stages still yields within one slice.

A lookup needs about five turns of the loop (dequeued, its check's answer, its future, the shield
around it, its caller) and the GIL for its check on a thread, twice (to run the check, then to hand
its answer to the loop). A thread waiting for the GIL asks the holder to drop it only after 5 ms
(CPython's switch interval) *with no release meanwhile*; a busy loop releases it at every turn (its
selector), which wakes the thread, but comes back for it before the thread is scheduled: the thread
waits again, indefinitely (a convoy), and pausing the loop for a moment per slice does not break it:
lookups behind a batch of thousands of requests still wait many slices. So while a lookup of the same
loop is in flight (counted in :class:`LoopSlices`), slices shrink to :data:`URGENT_SLICE_S` and then *wait
until no lookup is in flight* (at most :data:`URGENT_WAIT_S`, as a lookup may hang on the store):
the loop sleeps in its selector, and the lookup's thread gets the GIL as soon as it is scheduled.
Batches keep going meanwhile, at a fraction of their pace.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections.abc import Iterator

SLICE_S = 0.0005  # work on the loop between yields
PIECE_KEYS = 4096  # keys per piece of a per-key step (~0.5 ms of key building or dict operations)
URGENT_SLICE_S = 0.0003  # work on the loop between yields while a lookup is in flight
URGENT_WAIT_S = 0.002  # the longest a batch gives way after such a slice (a lookup may hang)


class LoopSlices:
    """Per event loop: how many lookups submitted on it are not answered yet (every worker of the
    loop adds its own; while any is, every :class:`LoopSlice` of the loop runs in short slices), and
    when a slice of the loop last resumed (shared: a step that goes from one sliced stage of a batch
    to the next, each with its own clock, still yields within one slice)."""

    __slots__ = ("__weakref__", "_answered", "_answered_timer", "lookups", "resumed")

    def __init__(self) -> None:
        self.lookups = 0
        self.resumed = time.perf_counter()
        # What slices waiting for the lookups share: resolved when none is in flight, or by the timer.
        self._answered: asyncio.Future[None] | None = None
        self._answered_timer: asyncio.TimerHandle | None = None

    def count_lookups(self, change: int) -> None:
        self.lookups += change
        if not self.lookups and self._answered is not None:
            _resolve(self._answered)
            if self._answered_timer is not None:
                self._answered_timer.cancel()
            self._answered = self._answered_timer = None

    async def lookups_answered(self, timeout: float) -> None:
        """Until no lookup is in flight, or ``timeout`` has passed (the loop idle meanwhile, unless
        something else is ready)."""
        if self._answered is None or self._answered.done():
            loop = asyncio.get_running_loop()
            self._answered = loop.create_future()
            self._answered_timer = loop.call_later(timeout, _resolve, self._answered)
        await asyncio.shield(self._answered)  # a cancelled waiter leaves it to the others

    @classmethod
    def of_running_loop(cls) -> LoopSlices:
        loop = asyncio.get_running_loop()
        found = _per_loop.get(loop)
        if found is None:
            found = _per_loop[loop] = cls()
        return found


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSlices] = weakref.WeakKeyDictionary()
# True in the task answering lookups (and tasks it starts): its own slices are the urgent work.
_answering_lookups: contextvars.ContextVar[bool] = contextvars.ContextVar("aiokv_lookups", default=False)


def answering_lookups() -> None:
    """Called by the task that answers lookups: its own slices never give way to lookups."""
    _answering_lookups.set(True)


class LoopSlice:
    """A clock over one step: :meth:`tick` yields to the loop once :data:`SLICE_S` has passed since a
    slice of the loop last resumed (:data:`URGENT_SLICE_S`, then a wait for the lookups, while one is
    in flight). Cheap enough to call per request (one ``perf_counter``)."""

    __slots__ = ("_budget", "_loop")

    def __init__(self) -> None:
        self._budget = SLICE_S  # read per clock, not at import: a test may shrink it
        # The lookups' own slices keep a clock of their own, with no lookup ever in flight: they are
        # the urgent work, and a few keys each.
        self._loop = LoopSlices() if _answering_lookups.get() else LoopSlices.of_running_loop()

    async def tick(self) -> None:
        loop = self._loop
        elapsed = time.perf_counter() - loop.resumed
        if loop.lookups:
            if elapsed >= min(self._budget, URGENT_SLICE_S):
                await loop.lookups_answered(URGENT_WAIT_S)
                loop.resumed = time.perf_counter()
        elif elapsed >= self._budget:
            await asyncio.sleep(0)
            loop.resumed = time.perf_counter()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def pieces(count: int, size: int = PIECE_KEYS) -> Iterator[slice]:
    """``slice``s covering ``range(count)`` in pieces of at most ``size``."""
    for start in range(0, count, size):
        yield slice(start, start + size)
