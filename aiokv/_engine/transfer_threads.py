"""The transfer lane's threads: each takes its next call itself, admitting it under the tracker's lock.

A call waited for a free thread on the loop, then the loop admitted it (``RequestTracker.begin_call``)
and handed it to the thread: two wake-ups per call (thread -> loop, loop -> thread) each time a thread
moved from one call to the next, a cost paid once per call that adds up over a batch of many calls.
Here a free thread takes the next queued call and asks its ``fast`` admission on the thread, under the
lock every loop-side change of a request's lifecycle takes (:attr:`RequestTracker.lock`): either every
request of the call goes (TRANSFERRING from then on) or ``fast`` declines, and the thread asks the
call's full ``gate`` on the loop, as before (a request cancelled or timed out meanwhile is cut from the
call there; the circuit breaker answers there). So the guarantees stay: a request cancelled while its
call waits never has it started; a request is TRANSFERRING exactly while one of its calls runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._thread_names import name_this_thread
from ..errors import WorkerClosedError

# What an admission hands back when the call may start: the call, and what to run on the loop once the
# thread has returned from it (the same shape as :data:`aiokv._engine.lanes.Admitted`).
Started = tuple[Callable[[], Any], Callable[[], None]]

_HANDOFF_POLL_S = 0.5  # how often a thread waiting for the loop's answer checks that the loop is alive


@dataclass(slots=True)
class TransferItem:
    """A call queued for a transfer thread. ``fast``: on the thread, under the lock; None declines.
    ``gate``: on the loop (the worker's full admission: terminated, breaker, then the call's gate)."""

    fast: Callable[[], Started | None] | None
    gate: Callable[[], Started | None]
    outcome: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Shared:
    """What the threads share with their owner (never the owner itself: an abandoned worker's threads
    end once it is collected)."""

    queue: queue.SimpleQueue[TransferItem | None]
    lock: threading.RLock
    terminated: bool = False  # written under the lock: no thread starts a call after it is set


class TransferThreads:
    """``count`` threads serving one queue of :class:`TransferItem` (started on first use)."""

    def __init__(self, count: int, lock: threading.RLock, name_prefix: str = "aiokv-transfer") -> None:
        self._count = count
        self._name_prefix = name_prefix
        self._shared = _Shared(queue.SimpleQueue(), lock)
        self._threads: list[threading.Thread] = []
        # Dropped without shutdown (its loop died): the threads still end.
        weakref.finalize(self, _stop, self._shared.queue, self._threads)

    def submit(self, item: TransferItem) -> None:
        if not self._threads:
            for index in range(self._count):
                name = f"{self._name_prefix}_{index}"
                thread = threading.Thread(target=_serve, args=(self._shared, name), name=name)
                thread.start()
                self._threads.append(thread)
        self._shared.queue.put(item)

    def terminate(self) -> None:
        """On the loop: no call starts any more; calls still queued fail with ``WorkerClosedError``."""
        shared = self._shared
        with shared.lock:
            shared.terminated = True
        while True:
            try:
                item = shared.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _fail_closed(item.outcome)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """The threads end once the queue before them is served (``cancel_futures``: terminate first)."""
        if cancel_futures:
            self.terminate()
        _stop(self._shared.queue, self._threads)
        if wait:
            for thread in self._threads:
                thread.join()


def _stop(work: queue.SimpleQueue[TransferItem | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        work.put(None)


def _serve(shared: _Shared, name: str) -> None:
    name_this_thread(name)
    while (item := shared.queue.get()) is not None:
        if item.outcome.done():  # its awaiter was cancelled while it waited: nothing was admitted
            continue
        with shared.lock:
            if shared.terminated:
                _tell(item.loop, _fail_closed, item.outcome)
                continue
            started = item.fast() if item.fast is not None else None
        if started is None:
            started = _ask_loop(item)
            if started is None:
                continue
        call, on_end = started
        result: Any = None
        error: BaseException | None = None
        try:
            result = call()
        except BaseException as exc:  # handed to the awaiter, as an executor would
            error = exc
        _tell(item.loop, _ended, item.outcome, on_end, result, error)
        del item, started, call, on_end, result, error


def _ask_loop(item: TransferItem) -> Started | None:
    """The full admission, on the loop; the thread waits for its answer (None: nothing to run)."""
    answer: concurrent.futures.Future[Started | None] = concurrent.futures.Future()
    if not _tell(item.loop, _gate_on_loop, item, answer):
        return None
    while True:
        try:
            return answer.result(timeout=_HANDOFF_POLL_S)
        except concurrent.futures.TimeoutError:
            if item.loop.is_closed():
                return None


def _tell(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
        loop.call_soon_threadsafe(callback, *args)
        return True
    return False


def _fail_closed(outcome: asyncio.Future[Any]) -> None:
    if not outcome.done():
        outcome.set_exception(WorkerClosedError("the worker was terminated before the call ran"))


def _gate_on_loop(item: TransferItem, answer: concurrent.futures.Future[Started | None]) -> None:
    outcome = item.outcome
    if outcome.done():
        answer.set_result(None)
        return
    try:
        started = item.gate()
    except BaseException as exc:
        outcome.set_exception(exc)
        answer.set_result(None)
        return
    if started is None:
        outcome.set_result(None)
    answer.set_result(started)


def _ended(
    outcome: asyncio.Future[Any], on_end: Callable[[], None], result: Any, error: BaseException | None
) -> None:
    on_end()
    if outcome.done():  # its awaiter was cancelled meanwhile
        return
    if error is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(result)
