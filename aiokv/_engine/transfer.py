"""The transfer of one KV-cache group: the group's regions (one ``regions_for_chunks`` call), the
tracker's go-ahead for each request, the backend calls (split by :mod:`.call_split`), and each answer's
codes (:mod:`.answers`), which the tracker writes into the requests and the batch's shared outcomes.

Admission: a call goes only when a transfer thread is free for it, and only for the requests still
going then (the tracker's per-call go-ahead for each request the call carries); rows of requests
cancelled, timed out or finished while the call waited are dropped, so their memory is never touched,
and a call left with no row is not made at all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import BoolArray, IntArray
from ..codes import Code
from ..errors import AiokvError, WorkerClosedError
from ..layout import RegionBatch
from ..stats import Op, WorkerStats
from .answers import PressureBackoff, answer_codes, batch_error
from .batch import Cycle
from .call_split import Call, GroupRows, split_calls
from .config import EngineConfig
from .early_loads import EarlyLoads, GroupCountdown
from .lanes import Admitted, Lane, Lanes
from .plan import Rows
from .replicas import RetryingGet, monotonic_deadline, replica_reader
from .request import Request
from .shared_reads import cut_sources, read_then_copy
from .slices import LoopSlice
from .tracker import RequestTracker

_NO_ROWS: IntArray = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class Admission:
    """A call as it starts: the call cut to the rows that go (None: no row goes), the requests
    :meth:`RequestTracker.begin_call` counted in (to count out when it returns), and the rows dropped
    (indices into the group's rows)."""

    call: Call | None
    requests: list[Request]
    dropped_rows: IntArray


def admit(call: Call, rows: GroupRows, tracker: RequestTracker) -> Admission:
    """Ask the tracker about every request of ``call`` (each once) and cut the call to those going."""
    plan_of_row = rows.plan_of_row[call.rows]
    plan_indices = np.unique(plan_of_row)
    requests = [rows.plan[j].request for j in plan_indices.tolist()]
    going = np.array(tracker.begin_call(requests), dtype=bool)
    if going.all():  # the usual case: nothing to cut
        return Admission(call, requests, np.zeros(0, dtype=np.int64))
    admitted = [r for r, ok in zip(requests, going.tolist(), strict=True) if ok]
    keep = np.isin(plan_of_row, plan_indices[going])
    dropped = call.rows[~keep]
    if not admitted:
        return Admission(None, [], dropped)
    index = np.flatnonzero(keep)
    copy_from = None if call.copy_from is None else cut_sources(call.copy_from, index)
    cut = Call(call.op, call.rows[index], call.keys[index], call.addrs[index], call.sizes[index], copy_from)
    return Admission(cut, admitted, dropped)


class GroupTransfer:
    """Moves the rows one group's plan holds; shared by every batch of a worker."""

    def __init__(
        self,
        config: EngineConfig,
        lanes: Lanes,
        tracker: RequestTracker,
        stats: WorkerStats,
        backoff: PressureBackoff,
    ) -> None:
        self._config = config
        self._lanes = lanes
        self._tracker = tracker
        self._stats = stats
        self._backoff = backoff

    async def run(self, cycle: Cycle, group: int, plan: list[Rows], early: EarlyLoads | None = None) -> None:
        """Rows are the chunks of ``plan`` back to back; calls write per-row codes into one array, so
        a call costs a few NumPy operations however many requests its rows belong to. ``early``: the
        loads to settle as soon as their calls have returned (:mod:`.early_loads`)."""
        rows = await GroupRows.of(plan, group)
        row_codes = np.full(rows.size, Code.PENDING, dtype=np.int64)
        row_errors: list[tuple[IntArray, BaseException]] = []
        region_batches = await self._regions(rows, group, row_codes, row_errors)
        alive = await self._begin(cycle, plan)
        config = self._config
        live_rows = alive[rows.plan_of_row]
        calls = split_calls(
            rows, region_batches, live_rows, config.max_regions_per_call, config.transfer_threads
        )
        entries_of_call = await _entries_of_calls(calls, rows)
        offsets = rows.offsets.tolist()
        finished_early = np.zeros(len(plan), dtype=bool)
        countdown: GroupCountdown | None = None
        if early and not row_errors:
            eligible = await early.eligible(plan, alive)
            if eligible.any():

                def finish(j: int, error: BaseException | None) -> None:
                    entry = plan[j]
                    finished_early[j] = True
                    codes = row_codes[offsets[j] : offsets[j + 1]]
                    self._tracker.set_codes(entry.request, group, entry.chunks, codes)
                    if error is not None:
                        self._tracker.fail(entry.request, error)
                    early.entry_done(entry.request)

                countdown = GroupCountdown(eligible, entries_of_call, finish)
        await all_settled(
            self._call(call, entries, rows, row_codes, row_errors, countdown)
            for call, entries in zip(calls, entries_of_call, strict=True)
        )
        clock = LoopSlice()
        for j, r in enumerate(plan):
            await clock.tick()
            if alive[j] and not finished_early[j]:
                codes = row_codes[offsets[j] : offsets[j + 1]]
                if r.op is Op.PUT:
                    self._tracker.set_store_codes(cycle, r.request, group, r.chunks, r.positions, codes)
                else:
                    self._tracker.set_codes(r.request, group, r.chunks, codes)
        for failed_rows, error in row_errors:
            for j in np.unique(rows.plan_of_row[failed_rows]).tolist():
                await clock.tick()
                if not finished_early[j]:  # those were failed as their calls returned
                    self._tracker.fail(plan[j].request, error)

    async def _regions(
        self,
        rows: GroupRows,
        group: int,
        row_codes: IntArray,
        row_errors: list[tuple[IntArray, BaseException]],
    ) -> list[RegionBatch]:
        """The regions of every row (one ``regions_for_chunks`` call on the control lane); if that
        fails, every row fails with the error."""
        try:
            regions_for_chunks = self._config.layouts[group].regions_for_chunks
            return await self._lanes.run(Lane.CONTROL, regions_for_chunks, rows.blocks)
        except Exception as exc:
            error: AiokvError
            if isinstance(exc, WorkerClosedError):  # terminate() abandoned the computation
                error = batch_error(f"computing the regions of group {group}", exc)
            else:
                error = AiokvError(f"computing the regions of group {group} failed: {exc!r}")
                error.__cause__ = exc
            row_codes[:] = Code.BACKEND_EXCEPTION
            row_errors.append((np.arange(row_codes.size), error))
            return []

    async def _begin(self, cycle: Cycle, plan: list[Rows]) -> BoolArray:
        """Per plan entry, whether its request may still be transferred. Requests cancelled while the
        regions were computed get no call (the chunks they were to write for others fail
        ``WRITER_CANCELLED``); each call asks again when a thread is free for it (:func:`admit`)."""
        clock = LoopSlice()
        alive = np.empty(len(plan), dtype=bool)
        for j, r in enumerate(plan):
            ok = alive[j] = self._tracker.plan_transfer(r.request)
            if not ok and r.op is Op.PUT:
                self._tracker.set_outcome(cycle, r.positions, Code.WRITER_CANCELLED)
            await clock.tick()
        return alive

    async def _call(
        self,
        call: Call,
        entries: IntArray,
        rows: GroupRows,
        row_codes: IntArray,
        row_errors: list[tuple[IntArray, BaseException]],
        countdown: GroupCountdown | None,
    ) -> None:
        """One backend call (carrying the rows of plan entries ``entries``), then its countdown."""
        error: BaseException | None = None
        try:
            error = await self._one_call(call, entries, rows, row_codes, row_errors)
        finally:
            if countdown is not None:
                countdown.call_returned(entries, error)

    async def _one_call(
        self,
        call: Call,
        entries: IntArray,
        rows: GroupRows,
        row_codes: IntArray,
        row_errors: list[tuple[IntArray, BaseException]],
    ) -> BaseException | None:
        """One backend call, started only once a transfer thread is free for it and only for the
        requests still going then; its answer becomes codes as it arrives, so the loop never handles
        all calls at once. The error it added to ``row_errors``, if any."""
        admission: Admission | None = None
        retrying: RetryingGet | None = None
        tracker = self._tracker
        loop = asyncio.get_running_loop()  # its time() is readable from any thread

        def started(going: Call, requests: list[Request]) -> Admitted[object]:
            """The call to run and its end, for the requests counted in (the tracker's lock held)."""
            self._stats.backend_calls[going.op] += 1
            backend = self._config.backend
            method: Callable[[Sequence[str], Any, Any], Any] = (
                backend.batch_put if going.op is Op.PUT else backend.batch_get
            )
            read = replica_reader(backend) if going.op is Op.GET else None
            if read is not None:
                nonlocal retrying
                whens = [r.deadline_handle.when() for r in requests if r.deadline_handle is not None]
                method = retrying = RetryingGet(method, read, monotonic_deadline(whens, loop.time()))
            copy_from = going.copy_from
            if copy_from is not None:
                return (
                    lambda: read_then_copy(method, going.keys, going.addrs, going.sizes, copy_from),
                    lambda: tracker.end_call(requests),
                )
            return (
                lambda: method(going.keys.tolist(), going.addrs, going.sizes),  # a list for the call only
                lambda: tracker.end_call(requests),
            )

        call_requests = [rows.plan[j].request for j in entries.tolist()]

        def fast() -> Admitted[object] | None:
            """On the transfer thread, holding the tracker's lock: the whole call goes, or the loop
            decides (:meth:`gate`)."""
            nonlocal admission
            if not tracker.try_begin_call(call_requests):
                return None
            admission = Admission(call, call_requests, _NO_ROWS)
            return started(call, call_requests)

        def gate() -> Admitted[object] | None:
            nonlocal admission
            admission = admit(call, rows, tracker)
            row_codes[admission.dropped_rows] = Code.WRITER_CANCELLED
            going, requests = admission.call, admission.requests
            if going is None:
                return None
            with tracker.lock:  # the counters transfer threads also write
                return started(going, requests)

        answer: object
        try:
            answer = await self._lanes.run_transfer(fast, gate)
        except Exception as exc:
            if admission is None:  # terminate() failed it before it started
                row_codes[call.rows] = Code.BACKEND_EXCEPTION
                failed = batch_error(f"batch_{call.op.value}", exc)
                row_errors.append((call.rows, failed))
                return failed
            answer = exc
        if admission is None or admission.call is None:
            return None
        went = admission.call
        if retrying is not None and retrying.retried:
            self._stats.backend_calls[Op.REPLICA_GET] += 1
        codes, error = answer_codes(went.op, went.keys, went.sizes, answer, self._stats, self._backoff)
        row_codes[went.rows] = codes
        if error is not None:
            row_errors.append((went.rows, error))
        return error


async def _entries_of_calls(calls: list[Call], rows: GroupRows) -> list[IntArray]:
    """Per call, the plan entries whose rows it carries (in slices: a group can make 1,000 calls)."""
    clock = LoopSlice()
    entries = []
    for call in calls:
        entries.append(np.unique(rows.plan_of_row[call.rows]))
        await clock.tick()
    return entries


async def all_settled(coroutines: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Await every coroutine to its end, then raise the first error: a plain gather would hand an
    error on while other backend calls still run on the requests' memory."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
