"""Step 2 of a batch: store keys are claimed, so that no key is written twice, by two requests of one
batch or by two overlapping batches. A key claimed by another batch makes a :class:`Wait`: the request
takes that batch's outcome for it."""

from __future__ import annotations

import itertools

import numpy as np

from .._arrays import IntArray
from .batch_keys import Cycle
from .request import Request, Wait
from .slices import LoopSlice, pieces


class Claims:
    """Which batch writes each store key now; only the claiming batch removes its claims.

    A key maps to its batch's number, not to the batch: a dict of ``str`` to ``int`` is never tracked
    by the garbage collector, while one holding the batches is, and young collections walked all the
    claims (see the batch_keys module)."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}
        self._batches: dict[int, Cycle] = {}  # the batches holding claims, by number
        self._numbers = itertools.count()

    async def claim(self, cycle: Cycle, stores: list[Request]) -> None:
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
        """Drop ``cycle``'s claims and publish its outcomes to the requests waiting on them."""
        claims = self._owner
        clock = LoopSlice()
        for part in pieces(len(cycle.claimed)):
            for key in cycle.claimed[part]:
                del claims[key]
            await clock.tick()
        self._batches.pop(cycle.number, None)
        cycle.publish()
