"""The keys a load found present but could not read (-800, -704), remembered so that the next store of
them rewrites them instead of skipping them (:mod:`.rewrite`). Bounded: the oldest are forgotten first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._arrays import BoolArray
from ..codes import Code
from ..stats import Op
from .batch_keys import Cycle, Keys, pick
from .plan import Plan

UNREADABLE_KEYS_KEPT = 65536
_READ_FAILURES = (int(Code.TRANSFER_FAILED), int(Code.NOT_FOUND))


class UnreadableKeys:
    """Keys a load found present but could not read, until a read or a rewrite of them succeeds."""

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
                failed = np.isin(codes, _READ_FAILURES)
                if failed.any():
                    self.add(pick(keys, rows.chunks[failed]))
                if self._keys and (codes >= 0).any():
                    self.discard(pick(keys, rows.chunks[codes >= 0]))

    def note_writes(self, cycle: Cycle) -> None:
        """Forget the keys this batch wrote (and confirmed readable)."""
        if self._keys:
            self.discard(pick(cycle.keys, np.flatnonzero(cycle.outcome == Code.OK)))
