"""``ThreadedKVWorker``: the worker for an engine's synchronous threads.

It runs a :class:`~aiokv.worker.KVWorker` on an event loop in a background thread and hands out
:class:`concurrent.futures.Future` objects, which keep the same promise as ``TransferFuture``: done
only once no backend touches the request's memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Generic, TypeVar

from ._thread_names import name_this_thread
from ._validate import BlockIds
from .backends.base import Backend
from .errors import WorkerClosedError
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, TokenIds
from .layout import KVLayout
from .results import LoadResult, StoreResult
from .runner import new_event_loop
from .worker import KVWorker

T = TypeVar("T")


class SyncTransferFuture(concurrent.futures.Future[T], Generic[T]):
    """A ``concurrent.futures.Future`` whose ``cancel()`` follows TransferFuture's rules.

    ``cancel()`` of a request inside a backend call returns True but the future completes (cancelled)
    only when that call returns, so ``done()`` never turns True while the memory is in use.

    ``request_id`` is the request's id once the loop has taken it (None until then: the futures of
    ``store_many`` / ``load_many`` are handed out before).
    """

    def __init__(self, owner: ThreadedKVWorker) -> None:
        super().__init__()
        self._owner = owner
        self._transfer: TransferFuture[T] | None = None
        self._cancel_when_attached = False
        self.request_id: int | None = None

    def cancel(self) -> bool:
        if self.done():
            return False
        return self._owner._call(self._cancel_on_loop)

    def _attach(self, transfer: TransferFuture[T]) -> None:
        """On the loop thread: the transfer this future follows."""
        self._transfer = transfer
        self.request_id = transfer.request_id
        transfer.add_done_callback(self._settle)
        if transfer.done():  # settled at the call (nothing to move)
            self._settle(transfer)
        elif self._cancel_when_attached:
            self._cancel_on_loop()

    def _cancel_on_loop(self) -> bool:
        transfer = self._transfer
        if transfer is None:  # cancelled on the loop thread before the loop took its request
            self._cancel_when_attached = True
            return True
        cancelled = transfer.cancel()
        if transfer.done():  # settled at once: done() is True when cancel() returns
            self._settle(transfer)
        return cancelled

    def _settle(self, transfer: TransferFuture[T]) -> None:
        """Runs on the loop thread when the transfer is done (once; later calls change nothing)."""
        if self.done():
            return
        if transfer.cancelled():
            concurrent.futures.Future.cancel(self)
            self.set_running_or_notify_cancel()
            return
        error = transfer.exception()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(transfer.result())


class ThreadedKVWorker:
    """Same arguments as :class:`KVWorker`; methods are plain blocking calls safe from any thread.

    ``store``/``load`` return at once with a :class:`SyncTransferFuture`; bad arguments raise at the
    call. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        layouts: Sequence[KVLayout] | KVLayout,
        backend: Backend,
        *,
        namespace: KeyNamespace | str,
        chunk_tokens: int | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        **options: Any,
    ) -> None:
        self._loop = (loop_factory or new_event_loop)()
        self._thread = threading.Thread(target=self._run_loop, name="aiokv-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()  # orders scheduling onto the loop against stopping it
        self._stopping = False  # set (under the lock) before the loop is told to stop
        self._closing = False  # a close() or terminate() has begun
        self._stopped = threading.Event()  # the loop thread has ended and the loop is closed
        self._waiting: set[concurrent.futures.Future[Any]] = set()  # callers blocked on the loop
        try:
            self._worker = KVWorker(
                layouts, backend, namespace=namespace, chunk_tokens=chunk_tokens, **options
            )
            self._run(self._worker.start())
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> ThreadedKVWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker(self) -> KVWorker:
        return self._worker

    def store(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> SyncTransferFuture[StoreResult]:
        return self._submit(self._worker.store, tokens, block_ids, timeout)

    def load(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> SyncTransferFuture[LoadResult]:
        return self._submit(self._worker.load, tokens, block_ids, timeout)

    def store_many(
        self, requests: Iterable[tuple[TokenIds | HashedPrompt, BlockIds]], *, timeout: float | None = None
    ) -> list[SyncTransferFuture[StoreResult]]:
        """:meth:`store` for several requests, without waiting for the worker's loop: :meth:`store`
        waits for the loop thread to take its request (to raise on bad arguments at the call), about a
        millisecond, more while other Python threads hold the GIL; an engine submitting every request
        of a step from its own thread calls this.

        One future per request, in order, handed out at once; the loop takes the requests soon after,
        in this order. A request whose arguments are refused gets its future failed with that error
        (``InvalidRequestError``/``TypeError``); the others are submitted. A worker closing or closed
        raises ``WorkerClosedError`` here, as :meth:`store` does."""
        return self._submit_many(self._worker.store, list(requests), timeout)

    def load_many(
        self, requests: Iterable[tuple[TokenIds | HashedPrompt, BlockIds]], *, timeout: float | None = None
    ) -> list[SyncTransferFuture[LoadResult]]:
        """:meth:`load` for several requests, without waiting for the worker's loop; as
        :meth:`store_many`."""
        return self._submit_many(self._worker.load, list(requests), timeout)

    def lookup(self, tokens: TokenIds | HashedPrompt, *, timeout: float | None = None) -> int:
        return self._run(self._worker.lookup(tokens), timeout)

    def lookup_many(self, prompts: Iterable[TokenIds | HashedPrompt]) -> list[concurrent.futures.Future[int]]:
        """:meth:`lookup` without blocking, not even for the worker's loop to take the prompts: one
        future per prompt, in order, answering its hit in tokens or raising what
        :meth:`KVWorker.lookup` raised (a refused prompt's future fails with that error). Cancelling a
        future cancels its lookup. A worker closing or closed raises ``WorkerClosedError`` here; one
        that closes first fails the futures with it."""
        wanted = list(prompts)
        futures: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in wanted]

        def start_all() -> None:
            for future, tokens in zip(futures, wanted, strict=True):
                if future.cancelled():  # by its caller, before the loop took it
                    with self._lock:
                        self._waiting.discard(future)
                    continue
                self._answer(future, self._loop.create_task(self._worker.lookup(tokens)))

        self._post(start_all, futures)  # in the waiting set until settled: a stopping loop fails them
        return futures

    def lookup_loaded(self, tokens: TokenIds | HashedPrompt) -> None:
        """:meth:`KVWorker.lookup_loaded` without waiting for the loop to take it (token ids are
        hashed here, on the calling thread). A worker closing or closed raises ``WorkerClosedError``."""
        chunk_tokens = self._worker.chunk_tokens
        prompt = (
            tokens if isinstance(tokens, HashedPrompt) else HashedPrompt.from_tokens(tokens, chunk_tokens)
        )
        self._post(functools.partial(self._worker.lookup_loaded, prompt), [])

    def _answer(self, future: concurrent.futures.Future[int], task: asyncio.Task[int]) -> None:
        """Settle ``future`` from ``task`` (on the loop thread); cancelling the future cancels the task."""

        def settle(done: asyncio.Task[int]) -> None:
            with self._lock:
                self._waiting.discard(future)
            if future.done() or not future.set_running_or_notify_cancel():
                return  # cancelled by its caller
            if done.cancelled():
                future.set_exception(WorkerClosedError("the lookup was cancelled by the worker's close"))
            elif (exc := done.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())

        def cancelled(_: concurrent.futures.Future[int]) -> None:
            if future.cancelled():
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to cancel
                    self._loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(settle)
        future.add_done_callback(cancelled)

    def stats(self) -> dict[str, Any]:
        return self._call(self._worker.stats)

    def stats_soon(self) -> concurrent.futures.Future[dict[str, Any]]:
        """:meth:`stats` without waiting for the worker's loop: a future the loop thread answers when it
        next runs, so a thread that asks every step (an engine's) never waits behind the loop's work.
        A worker closing or closed raises ``WorkerClosedError`` here; one that closes first fails the
        future with it."""
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def take() -> None:
            with self._lock:
                self._waiting.discard(future)
            _fill(future, self._worker.stats)

        self._post(take, [future])  # in the waiting set until answered: a stopping loop fails it
        return future

    def close(self, timeout: float | None = None) -> None:
        """Graceful close (see :meth:`KVWorker.close`), then stop the loop thread.

        Safe from any thread but the worker's own loop thread (a future's done callback runs there):
        there it raises ``RuntimeError`` and leaves the worker as it was. A second close, from any
        thread, returns once the first has finished.
        """
        self._refuse_on_loop_thread("close")
        if not self._begin_closing():
            self._stopped.wait()
            return
        try:
            self._run(self._worker.close(timeout))
        finally:
            self._stop_loop()

    def terminate(self) -> None:
        """Immediate close (see :meth:`KVWorker.terminate`); waits for in-flight backend calls."""
        self._refuse_on_loop_thread("terminate")
        if not self._begin_closing():
            with contextlib.suppress(WorkerClosedError):  # a close in progress: hurry it
                self._call(self._worker.terminate)
            self._stopped.wait()
            return
        try:
            self._call(self._worker.terminate)
            self._run(self._worker.wait_closed())
        finally:
            self._stop_loop()

    # -- internals ------------------------------------------------------------------------------

    def _submit(
        self,
        method: Callable[..., TransferFuture[T]],
        tokens: TokenIds | HashedPrompt,
        block_ids: BlockIds,
        timeout: float | None,
    ) -> SyncTransferFuture[T]:
        future: SyncTransferFuture[T] = SyncTransferFuture(self)
        self._call(lambda: future._attach(method(tokens, block_ids, timeout=timeout)))
        return future

    def _submit_many(
        self,
        method: Callable[..., TransferFuture[T]],
        requests: list[tuple[TokenIds | HashedPrompt, BlockIds]],
        timeout: float | None,
    ) -> list[SyncTransferFuture[T]]:
        futures: list[SyncTransferFuture[T]] = [SyncTransferFuture(self) for _ in requests]

        def submit_all() -> None:
            with self._lock:  # from here on each settles from its transfer, or now
                self._waiting.difference_update(futures)
            for future, (tokens, block_ids) in zip(futures, requests, strict=True):
                try:
                    future._attach(method(tokens, block_ids, timeout=timeout))
                except Exception as exc:  # refused arguments (or the worker closing meanwhile): this one
                    future.set_exception(exc)

        self._post(submit_all, futures)
        return futures

    def _run_loop(self) -> None:
        name_this_thread("aiokv-loop")
        self._loop.run_forever()

    def _post(self, fn: Callable[[], None], futures: Sequence[concurrent.futures.Future[Any]]) -> None:
        """Schedule ``fn`` on the loop thread without waiting for it; ``futures`` are failed by
        :meth:`_stop_loop` if the loop stops first. Raises ``WorkerClosedError`` once closing."""
        on_loop_thread = threading.current_thread() is self._thread
        with self._lock:
            if self._closing:
                raise WorkerClosedError("the threaded worker is closed")
            if not on_loop_thread:
                self._waiting.update(futures)
                self._loop.call_soon_threadsafe(fn)
        if on_loop_thread:  # a done callback submitting more: the loop is this thread
            fn()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread and return its result (or raise its exception) here; raises
        ``WorkerClosedError`` once the loop is stopping, and never waits on a stopped loop."""
        if threading.current_thread() is self._thread:
            return fn()

        def schedule() -> concurrent.futures.Future[T]:
            future: concurrent.futures.Future[T] = concurrent.futures.Future()

            self._loop.call_soon_threadsafe(_fill, future, fn)
            return future

        return self._wait(schedule)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking ThreadedKVWorker calls cannot run on its own loop thread")
        scheduled: list[concurrent.futures.Future[T]] = []

        def schedule() -> concurrent.futures.Future[T]:
            scheduled.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
            return scheduled[0]

        try:
            return self._wait(schedule, timeout)
        finally:
            if not scheduled:
                coro.close()  # refused before it reached the loop: no "never awaited" warning

    def _wait(self, schedule: Callable[[], concurrent.futures.Future[T]], timeout: float | None = None) -> T:
        """Schedule onto the loop unless it is stopping (checked under the lock :meth:`_stop_loop`
        takes, so whatever is scheduled runs before the loop stops), then wait for the result; a
        result the stopped loop can no longer give is failed by :meth:`_stop_loop`."""
        with self._lock:
            if self._stopping:
                raise WorkerClosedError("the threaded worker is closed")
            future = schedule()
            self._waiting.add(future)
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._waiting.discard(future)

    def _refuse_on_loop_thread(self, method: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"ThreadedKVWorker.{method}() cannot run on the worker's own loop thread (for example in "
                "a future's done callback): it waits for that thread; call it from another thread. "
                "The worker is left as it was."
            )

    def _begin_closing(self) -> bool:
        """True for the one caller that closes; the others wait for it."""
        with self._lock:
            first = not self._closing
            self._closing = True
        return first

    def _stop_loop(self) -> None:
        with self._lock:
            self._stopping = True
            self._closing = True
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        with self._lock:
            stranded = [f for f in self._waiting if not f.done()]
        for future in stranded:  # scheduled, yet the loop stopped before finishing it
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(WorkerClosedError("the threaded worker closed before the call finished"))
        self._loop.close()
        self._stopped.set()


def _fill(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Give ``future`` what ``fn`` returns or raises, unless its caller cancelled it first."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
