"""Store-pressure backoff: after the store answers "full" (-200), stores pause for a while (their
missing chunks fail ``NO_SPACE`` without a call) instead of hammering a full store."""

from __future__ import annotations

import asyncio
import logging

from ..stats import WorkerStats

logger = logging.getLogger("aiokv")


class PressureBackoff:
    def __init__(self, seconds: float, stats: WorkerStats) -> None:
        self._seconds = seconds
        self._stats = stats
        self._until = 0.0

    @property
    def enabled(self) -> bool:
        return self._seconds > 0

    def active(self) -> bool:
        return asyncio.get_running_loop().time() < self._until

    def enter(self) -> None:
        now = asyncio.get_running_loop().time()
        if now >= self._until:
            self._stats.pressure_backoffs += 1
            logger.warning("aiokv: store full (-200); backing off stores for %.2f s", self._seconds)
        self._until = now + self._seconds
