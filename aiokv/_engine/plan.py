"""Decisions. Per request, settle what needs no transfer (present store keys are
skipped, a load stops at its first hole) and collect, per group, the rows of chunks to move."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._arrays import BoolArray, IntArray
from ..codes import Code
from ..stats import Kind, Op
from .batch import Cycle, Keys, Wait
from .request import Request
from .slices import LoopSlice
from .tracker import RequestTracker


@dataclass(slots=True)
class Rows:
    """Chunks of one request that one group moves: its block rows, and (for puts) key positions."""

    request: Request
    op: Op  # Op.PUT or Op.GET
    chunks: IntArray
    positions: IntArray


Plan = list[list[Rows]]  # per group
# As ints: NumPy given an enum member probes its class for array protocols first (~1 us a call).
_NOT_ATTEMPTED, _NOT_FOUND = int(Code.NOT_ATTEMPTED), int(Code.NOT_FOUND)
Unreadable = Callable[[Keys], BoolArray]  # per key: whether reads of it failed


async def decide(
    cycle: Cycle,
    live: list[Request],
    present: BoolArray,
    groups: int,
    tracker: RequestTracker,
    *,
    backing_off: bool,
    unreadable: Unreadable | None = None,
) -> Plan:
    """Have ``tracker`` write the codes of chunks that need no transfer; return per group the rows to
    move.

    ``backing_off``: the store answered "full" recently, so missing store chunks get ``NO_SPACE``
    without a call. ``unreadable``: which keys reads failed on (present or not, a store rewrites
    them: see :mod:`.rewrite`); None when there are none.
    """
    plan: Plan = [[] for _ in range(groups)]
    taken = np.zeros(present.size, dtype=bool)  # store keys given a writer in this batch
    clock = LoopSlice()
    for request in live:
        if request.kind is Kind.STORE:
            _decide_store(
                cycle, request, present, taken, plan, tracker, backing_off=backing_off, unreadable=unreadable
            )
        else:
            _decide_load(request, present, plan, tracker)
        await clock.tick()
    return plan


def _decide_store(
    cycle: Cycle,
    request: Request,
    present: BoolArray,
    taken: IntArray,
    plan: Plan,
    tracker: RequestTracker,
    *,
    backing_off: bool,
    unreadable: Unreadable | None,
) -> None:
    for group, positions in enumerate(request.positions):
        own = cycle.owned[positions]
        if not own.any():
            continue
        found = own & present[positions]
        if found.any():  # (a fresh prompt's chunks are all missing: no skip to write)
            if unreadable is not None:
                found &= ~unreadable(request.keys[group])  # present, but reads failed: not a skip
            tracker.set_store_codes(cycle, request, group, found, positions[found], Code.PRESENT)
            missing = own & ~found
        else:
            missing = own
        if backing_off:
            tracker.set_store_codes(cycle, request, group, missing, positions[missing], Code.NO_SPACE)
            continue
        first = missing & ~taken[positions]
        duplicate = missing & ~first
        taken[positions[first]] = True
        if duplicate.any():
            chunks = np.flatnonzero(duplicate)
            request.waits += (Wait(cycle, group, chunks, request.keys[group][chunks]),)
        if first.any():
            chunks = np.flatnonzero(first)
            plan[group].append(Rows(request, Op.PUT, chunks, positions[chunks]))


def _decide_load(request: Request, present: BoolArray, plan: Plan, tracker: RequestTracker) -> None:
    found = np.stack([present[positions] for positions in request.positions])
    holes = np.flatnonzero(~found.all(axis=0))
    prefix = int(holes[0]) if holes.size else request.num_chunks
    whole = prefix == request.num_chunks
    for group in range(len(request.codes)):
        if not whole:
            tail = np.where(found[group, prefix:], _NOT_ATTEMPTED, _NOT_FOUND)
            tracker.set_codes(request, group, slice(prefix, None), tail)
        if prefix:
            chunks = np.arange(prefix, dtype=np.int64)
            plan[group].append(Rows(request, Op.GET, chunks, request.positions[group][:prefix]))
