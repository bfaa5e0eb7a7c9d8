"""What a tier stores and removes, as it happens: for a router that sends a request to the instance
holding its prefix, or a cache map kept beside the store.

A tier that takes a ``listener`` (:class:`~aiokv.MemoryBackend`, :class:`~aiokv.DiskBackend`) calls it
with a :class:`TierEvent` for every key that becomes readable (``"stored"``) and every key it stops
holding (``"removed"``), exactly once each and in the order they happen: the listener runs under the
tier's lock, on the thread making the call, so it must be quick and must not call the tier. A set kept
from the events alone equals the keys the tier holds. :class:`TierEventStream` is such a listener for
asyncio code: ``async for event in stream``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["TierEvent", "TierEventStream", "TierListener"]

EventKind = Literal["stored", "removed"]


@dataclass(frozen=True, slots=True)
class TierEvent:
    """``kind`` of ``key`` in the tier named ``tier`` (``"memory"``, ``"disk"``); ``reason``: why
    (stored: ``"put"``, ``"restart"``: found in the tier's files when it opened; removed:
    ``"removed"``, ``"evicted"``, ``"damaged"``, ``"missing"``)."""

    kind: EventKind
    key: str
    tier: str
    reason: str


TierListener = Callable[[TierEvent], None]


class TierEventStream:
    """A listener whose events are read with ``async for`` on the event loop that created it. Events
    wait in memory until read (the most recent ``max_pending``; older ones are dropped and counted in
    :attr:`dropped`, and the reader gets a ``RuntimeError`` at that point rather than a silently
    incomplete history)."""

    def __init__(self, max_pending: int = 1 << 20) -> None:
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque[TierEvent] = collections.deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0

    def __call__(self, event: TierEvent) -> None:
        with self._lock:
            if self._closed:
                return
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(event)
        self._loop.call_soon_threadsafe(self._ready.set)

    def close(self) -> None:
        """No more events: a reader ends once it has read those already here."""
        with self._lock:
            self._closed = True
        self._loop.call_soon_threadsafe(self._ready.set)

    def __aiter__(self) -> AsyncIterator[TierEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TierEvent]:
        while True:
            with self._lock:
                if self.dropped:
                    raise RuntimeError(f"{self.dropped} tier events were dropped unread (max_pending)")
                batch = list(self._pending)
                self._pending.clear()
                closed = self._closed
                self._ready.clear()
            for event in batch:
                yield event
            if closed and not batch:
                return
            if not batch:
                await self._ready.wait()
