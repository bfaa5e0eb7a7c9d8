"""One batch (:class:`Cycle`): its keys, their positions in the batch's list of unique keys, the
outcome of each store key (shared with every request that has it), and the claims that give each store
key one writer across overlapping batches (:class:`Claims`; a key another batch claimed makes a
:class:`Wait`: the request takes that batch's outcome for it).

Inside a batch, keys live in object arrays (:data:`KeyArray`), which the garbage collector never
tracks: the next young collection walked every list or tuple of them (a 62,500-key prompt's four:
5-8 ms on the loop, or on a transfer thread holding the GIL). Lists are made only for a backend call,
a piece at a time (:func:`pick`)."""

from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from ..codes import Code
from .slices import LoopSlice, pieces

KeyArray = npt.NDArray[np.object_]  # keys (str), one per element
Keys = Sequence[str] | KeyArray  # keys as a caller or a batch holds them


def key_array(keys: Collection[str]) -> KeyArray:
    return np.fromiter(keys, dtype=object, count=len(keys))


@dataclass(eq=False, slots=True)
class Cycle:
    """The keys of one batch and the outcome of the store keys it claimed.

    ``outcome`` is written (through the tracker, :mod:`.tracker`) by the batch that claimed a key;
    ``outcomes_ready`` is set once every outcome of the batch is final (``RequestTracker.publish``), for
    requests of other batches that wait on them.
    """

    outcomes_ready: asyncio.Future[None]
    keys: KeyArray = field(default_factory=lambda: key_array(()))  # unique keys of the batch
    owned: IntArray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    outcome: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    claimed: KeyArray = field(default_factory=lambda: key_array(()))
    number: int = -1  # given by Claims as the batch claims its keys
    _index: dict[str, int] | None = None

    @classmethod
    def new(cls) -> Cycle:
        return cls(outcomes_ready=asyncio.get_running_loop().create_future())

    async def outcome_of(self, keys: KeyArray) -> IntArray:
        """The outcome of each of ``keys`` (keys of this batch), built in slices."""
        if self._index is None:  # only batches that other requests wait on need it
            self._index = await index_of(self.keys)
        return self.outcome[await positions_in(self._index, keys)]

    def set_keys(self, keys: KeyArray) -> None:
        self.keys = keys
        self.owned = np.zeros(len(keys), dtype=bool)
        self.outcome = np.full(len(keys), Code.PENDING, dtype=np.int64)


@dataclass(slots=True)
class Wait:
    """Chunks of a store whose outcome another request of ``cycle`` decides (it writes them)."""

    cycle: Cycle
    group: int
    chunks: IntArray
    keys: KeyArray


async def assign_positions(
    cycle: Cycle, per_request_keys: Sequence[Sequence[KeyArray]]
) -> list[list[IntArray]]:
    """Fill ``cycle``'s unique keys; return, per request and group, each key's position in them."""
    clock = LoopSlice()
    every_key = [keys for request_keys in per_request_keys for keys in request_keys]
    unique: dict[str, None] = {}
    for keys in every_key:
        for part in pieces(len(keys)):
            unique.update(dict.fromkeys(keys[part]))
            await clock.tick()
    cycle.set_keys(key_array(unique))
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


async def index_of(keys: KeyArray) -> dict[str, int]:
    """``{key: its position}``, built in slices."""
    clock = LoopSlice()
    index: dict[str, int] = {}
    for part in pieces(len(keys)):
        index.update(zip(keys[part], range(part.start, part.stop), strict=False))
        await clock.tick()
    return index


async def positions_in(index: dict[str, int], keys: KeyArray) -> IntArray:
    """The position of each of ``keys`` in ``index``, in slices."""
    clock = LoopSlice()
    found = np.empty(len(keys), dtype=np.int64)
    for part in pieces(len(keys)):
        found[part] = [index[k] for k in keys[part]]
        await clock.tick()
    return found


def pick(items: Keys, index: IntArray) -> list[str]:
    """``[items[i] for i in index]`` at C speed, as a list (what a backend call takes)."""
    if isinstance(items, np.ndarray):
        return items[index].tolist()  # type: ignore[no-any-return]
    if index.size == 1:
        return [items[int(index[0])]]
    return list(operator.itemgetter(*index.tolist())(items)) if index.size else []


def rows_of(keys: KeyArray, rows: IntArray) -> KeyArray:
    """``keys`` at ``rows``: a view when the rows are consecutive (the usual case), else a copy."""
    if not consecutive(rows):
        return keys[rows]
    return keys[int(rows[0]) : int(rows[-1]) + 1]


def consecutive(rows: IntArray) -> bool:
    """Whether ascending ``rows`` are one run (``arange(first, last + 1)``)."""
    return bool(rows.size) and int(rows[-1]) - int(rows[0]) + 1 == rows.size


class Claimant(Protocol):
    """What claiming reads and writes of a store request (:class:`~aiokv._engine.request.Request`),
    typed here so that this module needs nothing of the request's, which imports this one."""

    keys: tuple[KeyArray, ...]
    positions: tuple[IntArray, ...]
    waits: tuple[Wait, ...]


class Claims:
    """Which batch writes each store key now; only the claiming batch removes its claims.

    A key maps to its batch's number, not to the batch: a dict of ``str`` to ``int`` is never tracked
    by the garbage collector, while one holding the batches is, and young collections walked all the
    claims (see above)."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}
        self._batches: dict[int, Cycle] = {}  # the batches holding claims, by number
        self._numbers = itertools.count()

    async def claim(self, cycle: Cycle, stores: Sequence[Claimant]) -> None:
        """Claim the store keys nobody claimed; add a Wait for the others."""
        number = cycle.number = next(self._numbers)
        self._batches[number] = cycle
        claims = self._owner
        clock = LoopSlice()
        for request in stores:
            for group, keys in enumerate(request.keys):
                foreign: list[tuple[IntArray, IntArray]] = []  # per piece: others' chunks, and whose
                for part in pieces(len(keys)):
                    owners = [claims.setdefault(k, number) for k in keys[part]]
                    if owners.count(number) != len(owners):  # C speed: the usual case has none
                        whose = np.asarray(owners)
                        others = np.flatnonzero(whose != number)
                        foreign.append((others + part.start, whose[others]))
                    await clock.tick()
                positions = request.positions[group]
                if not foreign:
                    cycle.owned[positions] = True
                    continue
                chunks = np.concatenate([c for c, _ in foreign])
                owners_of = np.concatenate([w for _, w in foreign])
                mine = np.ones(len(keys), dtype=bool)
                mine[chunks] = False
                cycle.owned[positions[mine]] = True
                for other in np.unique(owners_of).tolist():
                    theirs = chunks[owners_of == other]
                    request.waits += (Wait(self._batches[other], group, theirs, keys[theirs]),)
            await clock.tick()
        owned = cycle.owned
        cycle.claimed = cycle.keys if owned.all() else cycle.keys[owned]

    async def release(self, cycle: Cycle) -> None:
        """Drop ``cycle``'s claims (its outcomes are published next: ``RequestTracker.publish``)."""
        claims = self._owner
        clock = LoopSlice()
        for part in pieces(len(cycle.claimed)):
            for key in cycle.claimed[part]:
                del claims[key]
            await clock.tick()
        self._batches.pop(cycle.number, None)
