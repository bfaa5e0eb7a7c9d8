"""Loads settled as soon as their own chunks have landed, not when their batch ends.

A batch carries many requests' loads, and its calls run in plan order, so the first request's chunks
are in long before the last's. Settling every load at the batch's end made each wait for the whole
batch's bytes (under 16 concurrent hits a load took twice its batch's transfer time), and handed
vLLM the finished requests all at once, so their tails were computed in one long step. A load whose
every call, in every group, has returned is settled then: its caller goes on while the batch moves the
rest.

Only loads of at least :data:`~.call_split.LOAD_ALONE_BYTES`, the loads given calls of their own:
a smaller load shares its calls with up to hundreds of others, so its bytes land with theirs and
settling it alone would only add per-request work on the loop (~5% of a small request's CPU).

Only loads: a store's outcome is shared with the requests of other batches that wait on it
(:mod:`.batch`), and is published with its batch. Anything not settled here (a store, a load whose
group failed before its calls, a load still running a call) is settled at the batch's end as before
(:meth:`~aiokv._engine.pipeline.BatchPipeline.run_transfers`): settling twice is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .._arrays import BoolArray, IntArray
from ..stats import Kind, Op
from . import call_split
from .plan import Plan, Rows
from .request import Request
from .rewrite import UnreadableKeys
from .slices import LoopSlice
from .tracker import RequestTracker


class EarlyLoads:
    """The loads of one batch's plan that may settle early, and how many plan entries (a request's
    rows in one group) each still waits for."""

    __slots__ = ("_entries", "_left", "_tracker", "_unreadable")

    def __init__(self, tracker: RequestTracker, unreadable: UnreadableKeys) -> None:
        self._tracker = tracker
        self._unreadable = unreadable
        self._entries: dict[Request, list[tuple[int, Rows]]] = {}
        self._left: dict[Request, int] = {}

    @classmethod
    async def of(
        cls, plan: Plan, tracker: RequestTracker, unreadable: UnreadableKeys, chunk_bytes: Sequence[int]
    ) -> EarlyLoads:
        """The large loads of ``plan`` (``chunk_bytes``: a chunk's bytes per group), built in slices of
        the loop: a plan can hold 10,000 entries."""
        early = cls(tracker, unreadable)
        entries_of = early._entries
        load_bytes: dict[Request, int] = {}
        excluded: set[Request] = set()
        clock = LoopSlice()
        for group, entries in enumerate(plan):
            for rows in entries:
                request = rows.request
                if request.kind is not Kind.LOAD or rows.op is not Op.GET or request.waits:
                    excluded.add(request)
                else:
                    entries_of.setdefault(request, []).append((group, rows))
                    load_bytes[request] = load_bytes.get(request, 0) + rows.chunks.size * chunk_bytes[group]
                await clock.tick()
        excluded.update(r for r, size in load_bytes.items() if size < call_split.LOAD_ALONE_BYTES)
        for request in excluded:
            entries_of.pop(request, None)
        early._left = {request: len(entries) for request, entries in entries_of.items()}
        return early

    def __bool__(self) -> bool:
        return bool(self._left)

    def tracks(self, request: Request) -> bool:
        return request in self._left

    async def eligible(self, plan: list[Rows], alive: BoolArray) -> BoolArray:
        """Per entry of one group's ``plan``: whether it is a tracked load's and still going."""
        eligible = np.zeros(len(plan), dtype=bool)
        clock = LoopSlice()
        for j, rows in enumerate(plan):
            eligible[j] = alive[j] and rows.request in self._left
            await clock.tick()
        return eligible

    def entry_done(self, request: Request) -> None:
        """One of ``request``'s entries has its codes (every call carrying it returned): settle the
        load once none is left and none of its calls runs."""
        left = self._left.get(request)
        if left is None:
            return
        if left > 1:
            self._left[request] = left - 1
            return
        del self._left[request]
        if request.finished or request.running_calls:
            return
        sub_plan: Plan = [[] for _ in range(max(g for g, _ in self._entries[request]) + 1)]
        for group, rows in self._entries[request]:
            sub_plan[group].append(rows)
        self._unreadable.note_reads(sub_plan)  # as the batch's end would: a later store rewrites them
        self._tracker.settle(request)


class GroupCountdown:
    """For one group's calls: per plan entry the calls still to return, for the entries
    :class:`EarlyLoads` tracks; ``finish(j, error)`` is called once the last one has (``error``: the
    first error a call of the entry answered)."""

    __slots__ = ("_errors", "_finish", "_left")

    def __init__(
        self,
        eligible: BoolArray,
        entries_of_call: list[IntArray],
        finish: Callable[[int, BaseException | None], None],
    ) -> None:
        left = np.zeros(eligible.size, dtype=np.int64)
        for entries in entries_of_call:
            left[entries] += 1
        left[~eligible] = 0
        self._left = left
        self._errors: dict[int, BaseException] = {}
        self._finish = finish

    def call_returned(self, entries: IntArray, error: BaseException | None) -> None:
        left = self._left
        for j in entries.tolist():
            if left[j] <= 0:
                continue  # not tracked
            if error is not None:
                self._errors.setdefault(j, error)
            left[j] -= 1
            if left[j] == 0:
                self._finish(j, self._errors.pop(j, None))
