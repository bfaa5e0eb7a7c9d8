"""After the puts: a store's successful puts are confirmed readable before any result counts them.

A put answers success for a key that another writer (another worker, another Mooncake client) is
still writing: the store keeps the first value and says 0 at once, while a get answers "not found" or
"not ready" until that write ends. So the keys whose puts answered success are checked with one
``batch_exists``; those not yet present are waited for (polling, with a growing delay) and put again
(a put that finds the other write gone writes the key itself), for at most :data:`OTHER_WRITER_WAIT_S`.
A key still absent then is reported ``WRITE_IN_PROGRESS`` (-12): never stored or skipped while its
bytes cannot be read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

import numpy as np

from .._arrays import IntArray
from ..codes import WRITTEN, Code
from ..stats import Op
from .batch import Cycle, pick
from .exists import ExistenceCheck
from .lanes import Lanes
from .plan import Plan, Rows
from .request import Request
from .tracker import RequestTracker

logger = logging.getLogger("aiokv")

PutAgain = Callable[["Plan"], Awaitable[None]]  # re-runs the puts of some rows, per group

OTHER_WRITER_WAIT_S = 10.0  # how long a store waits for another writer's write of its keys
_FIRST_DELAY_S = 0.001
_MAX_DELAY_S = 0.05


class WriteConfirmation:
    """Confirms the keys one batch's puts answered success for; shared by every batch of a worker."""

    def __init__(self, exists: ExistenceCheck, lanes: Lanes, tracker: RequestTracker) -> None:
        self._exists = exists
        self._lanes = lanes
        self._tracker = tracker

    async def confirm(self, cycle: Cycle, plan: Plan, put_again: PutAgain) -> None:
        """Leave ``WRITTEN`` only on keys present now; ``put_again(rows_per_group)`` re-runs puts."""
        puts = [[rows for rows in group if rows.op is Op.PUT] for group in plan]
        if not any(puts) or self._lanes.terminated:
            # After terminate() nothing more reaches the backend: results say what the puts answered.
            return
        confirmed = np.zeros(len(cycle.keys), dtype=bool)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OTHER_WRITER_WAIT_S
        delay = _FIRST_DELAY_S
        while True:
            waiting = np.flatnonzero((cycle.outcome == WRITTEN) & ~confirmed)
            if not waiting.size:
                return
            present = await self._exists.check(pick(cycle.keys, waiting), _requests_of(puts, waiting))
            if present is None:  # its requests failed with the check's error
                self._set_codes(cycle, puts, waiting, Code.BACKEND_EXCEPTION)
                return
            confirmed[waiting[present]] = True
            absent = waiting[~present]
            if not absent.size:
                return
            if loop.time() >= deadline:
                logger.warning(
                    "aiokv: %d keys a put answered stored were still not readable after %.1f s "
                    "(another writer is writing them); reported WRITE_IN_PROGRESS",
                    absent.size,
                    OTHER_WRITER_WAIT_S,
                )
                self._set_codes(cycle, puts, absent, Code.WRITE_IN_PROGRESS)
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_DELAY_S)
            # A request cancelled or timed out meanwhile gets no go-ahead for its put: its keys then
            # read WRITER_CANCELLED, which ends the wait for them.
            await put_again(_rows_of(puts, absent))

    def _set_codes(self, cycle: Cycle, puts: Plan, positions: IntArray, code: Code) -> None:
        """``code`` for the keys at ``positions``: the batch's outcome, and every request putting them."""
        self._tracker.set_outcome(cycle, positions, code)
        for group, selected in enumerate(_rows_of(puts, positions)):
            for rows in selected:
                self._tracker.set_codes(rows.request, group, rows.chunks, code)


def _rows_of(puts: Plan, positions: IntArray) -> Plan:
    """Per group, the put rows (of every request) whose keys are at ``positions`` of the batch."""
    out: Plan = []
    for group in puts:
        selected = []
        for rows in group:
            mask = np.isin(rows.positions, positions)
            if mask.any():
                selected.append(Rows(rows.request, Op.PUT, rows.chunks[mask], rows.positions[mask]))
        out.append(selected)
    return out


def _requests_of(puts: Plan, positions: IntArray) -> Iterator[Request]:
    """The requests putting the keys at ``positions`` (computed only when asked: a failed check)."""
    for selected in _rows_of(puts, positions):
        for rows in selected:
            yield rows.request
