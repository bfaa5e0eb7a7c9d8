"""The keys of one batch: every request's keys, their positions in the batch's list of unique keys,
and the outcome of each store key (shared with every request that has it)."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .._arrays import IntArray
from ..codes import Code
from .slices import LoopSlice, pieces


@dataclass(eq=False, slots=True)
class Cycle:
    """The keys of one batch and the outcome of the store keys it claimed.

    ``outcome`` is written by the batch that claimed a key; ``outcomes_ready`` is set once every
    outcome of the batch is final, for requests of other batches that wait on them.
    """

    outcomes_ready: asyncio.Future[None]
    keys: list[str] = field(default_factory=list)  # unique keys of the batch
    owned: IntArray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    outcome: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    claimed: list[str] = field(default_factory=list)
    _index: dict[str, int] | None = None

    @classmethod
    def new(cls) -> Cycle:
        return cls(outcomes_ready=asyncio.get_running_loop().create_future())

    async def outcome_of(self, keys: Sequence[str]) -> IntArray:
        """The outcome of each of ``keys`` (keys of this batch), built in slices."""
        if self._index is None:  # only batches that other requests wait on need it
            self._index = await index_of(self.keys)
        return self.outcome[await positions_in(self._index, keys)]

    def set_keys(self, keys: list[str]) -> None:
        self.keys = keys
        self.owned = np.zeros(len(keys), dtype=bool)
        self.outcome = np.full(len(keys), Code.PENDING, dtype=np.int64)

    def publish(self) -> None:
        """Mark every outcome final: a claimed key nobody wrote went away with its writer."""
        self.outcome[self.owned & (self.outcome == Code.PENDING)] = Code.WRITER_CANCELLED
        if not self.outcomes_ready.done():
            self.outcomes_ready.set_result(None)


async def assign_positions(
    cycle: Cycle, per_request_keys: Sequence[Sequence[Sequence[str]]]
) -> list[list[IntArray]]:
    """Fill ``cycle``'s unique keys; return, per request and group, each key's position in them."""
    clock = LoopSlice()
    every_key = [keys for request_keys in per_request_keys for keys in request_keys]
    unique: dict[str, None] = {}
    for keys in every_key:
        for part in pieces(len(keys)):
            unique.update(dict.fromkeys(keys[part]))
            await clock.tick()
    cycle.set_keys(list(unique))
    positions: list[list[IntArray]] = []
    if len(unique) == sum(map(len, every_key)):
        # No key repeats (the usual case): positions are consecutive, no per-key lookups.
        offset = 0
        for request_keys in per_request_keys:
            mine = []
            for keys in request_keys:
                mine.append(np.arange(offset, offset + len(keys), dtype=np.int64))
                offset += len(keys)
            positions.append(mine)
            await clock.tick()
        return positions
    index = await index_of(cycle.keys)
    for request_keys in per_request_keys:
        positions.append([await positions_in(index, keys) for keys in request_keys])
    return positions


async def index_of(keys: list[str]) -> dict[str, int]:
    """``{key: its position}``, built in slices."""
    clock = LoopSlice()
    index: dict[str, int] = {}
    for part in pieces(len(keys)):
        index.update(zip(keys[part], range(part.start, part.stop), strict=False))
        await clock.tick()
    return index


async def positions_in(index: dict[str, int], keys: Sequence[str]) -> IntArray:
    """The position of each of ``keys`` in ``index``, in slices."""
    clock = LoopSlice()
    found = np.empty(len(keys), dtype=np.int64)
    for part in pieces(len(keys)):
        found[part] = [index[k] for k in keys[part]]
        await clock.tick()
    return found


def pick(items: Sequence[str], index: IntArray) -> list[str]:
    """``[items[i] for i in index]`` at C speed."""
    if index.size == 1:
        return [items[int(index[0])]]
    return list(operator.itemgetter(*index.tolist())(items)) if index.size else []


def pick_rows(items: Sequence[str], rows: IntArray) -> list[str]:
    """``items`` at ``rows``, by slicing when the rows are consecutive (the usual case)."""
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 != rows.size:
        return pick(items, rows)
    part = items[first : last + 1]
    return part if isinstance(part, list) else list(part)  # a request's keys are a tuple
