"""Keys whose reads failed are remembered (:class:`UnreadableKeys`) and rewritten by the next store
(:class:`Rewrites`), never skipped.

A store skips a chunk whose key exists. But a key can exist while no read of it succeeds: when the
Mooncake client that held its bytes was SIGKILLed, the master lists the key for ~20 s while every get
answers -800. So the worker remembers (boundedly) the keys a load found present but could not read
(-800, -704); a store of such a key does not skip it: ``batch_remove(force=True)`` first (else the put
would answer success and keep the dead value), then a put. A backend without ``batch_remove`` cannot
drop the dead value: those chunks are reported failed (``TRANSFER_FAILED``), never skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from .._arrays import BoolArray, IntArray
from ..backends.base import backend_traits
from ..codes import Code
from ..stats import Op
from .answers import batch_error
from .batch import Cycle, Keys, pick
from .config import EngineConfig
from .lanes import Lane, Lanes
from .plan import Plan, Rows
from .tracker import RequestTracker

logger = logging.getLogger("aiokv")

UNREADABLE_KEYS_KEPT = 65536
_READ_FAILURES = (int(Code.TRANSFER_FAILED), int(Code.NOT_FOUND))


class UnreadableKeys:
    """Keys a load found present but could not read (-800, -704), until a read or a rewrite of them
    succeeds. Bounded: the oldest are forgotten first."""

    def __init__(self, capacity: int = UNREADABLE_KEYS_KEPT) -> None:
        self._keys: dict[str, None] = {}  # insertion-ordered: a bounded FIFO
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._keys)

    def contains(self, keys: Keys) -> BoolArray:
        known = self._keys
        return np.fromiter((k in known for k in keys), dtype=bool, count=len(keys))

    def add(self, keys: Sequence[str]) -> None:
        known = self._keys
        for key in keys:
            known.pop(key, None)
            known[key] = None
        while len(known) > self._capacity:
            del known[next(iter(known))]

    def discard(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def note_reads(self, plan: Plan) -> None:
        """Remember the keys whose gets failed in this batch; forget those read successfully. Only the
        rows read count: a load's chunks missing at the existence check were never present."""
        for group, rows_list in enumerate(plan):
            for rows in rows_list:
                if rows.op is not Op.GET:
                    continue
                codes = rows.request.codes[group][rows.chunks]
                keys = rows.request.keys[group]
                # Two comparisons, not np.isin: ~1 us against ~30 us on a request's few chunks.
                failed = (codes == _READ_FAILURES[0]) | (codes == _READ_FAILURES[1])
                if failed.any():
                    self.add(pick(keys, rows.chunks[failed]))
                if self._keys and (codes >= 0).any():
                    self.discard(pick(keys, rows.chunks[codes >= 0]))

    def note_writes(self, cycle: Cycle) -> None:
        """Forget the keys this batch wrote (and confirmed readable)."""
        if self._keys:
            self.discard(pick(cycle.keys, np.flatnonzero(cycle.outcome == Code.OK)))


class Rewrites:
    """Drops the dead values of the unreadable keys a batch is about to put."""

    def __init__(
        self, config: EngineConfig, lanes: Lanes, tracker: RequestTracker, unreadable: UnreadableKeys
    ) -> None:
        self._config = config
        self._lanes = lanes
        self._tracker = tracker
        self._unreadable = unreadable
        self._can_remove = backend_traits(config.backend).can_remove

    async def prepare(self, cycle: Cycle, plan: Plan) -> Plan:
        """Remove the unreadable keys among the plan's puts; the plan without the rows that cannot be
        rewritten (their chunks fail with the code that says why)."""
        if not len(self._unreadable):
            return plan
        stale: list[IntArray] = []  # positions in the batch of the keys to rewrite
        for group, rows_list in enumerate(plan):
            for rows in rows_list:
                if rows.op is Op.PUT:
                    mine = self._unreadable.contains(pick(rows.request.keys[group], rows.chunks))
                    stale.append(rows.positions[mine])
        positions = np.unique(np.concatenate(stale)) if stale else np.zeros(0, dtype=np.int64)
        if not positions.size:
            return plan
        failed, error = await self._remove(cycle, positions)
        if not failed.size:
            return plan
        kept: Plan = []
        for group, rows_list in enumerate(plan):
            kept.append([])
            for rows in rows_list:
                drop = np.isin(rows.positions, failed) if rows.op is Op.PUT else np.zeros(0, dtype=bool)
                if not drop.any():
                    kept[group].append(rows)
                    continue
                outcome = cycle.outcome[rows.positions[drop]]
                self._tracker.set_codes(rows.request, group, rows.chunks[drop], outcome)
                if error is not None:
                    self._tracker.fail(rows.request, error)
                if not drop.all():
                    kept[group].append(Rows(rows.request, rows.op, rows.chunks[~drop], rows.positions[~drop]))
        return kept

    async def _remove(self, cycle: Cycle, positions: IntArray) -> tuple[IntArray, BaseException | None]:
        """``batch_remove(force=True)`` of the keys at ``positions``; the positions that cannot be
        rewritten (their failure code in ``cycle.outcome``), and the error if the call raised."""
        if not self._can_remove:
            self._tracker.set_outcome(cycle, positions, Code.TRANSFER_FAILED)
            return positions, None
        keys = pick(cycle.keys, positions)
        remove = self._config.backend.batch_remove  # type: ignore[attr-defined]
        try:
            codes = np.asarray(await self._lanes.run(Lane.CONTROL, lambda: remove(keys, force=True)))
            if codes.shape != (len(keys),):
                raise ValueError(f"batch_remove answered {codes.shape} codes for {len(keys)} keys")
        except Exception as exc:
            logger.warning("aiokv: batch_remove of %d unreadable keys failed: %s", len(keys), exc)
            self._tracker.set_outcome(cycle, positions, Code.BACKEND_EXCEPTION)
            return positions, batch_error("batch_remove", exc)
        bad = (codes < 0) & (codes != Code.NOT_FOUND)
        logger.info("aiokv: rewriting %d keys whose reads failed", len(keys) - int(bad.sum()))
        self._tracker.set_outcome(cycle, positions[bad], codes[bad])
        return positions[bad], None
