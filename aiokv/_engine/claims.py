"""Step 2 of a batch: store keys are claimed, so that no key is written twice, by two requests of one
batch or by two overlapping batches. A key claimed by another batch makes a :class:`Wait`: the request
takes that batch's outcome for it."""

from __future__ import annotations

import asyncio

import numpy as np

from .batch_keys import YIELD_EVERY_KEYS, Cycle, pick
from .request import Request, Wait


class Claims:
    """Which batch writes each store key now; only the claiming batch removes its claims."""

    def __init__(self) -> None:
        self._owner: dict[str, Cycle] = {}

    async def claim(self, cycle: Cycle, stores: list[Request]) -> None:
        """Claim the store keys nobody claimed; add a Wait for the others."""
        claims = self._owner
        done_keys = 0
        for request in stores:
            for group, keys in enumerate(request.keys):
                owners = [claims.setdefault(k, cycle) for k in keys]
                if owners.count(cycle) == len(owners):
                    cycle.owned[request.positions[group]] = True
                    continue
                foreign = np.array([o is not cycle for o in owners], dtype=bool)
                cycle.owned[request.positions[group][~foreign]] = True
                for other in {id(o): o for o in owners if o is not cycle}.values():
                    mine = np.flatnonzero([o is other for o in owners])
                    request.waits.append(Wait(other, group, mine, [keys[i] for i in mine.tolist()]))
            done_keys += request.num_chunks * len(request.keys)
            if done_keys >= YIELD_EVERY_KEYS:
                done_keys = 0
                await asyncio.sleep(0)
        cycle.claimed = pick(cycle.keys, np.flatnonzero(cycle.owned))

    def release(self, cycle: Cycle) -> None:
        """Drop ``cycle``'s claims and publish its outcomes to the requests waiting on them."""
        claims = self._owner
        for key in cycle.claimed:
            del claims[key]
        cycle.publish()
