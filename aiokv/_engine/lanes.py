"""Executor lanes: the threads backend calls run on.

Three lanes, so that lookups and the next batch's checks never queue behind long or hung transfers,
and a lookup never queues behind a batch's checks: ``TRANSFER`` (``executor_threads`` threads: batch
puts and gets, register), ``CONTROL`` (one daemon thread: a batch's existence checks and address
computation, which hold no caller memory) and ``LOOKUP`` (one daemon thread: the existence checks of
lookups, a few keys each, answered while a batch's 62,500-key check or 10,000 requests' regions are
still being computed).

A call's go-ahead is asked only when a thread of its lane is free for it, so a request cancelled or
timed out while its calls wait never has them started: a control or lookup call waits for its thread
on the loop (:meth:`Lanes.run_gated`); a transfer thread takes its next call itself and admits it
under the tracker's lock, or asks the loop when it cannot (:meth:`Lanes.run_transfer`,
:mod:`.transfer_threads`). On :meth:`Lanes.terminate`, calls waiting for
a thread fail with ``WorkerClosedError``; running transfer calls finish (they may touch caller
memory); a running control or lookup call is abandoned: its awaiter fails at once, its thread
finishes the call in the background and its result is dropped (a daemon thread, so not even
interpreter exit waits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from .._thread_names import name_this_thread
from ..errors import WorkerClosedError
from .slices import PIECE_KEYS, LoopSlice, pieces
from .transfer_threads import TransferItem, TransferThreads

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

Items = Sequence[K] | npt.NDArray[np.object_]  # a sequence, or an object array of them

# What a gate hands back when the call may start: the call itself, and what to do on the loop once
# the thread has returned from it (whatever happened to the coroutine awaiting it).
Admitted = tuple[Callable[[], T], Callable[[], None]]


class Lane(enum.Enum):
    CONTROL = "control"
    LOOKUP = "lookup"
    TRANSFER = "transfer"


_ABANDONABLE = (Lane.CONTROL, Lane.LOOKUP)  # daemon threads, holding no caller memory

# Keys per existence check (:meth:`Lanes.run_pieces`): a thread holds the GIL for a whole call, ~0.6-1.3
# ms for this many keys on the embedded backend (a 62,500-key prompt: 8 calls instead of one of 5-10 ms).
EXISTS_PIECE_KEYS = 8192


class Lanes:
    def __init__(
        self,
        transfer_threads: int,
        admit: Callable[[], BaseException | None] | None = None,
        *,
        lock: threading.RLock | None = None,
        admits_on_thread: Callable[[], bool] | None = None,
    ) -> None:
        # admit: asked on the loop once a thread is free for a call; an exception refuses the call (the
        # circuit breaker: calls that waited for a thread while the store went away are not sent).
        # admits_on_thread: the same question, thread-safe, asked by a transfer thread before a call's
        # fast admission (False: the call is admitted on the loop, where ``admit`` answers).
        # lock: the tracker's, held by a transfer thread admitting a call (:mod:`.transfer_threads`).
        self._admit = admit
        self._admits_on_thread = admits_on_thread
        self._transfer = TransferThreads(transfer_threads, lock if lock is not None else threading.RLock())
        self._executors: dict[Lane, Any] = {
            Lane.TRANSFER: self._transfer,
            Lane.CONTROL: DaemonThread("aiokv-control_0"),
            Lane.LOOKUP: DaemonThread("aiokv-lookup_0"),
        }
        self._slots = {Lane.CONTROL: Slots(1), Lane.LOOKUP: Slots(1)}
        self._abandonable: set[asyncio.Future[Any]] = set()  # control and lookup calls awaited now
        self._terminated = False

    @property
    def terminated(self) -> bool:
        return self._terminated

    async def run(self, lane: Lane, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``lane``; after :meth:`terminate`, raises ``WorkerClosedError`` instead."""
        answer = await self.run_gated(lane, lambda: (lambda: fn(*args), _nothing))
        return answer  # type: ignore[return-value]  # an ungated call always runs

    async def run_pieces(
        self, lane: Lane, fn: Callable[[Sequence[K]], Sequence[V]], items: Items[K], size: int
    ) -> list[V]:
        """``fn(items)`` as calls of at most ``size`` items, one after the other, answers joined. A
        backend method written in Python holds the GIL for its whole call (``batch_exists`` of 62,500
        keys on the embedded backend: 5-10 ms); between two pieces its thread waits for the loop to
        send the next, so the loop gets the GIL back at least that often."""
        answer: list[V] = []
        for start in range(0, len(items), size):
            answer += await self.run(lane, fn, _as_list(items[start : start + size]))
        return answer

    async def run_pieces_on_loop(
        self, fn: Callable[[Sequence[K]], Sequence[V]], items: Items[K], size: int = PIECE_KEYS
    ) -> list[V]:
        """``fn(items)`` on the loop itself, for a backend method that answers at once (the embedded
        backend's ``batch_exists``): no thread hand-off, in calls of at most ``size`` items with a
        tick of the loop's slice clock between them. After :meth:`terminate`, raises
        ``WorkerClosedError`` instead."""
        answer: list[V] = []
        clock = LoopSlice()
        for part in pieces(len(items), size):
            if self._terminated:
                raise WorkerClosedError("the worker was terminated before the call ran")
            answer += fn(_as_list(items[part]))
            await clock.tick()
        return answer

    async def run_gated(self, lane: Lane, gate: Callable[[], Admitted[T] | None]) -> T | None:
        """Wait for a free thread of ``lane``, then ask ``gate`` (on the loop) what to run: None
        starts nothing (and answers None); else its call runs, and its end callback runs on the loop
        once the thread returns from it.

        A call waiting for a thread is started by the callback in which the thread's previous call
        ends (one hop from the thread to the loop, no turn of the loop in between): the thread waits
        for the loop once per call, not for the awaiting task to be scheduled as well."""
        if lane is Lane.TRANSFER:
            return await self.run_transfer(None, gate)
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[T | None] = loop.create_future()
        pending = _Pending(gate, outcome)
        if self._slots[lane].take(pending) and not self._start(lane, pending):
            self._hand_on(lane)
        try:
            return await outcome
        except asyncio.CancelledError:
            # terminate() cancels the control and lookup calls awaited now (abandoned) and drops calls still
            # queued in an executor: they fail like a call that raised, instead of cancelling the
            # batch awaiting them (which would leave its requests unfinished forever).
            task = asyncio.current_task()
            if self._terminated and outcome.cancelled() and (task is None or not task.cancelling()):
                raise WorkerClosedError("the worker was terminated before the call returned") from None
            raise
        finally:
            self._abandonable.discard(outcome)

    async def run_transfer(
        self, fast: Callable[[], Admitted[T] | None] | None, gate: Callable[[], Admitted[T] | None]
    ) -> T | None:
        """A call on a transfer thread (:mod:`.transfer_threads`): the thread that takes it asks
        ``fast`` (on the thread, holding the tracker's lock; None declines), else ``gate`` on the loop
        as :meth:`run_gated` does; answers as :meth:`run_gated`."""
        if self._terminated:
            raise WorkerClosedError("the worker was terminated before the call ran")
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[T | None] = loop.create_future()
        on_thread = self._admits_on_thread

        def fast_admission() -> Admitted[T] | None:
            if fast is None or (on_thread is not None and not on_thread()):
                return None
            return fast()

        def full_gate() -> Admitted[T] | None:
            if self._terminated:
                raise WorkerClosedError("the worker was terminated before the call ran")
            refusal = self._admit() if self._admit is not None else None
            if refusal is not None:
                raise refusal
            return gate()

        self._transfer.submit(TransferItem(fast_admission, full_gate, outcome, loop))
        return await outcome

    def _start(self, lane: Lane, pending: _Pending[Any]) -> bool:
        """``pending`` holds a slot of ``lane``: ask its gate and submit its call. False: nothing was
        submitted, and the slot is free again."""
        outcome = pending.outcome
        try:
            if self._terminated:  # terminated between the slot's release and now
                raise WorkerClosedError("the worker was terminated before the call ran")
            refusal = self._admit() if self._admit is not None else None
            if refusal is not None:
                raise refusal
            admitted = pending.gate()
        except BaseException as exc:
            if not outcome.done():
                outcome.set_exception(exc)
            return False
        if admitted is None:
            if not outcome.done():
                outcome.set_result(None)
            return False
        call, on_end = admitted
        loop = asyncio.get_running_loop()

        def ended(done: concurrent.futures.Future[T]) -> None:
            self._hand_on(lane)  # first: the next call's thread is idle until then
            on_end()
            if outcome.done():  # cancelled meanwhile
                return
            if done.cancelled():
                outcome.cancel()
            elif (error := done.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(done.result())

        def returned(done: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(ended, done)

        done = self._executors[lane].submit(call)
        done.add_done_callback(returned)
        # A cancelled awaiter (terminate(), or its task) drops the call if it has not started yet.
        outcome.add_done_callback(lambda f: done.cancel() if f.cancelled() else None)
        if lane in _ABANDONABLE:
            self._abandonable.add(outcome)
        return True

    def _hand_on(self, lane: Lane) -> None:
        """A slot of ``lane`` is free: start the next waiting call on it, or keep it free."""
        slots = self._slots[lane]
        while (pending := slots.release()) is not None:
            if self._start(lane, pending):
                return

    def terminate(self) -> None:
        """Take no more calls; fail those waiting for a thread; abandon running control and lookup
        calls; running transfer calls finish."""
        self._terminated = True
        for slots in self._slots.values():
            slots.fail_waiters()
        for future in list(self._abandonable):
            future.cancel()
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    async def shutdown(self) -> None:
        """Wait for every transfer thread to end (on a helper thread: the loop keeps running); the
        control and lookup threads are joined unless they still run an abandoned call."""
        await asyncio.to_thread(self._executors[Lane.TRANSFER].shutdown, wait=True)
        for lane in _ABANDONABLE:
            daemon: DaemonThread = self._executors[lane]
            await asyncio.to_thread(daemon.shutdown, wait=daemon.idle)

    def shutdown_now(self) -> None:
        """Blocking shutdown, for a start that failed before anything ran on the lanes."""
        for executor in self._executors.values():
            executor.shutdown(wait=True)


def _as_list(items: Items[K]) -> list[K]:
    """What a backend call takes: a list (a batch keeps its keys in an object array)."""
    if isinstance(items, list):
        return items
    if isinstance(items, np.ndarray):
        return items.tolist()  # type: ignore[no-any-return]
    return list(items)


def _nothing() -> None:
    pass


@dataclass(slots=True)
class _Pending(Generic[T]):
    """A call waiting for a thread: its gate, and the future its awaiter waits on."""

    gate: Callable[[], Admitted[T] | None]
    outcome: asyncio.Future[T | None]


class Slots:
    """The free threads of a lane, handed out on the loop in the order asked for."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiters: deque[_Pending[Any]] = deque()
        self._failed = False

    def take(self, pending: _Pending[Any]) -> bool:
        """True: a slot is ``pending``'s now. False: it waits, and :meth:`release` hands it one."""
        if self._failed:
            raise WorkerClosedError("the worker was terminated before the call ran")
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        self._waiters.append(pending)
        return False

    def release(self) -> _Pending[Any] | None:
        """A slot is free: the first waiter still awaited gets it (returned), else it stays free."""
        while self._waiters:
            pending = self._waiters.popleft()
            if not pending.outcome.done():  # a cancelled awaiter is skipped
                return pending
        self._free += 1
        return None

    def fail_waiters(self) -> None:
        self._failed = True
        while self._waiters:
            outcome = self._waiters.popleft().outcome
            if not outcome.done():
                outcome.set_exception(WorkerClosedError("the worker was terminated before the call ran"))


_Work = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class DaemonThread:
    """A one-thread executor on a daemon thread: a call that never returns (a frozen store) can be
    abandoned, and neither close() nor interpreter exit waits for it."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._pending = 0  # submitted and not yet done
        self._lock = threading.Lock()  # _pending changes on the loop and on the thread
        self._thread = threading.Thread(target=_serve, args=(self._queue, name), name=name, daemon=True)
        self._thread.start()
        # An executor dropped without shutdown (its loop died) still lets its thread end.
        weakref.finalize(self, self._queue.put, None)

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
        future.add_done_callback(self._done)
        self._queue.put((future, fn))
        return future

    def _done(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        # cancel_futures: the loop cancels what it abandons; a cancelled future is skipped by _serve.
        self._queue.put(None)
        if wait:
            self._thread.join()


def _serve(work: queue.SimpleQueue[_Work | None], name: str) -> None:
    name_this_thread(name)
    while (item := work.get()) is not None:
        future, fn = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        del future, fn
