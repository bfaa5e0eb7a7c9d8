"""Whether a batch is settling its requests, so the next batch can wait for their callers.

A batch settles its requests in slices of the loop (:mod:`.slices`). The callers settled in one slice
submit their next requests two turns later (the future, the shield around it) while later slices are
still settling the rest, so a batch drained meanwhile takes only the first slices' callers; the two
groups, each in its own batch slot, then stay apart round after round: more, smaller batches, the more
so the more slices a settle spans (a busy or cold machine, or a slice per request). How many slices a
settle takes depends on the machine; whether it has ended does not. So the dispatcher starts its next
batch once no batch is settling.

A batch waiting for another batch's outcomes (a chunk it shares with that batch's writer, who may still
wait on the store) is not settling meanwhile: no new batch waits on the store behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class Settling:
    """How many batches of one worker are settling now, and a way to wait until none is."""

    __slots__ = ("_active", "_ended")

    def __init__(self) -> None:
        self._active = 0
        self._ended: asyncio.Future[None] | None = None  # shared by the waiters, resolved at 0

    @contextmanager
    def running(self) -> Iterator[None]:
        self._active += 1
        try:
            yield
        finally:
            self._leave()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Around a wait on something other than this batch's own work."""
        self._leave()
        try:
            yield
        finally:
            self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        ended = self._ended
        if not self._active and ended is not None:
            self._ended = None
            if not ended.done():
                ended.set_result(None)

    async def ended(self) -> None:
        """Until no batch is settling (at once if none is)."""
        if not self._active:
            return
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._ended)  # a cancelled waiter leaves it to the others
