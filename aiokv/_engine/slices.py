"""Bounded slices of a batch's work on the event loop.

Every per-request or per-key loop of a batch (key building, claims, decisions, writing codes back,
settling) runs on the loop. A batch can hold 10,000 requests or one request of 62,500 keys, so each
such loop checks a :class:`LoopSlice` between requests, and per-key work goes in pieces of
:data:`PIECE_KEYS` keys with a check between pieces: the loop (lookups, timers, the engine) never
waits much longer than :data:`SLICE_S` for a batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

SLICE_S = 0.002  # work on the loop between yields
PIECE_KEYS = 4096  # keys per piece of a per-key step (~0.5 ms of key building or dict operations)


class LoopSlice:
    """A clock over one step: :meth:`tick` yields to the loop once ``budget_s`` has passed since the
    last yield. Cheap enough to call per request (one ``perf_counter``)."""

    __slots__ = ("_budget", "_since")

    def __init__(self, budget_s: float = SLICE_S) -> None:
        self._budget = budget_s
        self._since = time.perf_counter()

    async def tick(self) -> None:
        if time.perf_counter() - self._since >= self._budget:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


def pieces(count: int, size: int = PIECE_KEYS) -> Iterator[slice]:
    """``slice``s covering ``range(count)`` in pieces of at most ``size``."""
    for start in range(0, count, size):
        yield slice(start, start + size)
