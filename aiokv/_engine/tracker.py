"""``RequestTracker``: the one owner of every request's lifecycle and of its result data.

Result data: a request's per-chunk codes (``Request.codes``) and a batch's outcome for each store key
(``Cycle.outcome``, which requests of other batches take) are written only through the methods under
"result data" below; the other modules decide the codes and hand them here.

Invariants of the lifecycle (stated here once; nothing else writes these fields or settles a future):

1. A request is TRANSFERRING exactly while one of its backend calls runs (``running_calls > 0``):
   :meth:`RequestTracker.begin_call`, asked when a transfer thread is free to start a call, counts
   it in (or refuses a request cancelled, timed out or finished meanwhile: its rows are dropped from
   the call); :meth:`RequestTracker.end_call` counts it out when the thread has returned. Between
   calls, and while its calls wait for a thread, a request is QUEUED again. DONE is final.
2. A request is DONE exactly when its future is settled, and :meth:`_settle_future` is the only place
   that settles futures (result, exception or cancellation), updates the request counters and
   latencies, cancels the deadline and forgets the request.
3. A TRANSFERRING request is never settled by cancel, deadline, error or terminate: those are
   remembered (``cancel_requested``, ``timed_out``, ``error``: the first error wins). A cancel or
   deadline takes effect as soon as its last running call returns (:meth:`end_call`); an error in
   :meth:`settle`, which the pipeline calls once none of the request's calls runs (a request whose
   calls are planned keeps its error for then too, so its other groups go on). So a future is
   never done while a backend may still read or write the caller's memory.
4. A QUEUED request is settled at once by cancel, deadline, :meth:`fail` or :meth:`terminate`; the
   pipeline then sees it ``finished`` and skips it, and :meth:`begin_call` refuses it, so none of its
   calls that has not started ever starts.
5. A refusal by the circuit breaker (:meth:`refuse`, or :meth:`fail` with a
   :class:`~aiokv.errors._CircuitOpenError`) is an answer, not an error: a QUEUED request is settled at
   once (lookups 0; stores and loads a result whose undecided chunks failed ``UNAVAILABLE``), a
   TRANSFERRING one remembers it (``refused``) and is answered so when its calls have returned.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np

from .._arrays import BoolArray, IntArray
from ..codes import Code
from ..errors import TransferTimeoutError, _CircuitOpenError
from ..stats import Kind, WorkerStats
from .batch import Cycle
from .request import Request, State
from .summary import load_result, lookup_length, store_result

P = ParamSpec("P")
R = TypeVar("R")


Method = Callable[Concatenate["RequestTracker", P], R]
Chunks = IntArray | BoolArray | slice  # which chunks of a group, or positions of a batch, to write
Codes = IntArray | int
_PENDING = int(Code.PENDING)  # an int: NumPy given an enum member probes its class first (~1 us)


def _locked(method: Method[P, R]) -> Method[P, R]:
    """The method runs holding the tracker's lock (a transfer thread may be admitting a call)."""

    @functools.wraps(method)
    def locked(self: RequestTracker, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class RequestTracker:
    def __init__(self, stats: WorkerStats, chunk_tokens: int) -> None:
        self._stats = stats
        self._chunk_tokens = chunk_tokens
        self.active: set[Request] = set()  # submitted and not DONE
        # Held by every change of a request's lifecycle made on the loop, and by a transfer thread
        # admitting its next call itself (:meth:`try_begin_call`, :mod:`.transfer_threads`).
        self.lock = threading.RLock()

    # -- submit ---------------------------------------------------------------------------------

    def track(self, request: Request, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        """Start tracking a new QUEUED request, with its deadline ``timeout`` seconds from now."""
        if timeout is not None:
            request.deadline_handle = loop.call_later(timeout, self._on_deadline, request)
        self._stats.requests[request.kind] += 1
        self.active.add(request)

    # -- asked by the pipeline ------------------------------------------------------------------

    def plan_transfer(self, request: Request) -> bool:
        """The pipeline is about to plan backend calls for ``request``: False if it was cancelled,
        timed out or finished meanwhile (plan nothing for it). From then on an error is remembered
        for :meth:`settle`, so the request's other groups go on (cancel and deadline still bite)."""
        if request.abandoned:
            return False
        request.transfer_planned = True
        return True

    @_locked
    def begin_call(self, requests: Iterable[Request]) -> list[bool]:
        """A thread is free to run a call on these requests' memory (each once): per request, True
        if it goes (TRANSFERRING until :meth:`end_call`), False if it was cancelled, timed out or
        finished meanwhile (its rows must be dropped from the call)."""
        admitted = []
        for request in requests:
            ok = not request.abandoned
            if ok:
                request.running_calls += 1
                request.state = State.TRANSFERRING
            admitted.append(ok)
        return admitted

    def try_begin_call(self, requests: Sequence[Request]) -> bool:
        """On a transfer thread, holding :attr:`lock`: the whole call goes (every request counted in, as
        :meth:`begin_call` does) or, if any request was cancelled, timed out or finished meanwhile, none
        of it does (False: the loop then cuts the call, :meth:`begin_call`)."""
        if any(request.abandoned for request in requests):
            return False
        for request in requests:
            request.running_calls += 1
            request.state = State.TRANSFERRING
        return True

    @_locked
    def end_call(self, requests: Iterable[Request]) -> None:
        """The thread returned from a call :meth:`begin_call` admitted these requests to. A request
        with no call running any more is QUEUED again, and settled now if cancelled or timed out
        (its calls not yet started will be refused)."""
        for request in requests:
            request.running_calls -= 1
            if request.running_calls == 0 and not request.finished:
                request.state = State.QUEUED
                if request.cancel_requested or request.timed_out:
                    self.settle(request)

    @_locked
    def fail(self, request: Request, error: BaseException) -> None:
        """A step failed for ``request``: settle it now if no call of it is planned, else remember the
        error for :meth:`settle` (the first one wins)."""
        if request.finished:
            return
        if isinstance(error, _CircuitOpenError) or isinstance(error.__cause__, _CircuitOpenError):
            self.refuse(request)
            return
        if request.state is State.TRANSFERRING or request.transfer_planned:
            if request.error is None:
                request.error = error
        else:
            self._settle_future(request, error=error)

    @_locked
    def settle(self, request: Request) -> None:
        """Finish a request none of whose backend calls runs any more, from what happened to it:
        cancelled, timed out, failed, or its result built from its per-chunk codes."""
        if request.finished:
            return
        if request.cancel_requested:
            self._settle_future(request, cancelled=True)
        elif request.timed_out:
            message = f"{request.kind.value} #{request.id} passed its deadline during the transfer"
            self._settle_future(request, error=TransferTimeoutError(message))
        elif request.error is not None:
            self._settle_future(request, error=request.error)
        elif request.refused:
            self._settle_refused(request)
        elif request.kind is Kind.STORE:
            self._settle_future(request, value=store_result(request.codes, self._stats))
        elif request.kind is Kind.LOAD:
            value = load_result(request.codes, request.blocks, self._chunk_tokens, self._stats)
            self._settle_future(request, value=value)
        else:
            self._settle_future(request, value=lookup_length(request.codes, self._chunk_tokens))

    def finish_lookup(self, request: Request, length: int) -> None:
        """A lookup answered without a batch (an empty prompt)."""
        self._settle_future(request, value=length)

    @_locked
    def refuse(self, request: Request) -> None:
        """The circuit breaker is open: answer ``request`` now, or when its running calls return."""
        if request.finished:
            return
        if request.state is State.TRANSFERRING:
            request.refused = True  # honoured by settle() once its calls have returned
        else:
            self._settle_refused(request)

    def queued(self) -> list[Request]:
        """The requests no backend call is using now (what a refusal may answer at once)."""
        return [request for request in self.active if request.state is State.QUEUED]

    def _settle_refused(self, request: Request) -> None:
        """Lookups: 0 hits. Stores and loads: the chunks still undecided fail ``UNAVAILABLE``
        (chunks already decided keep their outcome); blocks never touched by a refused call."""
        if request.kind is Kind.LOOKUP:
            self._settle_future(request, value=0)
            return
        undecided = [int(Code.PENDING), int(Code.BACKEND_EXCEPTION)]
        if request.codes:
            request.codes = tuple(
                np.where(np.isin(codes, undecided), int(Code.UNAVAILABLE), codes) for codes in request.codes
            )
        else:
            request.codes = tuple(np.full(request.num_chunks, int(Code.UNAVAILABLE)) for _ in request.blocks)
        request.refused = False
        self.settle(request)

    # -- result data: per-chunk codes and a batch's outcomes, written here only ----------------------

    def open_codes(self, request: Request, groups: int) -> None:
        """Give ``request`` its per-group codes, every chunk PENDING (as its keys are built)."""
        request.codes = tuple(np.full(request.num_chunks, _PENDING, dtype=np.int64) for _ in range(groups))

    def set_codes(self, request: Request, group: int, chunks: Chunks, codes: Codes) -> None:
        request.codes[group][chunks] = codes

    def set_outcome(self, cycle: Cycle, positions: Chunks, codes: Codes) -> None:
        """The outcome of the batch's store keys at ``positions`` (what requests waiting on them take)."""
        cycle.outcome[positions] = codes

    def set_store_codes(
        self, cycle: Cycle, request: Request, group: int, chunks: Chunks, positions: Chunks, codes: Codes
    ) -> None:
        """Codes of store chunks ``request`` decides for the batch: its own, and the batch's outcome of
        their keys."""
        request.codes[group][chunks] = codes
        cycle.outcome[positions] = codes

    def take_outcomes(self, request: Request, group: int, chunks: IntArray, outcome: IntArray) -> None:
        """Chunks another request wrote: present if that write succeeded, else its failure."""
        request.codes[group][chunks] = np.where(outcome >= 0, Code.PRESENT, outcome)

    def publish(self, cycle: Cycle) -> None:
        """Mark every outcome of ``cycle`` final: a claimed key nobody wrote went away with its writer."""
        cycle.outcome[cycle.owned & (cycle.outcome == Code.PENDING)] = Code.WRITER_CANCELLED
        if not cycle.outcomes_ready.done():
            cycle.outcomes_ready.set_result(None)

    def answer_lookup(self, request: Request, present: BoolArray) -> None:
        """A lookup's codes from the presence of the batch's keys; then its answer."""
        request.codes = tuple(present[p].astype(np.int64) for p in request.positions)
        self.settle(request)

    def finish_empty(self, request: Request, groups: int) -> None:
        """A store or load of no whole chunk, answered without a batch."""
        self.open_codes(request, groups)  # no chunk
        self.settle(request)

    # -- asked by the user and the worker -------------------------------------------------------

    @_locked
    def cancel(self, request: Request) -> bool:
        """``TransferFuture.cancel``: at once if no call may run, else when the calls return."""
        if request.finished:
            return False
        if request.state is State.TRANSFERRING:
            request.cancel_requested = True  # honoured when its running calls return (end_call)
        else:
            self._settle_future(request, cancelled=True)
        return True

    @_locked
    def terminate(self, error: BaseException) -> None:
        """Fail every request no backend call may touch; the transferring ones end with their calls."""
        for request in list(self.active):
            if request.state is State.QUEUED:
                self._settle_future(request, error=error)

    @_locked
    def _on_deadline(self, request: Request) -> None:
        request.deadline_handle = None
        if request.finished:
            return
        if request.state is State.TRANSFERRING:
            request.timed_out = True  # honoured when its running calls return (end_call)
        else:
            message = f"{request.kind.value} #{request.id} timed out before it ran"
            self._settle_future(request, error=TransferTimeoutError(message))

    # -- the one place futures are settled ------------------------------------------------------

    def _settle_future(
        self,
        request: Request,
        *,
        value: object = None,
        error: BaseException | None = None,
        cancelled: bool = False,
    ) -> None:
        if request.finished:
            return
        request.state = State.DONE
        self.active.discard(request)
        if request.deadline_handle is not None:
            request.deadline_handle.cancel()
            request.deadline_handle = None
        kind = request.kind
        self._stats.record_latency(kind, time.perf_counter() - request.submitted)
        if cancelled:
            self._stats.requests_cancelled[kind] += 1
            request.future._set_cancelled()
        elif error is not None:
            self._stats.requests_failed[kind] += 1
            request.future._set_exception(error)
        else:
            request.future._set_result(value)
