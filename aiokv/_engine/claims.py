"""Step 2 of a batch: store keys are claimed, so that no key is written twice, by two requests of one
batch or by two overlapping batches. A key claimed by another batch makes a :class:`Wait`: the request
takes that batch's outcome for it."""

from __future__ import annotations

import numpy as np

from .batch_keys import Cycle, pick
from .request import Request, Wait
from .slices import LoopSlice, pieces


class Claims:
    """Which batch writes each store key now; only the claiming batch removes its claims."""

    def __init__(self) -> None:
        self._owner: dict[str, Cycle] = {}

    async def claim(self, cycle: Cycle, stores: list[Request]) -> None:
        """Claim the store keys nobody claimed; add a Wait for the others."""
        claims = self._owner
        clock = LoopSlice()
        for request in stores:
            for group, keys in enumerate(request.keys):
                owners: list[Cycle] = []
                for part in pieces(len(keys)):
                    owners += [claims.setdefault(k, cycle) for k in keys[part]]
                    await clock.tick()
                if owners.count(cycle) == len(owners):
                    cycle.owned[request.positions[group]] = True
                    continue
                foreign = np.array([o is not cycle for o in owners], dtype=bool)
                cycle.owned[request.positions[group][~foreign]] = True
                for other in {id(o): o for o in owners if o is not cycle}.values():
                    mine = np.flatnonzero([o is other for o in owners])
                    request.waits += (Wait(other, group, mine, [keys[i] for i in mine.tolist()]),)
            await clock.tick()
        owned = np.flatnonzero(cycle.owned)
        cycle.claimed = cycle.keys if owned.size == len(cycle.keys) else pick(cycle.keys, owned)

    async def release(self, cycle: Cycle) -> None:
        """Drop ``cycle``'s claims and publish its outcomes to the requests waiting on them."""
        claims = self._owner
        clock = LoopSlice()
        for part in pieces(len(cycle.claimed)):
            for key in cycle.claimed[part]:
                del claims[key]
            await clock.tick()
        cycle.publish()
